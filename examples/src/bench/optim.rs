//! Optimizer step throughput: Adam on a 16M-element f32 shard, one thread and
//! all cores, against memcpy bandwidth (one thread, and all cores: what the
//! memory allows, the bound of an offloaded host step) measured in the same
//! run; and the same shard stepped as the offload's step thread steps a
//! GPT's, bucket by bucket, each bucket cut where the parameters fall, and
//! with each stepped bucket then rounded to bf16 as that thread does for a
//! 16-bit model.

use super::Report;
use std::hint::black_box;
use std::time::{Duration, Instant};
use zero_core::engine::pack_narrow;
use zero_core::optim::{Adam, AdamConfig, FunctionalOptimizer, ParamKey, ParamMut};
use zero_core::DType;

/// Elements in the benchmarked shard.
const SHARD_LEN: usize = 16 << 20;
/// Bytes one Adam step moves per element: parameter, exp_avg, exp_avg_sq
/// read and written (24), gradient read (4).
const ADAM_BYTES_PER_ELEMENT: f64 = 28.0;
/// Size of the memcpy reference buffer.
const MEMCPY_BYTES: usize = 64 << 20;

/// The fastest of `reps` runs of `f` after one warm-up run.
fn best_of(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap_or_default()
}

/// Single-thread copy bandwidth in GB/s (bytes copied per second: a copy of
/// N bytes counts N, as memcpy benchmarks report it).
fn memcpy_gbps() -> f64 {
    let src = vec![1u8; MEMCPY_BYTES];
    let mut dst = vec![0u8; MEMCPY_BYTES];
    let t = best_of(10, || {
        dst.copy_from_slice(black_box(&src));
        black_box(&mut dst);
    });
    MEMCPY_BYTES as f64 / t.as_secs_f64() / 1e9
}

