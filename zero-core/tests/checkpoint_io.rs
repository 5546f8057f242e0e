//! Tests of the checkpoint file primitives.

mod common;

use common::{ckpt_err, listing};

use std::io::Write;
use zero_core::checkpoint::{
    load_tensors, read_verified, save_tensors, write_atomic, write_tensors, FailAfter, FileRecord,
    Manifest, TensorBytes, FORMAT_VERSION, MANIFEST_FILE,
};
use zero_core::{DType, Error};

#[test]
fn write_atomic_then_read_verified_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("blob.bin");
    let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
    let record = write_atomic(&path, |w| w.write_all(&data)).unwrap();
    assert_eq!(record.len, data.len() as u64);
    assert_eq!(record.sha256.len(), 64);
    // Known vector: SHA-256 of "abc".
    let abc = write_atomic(dir.path().join("abc"), |w| w.write_all(b"abc")).unwrap();
    assert_eq!(
        abc.sha256,
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let back = read_verified(&path, &record.sha256, record.len).unwrap();
    assert_eq!(back, data);
    assert_eq!(listing(dir.path()), vec!["abc", "blob.bin"]);
}

#[test]
fn flipped_byte_is_a_checksum_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let record = write_atomic(&path, |w| w.write_all(&[1u8; 64])).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[17] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let (at, detail) = ckpt_err(read_verified(&path, &record.sha256, record.len).unwrap_err());
    assert_eq!(at, path);
    assert!(
        detail.starts_with("checksum mismatch: expected "),
        "{detail}"
    );
    assert!(detail.contains(&record.sha256), "{detail}");
    assert!(detail.contains("corrupted or was replaced"), "{detail}");
}

#[test]
fn truncated_and_missing_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    let record = write_atomic(&path, |w| w.write_all(&[9u8; 100])).unwrap();
    std::fs::write(&path, [9u8; 60]).unwrap();
    let (at, detail) = ckpt_err(read_verified(&path, &record.sha256, record.len).unwrap_err());
    assert_eq!(at, path);
    assert!(detail.contains("expected 100 bytes, found 60"), "{detail}");
    assert!(detail.contains("truncated"), "{detail}");

    let missing = dir.path().join("rank3.safetensors");
    let (at, detail) = ckpt_err(read_verified(&missing, &record.sha256, 100).unwrap_err());
    assert_eq!(at, missing);
    assert!(detail.contains("missing"), "{detail}");
}

#[test]
fn injected_write_failure_leaves_previous_file_and_no_temp_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let old = write_atomic(&path, |w| w.write_all(b"previous checkpoint")).unwrap();

    for limit in [0, 1, 5, 18, 4096] {
        let big = vec![7u8; 10_000];
        let err = write_atomic(&path, |w| FailAfter::new(w, limit).write_all(&big)).unwrap_err();
        match err {
            Error::Io { path: at, source } => {
                assert_eq!(at, path);
                assert!(source.to_string().contains("injected"), "{source}");
            }
            other => panic!("expected an I/O error, got {other:?}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"previous checkpoint");
        assert_eq!(listing(dir.path()), vec!["model.safetensors"]);
        read_verified(&path, &old.sha256, old.len).unwrap();
    }

    // The same through the safetensors writer, and with a crate error from
    // the callback coming back unchanged.
    let data = [0u8; 400];
    let tensors = [(
        "w",
        TensorBytes {
            dtype: DType::F32,
            shape: vec![10, 10],
            data: &data,
        },
    )];
    let err = write_atomic(&path, |w| {
        write_tensors(&path, &mut FailAfter::new(w, 100), &tensors).map_err(std::io::Error::other)
    })
    .unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    let err = write_atomic(&path, |_| {
        Err(std::io::Error::other(Error::Config("stop".into())))
    })
    .unwrap_err();
    assert!(
        matches!(err, Error::Config(ref s) if s == "stop"),
        "{err:?}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"previous checkpoint");
    assert_eq!(listing(dir.path()), vec!["model.safetensors"]);
}

#[test]
fn tensors_round_trip_through_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    let b: Vec<f64> = vec![1.0, -2.0, 3.5];
    let h: Vec<half::bf16> = [1.0f32, 2.0].map(half::bf16::from_f32).to_vec();
    let scalar: Vec<half::f16> = vec![half::f16::from_f32(4.0)];
    let tensors = vec![
        (
            "layer.weight".to_string(),
            TensorBytes {
                dtype: DType::F32,
                shape: vec![3, 4],
                data: bytemuck::cast_slice(&w),
            },
        ),
        (
            "layer.bias".to_string(),
            TensorBytes {
                dtype: DType::F64,
                shape: vec![3],
                data: bytemuck::cast_slice(&b),
            },
        ),
        (
            "half".to_string(),
            TensorBytes {
                dtype: DType::BF16,
                shape: vec![2],
                data: bytemuck::cast_slice(&h),
            },
        ),
        (
            "scalar".to_string(),
            TensorBytes {
                dtype: DType::F16,
                shape: vec![],
                data: bytemuck::cast_slice(&scalar),
            },
        ),
        (
            "empty".to_string(),
            TensorBytes {
                dtype: DType::F32,
                shape: vec![0, 5],
                data: &[],
            },
        ),
    ];
    let record = save_tensors(&path, &tensors).unwrap();
    let bytes = read_verified(&path, &record.sha256, record.len).unwrap();
    let loaded = load_tensors(&path, &bytes).unwrap();
    assert_eq!(loaded.len(), tensors.len());
    for (name, t) in &tensors {
        assert_eq!(&loaded[name], t, "{name}");
    }
    assert_eq!(loaded["layer.weight"].to_vec::<f32>().unwrap(), w);
    assert_eq!(loaded["layer.bias"].to_vec::<f64>().unwrap(), b);
    assert!(loaded["layer.bias"].to_vec::<f32>().is_err());

    // Readable by the safetensors crate itself, and deterministic.
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("layer.weight").unwrap().shape(), &[3, 4]);
    let again = save_tensors(dir.path().join("again.safetensors"), &tensors).unwrap();
    assert_eq!(again, record);
}

