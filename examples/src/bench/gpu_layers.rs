//! GPU benchmarks of the fused layers (feature `nccl`): causal
//! self-attention forward + backward and LayerNorm backward through the
//! Candle ops on `Device::new_cuda(0)`, at the GPT benchmark's shapes
//! (batch 16, 12 heads, T 256, head_dim 64; LayerNorm over [16 * 256, 768]),
//! in f32 and bf16 (bf16 attention on tensor cores from sm_80), and grouped
//! attention in bf16 (`causal_attention`, 32 query heads on 8 K/V heads of
//! 128), timed with CUDA events on the device's stream. The same figures
//! from PyTorch (`examples/pytorch/kernel_times.py`:
//! `scaled_dot_product_attention(is_causal=True)`, with `enable_gqa=True`
//! for the grouped case, and `F.layer_norm`'s backward) run in a child
//! `python3` when it has torch and a GPU, and the ratios ours / PyTorch's
//! are reported. The `Embedding` table's gradient (forward + backward at
//! GPT-2's table, 50,257 x 768, and the GPT benchmark's 4,096 ids) is timed
//! beside candle-nn's `Embedding` (Candle's `index_add`), f32 and bf16.

use super::Report;
use candle_core::{DType, Device, Module, Tensor, Var};
use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use zero_candle::nn::ops::{causal_attention, causal_self_attention};
use zero_candle::nn::{Embedding, LayerNorm};
use zero_nccl::cudarc::driver::{sys::CUevent_flags, CudaStream};

const BATCH: usize = 16;
const HEADS: usize = 12;
const TIME: usize = 256;
const HEAD_DIM: usize = 64;
/// The grouped case: a Llama-style layer (32 query heads, 8 K/V heads).
const GQA_HEADS: usize = 32;
const GQA_KV_HEADS: usize = 8;
const GQA_HEAD_DIM: usize = 128;

/// A grouped attention call's shape, `[batch, time, heads, kv_heads,
/// head_dim]`: the grouped case at the GPT's batch and time, and the 1.1B
/// Llama's (`bench gpu`'s TinyLlama; `kernel_times.py`'s `attn_llama`).
const GROUPED: [[usize; 5]; 2] = [
    [BATCH, TIME, GQA_HEADS, GQA_KV_HEADS, GQA_HEAD_DIM],
    [4, 2048, 32, 4, 64],
];
/// Their figures' names: `gpu.attn_{name}_fwd_bwd_ms_bf16`, and PyTorch's
/// in `kernel_times.py`'s JSON.
const GROUPED_NAMES: [&str; 2] = ["gqa", "llama"];
const WARMUP: usize = 3;
const ITERS: usize = 20;

type BenchResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Runs the fused-layer suite (after `gpu::device_present`).
pub fn run(report: &mut Report) {
    let (ours, our_grouped) = match ours(report) {
        Ok(ours) => ours,
        Err(e) => {
            report.failed("gpu layer benchmarks", e);
            return;
        }
    };
    match torch_times() {
        Ok(torch) => {
            for (dtype, suffix) in [("f32", ""), ("bf16", "_bf16")] {
                let (Some(&attn), Some(&norm)) = (
                    torch.get(&format!("attn_fwd_bwd_ms_{dtype}")),
                    torch.get(&format!("layer_norm_bwd_ms_{dtype}")),
                ) else {
                    eprintln!("kernel_times.py reported no {dtype} figures");
                    continue;
                };
                let (our_attn, our_norm) = ours[usize::from(dtype == "bf16")];
                report.add(
                    &format!("gpu.torch_attn_fwd_bwd_ms{suffix}"),
                    attn,
                    "ms",
                    None,
                );
                report.add(
                    &format!("gpu.torch_layer_norm_bwd_ms{suffix}"),
                    norm,
                    "ms",
                    None,
                );
                report.add(
                    &format!("gpu.attn_over_torch{suffix}"),
                    our_attn / attn,
                    "ratio",
                    Some(if dtype == "bf16" { "<= 1.3" } else { "<= 1.5" }),
                );
                report.add(
                    &format!("gpu.layer_norm_bwd_over_torch{suffix}"),
                    our_norm / norm,
                    "ratio",
                    Some("<= 2.0"),
                );
            }
            // The Llama's shape is reported only: its goal is its step's.
            for ((name, ours), goal) in GROUPED_NAMES
                .into_iter()
                .zip(our_grouped)
                .zip([Some("<= 1.3"), None])
            {
                match torch.get(&format!("attn_{name}_fwd_bwd_ms_bf16")) {
                    Some(&theirs) => {
                        report.add(
                            &format!("gpu.torch_attn_{name}_fwd_bwd_ms_bf16"),
                            theirs,
                            "ms",
                            None,
                        );
                        report.add(
                            &format!("gpu.attn_{name}_over_torch_bf16"),
                            ours / theirs,
                            "ratio",
                            goal,
                        );
                    }
                    None => eprintln!(
                        "kernel_times.py reported no {name} figure (SDPA's enable_gqa needs \
                         torch 2.5 or newer)"
                    ),
                }
            }
        }
        Err(e) => println!("gpu layer benchmarks: PyTorch comparison skipped: {e}"),
    }
}

