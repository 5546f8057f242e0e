//! Checkpoints through the engine: consolidation, sharded save and resume at
//! other world sizes, stages and partitioners, and failure cases.
//!
//! Gradients are synthetic: each of a global batch of 12 samples has a
//! gradient that depends only on the parameters, the sample's global index
//! and the step, and each rank averages its contiguous slice of the batch.
//! So every world size dividing 12 trains on the same global batch, and
//! runs at different world sizes agree within float noise.

use std::path::Path;
use zero_core::checkpoint::{
    load_into_plain, state_dict_from_plain, Manifest, StateDict, MANIFEST_FILE,
};
use zero_core::engine::HostGrad;
use zero_core::engine::PartitionerKind;
use zero_core::optim::{Adam, AdamConfig, Sgd, SgdConfig};
use zero_core::{
    Communicator, DType, Engine, EngineConfig, Error, FunctionalOptimizer, ParamInfo, SaveOptions,
    Stage, ThreadComm, ThreadGroup,
};

const GLOBAL_BATCH: usize = 12;

type Weights = Vec<Vec<f32>>;

/// MLP 20 -> 10 -> 5, names in sorted order.
fn mlp() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("0.bias", [10], DType::F32),
        ParamInfo::new("0.weight", [10, 20], DType::F32),
        ParamInfo::new("1.bias", [5], DType::F32),
        ParamInfo::new("1.weight", [5, 10], DType::F32),
    ]
}

fn init(params: &[ParamInfo]) -> Weights {
    params
        .iter()
        .enumerate()
        .map(|(p, info)| {
            (0..info.numel())
                .map(|j| ((p * 131 + j * 37) % 29) as f32 * 0.01 - 0.14)
                .collect()
        })
        .collect()
}

/// This rank's mean gradient over its slice of the global batch.
fn grads(weights: &Weights, step: usize, rank: usize, world: usize) -> Weights {
    let per_rank = GLOBAL_BATCH / world;
    weights
        .iter()
        .enumerate()
        .map(|(p, w)| {
            w.iter()
                .enumerate()
                .map(|(j, &x)| {
                    let mut sum = 0.0f32;
                    for i in rank * per_rank..(rank + 1) * per_rank {
                        let noise = ((i * 31 + j * 17 + p * 5 + step * 7) % 23) as f32 - 11.0;
                        sum += 0.05 * x * ((i % 3) as f32 + 1.0) + noise * 0.01;
                    }
                    sum / per_rank as f32
                })
                .collect()
        })
        .collect()
}

fn sgd(lr: f64, momentum: f64) -> Box<dyn FunctionalOptimizer<f32>> {
    Box::new(Sgd::new(SgdConfig::default().with_lr(lr).with_momentum(momentum)).unwrap())
}

fn config(stage: u8, partitioner: PartitionerKind) -> EngineConfig {
    EngineConfig::default()
        .with_stage(Stage::from_number(stage).unwrap())
        .with_partitioner(partitioner)
        .with_bucket_bytes(256)
}

fn engine(
    comm: ThreadComm,
    params: Vec<ParamInfo>,
    optimizer: Box<dyn FunctionalOptimizer<f32>>,
    config: EngineConfig,
) -> Engine<f32, ThreadComm> {
    Engine::new(comm, params, optimizer, config).unwrap()
}

/// Steps `from..to` with the synthetic gradients.
fn train(
    engine: &mut Engine<f32, ThreadComm>,
    weights: &mut Weights,
    steps: std::ops::Range<usize>,
) {
    let rank = engine.comm().rank();
    let world = engine.comm().world_size();
    for step in steps {
        let g = grads(weights, step, rank, world);
        let slots: Vec<Option<HostGrad<'_, f32>>> = g
            .iter()
            .zip(engine.params())
            .map(|(g, p)| p.trainable.then_some(g.into()))
            .collect();
        engine.step(&slots, weights).unwrap().unwrap();
    }
}

/// Every rank's result, unwrapped.
fn all<R: Send>(world: usize, f: impl Fn(ThreadComm) -> R + Sync) -> Vec<R> {
    ThreadGroup::new(world)
        .run(f)
        .into_iter()
        .map(|r| r.unwrap())
        .collect()
}

