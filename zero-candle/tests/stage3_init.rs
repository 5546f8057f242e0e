//! Stage 3 from the start: a model built through a `ShardedVarMap` is
//! sharded before its first step, each rank computing only its shard; it is
//! the same model at every world size, trains the weights of stage 2, and
//! saves and loads one tensor (or piece) at a time.

mod nn_support;

use candle_core::{DType, Device, Module, Storage, Tensor};
use rand::SeedableRng;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_candle::nn::{self, GradHook};
use zero_candle::{ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

const VOCAB: usize = 13;
const HIDDEN: usize = 16;
const LAYERS: usize = 3;
const SEQ: usize = 4;
/// Weights (256 elements) and the embedding (208) are sharded, biases and
/// norms (16) persist.
const PERSIST: usize = 64;
/// 64 f32 per bucket: every weight spans several buckets.
const BUCKET_BYTES: usize = 256;

/// Embedding, residual tanh layers, a norm, and a head tied to the
/// embedding, built through a `ShardedVarMap`'s `VarBuilder`.
struct Net {
    emb: nn::Embedding,
    layers: Vec<nn::Linear>,
    norm: nn::LayerNorm,
    head: nn::Linear,
}

impl Net {
    fn new(map: &ShardedVarMap, hook: Option<Arc<dyn GradHook>>) -> candle_core::Result<Self> {
        let vb = map.builder(DType::F32, &Device::Cpu);
        let emb = nn::embedding(VOCAB, HIDDEN, vb.pp("emb"), hook.clone())?;
        let layers = (0..LAYERS)
            .map(|i| nn::linear(HIDDEN, HIDDEN, vb.pp(format!("l{i}")), hook.clone()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = nn::layer_norm(HIDDEN, 1e-5, vb.pp("norm"), hook.clone())?;
        let head = nn::Linear::new(emb.embeddings().clone(), None, hook);
        Ok(Self {
            emb,
            layers,
            norm,
            head,
        })
    }

    fn loss(&self, tokens: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.emb.forward(tokens)?;
        for layer in &self.layers {
            h = (&h + layer.forward(&h)?.tanh()?)?;
        }
        let logits = self.head.forward(&self.norm.forward(&h)?)?.flatten_to(1)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

fn batch(rng: &mut rand::rngs::StdRng) -> candle_core::Result<(Tensor, Tensor)> {
    nn_support::token_batch(rng, VOCAB, SEQ)
}

fn config(stage: Stage) -> EngineConfig {
    EngineConfig::default()
        .with_stage(stage)
        .with_bucket_bytes(BUCKET_BYTES)
        .with_persist_numel(PERSIST)
}

/// Where the model's values come from.
#[derive(Clone)]
enum Source {
    Seed(u64),
    File(PathBuf),
}

fn vars(source: &Source) -> zero_candle::Result<ShardedVarMap> {
    match source {
        Source::Seed(seed) => Ok(ShardedVarMap::seeded(*seed)),
        Source::File(path) => ShardedVarMap::from_safetensors(path),
    }
}

/// Builds, trains `steps` steps and saves to `out` (every rank calls it).
/// Returns how many elements of deferred variables this rank held right
/// after construction.
fn train_and_save(
    comm: ThreadComm,
    source: &Source,
    stage: Stage,
    steps: usize,
    out: &Path,
) -> zero_candle::Result<usize> {
    let rank = comm.rank();
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let map = vars(source)?;
    let net = Net::new(&map, Some(hook.clone()))?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt = ZeroOptimizer::new_sharded(&map, comm, config(stage), Box::new(adamw), &hook)?;
    let held = held_elements(&opt, PERSIST);
    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + rank as u64);
    for _ in 0..steps {
        let (tokens, targets) = batch(&mut rng)?;
        opt.backward_step(&net.loss(&tokens, &targets)?)?;
    }
    opt.save_weights(out)?;
    Ok(held)
}

/// Elements held in the storage of this rank's variables above `persist`.
fn held_elements(opt: &ZeroOptimizer<ThreadComm>, persist: usize) -> usize {
    opt.vars()
        .iter()
        .filter(|v| v.elem_count() > persist)
        .map(|v| {
            let (storage, _) = v.storage_and_layout();
            match &*storage {
                Storage::Cpu(cpu) => cpu.as_slice::<f32>().map_or(0, <[f32]>::len),
                _ => 0,
            }
        })
        .sum()
}

fn run(world: usize, source: &Source, stage: Stage, steps: usize, out: &Path) -> Vec<usize> {
    ThreadGroup::new(world)
        .run(|comm| train_and_save(comm, source, stage, steps, out))
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works"))
        .collect()
}

fn read(path: &Path) -> Vec<(String, Vec<f32>)> {
    let mut tensors: Vec<(String, Vec<f32>)> = candle_core::safetensors::load(path, &Device::Cpu)
        .expect("a readable weights file")
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

#[test]
fn sharded_construction_is_one_model_at_every_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let seed = Source::Seed(7);
    // The whole model, as a plain (unsharded) construction gives it.
    let whole = dir.path().join("whole.safetensors");
    run(2, &seed, Stage::Gradients, 0, &whole);
    let want = std::fs::read(&whole).unwrap();
    assert_eq!(read(&whole).len(), 2 * LAYERS + 3, "every variable saved");
    for world in 1..=4 {
        let path = dir.path().join(format!("n{world}.safetensors"));
        let held = run(world, &seed, Stage::Parameters, 0, &path);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            want,
            "world {world}: not the model of a whole construction"
        );
        // The sharded variables hold nothing on any rank.
        assert_eq!(held, vec![0; world], "world {world}");
    }
    // Another seed is another model.
    let other = dir.path().join("other.safetensors");
    run(2, &Source::Seed(8), Stage::Parameters, 0, &other);
    assert_ne!(std::fs::read(&other).unwrap(), want);
}

#[test]
fn training_from_sharded_construction_gives_the_weights_of_stage_2() {
    let dir = tempfile::tempdir().unwrap();
    let seed = Source::Seed(3);
    for world in [1, 2, 3] {
        let stage2 = dir.path().join(format!("s2.{world}.safetensors"));
        let stage3 = dir.path().join(format!("s3.{world}.safetensors"));
        run(world, &seed, Stage::Gradients, 4, &stage2);
        run(world, &seed, Stage::Parameters, 4, &stage3);
        let (a, b) = (read(&stage2), read(&stage3));
        // The same arithmetic element by element (reductions in rank
        // order on threads, Adam element-wise): bitwise.
        assert_eq!(a, b, "world {world}");
        // And training moved them.
        let start = dir.path().join(format!("start.{world}.safetensors"));
        run(world, &seed, Stage::Gradients, 0, &start);
        assert_ne!(read(&start), a, "world {world}: the weights did not change");
    }
}

#[test]
fn weights_saved_at_stage_3_load_sharded_at_another_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("n2.safetensors");
    run(2, &Source::Seed(5), Stage::Parameters, 3, &saved);
    // Loaded (each rank reading its shard of the file) at 3 ranks and
    // saved again untrained: the same file.
    let again = dir.path().join("n3.safetensors");
    let held = run(
        3,
        &Source::File(saved.clone()),
        Stage::Parameters,
        0,
        &again,
    );
    assert_eq!(held, vec![0; 3]);
    assert_eq!(
        std::fs::read(&again).unwrap(),
        std::fs::read(&saved).unwrap()
    );
    // Loaded whole at stage 2 and sharded at stage 3, then trained on: the
    // same weights.
    let (s2, s3) = (
        dir.path().join("s2.safetensors"),
        dir.path().join("s3.safetensors"),
    );
    run(3, &Source::File(saved.clone()), Stage::Gradients, 2, &s2);
    run(3, &Source::File(saved.clone()), Stage::Parameters, 2, &s3);
    assert_eq!(read(&s2), read(&s3));
    assert_ne!(read(&s2), read(&saved), "training changed nothing");
}

#[test]
fn a_file_without_the_model_is_refused_naming_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("partial.safetensors");
    let t = Tensor::zeros((HIDDEN, HIDDEN), DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&std::collections::HashMap::from([("l0.weight", t)]), &path)
        .unwrap();
    let map = ShardedVarMap::from_safetensors(&path).unwrap();
    let err = match Net::new(&map, None) {
        Ok(_) => panic!("a model with tensors missing from the file was built"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("emb.weight") && err.contains("has no tensor"),
        "{err}"
    );
    // A wrong shape names both.
    let bad = dir.path().join("bad.safetensors");
    let t = Tensor::zeros((VOCAB, HIDDEN + 1), DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&std::collections::HashMap::from([("emb.weight", t)]), &bad)
        .unwrap();
    let map = ShardedVarMap::from_safetensors(&bad).unwrap();
    let err = Net::new(&map, None).err().expect("refused").to_string();
    assert!(
        err.contains("[13, 17]") && err.contains("[13, 16]"),
        "{err}"
    );
    // Not a safetensors file at all.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a tensor file").unwrap();
    let err = ShardedVarMap::from_safetensors(&junk)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("junk.safetensors"), "{err}");
}

#[test]
fn a_failed_save_leaves_no_file_and_fails_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("missing-dir").join("w.safetensors");
    let results = ThreadGroup::new(2)
        .run(|comm| train_and_save(comm, &Source::Seed(1), Stage::Parameters, 1, &target));
    for r in results {
        let err = r.expect("no panic").expect_err("the save fails");
        assert!(err.to_string().contains("w.safetensors"), "{err}");
    }
    assert!(!target.exists());
}
