//! Tests of the streamed checkpoint I/O: [`TensorWriter`] (a safetensors
//! file written one tensor at a time), [`MappedTensors`] (one read through
//! a memory map, a range at a time), the streamed checks of a file against
//! its record, and stage-3 checkpoints saved and loaded through them.

mod common;

use common::{ckpt_err, listing};

use half::{bf16, f16};
use sha2::{Digest, Sha256};
use std::path::Path;
use zero_core::checkpoint::{
    load_tensors, save_tensors, verify_file, write_tensors, FileRecord, Manifest, MappedTensors,
    TensorBytes, TensorWriter, MANIFEST_FILE,
};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{
    DType, Engine, EngineConfig, Error, FunctionalOptimizer, ParamInfo, Stage, ThreadComm,
    ThreadGroup,
};

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Tensors of every dtype, a scalar and an empty one, with their bytes.
struct Fixture {
    f64s: Vec<f64>,
    f32s: Vec<f32>,
    bf16s: Vec<bf16>,
    f16s: Vec<f16>,
    scalar: f64,
}

impl Fixture {
    fn new() -> Self {
        Self {
            f64s: (0..6).map(|i| i as f64 * 0.25 - 1.0).collect(),
            f32s: (0..5).map(|i| i as f32 * 1.5 + 0.125).collect(),
            bf16s: (0..3).map(|i| bf16::from_f32(i as f32 - 0.5)).collect(),
            f16s: (0..7).map(|i| f16::from_f32(i as f32 * 0.75)).collect(),
            scalar: 42.5,
        }
    }

    /// (name, tensor), in no particular order.
    fn tensors(&self) -> Vec<(&'static str, TensorBytes<'_>)> {
        let t = |dtype, shape: &[usize], data| TensorBytes {
            dtype,
            shape: shape.to_vec(),
            data,
        };
        vec![
            (
                "w.f16",
                t(DType::F16, &[7], bytemuck::cast_slice(&self.f16s)),
            ),
            (
                "b.f32",
                t(DType::F32, &[5], bytemuck::cast_slice(&self.f32s)),
            ),
            ("empty", t(DType::F32, &[0, 4], &[])),
            (
                "a.f64",
                t(DType::F64, &[2, 3], bytemuck::cast_slice(&self.f64s)),
            ),
            ("step", t(DType::F64, &[], bytemuck::bytes_of(&self.scalar))),
            (
                "c.bf16",
                t(DType::BF16, &[3], bytemuck::cast_slice(&self.bf16s)),
            ),
        ]
    }
}

/// The tensors in `write_tensors`' order: element size (largest first),
/// then name.
fn file_order<'a>(
    tensors: &[(&'static str, TensorBytes<'a>)],
) -> Vec<(&'static str, TensorBytes<'a>)> {
    let mut sorted = tensors.to_vec();
    sorted.sort_by(|(ln, lt), (rn, rt)| {
        rt.dtype
            .size_in_bytes()
            .cmp(&lt.dtype.size_in_bytes())
            .then(ln.cmp(rn))
    });
    sorted
}

