//! Stage 3: the sharded parameters are gathered on use, their variables
//! hold no values, and training gives the weights of stage 2.
//!
//! Stage 3 and stage 2 run the same arithmetic: the forward and backward
//! matmuls read the same values (gathered instead of held), gradients are
//! reduced element by element in rank order on the thread backend whatever
//! the bucket layout, and Adam steps element by element. So the weights
//! agree bitwise; a tolerance would hide a gather of the wrong values.

mod nn_support;

use candle_core::{DType, Device, Module, Storage, Tensor};
use candle_nn::{VarBuilder, VarMap};
use rand::SeedableRng;
use std::sync::Arc;
use std::time::Duration;
use zero_candle::nn::{self, GradHook};
use zero_candle::{ZeroHook, ZeroOptimizer};
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

/// Embedding, residual tanh layers, a norm, and an output head tied to the
/// embedding (two hooked uses of one sharded variable).
struct Net {
    emb: nn::Embedding,
    layers: Vec<nn::Linear>,
    norm: nn::LayerNorm,
    head: nn::Linear,
    varmap: VarMap,
    hook: Option<Arc<dyn GradHook>>,
    /// The first layer's (sharded) weight also read through [`nn::tap`],
    /// as a 16-bit MoE's f32 router reads its Linear's.
    tap_first: bool,
}