/// Copy bandwidth of the current rayon pool's threads together, each copying
/// its own chunk, in GB/s as [`memcpy_gbps`] counts it.
fn memcpy_parallel_gbps() -> f64 {
    use rayon::prelude::*;
    let src = vec![1u8; MEMCPY_BYTES];
    let mut dst = vec![0u8; MEMCPY_BYTES];
    let chunk = MEMCPY_BYTES.div_ceil(rayon::current_num_threads().max(1));
    let t = best_of(10, || {
        dst.par_chunks_mut(chunk)
            .zip(black_box(&src).par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        black_box(&mut dst);
    });
    MEMCPY_BYTES as f64 / t.as_secs_f64() / 1e9
}

/// The time of one Adam step over the shard as one piece, best of several.
fn adam_step_time() -> Duration {
    adam_step_time_in(None, false)
}

/// Elements of one bucket of the offload's step thread (4 MiB of f32,
/// the engine's default `bucket_bytes`).
const BUCKET_LEN: usize = 1 << 20;

/// One GPT-2 block's parameters (d_model 768) in order: the layer norms,
/// attention's qkv and projection, the MLP's two matrices, each weight
/// followed by its bias.
const BLOCK: [usize; 12] = [
    768,
    768,
    2304 * 768,
    2304,
    768 * 768,
    768,
    768,
    768,
    3072 * 768,
    3072,
    768 * 3072,
    768,
];

/// The pieces of each bucket of a shard laid out as GPT-2 blocks: per
/// bucket, the (offset, length) of each parameter's part in it, as the
/// offload's step thread steps them.
fn gpt_bucket_pieces() -> Vec<Vec<(usize, usize)>> {
    let mut params = Vec::new();
    let mut at = 0;
    for len in BLOCK.iter().cycle() {
        if at >= SHARD_LEN {
            break;
        }
        let len = (*len).min(SHARD_LEN - at);
        params.push((at, len));
        at += len;
    }
    (0..SHARD_LEN.div_ceil(BUCKET_LEN))
        .map(|b| {
            let (lo, hi) = (b * BUCKET_LEN, ((b + 1) * BUCKET_LEN).min(SHARD_LEN));
            params
                .iter()
                .filter_map(|&(at, len)| {
                    let (start, end) = (at.max(lo), (at + len).min(hi));
                    (start < end).then_some((start, end - start))
                })
                .collect()
        })
        .collect()
}

/// The time of one Adam step over the shard, best of several: as one
/// piece, or (`buckets`) bucket by bucket, each bucket one call with its
/// pieces, as the offload's step thread steps it; with `pack`, each
/// stepped bucket then rounded to bf16 and packed into a buffer of the
/// gradients' size, as that thread does for a 16-bit model.
fn adam_step_time_in(buckets: Option<&[Vec<(usize, usize)>]>, pack: bool) -> Duration {
    let mut adam = match Adam::<f32>::new(AdamConfig::default()) {
        Ok(adam) => adam,
        Err(e) => {
            eprintln!("bench optim: {e}");
            return Duration::MAX;
        }
    };
    let whole = [vec![(0, SHARD_LEN)]];
    let buckets = buckets.unwrap_or(&whole);
    let keys: Vec<Vec<ParamKey>> = buckets
        .iter()
        .map(|pieces| {
            pieces
                .iter()
                .map(|&(at, _)| ParamKey::new(format!("p{at}"), 0, 0))
                .collect()
        })
        .collect();
    let mut param: Vec<f32> = (0..SHARD_LEN).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let grad: Vec<f32> = (0..SHARD_LEN)
        .map(|i| ((i * 7) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let mut packed = vec![0f32; if pack { SHARD_LEN } else { 0 }];
    best_of(8, || {
        for (pieces, keys) in buckets.iter().zip(&keys) {
            let mut rest: &mut [f32] = &mut param;
            let mut consumed = 0;
            let mut params = Vec::with_capacity(pieces.len());
            let mut grads = Vec::with_capacity(pieces.len());
            for (&(at, len), key) in pieces.iter().zip(keys) {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(at - consumed);
                let (data, tail) = tail.split_at_mut(len);
                rest = tail;
                consumed = at + len;
                params.push(ParamMut { key, data });
                grads.push(Some(&grad[at..at + len]));
            }
            if let Err(e) = adam.step(&mut params, &grads) {
                eprintln!("bench optim: {e}");
            }
            if let (true, Some(&(lo, _)), Some(&(at, len))) = (pack, pieces.first(), pieces.last())
            {
                pack_narrow(&param[lo..at + len], DType::BF16, &mut packed[lo..at + len]);
            }
        }
        black_box(&mut param);
        black_box(&mut packed);
    })
}

/// Runs the optimizer benchmarks.
pub fn run(report: &mut Report) {
    let single = match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
        Ok(pool) => pool,
        Err(e) => {
            eprintln!("bench optim: cannot build a 1-thread pool: {e}");
            return;
        }
    };
    let memcpy = single.install(memcpy_gbps);
    let adam_1t = single.install(adam_step_time);
    let adam_mt = adam_step_time();
    let memcpy_mt = memcpy_parallel_gbps();
    let gbps = |t: Duration| SHARD_LEN as f64 * ADAM_BYTES_PER_ELEMENT / t.as_secs_f64() / 1e9;

    report.add("optim.memcpy_1t_gbps", memcpy, "GB/s", None);
    report.add("optim.adam_1t_gbps", gbps(adam_1t), "GB/s", None);
    report.add(
        "optim.adam_1t_step_ms",
        adam_1t.as_secs_f64() * 1e3,
        "ms",
        None,
    );
    report.add(
        "optim.adam_bw_over_memcpy",
        gbps(adam_1t) / memcpy,
        "ratio",
        Some(">= 1.0"),
    );
    report.add("optim.adam_mt_gbps", gbps(adam_mt), "GB/s", None);
    report.add(
        "optim.adam_mt_step_ms",
        adam_mt.as_secs_f64() * 1e3,
        "ms",
        None,
    );
    report.add(
        "optim.adam_mt_bw_over_memcpy",
        gbps(adam_mt) / memcpy,
        "ratio",
        None,
    );
    report.add("optim.memcpy_mt_gbps", memcpy_mt, "GB/s", None);
    report.add(
        "optim.adam_mt_bw_over_memcpy_mt",
        gbps(adam_mt) / memcpy_mt,
        "ratio",
        Some(">= 1.0"),
    );
    let buckets = gpt_bucket_pieces();
    let adam_buckets = adam_step_time_in(Some(&buckets), false);
    report.add(
        "optim.adam_mt_gpt_buckets_over_whole",
        adam_buckets.as_secs_f64() / adam_mt.as_secs_f64(),
        "ratio",
        Some("<= 1.1"),
    );
    // What rounding a 16-bit model's weights on the host adds to the step
    // (offload's write-back then sends half the bytes up).
    let adam_packed = adam_step_time_in(Some(&buckets), true);
    report.add(
        "optim.adam_mt_gpt_buckets_packed_over_buckets",
        adam_packed.as_secs_f64() / adam_buckets.as_secs_f64(),
        "ratio",
        None,
    );
    report.add(
        "optim.threads",
        rayon::current_num_threads() as f64,
        "count",
        None,
    );
}
