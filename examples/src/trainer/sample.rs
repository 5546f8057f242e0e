//! `--sample`: a model's continuation of a prompt, one token at a time,
//! the most likely token (temperature 0) or a draw at that temperature.

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// `count` token ids continuing `prompt` (not empty), each predicted from
/// the last `context` ids by `logits_of` (ids `[1, t]` -> logits `[t,
/// vocab]`), greedy when `temperature` is 0, else drawn with a generator
/// seeded by `seed` (the same continuation for the same seed).
pub fn continue_ids(
    prompt: &[u32],
    count: usize,
    context: usize,
    temperature: f64,
    seed: u64,
    device: &Device,
    logits_of: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut ids = prompt.to_vec();
    for _ in 0..count {
        let window = &ids[ids.len().saturating_sub(context)..];
        let input = Tensor::from_slice(window, (1, window.len()), device)?;
        let logits = logits_of(&input)?;
        let last = logits
            .get(window.len() - 1)?
            .to_dtype(DType::F64)?
            .to_vec1::<f64>()?;
        ids.push(pick(&last, temperature, &mut rng) as u32);
    }
    Ok(ids.split_off(prompt.len()))
}

/// The most likely id (temperature 0) or a sample at that temperature.
fn pick(logits: &[f64], temperature: f64, rng: &mut StdRng) -> usize {
    let best = logits
        .iter()
        .enumerate()
        .fold((0, f64::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 {
                (i, v)
            } else {
                best
            }
        });
    if temperature <= 0.0 {
        return best.0;
    }
    let weights: Vec<f64> = logits
        .iter()
        .map(|&v| ((v - best.1) / temperature).exp())
        .collect();
    let mut u = rng.gen_range(0.0..weights.iter().sum::<f64>());
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i;
        }
        u -= w;
    }
    best.0
}
