//! A first program: a small network trained on 4 ranks (threads of this
//! process) with ZeRO stage 2: each rank keeps a quarter of the optimizer
//! state and of the gradients, and takes a quarter of every batch.
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use zero_candle::{nn, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let results = ThreadGroup::new(4).run(train);
    let mut weights = Vec::new();
    for (rank, result) in results.into_iter().enumerate() {
        // Outer: the rank panicked or lost a peer; inner: its own error.
        let (first_loss, last_loss, rank_weights) = result??;
        println!("rank {rank}: loss {first_loss:.4} -> {last_loss:.4}");
        assert!(last_loss < first_loss / 10.0, "rank {rank} did not learn");
        weights.push(rank_weights);
    }
    assert!(weights.iter().all(|w| *w == weights[0]), "ranks differ");
    Ok(())
}

/// One rank: its first and last loss, and its final weights.
fn train(comm: ThreadComm) -> zero_candle::Result<(f32, f32, Vec<f32>)> {
    let rows = 256 / comm.world_size(); // this rank's part of each batch
    let device = Device::Cpu;
    // zero_candle::nn layers hand their gradients to the hook during
    // backward, so each bucket is reduced while backward goes on.
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let hidden = nn::linear(2, 64, vb.pp("hidden"), Some(hook.clone()))?;
    let output = nn::linear(64, 1, vb.pp("output"), Some(hook.clone()))?;
    // Candle draws other random weights on every rank: the optimizer
    // copies rank 0's to all of them (EngineConfig::starting_model).
    let config = EngineConfig::default().with_stage(Stage::Gradients);
    let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
    let mut opt = ZeroOptimizer::new(&varmap, comm, config, Box::new(adamw))?.with_hook(&hook)?;

    let mut losses = Vec::new();
    for _ in 0..300 {
        // Learn y = sin(3 x0) x1 on [-1, 1]², each rank on its own rows.
        let x = Tensor::rand(-1f32, 1f32, (rows, 2), &device)?;
        let y = ((x.narrow(1, 0, 1)? * 3.0)?.sin()? * x.narrow(1, 1, 1)?)?;
        let prediction = output.forward(&hidden.forward(&x)?.relu()?)?;
        let loss = (prediction - y)?.sqr()?.mean_all()?;
        // The gradients are averaged over the ranks: a step of the whole batch.
        opt.backward_step(&loss)?;
        losses.push(loss.to_scalar::<f32>()?);
    }
    let weights = opt.full_weights()?;
    let weights = weights
        .iter()
        .map(|(_, w)| w.flatten_all()?.to_vec1::<f32>());
    let weights = weights.collect::<candle_core::Result<Vec<_>>>()?.concat();
    let first_10: f32 = losses[..10].iter().sum::<f32>() / 10.0;
    let last_10: f32 = losses[losses.len() - 10..].iter().sum::<f32>() / 10.0;
    Ok((first_10, last_10, weights))
}