/// Milliseconds per call of `f`, CUDA events on `stream` around `ITERS`
/// calls after a warm-up.
fn time_ms(stream: &Arc<CudaStream>, mut f: impl FnMut() -> BenchResult<()>) -> BenchResult<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..ITERS {
        f()?;
    }
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(start.elapsed_ms(&end)? as f64 / ITERS as f64)
}

/// Our figures in ms: `[(attention, LayerNorm backward); f32, bf16]`, and
/// the grouped attention in bf16 at [`GROUPED`]'s shapes.
type OurTimes = ([(f64, f64); 2], [f64; 2]);

/// Times our kernels on GPU 0 and reports each time.
fn ours(report: &mut Report) -> BenchResult<OurTimes> {
    let device = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &device else {
        return Err("Device::new_cuda returned a non-CUDA device".into());
    };
    let stream = cuda.cuda_stream();
    let d_model = HEADS * HEAD_DIM;
    let mut figures = [(0.0, 0.0); 2];
    for (i, (dtype, suffix)) in [(DType::F32, ""), (DType::BF16, "_bf16")]
        .into_iter()
        .enumerate()
    {
        let qkv = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (BATCH, TIME, 3 * d_model), &device)?.to_dtype(dtype)?,
        )?;
        // Backward from the output itself: Candle seeds it with ones.
        let attn_ms = time_ms(&stream, || {
            let y = causal_self_attention(qkv.as_tensor(), HEADS)?;
            let grads = y.backward()?;
            drop(grads);
            Ok(())
        })?;

        let x = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (BATCH * TIME, d_model), &device)?.to_dtype(dtype)?,
        )?;
        let w = Var::from_tensor(&Tensor::ones(d_model, dtype, &device)?)?;
        let b = Var::from_tensor(&Tensor::zeros(d_model, dtype, &device)?)?;
        let norm = LayerNorm::new(w.as_tensor().clone(), b.as_tensor().clone(), 1e-5, None);
        let y = norm.forward(x.as_tensor())?;
        // The forward once, then only its backward: dx, dw and db.
        let norm_ms = time_ms(&stream, || {
            let grads = y.backward()?;
            drop(grads);
            Ok(())
        })?;
        report.add(&format!("gpu.attn_fwd_bwd_ms{suffix}"), attn_ms, "ms", None);
        report.add(
            &format!("gpu.layer_norm_bwd_ms{suffix}"),
            norm_ms,
            "ms",
            None,
        );
        figures[i] = (attn_ms, norm_ms);
    }
    let mut grouped = [0.0; 2];
    for ((ms, [batch, time, heads, kv_heads, head_dim]), name) in
        grouped.iter_mut().zip(GROUPED).zip(GROUPED_NAMES)
    {
        let randn = |heads: usize| -> BenchResult<Var> {
            let shape = (batch, time, heads, head_dim);
            let t = Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(DType::BF16)?;
            Ok(Var::from_tensor(&t)?)
        };
        let (q, k, v) = (randn(heads)?, randn(kv_heads)?, randn(kv_heads)?);
        *ms = time_ms(&stream, || {
            let y = causal_attention(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
            let grads = y.backward()?;
            drop(grads);
            Ok(())
        })?;
        report.add(&format!("gpu.attn_{name}_fwd_bwd_ms_bf16"), *ms, "ms", None);
    }
    // A failure here keeps the comparisons above.
    if let Err(e) = embedding_figures(report, &device, &stream) {
        report.failed("gpu.embedding_over_candle", e);
    }
    Ok((figures, grouped))
}

