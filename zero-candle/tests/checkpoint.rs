//! Activation checkpointing: a block run through `checkpoint` gives the
//! gradients and trained weights of the plain forward, bitwise, with and
//! without a `ZeroHook`, at every stage; a block that computes other values
//! when run again is an error naming it.

mod nn_support;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use rand::SeedableRng;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use zero_candle::nn::{self, GradHook};
use zero_candle::{checkpoint, ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, NormType, Overlap, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

const VOCAB: usize = 13;
const HIDDEN: usize = 16;
const BLOCKS: usize = 3;
const SEQ: usize = 4;
const PERSIST: usize = 64;

/// A residual block: norm, two linears, tanh.
#[derive(Clone)]
struct Block {
    norm: nn::LayerNorm,
    up: nn::Linear,
    down: nn::Linear,
}

impl Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.up.forward(&self.norm.forward(x)?)?.tanh()?;
        x + self.down.forward(&h)?
    }
}

/// Embedding, residual blocks, and a head tied to the embedding.
struct Net {
    emb: nn::Embedding,
    blocks: Vec<Block>,
    head: nn::Linear,
    checkpointed: bool,
}

impl Net {
    fn new(
        vb: VarBuilder,
        hook: Option<Arc<dyn GradHook>>,
        checkpointed: bool,
    ) -> candle_core::Result<Self> {
        let emb = nn::embedding(VOCAB, HIDDEN, vb.pp("emb"), hook.clone())?;
        let blocks = (0..BLOCKS)
            .map(|i| {
                let vb = vb.pp(format!("b{i}"));
                Ok(Block {
                    norm: nn::layer_norm(HIDDEN, 1e-5, vb.pp("norm"), hook.clone())?,
                    up: nn::linear(HIDDEN, 2 * HIDDEN, vb.pp("up"), hook.clone())?,
                    down: nn::linear(2 * HIDDEN, HIDDEN, vb.pp("down"), hook.clone())?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let head = nn::Linear::new(emb.embeddings().clone(), None, hook);
        Ok(Self {
            emb,
            blocks,
            head,
            checkpointed,
        })
    }

    fn loss(&self, tokens: &Tensor, targets: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.emb.forward(tokens)?;
        for (i, block) in self.blocks.iter().enumerate() {
            h = if self.checkpointed {
                let block = block.clone();
                checkpoint(&format!("block {i}"), &h, move |x| block.forward(x))?
            } else {
                block.forward(&h)?
            };
        }
        let logits = self.head.forward(&h)?.flatten_to(1)?;
        candle_nn::loss::cross_entropy(&logits, &targets.flatten_all()?)
    }
}

fn batch(rng: &mut rand::rngs::StdRng) -> candle_core::Result<(Tensor, Tensor)> {
    nn_support::token_batch(rng, VOCAB, SEQ)
}

type Weights = Vec<(String, Vec<f32>)>;

/// Trains `steps` optimizer steps on 2 thread ranks; every rank's weights.
fn train(config: &EngineConfig, checkpointed: bool, steps: usize) -> Vec<Weights> {
    ThreadGroup::new(2)
        .run(|comm: ThreadComm| -> zero_candle::Result<Weights> {
            let rank = comm.rank();
            let hook = ZeroHook::<ThreadComm, f32>::new();
            let map = ShardedVarMap::seeded(9);
            let net = Net::new(
                map.builder(DType::F32, &Device::Cpu),
                Some(hook.clone()),
                checkpointed,
            )?;
            let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
            let mut opt =
                ZeroOptimizer::new_sharded(&map, comm, config.clone(), Box::new(adamw), &hook)?;
            let mut rng = rand::rngs::StdRng::seed_from_u64(100 + rank as u64);
            for _ in 0..steps * config.grad_accum_steps {
                let (tokens, targets) = batch(&mut rng)?;
                opt.backward_step(&net.loss(&tokens, &targets)?)?;
            }
            opt.full_weights()?
                .into_iter()
                .map(|(n, t)| Ok((n, t.flatten_all()?.to_vec1::<f32>()?)))
                .collect()
        })
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works"))
        .collect()
}

#[test]
fn checkpointed_training_gives_the_weights_of_the_plain_forward_at_every_stage() {
    for stage in [
        Stage::Ddp,
        Stage::OptimizerState,
        Stage::Gradients,
        Stage::Parameters,
    ] {
        let base = EngineConfig::default()
            .with_stage(stage)
            .with_bucket_bytes(256)
            .with_persist_numel(PERSIST);
        let variants = [
            ("plain", base.clone()),
            (
                "accumulation and clipping",
                base.clone()
                    .with_grad_accum_steps(2)
                    .with_clip(0.5, NormType::L2),
            ),
            (
                "after-backward",
                base.clone().with_overlap(Overlap::AfterBackward),
            ),
            ("no overlap", base.clone().with_overlap(Overlap::None)),
        ];
        for (what, config) in variants {
            let plain = train(&config, false, 3);
            let checkpointed = train(&config, true, 3);
            assert_eq!(plain, checkpointed, "stage {}, {what}", stage.number());
        }
    }
}

#[test]
fn plain_layers_inside_a_block_get_their_gradients_through_merge_pending() -> candle_core::Result<()>
{
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let fc = candle_nn::linear(6, 6, vb.pp("fc"))?;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 6), &Device::Cpu)?)?;
    let run = |checkpointed: bool| -> candle_core::Result<Vec<Vec<f32>>> {
        let block = fc.clone();
        let y = if checkpointed {
            checkpoint("fc", x.as_tensor(), move |x| block.forward(x)?.tanh())?
        } else {
            fc.forward(x.as_tensor())?.tanh()?
        };
        let mut grads = (y.sqr()?.sum_all()? * 0.5)?.backward()?;
        zero_candle::recompute::merge_pending(&mut grads)?;
        let mut out = Vec::new();
        for t in [x.as_tensor(), fc.weight(), fc.bias().expect("a bias")] {
            let g = grads.get(t).expect("every gradient arrives");
            out.push(g.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    };
    assert_eq!(run(false)?, run(true)?);
    Ok(())
}

#[test]
fn a_block_that_computes_something_else_when_run_again_is_an_error_naming_it() {
    let x = Var::from_tensor(&Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let y = checkpoint("noisy block", x.as_tensor(), move |x| {
        // Reads state that changes between the forward and its recompute.
        let c = seen.fetch_add(1, Ordering::SeqCst) as f64;
        x.affine(1.0, c)
    })
    .unwrap();
    let err = y
        .sum_all()
        .unwrap()
        .backward()
        .expect_err("recomputed other values");
    let text = err.to_string();
    assert!(
        text.contains("noisy block") && text.contains("other values"),
        "{text}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
