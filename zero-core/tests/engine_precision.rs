//! Mixed precision in the engine: f32 master weights over a bf16 model,
//! loss scaling against `torch.amp.GradScaler`, and checkpoints across
//! precisions.
//!
//! The golden values of the loss-scaling test come from
//! `tests/golden/gen_scaler_golden.py` (torch.amp.GradScaler on the same
//! schedule of planted infs and NaNs).

mod common;

use common::{run, PlanCheck, Seen};
use half::bf16;
use std::path::Path;
use std::sync::{Arc, Mutex};
use zero_core::checkpoint::Manifest;
use zero_core::engine::HostGrad;
use zero_core::engine::{CastParams, DynamicLossScale, Fetcher, GatherMemory, LossScale};
use zero_core::optim::{Adam, AdamConfig, Sgd, SgdConfig};
use zero_core::{Communicator, DType, Engine, EngineConfig, FunctionalOptimizer, ParamInfo, Stage};

fn config(stage: u8) -> EngineConfig {
    EngineConfig::default()
        .with_stage(Stage::from_number(stage).unwrap())
        .with_bucket_bytes(64)
}

// ---------------------------------------------------------------- scaling

#[derive(serde::Deserialize)]
struct ScalerGolden {
    steps: usize,
    world: usize,
    params: Vec<(String, usize)>,
    planted: Vec<(usize, usize, usize, usize, String)>,
    lr: f64,
    momentum: f64,
    scales: Vec<f64>,
    skipped: Vec<bool>,
    final_scale: f64,
    weights: Vec<Vec<f32>>,
}

