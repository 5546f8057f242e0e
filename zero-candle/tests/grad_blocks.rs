//! Weight gradients in blocks of rows: a Linear whose hook takes blocks
//! (`GradHook::block_bytes`) never computes its whole weight gradient, and
//! what it hands over is that gradient, bit for bit; the engine, given the
//! blocks, trains the same weights as given whole gradients.

mod nn_support;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use nn_support::{assert_equal, data, hook, var, weighted_sum, Recorder};
use rand::{Rng, SeedableRng};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use zero_candle::nn::{self, GradHook};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Overlap, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

/// Small blocks: a 24-input layer of 400 outputs gives two (at least 192
/// rows each, so that each block's matmul is bitwise that block of the
/// whole one).
const BLOCK_BYTES: usize = 4096;

/// A hook that takes blocks and records them, in order.
#[derive(Default)]
struct BlockRecorder {
    blocks: Mutex<Vec<(Range<usize>, Tensor)>>,
}

impl GradHook for BlockRecorder {
    fn grad_ready(&self, var: &Var, _grad: Tensor) -> candle_core::Result<()> {
        panic!(
            "{:?}: a hook taking blocks got a whole gradient",
            var.dims()
        )
    }

    fn block_bytes(&self) -> Option<usize> {
        Some(BLOCK_BYTES)
    }

    fn grad_block_ready(
        &self,
        _var: &Var,
        rows: Range<usize>,
        grad: Tensor,
    ) -> candle_core::Result<()> {
        self.blocks.lock().unwrap().push((rows, grad));
        Ok(())
    }
}

#[test]
fn a_linear_hands_its_weight_gradient_over_in_blocks_that_are_the_whole_bit_for_bit() {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = data(1, &[7, 24], dtype);
        let (weight, bias) = (var(2, &[400, 24], dtype), var(3, &[400], dtype));

        let whole = Recorder::new();
        let layer = nn::Linear::new(
            weight.as_tensor().clone(),
            Some(bias.as_tensor().clone()),
            hook(&whole),
        );
        weighted_sum(&layer.forward(&x).unwrap(), 4)
            .backward()
            .unwrap();
        let want = whole.grad_of(weight.as_tensor());

        let blocks = Arc::new(BlockRecorder::default());
        let layer = nn::Linear::new(
            weight.as_tensor().clone(),
            None,
            Some(blocks.clone() as Arc<dyn GradHook>),
        );
        let y = (layer.forward(&x).unwrap() + bias.as_tensor().broadcast_as((7, 400)).unwrap())
            .unwrap();
        weighted_sum(&y, 4).backward().unwrap();

        let got = blocks.blocks.lock().unwrap().clone();
        let rows: Vec<Range<usize>> = got.iter().map(|(rows, _)| rows.clone()).collect();
        assert_eq!(rows, [0..192, 192..400], "{dtype:?}: blocks in row order");
        let parts: Vec<Tensor> = got.into_iter().map(|(_, grad)| grad).collect();
        let joined = Tensor::cat(&parts, 0).unwrap();
        assert_equal(&format!("{dtype:?} ∂W from blocks"), &joined, &want);
    }
}

/// Two layers whose weights come in two blocks each, then a head.
fn train(
    comm: ThreadComm,
    config: &EngineConfig,
    blocks: bool,
) -> zero_candle::Result<Vec<Vec<f32>>> {
    let rank = comm.rank();
    let hook = ZeroHook::<ThreadComm, f32>::new();
    hook.set_block_bytes(blocks.then_some(BLOCK_BYTES));
    let as_hook: Option<Arc<dyn GradHook>> = Some(hook.clone());
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let l1 = nn::linear(24, 400, vb.pp("l1"), as_hook.clone())?;
    let l2 = nn::linear(400, 400, vb.pp("l2"), as_hook.clone())?;
    let head = nn::linear(400, 3, vb.pp("head"), as_hook)?;
    nn_support::seed_varmap(&varmap, 7)?;
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt =
        ZeroOptimizer::new(&varmap, comm, config.clone(), Box::new(adamw))?.with_hook(&hook)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(50 + rank as u64);
    for _ in 0..3 * config.grad_accum_steps {
        let x: Vec<f32> = (0..6 * 24).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let x = Tensor::from_vec(x, (6, 24), &Device::Cpu)?;
        let h = l2.forward(&l1.forward(&x)?.relu()?)?.relu()?;
        opt.backward_step(&head.forward(&h)?.sqr()?.mean_all()?)?;
    }
    let weights = opt.full_weights()?;
    Ok(weights
        .iter()
        .map(|(_, w)| w.flatten_all()?.to_vec1())
        .collect::<candle_core::Result<_>>()?)
}

#[test]
fn blocks_train_the_same_weights_as_whole_gradients_at_every_stage() {
    // Buckets of 3000 elements, so blocks of 4800 (l1) and 76800 (l2)
    // elements end inside buckets, and a bucket is complete only once
    // several blocks have covered it.
    let base = EngineConfig::default().with_bucket_bytes(12_000);
    let configs = [
        (Stage::Ddp, Overlap::AfterBackward, 1),
        (Stage::OptimizerState, Overlap::AfterBackward, 2),
        (Stage::Gradients, Overlap::AfterBackward, 1),
        (Stage::Gradients, Overlap::Interleaved, 2),
        (Stage::Gradients, Overlap::None, 1),
        (Stage::Parameters, Overlap::AfterBackward, 2),
    ];
    for (stage, overlap, accum) in configs {
        let config = base
            .clone()
            .with_stage(stage)
            .with_overlap(overlap)
            .with_grad_accum_steps(accum);
        let run = |blocks: bool| {
            ThreadGroup::new(2)
                .run(|comm| train(comm, &config, blocks))
                .into_iter()
                .map(|r| r.expect("no panic").expect("training works"))
                .collect::<Vec<_>>()
        };
        let (whole, blocks) = (run(false), run(true));
        assert_eq!(
            whole, blocks,
            "stage {stage:?}, overlap {overlap:?}, {accum} micro-step(s)"
        );
    }
}