/// 6 uninterrupted steps at W=4, stage 2, flat; the weights of rank 0.
fn uninterrupted(optimizer: fn() -> Box<dyn FunctionalOptimizer<f32>>) -> Weights {
    let out = all(4, |comm| {
        let mut e = engine(comm, mlp(), optimizer(), config(2, PartitionerKind::Flat));
        let mut w = init(&mlp());
        train(&mut e, &mut w, 0..6);
        w
    });
    out[0].clone()
}

fn momentum() -> Box<dyn FunctionalOptimizer<f32>> {
    sgd(0.1, 0.99)
}

fn adam() -> Box<dyn FunctionalOptimizer<f32>> {
    Box::new(Adam::new(AdamConfig::default().with_lr(0.01)).unwrap())
}

fn max_diff(a: &Weights, b: &Weights) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn ckpt_err(err: Error) -> (std::path::PathBuf, String) {
    match err {
        Error::Checkpoint { path, detail } => (path, detail),
        other => panic!("expected a checkpoint error, got {other}"),
    }
}

/// Saves after 3 steps at W=4 stage 2 (flat) into `dir`; returns the
/// weights then.
fn save_after_three(dir: &Path, optimizer: fn() -> Box<dyn FunctionalOptimizer<f32>>) -> Weights {
    let out = all(4, |comm| {
        let mut e = engine(comm, mlp(), optimizer(), config(2, PartitionerKind::Flat));
        let mut w = init(&mlp());
        train(&mut e, &mut w, 0..3);
        let options = SaveOptions {
            user: serde_json::json!({ "data_position": 36 }),
            ..SaveOptions::default()
        };
        e.save_checkpoint(dir, &mut w, &options).unwrap();
        w
    });
    out[0].clone()
}

/// Resumes from `dir` at `world`, `stage`, `partitioner`, runs steps 3..6.
fn resume(
    dir: &Path,
    world: usize,
    stage: u8,
    partitioner: PartitionerKind,
    optimizer: fn() -> Box<dyn FunctionalOptimizer<f32>>,
) -> Weights {
    let out = all(world, |comm| {
        let mut e = engine(comm, mlp(), optimizer(), config(stage, partitioner));
        let mut w: Weights = mlp().iter().map(|p| vec![0.0; p.numel()]).collect();
        let manifest = e.load_checkpoint(dir, &mut w).unwrap();
        let info = manifest.checkpoint.unwrap();
        assert_eq!(info.user["data_position"], 36);
        assert_eq!(e.steps(), 3);
        train(&mut e, &mut w, 3..6);
        w
    });
    out[0].clone()
}

#[test]
fn consolidation_gathers_full_state_and_loads_on_every_rank() {
    let reference = uninterrupted(momentum);
    let dicts = all(4, |comm| {
        let mut e = engine(comm, mlp(), momentum(), config(1, PartitionerKind::Flat));
        let mut w = init(&mlp());
        train(&mut e, &mut w, 0..3);
        (e.consolidate_state_dict(1).unwrap(), w)
    });
    assert!(dicts[0].0.is_none() && dicts[2].0.is_none() && dicts[3].0.is_none());
    let dict = dicts[1].0.clone().unwrap();
    let weights = dicts[1].1.clone();
    assert_eq!(dict.state.len(), 4);
    assert_eq!(dict.optimizer, "sgd");
    assert_eq!(dict.steps, 3);
    for p in mlp() {
        assert_eq!(
            dict.state[&p.name].tensors["momentum_buffer"].len(),
            p.numel()
        );
    }
    assert_eq!(dict.param_groups.len(), 1);
    assert_eq!(dict.param_groups[0].params.len(), 4);
    assert_eq!(dict.param_groups[0].hyperparams["lr"], 0.1);

    // Load on every rank of a fresh group whose optimizer has other
    // hyperparameters: it takes the saved ones and continues identically.
    let out = all(4, |comm| {
        let mut e = engine(comm, mlp(), sgd(0.5, 0.1), config(1, PartitionerKind::Flat));
        e.load_state_dict(&dict).unwrap();
        assert_eq!(e.optimizer().unwrap().hyperparams(0)["lr"], 0.1);
        assert_eq!(e.optimizer().unwrap().hyperparams(0)["momentum"], 0.99);
        let mut w = weights.clone();
        train(&mut e, &mut w, 3..6);
        w
    });
    assert_eq!(max_diff(&out[0], &reference), 0.0);

    // The same dict loads at another world size, stage and partitioner.
    let out = all(3, |comm| {
        let mut e = engine(comm, mlp(), momentum(), config(2, PartitionerKind::Greedy));
        e.load_state_dict(&dict).unwrap();
        let mut w = weights.clone();
        train(&mut e, &mut w, 3..6);
        w
    });
    assert!(max_diff(&out[0], &reference) < 1e-4);

    // ... and into the plain optimizer, and back.
    let mut plain = Sgd::<f32>::new(SgdConfig::default().with_lr(0.3)).unwrap();
    load_into_plain(&dict, &mut plain).unwrap();
    assert_eq!(
        FunctionalOptimizer::<f32>::hyperparams(&plain, 0)["lr"],
        0.1
    );
    let names: Vec<String> = mlp().into_iter().map(|p| p.name).collect();
    let back = state_dict_from_plain(&plain, &[names]).unwrap();
    assert_eq!(back.state, dict.state);
    assert_eq!(back.param_groups, dict.param_groups);
}

