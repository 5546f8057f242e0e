//! Text data for `--model gpt`: a UTF-8 file read as bytes, split into
//! training and validation text, and windows drawn deterministically.

use crate::trainer::TrainError;
use std::path::{Path, PathBuf};

/// Where the corpus comes from when `--data` is not given: the license
/// texts of Debian's `base-files` package, present on every Debian and
/// Ubuntu system (about 300 KB of English prose).
pub const DEFAULT_CORPUS_DIR: &str = "/usr/share/common-licenses";

/// Bytes of text, split into a training part and the last tenth for
/// validation.
#[derive(Clone, Debug)]
pub struct TextData {
    /// The training bytes.
    pub train: Vec<u8>,
    /// The validation bytes (the end of the text).
    pub validation: Vec<u8>,
    /// Where the text came from, for messages.
    pub source: String,
}

impl TextData {
    /// Splits `text` into training (first 90%) and validation (last 10%);
    /// each part must hold at least one window of `context + 1` bytes.
    pub fn from_bytes(text: Vec<u8>, context: usize, source: &str) -> Result<Self, TrainError> {
        let split = text.len() - text.len() / 10;
        let (train, validation) = (text[..split].to_vec(), text[split..].to_vec());
        if validation.len() <= context {
            return Err(TrainError::Data {
                path: PathBuf::from(source),
                detail: format!(
                    "{} bytes of text leave {} for validation, fewer than one window of \
                     --context {context} + 1; give more text or a shorter --context",
                    text.len(),
                    validation.len()
                ),
            });
        }
        Ok(Self {
            train,
            validation,
            source: source.to_string(),
        })
    }

    /// Reads a text file (UTF-8 or any bytes: the vocabulary is bytes).
    pub fn load(path: &Path, context: usize) -> Result<Self, TrainError> {
        let text = std::fs::read(path).map_err(|e| TrainError::Data {
            path: path.to_path_buf(),
            detail: format!("cannot read the text corpus: {e}"),
        })?;
        Self::from_bytes(text, context, &path.display().to_string())
    }

    /// The files of [`DEFAULT_CORPUS_DIR`], concatenated in name order (so
    /// every rank and every run reads the same text).
    pub fn default_corpus(context: usize) -> Result<Self, TrainError> {
        let dir = Path::new(DEFAULT_CORPUS_DIR);
        let missing = |detail: String| TrainError::Data {
            path: dir.to_path_buf(),
            detail: format!(
                "{detail}; without --data the GPT trains on the license texts Debian's \
                 base-files installs there. Pass --data FILE with any plain text file"
            ),
        };
        let entries = std::fs::read_dir(dir).map_err(|e| missing(format!("cannot list: {e}")))?;
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .collect();
        paths.sort();
        // Several names are links to the same text (GPL -> GPL-3); read
        // each file once.
        let mut seen = std::collections::BTreeSet::new();
        let mut text = Vec::new();
        for path in paths {
            let Ok(real) = std::fs::canonicalize(&path) else {
                continue;
            };
            if !real.is_file() || !seen.insert(real.clone()) {
                continue;
            }
            let bytes = std::fs::read(&real).map_err(|e| TrainError::Data {
                path: real.clone(),
                detail: format!("cannot read: {e}"),
            })?;
            text.extend_from_slice(&bytes);
        }
        if text.is_empty() {
            return Err(missing("holds no text".into()));
        }
        Self::from_bytes(text, context, DEFAULT_CORPUS_DIR)
    }

    /// Windows of `context + 1` bytes (inputs and next-byte targets) that
    /// rank `rank` trains on in the global micro-batch starting at sequence
    /// `first_sequence`: sequence `k = first_sequence + rank * batch + i`
    /// starts at a position drawn from `(seed, k)` alone, so the global
    /// batch is the same whatever the world size, and a resume continues
    /// from a sequence count. Row-major `[batch, context + 1]`.
    pub fn windows_at(
        &self,
        first_sequence: u64,
        rank: usize,
        batch: usize,
        context: usize,
        seed: u64,
    ) -> Vec<u32> {
        let starts = (self.train.len() - context) as u64;
        let first = first_sequence + (rank * batch) as u64;
        let mut ids = Vec::with_capacity(batch * (context + 1));
        for i in 0..batch as u64 {
            let start = (mix(seed, first + i) % starts) as usize;
            ids.extend(
                self.train[start..start + context + 1]
                    .iter()
                    .map(|&b| b as u32),
            );
        }
        ids
    }

    /// The `i`-th of `count` validation windows of `context + 1` bytes,
    /// evenly spaced over the validation text (the same on every rank).
    pub fn validation_window(&self, i: usize, count: usize, context: usize) -> Vec<u32> {
        let starts = self.validation.len() - context;
        let start = i * starts / count.max(1);
        self.validation[start..start + context + 1]
            .iter()
            .map(|&b| b as u32)
            .collect()
    }
}

/// SplitMix64 of `(seed, index)`: a well-mixed position for each sequence,
/// independent of how sequences are split among ranks.
fn mix(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(index)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_global_batch_does_not_depend_on_the_world_size() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let data = TextData::from_bytes(text, 8, "test").unwrap();
        let whole = data.windows_at(40, 0, 8, 8, 7);
        let parts: Vec<u32> = (0..4)
            .flat_map(|rank| data.windows_at(40, rank, 2, 8, 7))
            .collect();
        assert_eq!(whole, parts);
    }

    #[test]
    fn too_little_text_is_an_error_that_says_what_to_do() {
        let err = TextData::from_bytes(vec![b'a'; 50], 16, "tiny.txt").unwrap_err();
        assert!(err.to_string().contains("--context"), "{err}");
    }
}