fn specs(tensors: &[(&str, TensorBytes<'_>)]) -> Vec<(String, DType, Vec<usize>)> {
    tensors
        .iter()
        .map(|(n, t)| (n.to_string(), t.dtype, t.shape.clone()))
        .collect()
}

#[test]
fn tensor_writer_in_chunks_writes_what_write_tensors_writes() {
    let fixture = Fixture::new();
    let tensors = fixture.tensors();
    let mut expected = Vec::new();
    write_tensors(Path::new("expected"), &mut expected, &tensors).unwrap();

    let ordered = file_order(&tensors);
    let data: Vec<u8> = ordered.iter().flat_map(|(_, t)| t.data.to_vec()).collect();
    // Chunk sizes that split tensors and span several at once.
    for chunk in [1, 3, 7, 1000] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let mut writer = TensorWriter::create(&path, &specs(&ordered)).unwrap();
        for part in data.chunks(chunk) {
            writer.write(part).unwrap();
        }
        let record = writer.finish().unwrap();

        let written = std::fs::read(&path).unwrap();
        assert_eq!(written, expected, "chunks of {chunk} bytes");
        assert_eq!(
            record,
            FileRecord {
                sha256: sha256(&expected),
                len: expected.len() as u64,
            }
        );
        assert_eq!(listing(dir.path()), ["model.safetensors"]);

        // The safetensors crate and load_tensors read it back.
        let parsed = safetensors::SafeTensors::deserialize(&written).unwrap();
        assert_eq!(
            parsed.tensor("a.f64").unwrap().data(),
            bytemuck::cast_slice::<f64, u8>(&fixture.f64s)
        );
        let loaded = load_tensors(&path, &written).unwrap();
        for (name, t) in &tensors {
            assert_eq!(&loaded[*name], t, "{name}");
        }
    }
}

#[test]
fn tensor_writer_keeps_the_given_order_even_unaligned() {
    // A bf16 tensor of one element first puts the f32 tensor after it at
    // byte 2 of the data: valid, but unaligned for f32.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("unaligned.safetensors");
    let first = [bf16::from_f32(3.0)];
    // More elements than read_range_as converts in one chunk.
    let values: Vec<f32> = (0..10_000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let specs = vec![
        ("z.first".to_string(), DType::BF16, vec![1]),
        ("a.second".to_string(), DType::F32, vec![100, 100]),
    ];
    let mut writer = TensorWriter::create(&path, &specs).unwrap();
    writer.write(bytemuck::cast_slice(&first)).unwrap();
    writer.write(bytemuck::cast_slice(&values)).unwrap();
    writer.finish().unwrap();

    let file = MappedTensors::open(&path).unwrap();
    let t = file.get("a.second").unwrap();
    assert_eq!(
        t.data.as_ptr() as usize % 4,
        2,
        "the test needs unaligned data"
    );
    assert_eq!(t.to_vec::<f32>().unwrap(), values);
    let mut wide = vec![0.0f64; 9_000];
    t.read_range_as(500..9_500, &mut wide).unwrap();
    let expected: Vec<f64> = values[500..9_500].iter().map(|&v| v as f64).collect();
    assert_eq!(wide, expected);
    let mut narrow = vec![bf16::ZERO; 5_000];
    t.read_range_as(5_000..10_000, &mut narrow).unwrap();
    let expected: Vec<bf16> = values[5_000..].iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(narrow, expected);
}

#[test]
fn too_few_or_too_many_bytes_are_errors_and_leave_no_file() {
    let specs = vec![
        ("a".to_string(), DType::F32, vec![2]),
        ("b".to_string(), DType::F32, vec![3]),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.safetensors");

    // Too few: `b` got one of its three elements.
    let mut writer = TensorWriter::create(&path, &specs).unwrap();
    writer.write(&[0u8; 12]).unwrap();
    let (at, detail) = ckpt_err(writer.finish().unwrap_err());
    assert_eq!(at, path);
    assert!(detail.contains("\"b\" got 4 of its 12 bytes"), "{detail}");
    assert!(detail.contains("8 bytes missing"), "{detail}");
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));

    // Too many: refused, and the writer cannot be finished after.
    let mut writer = TensorWriter::create(&path, &specs).unwrap();
    writer.write(&[0u8; 16]).unwrap();
    let (at, detail) = ckpt_err(writer.write(&[0u8; 8]).unwrap_err());
    assert_eq!(at, path);
    assert!(detail.contains("got 8 bytes"), "{detail}");
    assert!(detail.contains("4 of the 20 announced left"), "{detail}");
    let (_, detail) = ckpt_err(writer.finish().unwrap_err());
    assert!(detail.contains("earlier write"), "{detail}");
    assert!(listing(dir.path()).is_empty(), "{:?}", listing(dir.path()));

    // A name given twice is refused before anything is created.
    let twice = vec![
        ("a".to_string(), DType::F32, vec![2]),
        ("a".to_string(), DType::F16, vec![2]),
    ];
    let (_, detail) = ckpt_err(TensorWriter::create(&path, &twice).unwrap_err());
    assert!(detail.contains("\"a\" is given twice"), "{detail}");
    assert!(listing(dir.path()).is_empty());
}

#[test]
fn an_unfinished_write_leaves_the_previous_file_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let old = [1.0f32, 2.0];
    let old_tensor = TensorBytes {
        dtype: DType::F32,
        shape: vec![2],
        data: bytemuck::cast_slice(&old),
    };
    save_tensors(&path, &[("w", old_tensor)]).unwrap();
    let before = std::fs::read(&path).unwrap();

    let specs = vec![("w".to_string(), DType::F32, vec![2])];
    // Dropped mid-way (as on an error or a panic of the caller).
    let mut writer = TensorWriter::create(&path, &specs).unwrap();
    writer.write(bytemuck::bytes_of(&9.0f32)).unwrap();
    drop(writer);
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(listing(dir.path()), ["model.safetensors"]);

    // Failed by too many bytes, then finished anyway.
    let mut writer = TensorWriter::create(&path, &specs).unwrap();
    assert!(writer.write(&[0u8; 12]).is_err());
    assert!(writer.finish().is_err());
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(listing(dir.path()), ["model.safetensors"]);

    // A complete write replaces it.
    let mut writer = TensorWriter::create(&path, &specs).unwrap();
    writer.write(bytemuck::cast_slice(&[5.0f32, 6.0])).unwrap();
    writer.finish().unwrap();
    let file = MappedTensors::open(&path).unwrap();
    assert_eq!(file.get("w").unwrap().to_vec::<f32>().unwrap(), [5.0, 6.0]);
}