#[test]
fn bad_tensors_are_errors_naming_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let short = [0u8; 7];
    let err = save_tensors(
        &path,
        &[(
            "w",
            TensorBytes {
                dtype: DType::F32,
                shape: vec![2],
                data: &short,
            },
        )],
    )
    .unwrap_err();
    let (at, detail) = ckpt_err(err);
    assert_eq!(at, path);
    assert!(
        detail.contains("\"w\"") && detail.contains("7 bytes"),
        "{detail}"
    );
    assert!(!path.exists());
    assert!(listing(dir.path()).is_empty());

    let (at, detail) = ckpt_err(load_tensors(&path, b"not a safetensors file").unwrap_err());
    assert_eq!(at, path);
    assert!(detail.contains("not a valid safetensors file"), "{detail}");

    // An integer tensor written by another tool.
    let ints: Vec<u8> = bytemuck::cast_slice(&[1i64, 2]).to_vec();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![2], &ints).unwrap();
    let bytes = safetensors::serialize([("steps", view)], None).unwrap();
    let (_, detail) = ckpt_err(load_tensors(&path, &bytes).unwrap_err());
    assert!(
        detail.contains("\"steps\"") && detail.contains("I64"),
        "{detail}"
    );
}

#[test]
fn manifest_round_trips_and_verifies_files() {
    let dir = tempfile::tempdir().unwrap();
    let data = [3u8; 32];
    let record =
        write_atomic(dir.path().join("model.safetensors"), |w| w.write_all(&data)).unwrap();
    let mut manifest = Manifest::new();
    manifest.record("model.safetensors", record.clone());
    manifest
        .extra
        .insert("world_size".into(), serde_json::json!(4));
    manifest.save(dir.path()).unwrap();

    let loaded = Manifest::load(dir.path()).unwrap();
    assert_eq!(loaded, manifest);
    assert_eq!(loaded.format_version, FORMAT_VERSION);
    assert_eq!(loaded.files["model.safetensors"], record);
    assert_eq!(
        loaded.read_file(dir.path(), "model.safetensors").unwrap(),
        data
    );

    let (_, detail) = ckpt_err(
        loaded
            .read_file(dir.path(), "optimizer.safetensors")
            .unwrap_err(),
    );
    assert!(detail.contains("lists no file"), "{detail}");
    let mut evil = loaded.clone();
    evil.record(
        "../escape",
        FileRecord {
            sha256: String::new(),
            len: 0,
        },
    );
    let (_, detail) = ckpt_err(evil.read_file(dir.path(), "../escape").unwrap_err());
    assert!(detail.contains("plain relative path"), "{detail}");
}

#[test]
fn unknown_format_versions_and_missing_manifests_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (at, detail) = ckpt_err(Manifest::load(dir.path()).unwrap_err());
    assert_eq!(at, dir.path().join(MANIFEST_FILE));
    assert!(detail.contains("no manifest"), "{detail}");

    // A newer format fails on its version even if the rest is unreadable.
    std::fs::write(
        dir.path().join(MANIFEST_FILE),
        r#"{"format_version": 7, "files": "a shape this build cannot read"}"#,
    )
    .unwrap();
    let (_, detail) = ckpt_err(Manifest::load(dir.path()).unwrap_err());
    assert_eq!(
        detail,
        "format version 7 is newer than this build supports (1); upgrade zero-rs"
    );

    std::fs::write(dir.path().join(MANIFEST_FILE), r#"{"files": {}}"#).unwrap();
    let (_, detail) = ckpt_err(Manifest::load(dir.path()).unwrap_err());
    assert!(detail.contains("format_version"), "{detail}");

    std::fs::write(dir.path().join(MANIFEST_FILE), r#"{"format_version": 0}"#).unwrap();
    assert!(Manifest::load(dir.path()).is_err());
}
