//! PyTorch's GPT (`examples/pytorch/gpt_peer.py`) on the same GPU in the
//! same run, and our figures over its.

use super::case::Measured;
use super::{BATCH, CONFIG, SEED, STEPS, WARMUP};
use crate::bench::torch_peer::{run_gpt_peer, PeerArgs, PeerAttention, PeerDevice, PeerDtype};
use crate::bench::Report;

/// PyTorch's GPT in a child process: f32 with the trainer's manual
/// attention, and bf16 autocast with SDPA (PyTorch's fast path); its
/// figures, and ours (`f32_fused`, `bf16_fused`) over them.
pub(super) fn against_torch(
    report: &mut Report,
    f32_fused: Option<&Measured>,
    bf16_fused: Option<&Measured>,
) {
    let peer = |dtype: PeerDtype, attention: PeerAttention| {
        run_gpt_peer(&PeerArgs {
            layers: CONFIG.layers,
            heads: CONFIG.heads,
            d_model: CONFIG.d_model,
            context: CONFIG.context,
            batch: BATCH,
            steps: STEPS,
            warmup: WARMUP,
            device: PeerDevice::Cuda,
            dtype,
            attention,
            threads: None,
            seed: SEED,
            python: "python3".into(),
        })
    };
    match peer(PeerDtype::F32, PeerAttention::Manual) {
        Ok(torch) => {
            println!(
                "bench gpu gpt: PyTorch {} on {}",
                torch.torch_version, torch.device_name
            );
            report.add(
                "gpu.torch_gpt_tokens_per_s",
                torch.tokens_per_s,
                "tokens/s",
                None,
            );
            if let Some(m) = f32_fused {
                report.add(
                    "gpu.gpt_over_torch",
                    m.tokens_per_s / torch.tokens_per_s,
                    "ratio",
                    Some(">= 1.0"),
                );
            }
            peaks(
                report,
                ("gpu.torch_gpt_peak_gb", "gpu.gpt_peak_over_torch"),
                f32_fused,
                torch.peak_bytes,
            );
        }
        Err(e) => println!(
            "gpu gpt benchmark: no PyTorch f32 figures (gpu.gpt_over_torch, \
             gpu.gpt_peak_over_torch): {e}"
        ),
    }
    match peer(PeerDtype::Bf16, PeerAttention::Sdpa) {
        Ok(torch) => {
            report.add(
                "gpu.torch_sdpa_bf16_tokens_per_s",
                torch.tokens_per_s,
                "tokens/s",
                None,
            );
            if let Some(m) = bf16_fused {
                report.add(
                    "gpu.gpt_bf16_over_torch_sdpa",
                    m.tokens_per_s / torch.tokens_per_s,
                    "ratio",
                    Some(">= 0.9"),
                );
            }
            peaks(
                report,
                (
                    "gpu.torch_sdpa_bf16_peak_gb",
                    "gpu.gpt_bf16_peak_over_torch_sdpa",
                ),
                bf16_fused,
                torch.peak_bytes,
            );
        }
        Err(e) => println!(
            "gpu gpt benchmark: no PyTorch bf16 figures (gpu.gpt_bf16_over_torch_sdpa, \
             gpu.gpt_bf16_peak_over_torch_sdpa): {e}"
        ),
    }
}

/// PyTorch's peak device memory (`names.0`, in GB) and ours over it
/// (`names.1`), where both are known; else why not.
fn peaks(report: &mut Report, names: (&str, &str), ours: Option<&Measured>, theirs: Option<u64>) {
    let (peak, ratio) = names;
    if let Some(theirs) = theirs {
        report.add(peak, theirs as f64 / 1e9, "GB", None);
    }
    match (ours.and_then(|m| m.peak_bytes), theirs) {
        (Some(ours), Some(theirs)) => {
            report.add(ratio, ours as f64 / theirs as f64, "ratio", Some("<= 1.0"))
        }
        (None, _) => println!("gpu gpt benchmark: no {ratio}: our peak is unknown"),
        (_, None) => println!("gpu gpt benchmark: no {ratio}: gpt_peer.py reported no peak memory"),
    }
}