#[test]
fn mapped_tensors_read_what_was_written() {
    let fixture = Fixture::new();
    let tensors = fixture.tensors();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.safetensors");
    save_tensors(&path, &tensors).unwrap();

    let file = MappedTensors::open(&path).unwrap();
    assert_eq!(file.path(), path);
    assert_eq!(file.len(), tensors.len());
    let mut names: Vec<&str> = tensors.iter().map(|(n, _)| *n).collect();
    names.sort();
    assert_eq!(file.names().collect::<Vec<_>>(), names);
    for (name, t) in &tensors {
        assert_eq!(&file.get(name).unwrap(), t, "{name}");
    }
    assert!(file.get("missing").is_none());
}

/// Every range of every dtype, converted to every dtype, is what
/// `to_vec_as` gives for the whole tensor, sliced.
#[test]
fn read_range_as_converts_any_dtype_to_any() {
    let fixture = Fixture::new();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.safetensors");
    save_tensors(&path, &fixture.tensors()).unwrap();
    let file = MappedTensors::open(&path).unwrap();

    // The reference: each source value widened to f64 (exact), then
    // rounded once to the target type.
    fn check<T: zero_core::Element>(t: &TensorBytes<'_>, source: &[f64], name: &str) {
        let whole: Vec<T> = source.iter().map(|&v| T::from_f64(v)).collect();
        assert_eq!(t.to_vec_as::<T>().unwrap(), whole, "{name} as {}", T::DTYPE);
        let n = whole.len();
        for start in 0..=n {
            for end in start..=n {
                let mut out = vec![T::default(); end - start];
                t.read_range_as(start..end, &mut out).unwrap();
                assert_eq!(
                    out,
                    whole[start..end],
                    "{name} {start}..{end} as {}",
                    T::DTYPE
                );
            }
        }
    }
    let wide = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let sources: [(&str, Vec<f64>); 5] = [
        ("a.f64", fixture.f64s.clone()),
        ("b.f32", wide(&fixture.f32s)),
        ("c.bf16", fixture.bf16s.iter().map(|x| x.to_f64()).collect()),
        ("w.f16", fixture.f16s.iter().map(|x| x.to_f64()).collect()),
        ("step", vec![fixture.scalar]),
    ];
    for (name, source) in &sources {
        let t = file.get(name).unwrap();
        check::<f32>(&t, source, name);
        check::<f64>(&t, source, name);
        check::<bf16>(&t, source, name);
        check::<f16>(&t, source, name);
    }
    // Narrowing rounds to nearest; widening is exact.
    let t = file.get("b.f32").unwrap();
    let mut out = [bf16::ZERO; 2];
    t.read_range_as(1..3, &mut out).unwrap();
    assert_eq!(out, [bf16::from_f32(1.625), bf16::from_f32(3.125)]);
    let mut wide = [0.0f64; 1];
    file.get("c.bf16")
        .unwrap()
        .read_range_as(2..3, &mut wide)
        .unwrap();
    assert_eq!(wide, [1.5]);
}

