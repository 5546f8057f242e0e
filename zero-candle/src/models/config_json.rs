//! Reading a `config.json`'s keys: errors that name the key whose value
//! does not fit, and sizes bounded so that no arithmetic on them overflows.

use serde::de::{Deserialize, Deserializer, Error};

/// The largest size a config may give: a width, or a count of layers,
/// heads, experts, tokens or positions. No model comes near it (the widest
/// vocabularies hold about 2^18 tokens, the widest layers 2^17 values), and
/// the products of four such sizes (a parameter count) fit in a `u128`.
pub const MAX_SIZE: usize = 1 << 24;

/// `T` read from `config` as serde reads it; an error names the key whose
/// value does not fit (`` `num_hidden_layers`: invalid type: string "x",
/// expected usize ``).
pub(crate) fn read_keys<'de, T: Deserialize<'de>>(
    config: &'de serde_json::Value,
) -> Result<T, String> {
    serde_path_to_error::deserialize(config).map_err(|e| match e.path().to_string() {
        path if path == "." => e.inner().to_string(),
        path => format!("`{path}`: {}", e.inner()),
    })
}

/// An error naming the first of `sizes` (a config key and its value) that
/// is zero or above [`MAX_SIZE`].
pub(crate) fn check_sizes(sizes: &[(&str, usize)]) -> Result<(), String> {
    for &(key, n) in sizes {
        if n == 0 {
            return Err(format!("`{key}` must be positive"));
        }
        bounded::<serde_json::Error>(n).map_err(|e| format!("`{key}`: {e}"))?;
    }
    Ok(())
}

/// `n` if it is at most [`MAX_SIZE`].
pub(crate) fn bounded<E: Error>(n: usize) -> Result<usize, E> {
    match n <= MAX_SIZE {
        true => Ok(n),
        false => Err(E::custom(format!(
            "{n} is above {MAX_SIZE} (2^24), larger than any model's: check the value"
        ))),
    }
}

/// A size key (`#[serde(deserialize_with = "size")]`), at most
/// [`MAX_SIZE`].
pub(crate) fn size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<usize, D::Error> {
    bounded(usize::deserialize(deserializer)?)
}

/// An optional size key (`#[serde(default, deserialize_with =
/// "optional_size")]`), at most [`MAX_SIZE`].
pub(crate) fn optional_size<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<usize>, D::Error> {
    Option::<usize>::deserialize(deserializer)?
        .map(bounded)
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    struct Keys {
        #[serde(deserialize_with = "size")]
        layers: usize,
        #[serde(default, deserialize_with = "optional_size")]
        width: Option<usize>,
    }

    fn read(json: serde_json::Value) -> Result<Keys, String> {
        read_keys(&json)
    }

    #[test]
    fn errors_name_the_key_and_sizes_are_bounded() {
        let keys = read(serde_json::json!({"layers": MAX_SIZE})).unwrap();
        assert_eq!((keys.layers, keys.width), (MAX_SIZE, None));
        let keys = read(serde_json::json!({"layers": 2, "width": null})).unwrap();
        assert_eq!(keys.width, None);
        let err = read(serde_json::json!({"layers": "x"})).unwrap_err();
        assert!(err.starts_with("`layers`: invalid type"), "{err}");
        let err = read(serde_json::json!({"layers": MAX_SIZE + 1})).unwrap_err();
        assert!(err.starts_with("`layers`: 16777217 is above"), "{err}");
        let err = read(serde_json::json!({"layers": 1, "width": u64::MAX})).unwrap_err();
        assert!(
            err.starts_with("`width`: 18446744073709551615 is above"),
            "{err}"
        );
        let err = read(serde_json::json!({})).unwrap_err();
        assert_eq!(err, "missing field `layers`");
    }

    #[test]
    fn sizes_are_positive_and_bounded() {
        check_sizes(&[("a", 1), ("b", MAX_SIZE)]).unwrap();
        let err = check_sizes(&[("a", 1), ("b", 0)]).unwrap_err();
        assert_eq!(err, "`b` must be positive");
        let err = check_sizes(&[("a", MAX_SIZE + 1)]).unwrap_err();
        assert!(err.starts_with("`a`: 16777217 is above 16777216"), "{err}");
    }
}