impl Net {
    fn new(hook: Option<Arc<dyn GradHook>>, tap_first: bool) -> candle_core::Result<Self> {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let emb = nn::embedding(VOCAB, HIDDEN, vb.pp("emb"), hook.clone())?;
        let layers = (0..LAYERS)
            .map(|i| nn::linear(HIDDEN, HIDDEN, vb.pp(format!("l{i}")), hook.clone()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = nn::layer_norm(HIDDEN, 1e-5, vb.pp("norm"), hook.clone())?;
        let head = nn::Linear::new(emb.embeddings().clone(), None, hook.clone());
        nn_support::seed_varmap(&varmap, 7)?;
        Ok(Self {
            emb,
            layers,
            norm,
            head,
            varmap,
            hook,
            tap_first,
        })
    }

    /// The loss, leaving out layer `skip` if given.
    fn loss(
        &self,
        tokens: &Tensor,
        targets: &Tensor,
        skip: Option<usize>,
    ) -> candle_core::Result<Tensor> {
        let mut h = self.emb.forward(tokens)?;
        for (i, layer) in self.layers.iter().enumerate() {
            if skip != Some(i) {
                h = (&h + layer.forward(&h)?.tanh()?)?;
            }
        }
        if self.tap_first {
            let weight = candle_core::Var::from_tensor(self.layers[0].weight())?;
            let weight = nn::tap(&weight, self.hook.clone())?;
            h = (&h + h.broadcast_matmul(&weight.t()?)?.sin()?)?;
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

/// What a rank does at each step besides training.
#[derive(Clone, Copy, Default)]
struct Plan {
    steps: usize,
    /// (step, rank or every rank, layer) left out of the forward.
    skip: Option<(usize, Option<usize>, usize)>,
    /// Forward-only passes before each step.
    evals: usize,
    /// The model taps its first layer's weight too.
    tap_first: bool,
}

type Weights = Vec<(String, Vec<f32>)>;

/// Trains as `plan` says; returns the optimizer and the model.
fn train(
    comm: ThreadComm,
    config: &EngineConfig,
    plan: Plan,
) -> zero_candle::Result<(ZeroOptimizer<ThreadComm>, Net)> {
    let rank = comm.rank();
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let net = Net::new(Some(hook.clone()), plan.tap_first)?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt =
        ZeroOptimizer::new(&net.varmap, comm, config.clone(), Box::new(adamw))?.with_hook(&hook)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + rank as u64);
    for step in 0..plan.steps * config.grad_accum_steps {
        let (tokens, targets) = batch(&mut rng)?;
        for _ in 0..plan.evals {
            net.loss(&tokens, &targets, None)?;
        }
        let skip = match plan.skip {
            Some((at, who, layer)) if at == step && who.is_none_or(|r| r == rank) => Some(layer),
            _ => None,
        };
        opt.backward_step(&net.loss(&tokens, &targets, skip)?)?;
    }
    Ok((opt, net))
}

fn weights(opt: &ZeroOptimizer<ThreadComm>) -> zero_candle::Result<Weights> {
    opt.full_weights()?
        .into_iter()
        .map(|(name, t)| Ok((name, t.flatten_all()?.to_vec1::<f32>()?)))
        .collect()
}

fn run(world: usize, config: &EngineConfig, plan: Plan) -> Vec<Weights> {
    ThreadGroup::new(world)
        .run(|comm| train(comm, config, plan).and_then(|(opt, _)| weights(&opt)))
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works"))
        .collect()
}

#[test]
fn stage_3_trains_the_weights_of_stage_2() {
    let plan = Plan {
        steps: 4,
        ..Plan::default()
    };
    for world in 1..=4 {
        let reference = run(world, &config(Stage::Gradients), plan);
        let variants = [
            ("default", config(Stage::Parameters)),
            (
                "no prefetch",
                config(Stage::Parameters).with_prefetch_bytes(0),
            ),
            ("persist 0", config(Stage::Parameters).with_persist_numel(0)),
        ];
        for (what, config) in variants {
            let sharded = run(world, &config, plan);
            assert_eq!(reference, sharded, "world {world}, {what}");
        }
    }
    // With accumulation (stage 3 reduce-scatters every micro-step, as 2).
    let plan = Plan {
        steps: 3,
        ..Plan::default()
    };
    let reference = run(3, &config(Stage::Gradients).with_grad_accum_steps(2), plan);
    let sharded = run(3, &config(Stage::Parameters).with_grad_accum_steps(2), plan);
    assert_eq!(reference, sharded, "accumulation");
}

#[test]
fn a_sharded_weight_a_tap_also_reads_trains_the_weights_of_stage_2() {
    // The tap copies the gathered values and hands its gradient to the
    // hook beside the Linear's: gathered whole, the arithmetic of stage 2
    // (the same weights bitwise); in pieces, the Linear's products add in
    // another order (see the test of pieces above: within 1e-5).
    let plan = Plan {
        steps: 3,
        tap_first: true,
        ..Plan::default()
    };
    for world in [1, 2] {
        let reference = run(world, &config(Stage::Gradients), plan);
        let whole = run(world, &config(Stage::Parameters), plan);
        assert_eq!(reference, whole, "world {world}");
        let pieces = run(
            world,
            &config(Stage::Parameters).with_gather_bytes(40),
            plan,
        );
        let most = max_difference(&reference, &pieces);
        assert!(
            most < 1e-5,
            "world {world}, pieces: weights differ by {most}"
        );
    }
}

/// The largest difference between two runs' weights.
fn max_difference(a: &[Weights], b: &[Weights]) -> f32 {
    let mut most = 0f32;
    for (a, b) in a.iter().zip(b) {
        for ((name_a, a), (name_b, b)) in a.iter().zip(b) {
            assert_eq!(name_a, name_b);
            for (x, y) in a.iter().zip(b) {
                most = most.max((x - y).abs());
            }
        }
    }
    most
}

#[test]
fn layers_gathered_in_pieces_train_the_weights_of_stage_2() {
    // 40-byte pieces: every sharded weight (1 KiB) and the tied embedding
    // come in many pieces, most rows split over two pieces, so the
    // forward, the input gradient and the lookup put rows together.
    // Computed in pieces, the products of split rows and the input
    // gradient's sum over the weight's rows add in another order than
    // one matmul: the weights then differ by f32 rounding (1.2e-7 at
    // most, measured). After four AdamW steps at lr 1e-2, a wrong or
    // missing piece moves a weight by about a step (1e-2): 1e-5 separates
    // the two.
    let plan = Plan {
        steps: 4,
        ..Plan::default()
    };
    let pieces = config(Stage::Parameters).with_gather_bytes(40);
    for world in 1..=3 {
        let reference = run(world, &config(Stage::Gradients), plan);
        for (what, config) in [
            ("pieces", pieces.clone()),
            ("pieces, no prefetch", pieces.clone().with_prefetch_bytes(0)),
        ] {
            let sharded = run(world, &config, plan);
            let most = max_difference(&reference, &sharded);
            assert!(
                most < 1e-5,
                "world {world}, {what}: weights differ by {most}"
            );
        }
    }
}

#[test]
fn a_layer_gathered_in_pieces_never_exists_whole_and_every_piece_is_prefetched() {
    let weight_bytes = HIDDEN * HIDDEN * 4;
    let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
        let config = config(Stage::Parameters)
            .with_gather_bytes(64)
            .with_prefetch_bytes(128);
        let (mut opt, net) = train(
            comm,
            &config,
            Plan {
                steps: 1,
                ..Plan::default()
            },
        )?;
        let index = |name: &str| opt.names().iter().position(|n| n == name).unwrap();
        let (l1, emb) = (index("l1.weight"), index("emb.weight"));
        let fetcher = opt.engine().fetcher().unwrap().clone();
        let pieces = |param: usize| fetcher.pieces(param) as u64;
        // 64-byte pieces at N=2: 8 elements of each rank's chunk.
        assert_eq!(pieces(l1), (HIDDEN * HIDDEN / 16) as u64);
        let before = opt.fetch_stats().unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..3 {
            let (tokens, targets) = batch(&mut rng)?;
            opt.backward_step(&net.loss(&tokens, &targets, None)?)?;
        }
        let stats = opt.fetch_stats().unwrap();
        // Each piece twice per step (forward, input gradient); the tied
        // embedding three times (lookup, head forward and backward).
        assert_eq!(stats.gathers[l1] - before.gathers[l1], 3 * 2 * pieces(l1));
        assert_eq!(
            stats.gathers[emb] - before.gathers[emb],
            3 * 3 * pieces(emb)
        );
        assert_eq!(stats.misses, 0, "{stats:?}");
        // The backward's first pieces were gathered during the forward.
        assert!(stats.early - before.early >= 3, "{stats:?}");
        // The piece in use and 128 bytes ahead: never a whole weight.
        assert!(stats.peak_live_bytes <= 64 + 128, "{stats:?}");
        assert!(stats.peak_live_bytes < weight_bytes, "{stats:?}");
        Ok(())
    });
    for r in results {
        r.expect("no panic").expect("stage 3 in pieces works");
    }
}

#[test]
fn sharded_variables_give_their_memory_back_and_every_use_is_prefetched() {
    let unit_bytes = HIDDEN * HIDDEN * 4;
    // Room for three gathered layers: the one in use and two prefetched.
    let max_live = 3 * unit_bytes + 512;
    let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<()> {
        let config = config(Stage::Parameters).with_max_live_bytes(max_live);
        let (opt, net) = train(
            comm,
            &config,
            Plan {
                steps: 1,
                ..Plan::default()
            },
        )?;
        let stored = |name: &str| -> usize {
            let var = &net.varmap.data().lock().unwrap()[name];
            let (storage, _) = var.storage_and_layout();
            match &*storage {
                Storage::Cpu(cpu) => cpu.as_slice::<f32>().map(|s| s.len()).unwrap_or(0),
                _ => unreachable!("CPU test"),
            }
        };
        // Sharded: no values left in the variable; persistent: whole.
        for name in ["emb.weight", "l0.weight", "l1.weight", "l2.weight"] {
            assert_eq!(stored(name), 0, "{name}");
            let i = opt.names().iter().position(|n| n == name).unwrap();
            assert!(opt.engine().fetcher().unwrap().is_sharded(i), "{name}");
        }
        for name in ["l0.bias", "norm.weight"] {
            assert_eq!(stored(name), HIDDEN, "{name}");
        }
        // The engine's report counts no replica for the sharded ones: less
        // than the whole model (stage 2 holds it plus a shard).
        let whole: usize = opt.vars().iter().map(|v| v.elem_count() * 4).sum();
        assert!(
            opt.memory_report().params < whole,
            "{:?}",
            opt.memory_report()
        );

        // Per step: each layer is gathered for its forward and for its
        // backward (∂x needs the weight); the tied embedding for its
        // forward, and as the head for its forward and backward.
        let gathers_of = |opt: &ZeroOptimizer<ThreadComm>, name: &str| {
            let i = opt.names().iter().position(|n| n == name).unwrap();
            opt.fetch_stats().unwrap().gathers[i]
        };
        let mut opt = opt;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for _ in 0..3 {
            let before: Vec<u64> = ["emb.weight", "l0.weight", "l1.weight", "l2.weight"]
                .iter()
                .map(|n| gathers_of(&opt, n))
                .collect();
            let (tokens, targets) = batch(&mut rng)?;
            opt.backward_step(&net.loss(&tokens, &targets, None)?)?;
            let after: Vec<u64> = ["emb.weight", "l0.weight", "l1.weight", "l2.weight"]
                .iter()
                .map(|n| gathers_of(&opt, n))
                .collect();
            let per_step: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
            assert_eq!(per_step, vec![3, 2, 2, 2]);
            for name in ["l0.bias", "norm.weight", "norm.bias"] {
                assert_eq!(gathers_of(&opt, name), 0, "{name} persists");
            }
        }
        let stats = opt.fetch_stats().unwrap();
        // Planned from the step that ran on whole weights: no gather was
        // ever issued late, in the first sharded step either.
        assert_eq!(stats.misses, 0, "{stats:?}");
        assert!(stats.hits >= 3 * 9, "{stats:?}");
        assert!(stats.peak_live_bytes <= max_live, "{stats:?}");
        assert!(
            stats.peak_live_bytes >= 2 * unit_bytes,
            "prefetch ran ahead"
        );
        Ok(())
    });
    for r in results {
        r.expect("no panic").expect("stage 3 works");
    }
}

#[test]
fn a_forward_that_changes_on_every_rank_re_records() {
    let plan = Plan {
        steps: 4,
        skip: Some((2, None, 1)),
        ..Plan::default()
    };
    let reference = run(2, &config(Stage::Gradients), plan);
    let results = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<(Weights, u64)> {
        let (opt, _) = train(comm, &config(Stage::Parameters), plan)?;
        Ok((weights(&opt)?, opt.fetch_stats().unwrap().retraces))
    });
    for (r, expected) in results.into_iter().zip(reference) {
        let (weights, retraces) = r
            .expect("no panic")
            .expect("a changed trace is not an error");
        assert_eq!(weights, expected);
        // Changed at step 2, back at step 3: forward and backward twice.
        assert!(retraces >= 2, "{retraces}");
    }
}