#[test]
fn load_state_dict_rejects_unknown_names_and_wrong_lengths() {
    let out = all(2, |comm| {
        let mut e = engine(comm, mlp(), momentum(), config(1, PartitionerKind::Flat));
        let mut w = init(&mlp());
        train(&mut e, &mut w, 0..1);
        e.consolidate_state_dict(0).unwrap()
    });
    let dict = out[0].clone().unwrap();
    let results = ThreadGroup::new(2).run(|comm| {
        let mut e = engine(comm, mlp(), momentum(), config(1, PartitionerKind::Flat));
        let mut unknown = dict.clone();
        let state = unknown.state["0.bias"].clone();
        unknown.state.insert("2.bias".into(), state);
        let a = e.load_state_dict(&unknown).unwrap_err().to_string();
        let mut short = dict.clone();
        if let Some(s) = short.state.get_mut("0.bias") {
            s.tensors.values_mut().for_each(|t| t.truncate(3));
        }
        let b = e.load_state_dict(&short).unwrap_err().to_string();
        (a, b)
    });
    for r in results {
        let (a, b) = r.unwrap();
        assert!(
            a.contains("\"2.bias\"") && a.contains("not a parameter"),
            "{a}"
        );
        assert!(b.contains("has 3 elements") && b.contains("10"), "{b}");
    }
}

#[test]
fn consolidation_with_empty_shards_does_not_hang() {
    let params = vec![
        ParamInfo::new("a", [3], DType::F32),
        ParamInfo::new("b", [2], DType::F32),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let out = all(4, |comm| {
        let mut e = engine(
            comm,
            params.clone(),
            adam(),
            config(1, PartitionerKind::Greedy),
        );
        let mut w = init(&params);
        let rank = e.comm().rank();
        let g = grads(&w, 0, rank, 4);
        let slots: Vec<Option<HostGrad<'_, f32>>> = g.iter().map(|g| Some(g.into())).collect();
        e.step(&slots, &mut w).unwrap();
        let dict = e.consolidate_state_dict(3).unwrap();
        e.save_consolidated(path, 2).unwrap();
        dict
    });
    let dict = out[3].clone().unwrap();
    assert_eq!(dict.state.len(), 2);
    assert_eq!(dict.state["a"].tensors["exp_avg"].len(), 3);
    assert_eq!(dict.state["b"].scalars["step"], 1.0);
    let loaded = StateDict::<f32>::load(path).unwrap();
    assert_eq!(loaded, dict);
}

#[test]
fn consolidated_file_streams_pieces_that_straddle_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let out = all(4, |comm| {
        let mut e = engine(comm, mlp(), adam(), config(2, PartitionerKind::Flat));
        let mut w = init(&mlp());
        train(&mut e, &mut w, 0..2);
        let dict = e.consolidate_state_dict(0).unwrap();
        e.save_consolidated(path, 3).unwrap();
        // Saving again into the same directory writes a new file, never the
        // one the current manifest points to, and removes the old one after.
        e.save_consolidated(path, 3).unwrap();
        dict
    });
    let dict = out[0].clone().unwrap();
    assert_eq!(StateDict::<f32>::load(path).unwrap(), dict);
    let mut files: Vec<String> = std::fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["manifest.json", "optimizer.step2.1.safetensors"]);
    // The file is plain safetensors with PyTorch-like names.
    let bytes = std::fs::read(path.join("optimizer.step2.1.safetensors")).unwrap();
    let tensors = zero_core::checkpoint::load_tensors("optimizer.safetensors", &bytes).unwrap();
    assert_eq!(tensors["state.0.weight.exp_avg_sq"].shape, vec![200]);
    assert!(tensors["state.1.bias.step"].shape.is_empty());
}