#[test]
fn read_range_as_out_of_bounds_is_an_error_naming_the_range() {
    let values = [1.0f32, 2.0, 3.0];
    let t = TensorBytes {
        dtype: DType::F32,
        shape: vec![3],
        data: bytemuck::cast_slice(&values),
    };
    let mut out = [0.0f64; 2];
    let msg = t.read_range_as(2..4, &mut out).unwrap_err().to_string();
    assert!(msg.contains("2..4") && msg.contains("3 elements"), "{msg}");
    #[allow(clippy::reversed_empty_ranges)]
    let backwards = 3..1;
    let msg = t
        .read_range_as::<f32>(backwards, &mut [])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("3..1"), "{msg}");
    match t.read_range_as(0..3, &mut out).unwrap_err() {
        Error::BufferSize { got, expected, .. } => assert_eq!((got, expected), (2, 3)),
        other => panic!("expected a buffer size error, got {other:?}"),
    }
    // Nothing was written by the failed calls.
    assert_eq!(out, [0.0, 0.0]);
}

#[test]
fn mapping_a_file_that_is_not_safetensors_names_the_file_and_the_fault() {
    let dir = tempfile::tempdir().unwrap();

    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    let (at, detail) = ckpt_err(MappedTensors::open(&garbage).unwrap_err());
    assert_eq!(at, garbage);
    assert!(detail.contains("not a valid safetensors file"), "{detail}");

    let empty = dir.path().join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    let (at, detail) = ckpt_err(MappedTensors::open(&empty).unwrap_err());
    assert_eq!(at, empty);
    assert!(detail.contains("not a valid safetensors file"), "{detail}");

    let missing = dir.path().join("missing.safetensors");
    let (at, detail) = ckpt_err(MappedTensors::open(&missing).unwrap_err());
    assert_eq!(at, missing);
    assert!(detail.contains("missing"), "{detail}");

    // A valid file with an integer tensor.
    let ints = dir.path().join("ints.safetensors");
    let data = [1i32, 2];
    let view = safetensors::tensor::TensorView::new(
        safetensors::Dtype::I32,
        vec![2],
        bytemuck::cast_slice(&data),
    )
    .unwrap();
    safetensors::serialize_to_file([("counts", view)], None, &ints).unwrap();
    let (at, detail) = ckpt_err(MappedTensors::open(&ints).unwrap_err());
    assert_eq!(at, ints);
    assert!(detail.contains("\"counts\" has dtype I32"), "{detail}");
}

/// A checkpoint-like directory holding one file recorded in the manifest.
fn recorded(dir: &Path) -> (Manifest, std::path::PathBuf, FileRecord) {
    let values: Vec<f32> = (0..300).map(|i| i as f32).collect();
    let t = TensorBytes {
        dtype: DType::F32,
        shape: vec![300],
        data: bytemuck::cast_slice(&values),
    };
    let path = dir.join("model.safetensors");
    let record = save_tensors(&path, &[("w", t)]).unwrap();
    let mut manifest = Manifest::new();
    manifest.record("model.safetensors", record.clone());
    (manifest, path, record)
}