#[test]
fn a_rank_whose_forward_differs_is_an_error_on_every_rank() {
    let plan = Plan {
        steps: 4,
        skip: Some((2, Some(1), 1)),
        ..Plan::default()
    };
    let results = ThreadGroup::new(2)
        .with_timeout(Duration::from_secs(60))
        .run(|comm| train(comm, &config(Stage::Parameters), plan).map(|_| ()));
    for r in results {
        let e = r.expect("no panic").expect_err("the ranks' models differ");
        let message = e.to_string();
        assert!(message.contains("differ"), "{message}");
        assert!(!message.contains("timed out"), "not a hang: {message}");
    }
}

#[test]
fn evaluation_passes_between_steps_change_nothing() {
    let plan = Plan {
        steps: 3,
        ..Plan::default()
    };
    let plain = run(2, &config(Stage::Parameters), plan);
    let with_evals = run(2, &config(Stage::Parameters), Plan { evals: 3, ..plan });
    assert_eq!(plain, with_evals);
}

#[test]
fn stage_3_checkpoints_resume_at_any_stage_and_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s3");
    let plan = Plan {
        steps: 3,
        ..Plan::default()
    };
    // Saved by stage 3 at two ranks, after sharding.
    let saved = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<Weights> {
        let (mut opt, _) = train(comm, &config(Stage::Parameters), plan)?;
        opt.save_checkpoint(&path)?;
        weights(&opt)
    });
    let saved = saved.into_iter().next().unwrap().unwrap().unwrap();
    // Loaded by stage 2 at three ranks, and by stage 3 at four after it
    // sharded (the sharded parameters' values go to their shards only).
    let s2 = ThreadGroup::new(3).run(|comm| -> zero_candle::Result<Weights> {
        let net = Net::new(None, false)?;
        let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
        let mut opt =
            ZeroOptimizer::new(&net.varmap, comm, config(Stage::Gradients), Box::new(adamw))?;
        opt.load_checkpoint(&path)?;
        weights(&opt)
    });
    let s3 = ThreadGroup::new(4).run(|comm| -> zero_candle::Result<Weights> {
        let (mut opt, _) = train(
            comm,
            &config(Stage::Parameters),
            Plan {
                steps: 1,
                ..Plan::default()
            },
        )?;
        opt.load_checkpoint(&path)?;
        weights(&opt)
    });
    for w in s2.into_iter().chain(s3) {
        assert_eq!(w.expect("no panic").expect("loads"), saved);
    }
}