#[test]
fn resume_at_same_world_size_is_bitwise_identical() {
    for optimizer in [momentum as fn() -> _, adam] {
        let reference = uninterrupted(optimizer);
        let dir = tempfile::tempdir().unwrap();
        save_after_three(dir.path(), optimizer);
        let resumed = resume(dir.path(), 4, 2, PartitionerKind::Flat, optimizer);
        assert_eq!(max_diff(&resumed, &reference), 0.0);
    }
}

#[test]
fn resume_at_other_world_sizes_stages_and_partitioners() {
    let reference = uninterrupted(adam);
    let dir = tempfile::tempdir().unwrap();
    save_after_three(dir.path(), adam);
    for (world, stage, partitioner) in [
        (3, 1, PartitionerKind::Greedy),
        (1, 0, PartitionerKind::Flat),
        (2, 2, PartitionerKind::Greedy),
    ] {
        let resumed = resume(dir.path(), world, stage, partitioner, adam);
        let diff = max_diff(&resumed, &reference);
        assert!(diff < 1e-5, "W={world} stage {stage}: {diff}");
    }
}

#[test]
fn save_right_after_construction_and_frozen_weights() {
    let mut params = mlp();
    params[0].trainable = false; // "0.bias" frozen
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let saved = all(2, |comm| {
        let mut e = engine(
            comm,
            params.clone(),
            momentum(),
            config(2, PartitionerKind::Flat),
        );
        let mut w = init(&params);
        e.save_checkpoint(path, &mut w, &zero_core::SaveOptions::default())
            .unwrap();
        w
    });
    let manifest = Manifest::load(path).unwrap();
    let info = manifest.checkpoint.as_ref().unwrap();
    assert_eq!(info.steps, 0);
    assert_eq!(info.world_size, 2);
    assert!(!info.params[0].trainable);
    let out = all(3, |comm| {
        let mut e = engine(
            comm,
            params.clone(),
            momentum(),
            config(1, PartitionerKind::Greedy),
        );
        let mut w: Weights = params.iter().map(|p| vec![9.0; p.numel()]).collect();
        e.load_checkpoint(path, &mut w).unwrap();
        assert_eq!(w, saved[0]);
        train(&mut e, &mut w, 0..2);
        w
    });
    // The frozen bias never moves.
    assert_eq!(out[0][0], saved[0][0]);
    assert_ne!(out[0][1], saved[0][1]);
}

#[test]
fn save_mid_accumulation_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let out = all(2, |comm| {
        let mut e = engine(
            comm,
            mlp(),
            momentum(),
            config(2, PartitionerKind::Flat).with_grad_accum_steps(2),
        );
        let mut w = init(&mlp());
        let g = grads(&w, 0, e.comm().rank(), 2);
        let slots: Vec<Option<HostGrad<'_, f32>>> = g.iter().map(|g| Some(g.into())).collect();
        assert!(e.step(&slots, &mut w).unwrap().is_none());
        let err = e
            .save_checkpoint(path, &mut w, &zero_core::SaveOptions::default())
            .unwrap_err();
        // Finishing the step makes it possible.
        e.step(&slots, &mut w).unwrap().unwrap();
        e.save_checkpoint(path, &mut w, &zero_core::SaveOptions::default())
            .unwrap();
        err
    });
    for err in out {
        assert!(matches!(err, Error::State(_)), "{err}");
        assert!(
            err.to_string().contains("finish the optimizer step first"),
            "{err}"
        );
    }
}