#[test]
fn map_file_and_verify_file_check_the_record_without_reading_the_file_in() {
    let dir = tempfile::tempdir().unwrap();
    let (manifest, path, record) = recorded(dir.path());

    verify_file(&path, &record.sha256, record.len).unwrap();
    let file = manifest.map_file(dir.path(), "model.safetensors").unwrap();
    let mut out = [0.0f64; 3];
    file.get("w")
        .unwrap()
        .read_range_as(297..300, &mut out)
        .unwrap();
    assert_eq!(out, [297.0, 298.0, 299.0]);
    drop(file);

    // Corrupted: same length, one byte changed.
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&path, &bytes).unwrap();
    for err in [
        verify_file(&path, &record.sha256, record.len).unwrap_err(),
        manifest
            .map_file(dir.path(), "model.safetensors")
            .unwrap_err(),
    ] {
        let (at, detail) = ckpt_err(err);
        assert_eq!(at, path);
        assert!(detail.contains("checksum mismatch"), "{detail}");
    }

    // Truncated.
    std::fs::write(&path, &bytes[..100]).unwrap();
    for err in [
        verify_file(&path, &record.sha256, record.len).unwrap_err(),
        manifest
            .map_file(dir.path(), "model.safetensors")
            .unwrap_err(),
    ] {
        let (at, detail) = ckpt_err(err);
        assert_eq!(at, path);
        assert!(detail.contains("truncated"), "{detail}");
    }

    // Not listed, or not inside the directory.
    let (at, detail) = ckpt_err(manifest.map_file(dir.path(), "other").unwrap_err());
    assert_eq!(at, dir.path().join(MANIFEST_FILE));
    assert!(detail.contains("lists no file \"other\""), "{detail}");
    let mut evil = manifest.clone();
    evil.record("../escape", record);
    let (_, detail) = ckpt_err(evil.map_file(dir.path(), "../escape").unwrap_err());
    assert!(detail.contains("not a plain relative path"), "{detail}");
}

// Stage 3 through the engine.

/// Two large parameters that stage 3 shards and a small one it keeps whole
/// (below `persist_numel`), sorted by name.
fn stage3_params() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("a.weight", [12, 10], DType::F32),
        ParamInfo::new("b.bias", [5], DType::F32),
        ParamInfo::new("c.weight", [7, 9], DType::F32),
    ]
}

fn stage3_init() -> Vec<Vec<f32>> {
    stage3_params()
        .iter()
        .enumerate()
        .map(|(p, info)| {
            (0..info.numel())
                .map(|j| (p * 1000 + j) as f32 * 0.001 - 0.3)
                .collect()
        })
        .collect()
}

fn stage3_engine(comm: ThreadComm) -> Engine<f32, ThreadComm> {
    let sgd: Box<dyn FunctionalOptimizer<f32>> =
        Box::new(Sgd::new(SgdConfig::default().with_lr(0.1)).unwrap());
    let config = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_bucket_bytes(64)
        .with_persist_numel(8);
    Engine::new(comm, stage3_params(), sgd, config).unwrap()
}

/// Shards every parameter it can from the start, reading from `replica`.
fn shard(engine: &mut Engine<f32, ThreadComm>, replica: &mut Vec<Vec<f32>>) {
    let n = engine.params().len();
    let order: Vec<usize> = (0..n).rev().collect();
    let fetcher = engine
        .shard_from_start(&order, &vec![true; n], replica)
        .unwrap();
    assert!(fetcher.is_sharded(0) && !fetcher.is_sharded(1) && fetcher.is_sharded(2));
}