/// GPT-2's token table and the GPT benchmark's ids per step.
const EMBEDDING_VOCAB: usize = 50_257;
const EMBEDDING_DIM: usize = 768;

/// The `Embedding` lookup's forward + backward, ours against candle-nn's
/// (whose backward is Candle's `index_add`), in f32 and bf16.
fn embedding_figures(
    report: &mut Report,
    device: &Device,
    stream: &Arc<CudaStream>,
) -> BenchResult<()> {
    // Skewed ids, as text's are: id = vocab * u^3 for u spread over [0, 1).
    let ids: Vec<u32> = (0..BATCH * TIME)
        .map(|i| {
            let u = (i as f64 * 0.618_033_988_749_895).fract();
            (EMBEDDING_VOCAB as f64 * u * u * u) as u32
        })
        .collect();
    let ids = Tensor::new(ids.as_slice(), device)?;
    for (dtype, suffix) in [(DType::F32, ""), (DType::BF16, "_bf16")] {
        let table = Var::from_tensor(
            &Tensor::randn(0f32, 0.02, (EMBEDDING_VOCAB, EMBEDDING_DIM), device)?
                .to_dtype(dtype)?,
        )?;
        let ours = Embedding::new(table.as_tensor().clone(), EMBEDDING_DIM, None);
        let candle = candle_nn::Embedding::new(table.as_tensor().clone(), EMBEDDING_DIM);
        let time = |layer: &dyn Module| {
            time_ms(stream, || {
                let grads = layer.forward(&ids)?.sum_all()?.backward()?;
                drop(grads);
                Ok(())
            })
        };
        let (ours_ms, candle_ms) = (time(&ours)?, time(&candle)?);
        report.add(
            &format!("gpu.embedding_fwd_bwd_ms{suffix}"),
            ours_ms,
            "ms",
            None,
        );
        report.add(
            &format!("gpu.candle_embedding_fwd_bwd_ms{suffix}"),
            candle_ms,
            "ms",
            None,
        );
        report.add(
            &format!("gpu.embedding_over_candle{suffix}"),
            ours_ms / candle_ms,
            "ratio",
            None,
        );
    }
    Ok(())
}

/// PyTorch's figures by name (`attn_fwd_bwd_ms_f32`, ...), or why not.
fn torch_times() -> Result<HashMap<String, f64>, String> {
    let script = super::torch_peer::pytorch_script("kernel_times.py");
    let output = Command::new("python3")
        .arg(&script)
        .args(["--batch", &BATCH.to_string()])
        .args(["--heads", &HEADS.to_string()])
        .args(["--time", &TIME.to_string()])
        .args(["--head-dim", &HEAD_DIM.to_string()])
        .args(["--gqa-heads", &GQA_HEADS.to_string()])
        .args(["--gqa-kv-heads", &GQA_KV_HEADS.to_string()])
        .args(["--gqa-head-dim", &GQA_HEAD_DIM.to_string()])
        .args(["--iters", &ITERS.to_string()])
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                "python3 not found: the PyTorch figures need Python 3 with a CUDA torch".to_string()
            }
            _ => format!("cannot run python3 {}: {e}", script.display()),
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(match output.status.code() {
            Some(2) => "python3 has no torch; install a CUDA build with \
                        `python3 -m pip install torch`"
                .into(),
            Some(3) => "PyTorch sees no CUDA device (a CPU-only torch wheel?)".into(),
            _ => format!(
                "{} failed ({}): {}",
                script.display(),
                output.status,
                stderr.trim()
            ),
        });
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("kernel_times.py printed no JSON line: {stdout:?}"))?;
    let parsed: HashMap<String, serde_json::Value> = serde_json::from_str(line)
        .map_err(|e| format!("cannot read kernel_times.py's JSON line ({e}): {line}"))?;
    Ok(parsed
        .into_iter()
        .filter_map(|(k, v)| v.as_f64().map(|v| (k, v)))
        .collect())
}