#[test]
fn failed_save_leaves_previous_checkpoint_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    let at_three = save_after_three(path, adam);
    let errors = all(4, |comm| {
        let mut e = engine(comm, mlp(), adam(), config(2, PartitionerKind::Flat));
        let mut w = init(&mlp());
        e.load_checkpoint(path, &mut w).unwrap();
        train(&mut e, &mut w, 3..4);
        let options = SaveOptions {
            fail_after: Some((1, 100)),
            ..SaveOptions::default()
        };
        e.save_checkpoint(path, &mut w, &options)
            .unwrap_err()
            .to_string()
    });
    assert!(
        errors[1].contains("injected write failure"),
        "{}",
        errors[1]
    );
    for e in [&errors[0], &errors[2], &errors[3]] {
        assert!(e.contains("failed on rank 1"), "{e}");
    }
    // The previous checkpoint still loads, with the weights of step 3.
    let manifest = Manifest::load(path).unwrap();
    assert_eq!(manifest.checkpoint.unwrap().steps, 3);
    let reference = uninterrupted(adam);
    let out = all(2, |comm| {
        let mut e = engine(comm, mlp(), adam(), config(1, PartitionerKind::Flat));
        let mut w = init(&mlp());
        e.load_checkpoint(path, &mut w).unwrap();
        assert_eq!(w, at_three);
        train(&mut e, &mut w, 3..6);
        // A later successful save replaces it and removes the stale files.
        e.save_checkpoint(path, &mut w, &zero_core::SaveOptions::default())
            .unwrap();
        w
    });
    assert!(max_diff(&out[0], &reference) < 1e-5);
    let mut names: Vec<String> = std::fs::read_dir(path)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            "manifest.json",
            "model.step6.safetensors",
            "optim.step6.rank0.safetensors",
            "optim.step6.rank1.safetensors",
        ]
    );
}

#[test]
fn corrupted_file_unknown_version_and_other_model_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path();
    save_after_three(path, momentum);
    let load = |params: Vec<ParamInfo>| {
        ThreadGroup::new(2)
            .run(|comm| {
                let mut e = engine(
                    comm,
                    params.clone(),
                    momentum(),
                    config(2, PartitionerKind::Flat),
                );
                let mut w = init(&params);
                e.load_checkpoint(path, &mut w).unwrap_err()
            })
            .into_iter()
            .map(|r| r.unwrap())
            .collect::<Vec<_>>()
    };

    // Another model: different shapes.
    let mut other = mlp();
    other[1].shape = vec![10, 21];
    for err in load(other) {
        let (at, detail) = ckpt_err(err);
        assert_eq!(at, path.join(MANIFEST_FILE));
        assert!(
            detail.contains("another model") && detail.contains("0.weight"),
            "{detail}"
        );
    }

    // One flipped byte in a rank file: a checksum error naming it.
    let file = path.join("optim.step3.rank2.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 5;
    bytes[last] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    let errors = load(mlp());
    // At W=2, rank 1 reads the files of saved ranks 2 and 3.
    let (at, detail) = ckpt_err(errors.into_iter().nth(1).unwrap());
    assert_eq!(at, file);
    assert!(detail.contains("checksum mismatch"), "{detail}");
    bytes[last] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();

    // A truncated model file.
    let model = path.join("model.step3.safetensors");
    let full = std::fs::read(&model).unwrap();
    std::fs::write(&model, &full[..full.len() - 8]).unwrap();
    for err in load(mlp()) {
        let (at, detail) = ckpt_err(err);
        if at == model {
            assert!(detail.contains("truncated"), "{detail}");
        } else {
            assert!(detail.contains("failed on rank"), "{detail}");
        }
    }
    std::fs::write(&model, &full).unwrap();

    // An unknown format version.
    let manifest = std::fs::read_to_string(path.join(MANIFEST_FILE)).unwrap();
    std::fs::write(
        path.join(MANIFEST_FILE),
        manifest.replace("\"format_version\": 1", "\"format_version\": 99"),
    )
    .unwrap();
    for err in load(mlp()) {
        let (_, detail) = ckpt_err(err);
        assert!(detail.contains("format version 99"), "{detail}");
    }
}
