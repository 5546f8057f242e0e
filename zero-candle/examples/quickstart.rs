//! A first program: a small network trained on 4 ranks (threads of this
//! process) with ZeRO stage 2, each rank keeping a quarter of the optimizer
//! state and of the gradients and taking a quarter of every batch.
//! `cargo run --release -p zero-candle --example quickstart`
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use zero_candle::{nn, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

const WORLD_SIZE: usize = 4;
const BATCH: usize = 256; // rows per step, over all ranks
const STEPS: usize = 300;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let results = ThreadGroup::new(WORLD_SIZE).run(train);
    let mut finals = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        // The outer error: the rank panicked, or a peer failed; the inner
        // one: what this rank's training returned.
        let (first_loss, last_loss, weights) = result??;
        println!("rank {rank}: loss {first_loss:.4} -> {last_loss:.4}");
        assert!(last_loss < first_loss / 10.0, "rank {rank} did not learn");
        finals.push(weights);
    }
    assert!(finals.iter().all(|w| *w == finals[0]), "ranks differ");
    Ok(())
}

/// One rank: builds the model, trains it, returns its first and last loss
/// and its final weights.
fn train(comm: ThreadComm) -> zero_candle::Result<(f32, f32, Vec<f32>)> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let device = Device::Cpu;
    // Layers from zero_candle::nn report their gradients to the hook during
    // backward, so each bucket is reduced while backward goes on.
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let hidden = nn::linear(2, 64, vb.pp("hidden"), Some(hook.clone()))?;
    let output = nn::linear(64, 1, vb.pp("output"), Some(hook.clone()))?;
    // Candle draws other random weights on every rank: the optimizer copies
    // rank 0's to all of them (EngineConfig::starting_model).
    let config = EngineConfig::default().with_stage(Stage::Gradients);
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt = ZeroOptimizer::new(&varmap, comm, config, Box::new(adamw))?.with_hook(&hook)?;

    let (mut first_loss, mut last_loss) = (None, 0.0);
    for step in 0..STEPS {
        let (x, y) = batch(step, rank, world_size, &device)?;
        let prediction = output.forward(&hidden.forward(&x)?.relu()?)?;
        let loss = (prediction - y)?.sqr()?.mean_all()?;
        // Gradients are averaged over the ranks: one step of the whole batch.
        opt.backward_step(&loss)?;
        last_loss = loss.to_scalar::<f32>()?;
        first_loss.get_or_insert(last_loss);
    }
    let weights = opt.full_weights()?;
    let weights = weights
        .iter()
        .map(|(_, w)| w.flatten_all()?.to_vec1::<f32>());
    let weights = weights.collect::<candle_core::Result<Vec<_>>>()?.concat();
    Ok((first_loss.unwrap_or(f32::NAN), last_loss, weights))
}

/// This rank's rows of step `step`'s batch: points of [-1, 1]² spread
/// evenly (an additive recurrence), the target `sin(3 x0) x1`.
fn batch(
    step: usize,
    rank: usize,
    world_size: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let rows = BATCH / world_size;
    let (mut x, mut y) = (Vec::with_capacity(2 * rows), Vec::with_capacity(rows));
    for row in 0..rows {
        let i = (step * BATCH + rank * rows + row) as f64;
        let x0 = (i * 0.754_877_666).fract() * 2.0 - 1.0;
        let x1 = (i * 0.569_840_291).fract() * 2.0 - 1.0;
        x.extend([x0 as f32, x1 as f32]);
        y.push(((3.0 * x0).sin() * x1) as f32);
    }
    Ok((
        Tensor::from_vec(x, (rows, 2), device)?,
        Tensor::from_vec(y, (rows, 1), device)?,
    ))
}
