//! `step.fwd_bwd_over_candle_nn`: forward + backward of one MLP built from
//! `zero_candle::nn`'s fused Linear over the same MLP built from candle-nn's
//! Linear (same weights, same batch, world size 1), timed alternately in
//! one run.

use super::Report;
use candle_core::{Device, Tensor, Var};
use candle_nn::Module;
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// MLP 1024-4x2048-10, as `bench memory`.
const WIDTHS: [usize; 6] = [1024, 2048, 2048, 2048, 2048, 10];
const BATCH: usize = 32;
const WARMUP: usize = 2;
const ROUNDS: usize = 9;

fn forward_backward(
    layers: &[Box<dyn Module>],
    x: &Tensor,
    y: &Tensor,
) -> candle_core::Result<f64> {
    let started = Instant::now();
    let mut h = x.clone();
    for (i, layer) in layers.iter().enumerate() {
        h = layer.forward(&h)?;
        if i + 1 < layers.len() {
            h = h.relu()?;
        }
    }
    let loss = candle_nn::loss::cross_entropy(&h, y)?;
    let grads = loss.backward()?;
    drop(grads);
    Ok(started.elapsed().as_secs_f64())
}

fn measure() -> candle_core::Result<(f64, f64)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut ours: Vec<Box<dyn Module>> = Vec::new();
    let mut theirs: Vec<Box<dyn Module>> = Vec::new();
    for pair in WIDTHS.windows(2) {
        let bound = 1.0 / (pair[0] as f32).sqrt();
        let w: Vec<f32> = (0..pair[0] * pair[1])
            .map(|_| rng.gen_range(-bound..bound))
            .collect();
        let b: Vec<f32> = (0..pair[1]).map(|_| rng.gen_range(-bound..bound)).collect();
        let w = Var::from_tensor(&Tensor::from_vec(w, (pair[1], pair[0]), &Device::Cpu)?)?;
        let b = Var::from_tensor(&Tensor::from_vec(b, pair[1], &Device::Cpu)?)?;
        ours.push(Box::new(zero_candle::nn::Linear::new(
            w.as_tensor().clone(),
            Some(b.as_tensor().clone()),
            None,
        )));
        theirs.push(Box::new(candle_nn::Linear::new(
            w.as_tensor().clone(),
            Some(b.as_tensor().clone()),
        )));
    }
    let (x, y) = super::random_batch(&mut rng, BATCH, WIDTHS[0], 10)?;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..WARMUP + ROUNDS {
        let ta = forward_backward(&ours, &x, &y)?;
        let tb = forward_backward(&theirs, &x, &y)?;
        if round >= WARMUP {
            a.push(ta);
            b.push(tb);
        }
    }
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    Ok((a[a.len() / 2], b[b.len() / 2]))
}

/// Adds `step.fwd_bwd_ms`, `step.fwd_bwd_candle_nn_ms` and their ratio.
pub fn run(report: &mut Report) {
    println!(
        "bench step (layers): MLP {WIDTHS:?}, batch {BATCH}, forward + backward, world size 1, \
         zero_candle::nn::Linear vs candle_nn::Linear on the same weights, medians of {ROUNDS} \
         alternated rounds"
    );
    match measure() {
        Ok((ours, theirs)) => {
            report.add("step.fwd_bwd_ms", ours * 1e3, "ms", None);
            report.add("step.fwd_bwd_candle_nn_ms", theirs * 1e3, "ms", None);
            report.add(
                "step.fwd_bwd_over_candle_nn",
                ours / theirs,
                "ratio",
                Some("<= 0.7"),
            );
        }
        Err(e) => eprintln!("bench step (layers): {e}"),
    }
}