fn all<R: Send>(world: usize, f: impl Fn(ThreadComm) -> R + Sync) -> Vec<R> {
    ThreadGroup::new(world)
        .with_timeout(std::time::Duration::from_secs(60))
        .run(f)
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

fn model_file(dir: &Path) -> std::path::PathBuf {
    let manifest = Manifest::load(dir).unwrap();
    let info = manifest.checkpoint.unwrap();
    dir.join(info.model_file.unwrap())
}

/// What `write_tensors` writes for the parameters with `values`.
fn expected_model(values: &[Vec<f32>]) -> Vec<u8> {
    let tensors: Vec<(String, TensorBytes<'_>)> = stage3_params()
        .iter()
        .zip(values)
        .map(|(p, v)| {
            (
                p.name.clone(),
                TensorBytes {
                    dtype: DType::F32,
                    shape: p.shape.clone(),
                    data: bytemuck::cast_slice(v),
                },
            )
        })
        .collect();
    let mut bytes = Vec::new();
    write_tensors(Path::new("expected"), &mut bytes, &tensors).unwrap();
    bytes
}

#[test]
fn stage3_model_file_is_streamed_from_the_shards_and_loads_at_another_world_size() {
    let init = stage3_init();
    let saved = tempfile::tempdir().unwrap();
    all(3, |comm| {
        let mut engine = stage3_engine(comm);
        let mut replica = init.clone();
        shard(&mut engine, &mut replica);
        // The engine no longer reads the sharded parameters' replica: the
        // model file must hold the shards' values, not these.
        replica[0].fill(-7.0);
        replica[2].fill(-7.0);
        engine
            .save_checkpoint(
                saved.path(),
                &mut replica,
                &zero_core::SaveOptions::default(),
            )
            .unwrap();
    });
    let bytes = std::fs::read(model_file(saved.path())).unwrap();
    assert_eq!(bytes, expected_model(&init));

    // Loaded at W=2 into a replica of zeros: the kept parameter's replica
    // gets its values, the sharded ones' replica stays as it was, and the
    // shards hold the checkpoint's values (saved again, byte for byte).
    let resaved = tempfile::tempdir().unwrap();
    let replicas = all(2, |comm| {
        let mut engine = stage3_engine(comm);
        let mut replica: Vec<Vec<f32>> = init.iter().map(|v| vec![0.0; v.len()]).collect();
        shard(&mut engine, &mut replica);
        engine.load_checkpoint(saved.path(), &mut replica).unwrap();
        engine
            .save_checkpoint(
                resaved.path(),
                &mut replica,
                &zero_core::SaveOptions::default(),
            )
            .unwrap();
        replica
    });
    for replica in &replicas {
        assert_eq!(replica[1], init[1]);
        assert!(replica[0].iter().chain(&replica[2]).all(|&v| v == 0.0));
    }
    let again = std::fs::read(model_file(resaved.path())).unwrap();
    assert_eq!(again, bytes);
}

#[test]
fn stage3_failed_model_write_is_an_error_on_every_rank_and_nothing_hangs() {
    let dir = tempfile::tempdir().unwrap();
    // A directory where rank 0 renames the model file: every piece is
    // streamed, then the rename fails.
    std::fs::create_dir(dir.path().join("model.step0.safetensors")).unwrap();
    let other = tempfile::tempdir().unwrap();
    let errors = all(3, |comm| {
        let mut engine = stage3_engine(comm);
        let mut replica = stage3_init();
        shard(&mut engine, &mut replica);
        let err = engine
            .save_checkpoint(dir.path(), &mut replica, &zero_core::SaveOptions::default())
            .unwrap_err();
        // The ranks stayed in step: another directory saves fine.
        engine
            .save_checkpoint(
                other.path(),
                &mut replica,
                &zero_core::SaveOptions::default(),
            )
            .unwrap();
        err.to_string()
    });
    let bytes = std::fs::read(model_file(other.path())).unwrap();
    assert_eq!(bytes, expected_model(&stage3_init()));
    assert!(
        errors[0].contains("model.step0.safetensors"),
        "{}",
        errors[0]
    );
    for err in &errors[1..] {
        assert!(err.contains("failed on rank 0"), "{err}");
    }
    // No manifest: the save did not commit; no temporary file is left.
    let mut names = listing(dir.path());
    names.retain(|n| !n.starts_with("optim."));
    assert_eq!(names, ["model.step0.safetensors"]);
    assert!(dir.path().join("model.step0.safetensors").is_dir());
}