fn scaler_golden() -> ScalerGolden {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/scaler_golden.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The unscaled gradient formula of `gen_scaler_golden.py`.
fn golden_grad(step: usize, rank: usize, p: usize, i: usize) -> f64 {
    ((i % 7) + 1) as f64 * (rank + 1) as f64 * ((step % 5) + 1) as f64 / 64.0 - 0.5
        + p as f64 * 0.125
}

fn golden_init(p: usize, i: usize) -> f32 {
    ((i % 11) as f64 * 0.25 - 1.0 + p as f64 * 0.5) as f32
}

#[test]
fn dynamic_loss_scale_matches_torch_grad_scaler_on_every_rank() {
    let golden = scaler_golden();
    let infos: Vec<ParamInfo> = golden
        .params
        .iter()
        .map(|(name, n)| ParamInfo::new(name.clone(), [*n], DType::F32))
        .collect();
    let scale = LossScale::Dynamic(DynamicLossScale {
        growth_interval: 3,
        ..DynamicLossScale::default()
    });
    for stage in 0..=2u8 {
        let out = run(golden.world, |comm| {
            let rank = comm.rank();
            let sgd = Sgd::new(
                SgdConfig::default()
                    .with_lr(golden.lr)
                    .with_momentum(golden.momentum),
            )?;
            let mut engine = Engine::<f32, _>::new(
                comm,
                infos.clone(),
                Box::new(sgd),
                config(stage).with_loss_scale(scale),
            )?;
            let mut weights: Vec<Vec<f32>> = golden
                .params
                .iter()
                .enumerate()
                .map(|(p, (_, n))| (0..*n).map(|i| golden_init(p, i)).collect())
                .collect();
            let mut seen = Vec::new();
            for step in 0..golden.steps {
                let scale = engine.loss_scale().unwrap();
                // What backward of the scaled loss would give.
                let mut grads: Vec<Vec<f32>> = golden
                    .params
                    .iter()
                    .enumerate()
                    .map(|(p, (_, n))| {
                        (0..*n)
                            .map(|i| (golden_grad(step, rank, p, i) * scale) as f32)
                            .collect()
                    })
                    .collect();
                for (s, r, p, i, v) in &golden.planted {
                    if (*s, *r) == (step, rank) {
                        grads[*p][*i] = v.parse().unwrap();
                    }
                }
                let before = weights.clone();
                let slots: Vec<Option<HostGrad<'_, f32>>> =
                    grads.iter().map(|g| Some(g.into())).collect();
                let report = engine.step(&slots, &mut weights)?.unwrap();
                if report.skipped {
                    assert_eq!(
                        weights, before,
                        "rank {rank}: a skipped step changed weights"
                    );
                }
                seen.push((report.loss_scale.unwrap(), report.skipped));
            }
            Ok((seen, engine.loss_scale().unwrap(), weights))
        });
        for (rank, (seen, final_scale, weights)) in out.iter().enumerate() {
            let scales: Vec<f64> = seen.iter().map(|s| s.0).collect();
            let skipped: Vec<bool> = seen.iter().map(|s| s.1).collect();
            assert_eq!(scales, golden.scales, "stage {stage} rank {rank}: scales");
            assert_eq!(
                skipped, golden.skipped,
                "stage {stage} rank {rank}: skipped"
            );
            assert_eq!(
                *final_scale, golden.final_scale,
                "stage {stage} rank {rank}"
            );
            for (p, (ours, theirs)) in weights.iter().zip(&golden.weights).enumerate() {
                for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
                    assert!(
                        (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                        "stage {stage} rank {rank}: weight {p}[{i}]: {a} vs torch {b}"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------- master weights

/// Two parameters, bf16, of 50 and 30 elements (they straddle ranks).
fn bf16_infos() -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("a", [5, 10], DType::BF16),
        ParamInfo::new("b", [30], DType::BF16),
    ]
}

fn as_dtype(infos: &[ParamInfo], dtype: DType) -> Vec<ParamInfo> {
    infos
        .iter()
        .map(|p| ParamInfo::new(p.name.clone(), p.shape.clone(), dtype))
        .collect()
}

fn bf16_init(infos: &[ParamInfo]) -> Vec<Vec<bf16>> {
    infos
        .iter()
        .enumerate()
        .map(|(p, info)| {
            (0..info.numel())
                .map(|i| bf16::from_f64(1.0 + ((p * 7 + i * 3) % 13) as f64 / 16.0))
                .collect()
        })
        .collect()
}

/// A gradient that depends on the step, the rank and the weights.
fn grad_of(weights: &[f32], step: usize, rank: usize, p: usize) -> Vec<f32> {
    weights
        .iter()
        .enumerate()
        .map(|(i, w)| 0.3 * w + (((i * 5 + p * 3 + step * 7 + rank * 11) % 17) as f32 - 8.0) * 0.05)
        .collect()
}

#[test]
fn f32_masters_keep_updates_that_a_bf16_engine_loses() {
    // SGD with lr 1e-4 on weights in [1, 2): each update is below half a
    // bf16 ulp there (2^-8), so a bf16 engine rounds every update away;
    // f32 masters add them up.
    let infos = bf16_infos();
    let steps = 100;
    let lr = 1e-4;
    let sgd = || -> Box<dyn FunctionalOptimizer<f32>> {
        Box::new(Sgd::new(SgdConfig::default().with_lr(lr)).unwrap())
    };
    for stage in 0..=2u8 {
        let masters = run(2, |comm| {
            let mut engine = Engine::<f32, _>::new(comm, infos.clone(), sgd(), config(stage))?;
            let mut replica = CastParams(bf16_init(&infos));
            let grads: Vec<Vec<f32>> = infos.iter().map(|p| vec![1.0; p.numel()]).collect();
            for _ in 0..steps {
                let slots: Vec<Option<HostGrad<'_, f32>>> =
                    grads.iter().map(|g| Some(g.into())).collect();
                engine.step(&slots, &mut replica)?;
            }
            Ok(replica.0)
        });
        let plain = run(2, |comm| {
            let sgd: Box<dyn FunctionalOptimizer<bf16>> =
                Box::new(Sgd::new(SgdConfig::default().with_lr(lr))?);
            let mut engine = Engine::<bf16, _>::new(comm, infos.clone(), sgd, config(stage))?;
            let mut replica = bf16_init(&infos);
            let grads: Vec<Vec<bf16>> = infos.iter().map(|p| vec![bf16::ONE; p.numel()]).collect();
            for _ in 0..steps {
                let slots: Vec<Option<HostGrad<'_, bf16>>> =
                    grads.iter().map(|g| Some(g.into())).collect();
                engine.step(&slots, &mut replica)?;
            }
            Ok(replica)
        });
        let init = bf16_init(&infos);
        assert_eq!(
            plain[0], init,
            "stage {stage}: bf16 updates are rounded away"
        );
        // With masters: the f32 sum of 100 updates, rounded once.
        for (p, w0) in init.iter().enumerate() {
            for (i, w) in w0.iter().enumerate() {
                let mut master = w.to_f32();
                for _ in 0..steps {
                    master -= lr as f32;
                }
                let want = bf16::from_f32(master);
                for replica in &masters {
                    assert_eq!(replica[p][i], want, "stage {stage}: {p}[{i}]");
                }
                assert_ne!(
                    want, *w,
                    "the test's updates must add up to a visible change"
                );
            }
        }
    }
}

/// Five Adam steps of the bf16 model with f32 masters on 2 ranks under
/// `cfg`: each rank's replica and the bytes it sent in the steps.
fn train_bf16(cfg: EngineConfig) -> Vec<(Vec<Vec<bf16>>, u64)> {
    let infos = bf16_infos();
    run(2, |comm| {
        let adam: Box<dyn FunctionalOptimizer<f32>> =
            Box::new(Adam::new(AdamConfig::default().with_lr(1e-2))?);
        let mut engine = Engine::<f32, _>::new(comm, infos.clone(), adam, cfg.clone())?;
        let mut replica = CastParams(bf16_init(&infos));
        let rank = engine.comm().rank();
        let mut sent = 0;
        for step in 0..5 {
            let grads: Vec<Vec<f32>> = replica
                .0
                .iter()
                .enumerate()
                .map(|(p, w)| {
                    let w: Vec<f32> = w.iter().map(|x| x.to_f32()).collect();
                    grad_of(&w, step, rank, p)
                })
                .collect();
            let slots: Vec<Option<HostGrad<'_, f32>>> =
                grads.iter().map(|g| Some(g.into())).collect();
            let before = engine.comm().bytes_sent();
            engine.step(&slots, &mut replica)?;
            sent += engine.comm().bytes_sent() - before;
        }
        Ok((replica.0, sent))
    })
}

#[test]
fn gathering_in_bf16_halves_the_bytes_and_gives_the_same_weights() {
    let train = |in_bf16: bool| train_bf16(config(2).with_gather_in_param_dtype(in_bf16));
    let (wide, narrow) = (train(false), train(true));
    for rank in 0..2 {
        assert_eq!(wide[rank].0, narrow[rank].0, "rank {rank}: same weights");
        assert!(
            narrow[rank].1 < wide[rank].1,
            "rank {rank}: {} bytes in bf16, {} in f32",
            narrow[rank].1,
            wide[rank].1
        );
    }
}

#[test]
fn reducing_in_bf16_halves_the_reduction_bytes_and_stays_close() {
    let train = |in_bf16: bool| train_bf16(config(2).with_reduce_in_param_dtype(in_bf16));
    let (wide, narrow) = (train(false), train(true));
    for rank in 0..2 {
        // The gathers are bf16 either way: the reductions alone differ.
        assert!(
            narrow[rank].1 < wide[rank].1,
            "rank {rank}: {} bytes reducing in bf16, {} in f32",
            narrow[rank].1,
            wide[rank].1
        );
        for (p, (a, b)) in wide[rank].0.iter().zip(&narrow[rank].0).enumerate() {
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (x.to_f32(), y.to_f32());
                // Adam's steps are about lr = 1e-2 each; rounding each
                // gradient to bf16 (8 bits) moves them by a small fraction.
                assert!((x - y).abs() <= 1e-2, "rank {rank}, param {p}: {x} vs {y}");
            }
        }
    }
}

/// Trains `steps` steps of Adam on the bf16 model with f32 masters and a
/// dynamic loss scale (an inf planted every 4th step on rank 0), from a
/// checkpoint if `resume`, then saves into `save`. Returns each rank's
/// replica and loss scale.
fn train_bf16_masters(
    world: usize,
    stage: u8,
    first_step: usize,
    steps: usize,
    resume: Option<&Path>,
    save: &Path,
) -> Vec<(Vec<Vec<bf16>>, Option<f64>)> {
    let infos = bf16_infos();
    run(world, |comm| {
        let adam: Box<dyn FunctionalOptimizer<f32>> =
            Box::new(Adam::new(AdamConfig::default().with_lr(3e-3))?);
        let cfg = config(stage).with_loss_scale(LossScale::Dynamic(DynamicLossScale {
            growth_interval: 2,
            ..DynamicLossScale::default()
        }));
        let mut engine = Engine::<f32, _>::new(comm, infos.clone(), adam, cfg)?;
        let mut replica = CastParams(bf16_init(&infos));
        if let Some(dir) = resume {
            engine.load_checkpoint(dir, &mut replica)?;
        }
        let rank = engine.comm().rank();
        for step in first_step..first_step + steps {
            let scale = engine.loss_scale().unwrap_or(1.0) as f32;
            let mut grads: Vec<Vec<f32>> = replica
                .0
                .iter()
                .enumerate()
                .map(|(p, w)| {
                    let w: Vec<f32> = w.iter().map(|x| x.to_f32()).collect();
                    grad_of(&w, step, rank, p)
                        .into_iter()
                        .map(|g| g * scale)
                        .collect()
                })
                .collect();
            if step % 4 == 3 && rank == 0 {
                grads[1][2] = f32::INFINITY;
            }
            let slots: Vec<Option<HostGrad<'_, f32>>> =
                grads.iter().map(|g| Some(g.into())).collect();
            let report = engine.step(&slots, &mut replica)?.unwrap();
            assert_eq!(report.skipped, step % 4 == 3);
        }
        engine.save_checkpoint(save, &mut replica, &zero_core::SaveOptions::default())?;
        Ok((replica.0, engine.loss_scale()))
    })
}

/// The model file of the checkpoint in `dir`: (name, dtype, raw bytes).
fn model_file(dir: &Path) -> Vec<(String, String, Vec<u8>)> {
    let manifest = Manifest::load(dir).unwrap();
    let file = manifest.checkpoint.unwrap().model_file.unwrap();
    let bytes = std::fs::read(dir.join(file)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, format!("{:?}", t.dtype()), t.data().to_vec()))
        .collect();
    out.sort();
    out
}

#[test]
fn master_weights_and_loss_scale_survive_save_and_resume_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let (mid, full, resumed) = (
        tmp.path().join("mid"),
        tmp.path().join("full"),
        tmp.path().join("resumed"),
    );
    for stage in 0..=2u8 {
        train_bf16_masters(2, stage, 0, 6, None, &mid);
        // The same 12 steps without a break.
        let straight = train_bf16_masters(2, stage, 0, 12, None, &full);
        let again = train_bf16_masters(2, stage, 6, 6, Some(&mid), &resumed);
        assert_eq!(
            straight, again,
            "stage {stage}: replica and loss scale after resume"
        );
        // The model file holds the f32 masters: bitwise the same, and finer
        // than bf16 (so a resume from the bf16 replica would lose them).
        let (a, b) = (model_file(&full), model_file(&resumed));
        assert_eq!(a, b, "stage {stage}: master weights after resume");
        assert!(a.iter().all(|(_, dtype, _)| dtype == "F32"));
        let finer = a.iter().any(|(_, _, data)| {
            bytemuck::cast_slice::<u8, f32>(&data.clone())
                .iter()
                .any(|x| bf16::from_f32(*x).to_f32() != *x)
        });
        assert!(finer, "stage {stage}: the masters must hold more than bf16");
    }
}

#[test]
fn checkpoints_load_across_precisions_world_sizes_and_stages() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16_ckpt = tmp.path().join("bf16");
    train_bf16_masters(2, 2, 0, 5, None, &bf16_ckpt);
    let masters = model_file(&bf16_ckpt);

    // An f32 run (3 ranks, stage 1) from the bf16 run's checkpoint: its
    // weights are the masters, bitwise; it trains, and saves f32.
    let f32_ckpt = tmp.path().join("f32");
    let f32_infos = as_dtype(&bf16_infos(), DType::F32);
    run(3, |comm| {
        let adam: Box<dyn FunctionalOptimizer<f32>> =
            Box::new(Adam::new(AdamConfig::default().with_lr(3e-3))?);
        let mut engine = Engine::<f32, _>::new(comm, f32_infos.clone(), adam, config(1))?;
        let mut weights: Vec<Vec<f32>> = f32_infos.iter().map(|p| vec![0.0; p.numel()]).collect();
        engine.load_checkpoint(&bf16_ckpt, &mut weights)?;
        engine.save_checkpoint(&f32_ckpt, &mut weights, &zero_core::SaveOptions::default())?;
        Ok(())
    });
    assert_eq!(
        model_file(&f32_ckpt),
        masters,
        "f32 run: weights are the masters"
    );

    // And back: a bf16 run with masters (1 rank, stage 0) from the f32
    // checkpoint: its masters are the f32 weights, bitwise, its replica
    // them rounded.
    let back = tmp.path().join("back");
    let replicas = run(1, |comm| {
        let adam: Box<dyn FunctionalOptimizer<f32>> =
            Box::new(Adam::new(AdamConfig::default().with_lr(3e-3))?);
        let mut engine = Engine::<f32, _>::new(comm, bf16_infos(), adam, config(0))?;
        let mut replica = CastParams(bf16_init(&bf16_infos()));
        engine.load_checkpoint(&f32_ckpt, &mut replica)?;
        engine.save_checkpoint(&back, &mut replica, &zero_core::SaveOptions::default())?;
        Ok(replica.0)
    });
    assert_eq!(
        model_file(&back),
        masters,
        "bf16 run: masters from the f32 weights"
    );
    for (p, (_, _, data)) in masters.iter().enumerate() {
        let values = bytemuck::cast_slice::<u8, f32>(&data.clone()).to_vec();
        let rounded: Vec<bf16> = values.iter().map(|x| bf16::from_f32(*x)).collect();
        assert_eq!(
            replicas[0][p], rounded,
            "replica {p} is the masters rounded"
        );
    }

    // A bf16 engine without masters (2 ranks, stage 2) loads it too: the
    // weights and the optimizer state rounded to bf16, and it trains.
    run(2, |comm| {
        let adam: Box<dyn FunctionalOptimizer<bf16>> =
            Box::new(Adam::new(AdamConfig::default().with_lr(3e-3))?);
        let mut engine = Engine::<bf16, _>::new(comm, bf16_infos(), adam, config(2))?;
        let mut replica = bf16_init(&bf16_infos());
        engine.load_checkpoint(&bf16_ckpt, &mut replica)?;
        let grads: Vec<Vec<bf16>> = replica.iter().map(|w| vec![bf16::ONE; w.len()]).collect();
        let slots: Vec<Option<HostGrad<'_, bf16>>> = grads.iter().map(|g| Some(g.into())).collect();
        engine.step(&slots, &mut replica)?;
        Ok(())
    });
}

/// What one rank's stage-3 run below ends with: each parameter gathered
/// whole, the dtype the memory was asked to gather in, each parameter's
/// number of gathered pieces, and the bytes the gathers sent.
struct Gathered {
    full: Vec<Vec<f32>>,
    asked: Option<DType>,
    pieces: Vec<usize>,
    sent: u64,
}

/// Each parameter `fetcher` shards gathered whole, its pieces and the
/// bytes sent.
fn whole<G: GatherMemory<f32>>(
    fetcher: &Fetcher<f32, G>,
    n: usize,
    asked: Option<DType>,
) -> zero_core::Result<Gathered> {
    let full = (0..n)
        .map(|p| fetcher.gather_full(p))
        .collect::<zero_core::Result<Vec<_>>>()?;
    Ok(Gathered {
        full,
        asked,
        pieces: (0..n).map(|p| fetcher.pieces(p)).collect(),
        sent: fetcher.bytes_sent(),
    })
}

/// Stage 3 over `infos` on `world` ranks: sharded before the first step,
/// three SGD steps whose updates lie below half a bf16 ulp of the weights
/// (so the masters move and their bf16 rounding does not), then every
/// parameter gathered whole. `device`: the memory poses as a device
/// ([`PlanCheck`], which records what it is asked); else the engine runs
/// on host memory.
fn stage_3_gathers(
    infos: &[ParamInfo],
    world: usize,
    config: &EngineConfig,
    device: bool,
) -> Vec<Gathered> {
    run(world, |comm| {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let sgd = Box::new(Sgd::new(SgdConfig::default().with_lr(1e-4))?);
        let (infos, config) = (infos.to_vec(), config.clone());
        let mut replica = CastParams(bf16_init(&infos));
        let grads: Vec<Vec<f32>> = infos.iter().map(|p| vec![1.0; p.numel()]).collect();
        let slots: Vec<Option<HostGrad<'_, f32>>> = grads.iter().map(|g| Some(g.into())).collect();
        let all = vec![true; infos.len()];
        if device {
            let memory = PlanCheck::new(seen.clone(), true);
            let mut engine = Engine::with_memory(comm, memory, infos.clone(), sgd, config)?;
            let fetcher = engine.shard_parameters(&all, &mut replica)?;
            for _ in 0..3 {
                engine.step(&slots, &mut replica)?;
            }
            let asked = seen.lock().expect("no test thread panicked").gathered_in;
            whole(&fetcher, infos.len(), asked)
        } else {
            let mut engine = Engine::<f32, _>::new(comm, infos.clone(), sgd, config)?;
            let fetcher = engine.shard_parameters(&all, &mut replica)?;
            for _ in 0..3 {
                engine.step(&slots, &mut replica)?;
            }
            whole(&fetcher, infos.len(), None)
        }
    })
}

#[test]
fn stage_3_gathers_a_bf16_model_in_bf16() {
    let infos = bf16_infos();
    let base = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_bucket_bytes(64)
        .with_persist_numel(0)
        .with_gather_bytes(40);
    let in_masters = base.clone().with_gather_in_param_dtype(false);
    for world in [1, 2] {
        for device in [true, false] {
            let what = format!("N={world}, {}", if device { "device" } else { "host" });
            let masters = stage_3_gathers(&infos, world, &in_masters, device);
            let narrowed = stage_3_gathers(&infos, world, &base, device);
            for (wide, narrow) in masters.iter().zip(&narrowed) {
                if device {
                    assert_eq!(wide.asked, None, "{what}: asked to gather in f32");
                    assert_eq!(narrow.asked, Some(DType::BF16), "{what}: asked for bf16");
                }
                let mut moved = 0;
                for (p, (m, r)) in wide.full.iter().zip(&narrow.full).enumerate() {
                    let want: Vec<f32> = m.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
                    assert_eq!(*r, want, "{what} param {p}: the masters rounded to bf16");
                    moved += m.iter().zip(r).filter(|(m, r)| m != r).count();
                }
                assert!(
                    moved > 0,
                    "{what}: the masters moved below bf16's resolution"
                );
                // The budgets count two bytes a gathered element: a piece
                // of 40 bytes holds twice the elements.
                assert!(
                    narrow.pieces.iter().zip(&wide.pieces).all(|(n, w)| n < w),
                    "{what}: pieces {:?} in bf16, {:?} in f32",
                    narrow.pieces,
                    wide.pieces
                );
                // Half the bytes on the wire (the thread backend counts
                // what each rank sends; one rank sends nothing).
                if world > 1 {
                    assert!(
                        wide.sent > 0 && narrow.sent * 2 <= wide.sent,
                        "{what}: {} bytes sent in bf16, {} in f32",
                        narrow.sent,
                        wide.sent
                    );
                }
            }
        }
    }
    // An f32 model has no 16-bit dtype to gather in.
    let f32_infos = as_dtype(&infos, DType::F32);
    let gathered = &stage_3_gathers(&f32_infos, 1, &base, true)[0];
    assert_eq!(gathered.asked, None, "an f32 model gathers in f32");
}
