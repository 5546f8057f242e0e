//! Stage 3 from the start never allocates a whole sharded parameter: not
//! at construction, not in the first step, not when saving. A counting
//! allocator records the largest allocation while a run is watched (this
//! test binary holds one test, so nothing else allocates meanwhile).

use candle_core::{DType, Device, Module, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use zero_candle::nn;
use zero_candle::{ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{ThreadComm, ThreadGroup};

struct Counting;

static WATCHING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const WIDTH: usize = 1024;
const LAYERS: usize = 3;
/// One weight: 1 Mi elements, 4 MiB (larger than what the matmuls allocate
/// for their own work, and than a block of a gradient's rows).
const WEIGHT_BYTES: usize = WIDTH * WIDTH * 4;

/// Three 1024 x 1024 layers on 4 ranks: a rank's shard (and each optimizer
/// moment) is 3/4 of one weight, buckets and gathered pieces 16 KiB, the
/// hook's gradient blocks 192 rows (its smallest), activations 12 x 1024.
fn run(dir: &Path, stage: Stage) -> usize {
    let config = EngineConfig::default()
        .with_stage(stage)
        .with_bucket_bytes(16 << 10)
        .with_gather_bytes(16 << 10)
        .with_persist_numel(WIDTH);
    let out = dir.join(format!("stage{}.safetensors", stage.number()));
    LARGEST.store(0, Ordering::SeqCst);
    WATCHING.store(true, Ordering::SeqCst);
    let results = ThreadGroup::new(4).run(|comm| -> zero_candle::Result<()> {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        hook.set_block_bytes(Some(16 << 10));
        let map = ShardedVarMap::seeded(11);
        let vb = map.builder(DType::F32, &Device::Cpu);
        let layers = (0..LAYERS)
            .map(|i| nn::linear(WIDTH, WIDTH, vb.pp(format!("l{i}")), Some(hook.clone())))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let adamw = AdamW::new(AdamWConfig::default())?;
        let mut opt =
            ZeroOptimizer::new_sharded(&map, comm, config.clone(), Box::new(adamw), &hook)?;
        let x = Tensor::ones((12, WIDTH), DType::F32, &Device::Cpu)?;
        let mut h = x;
        for layer in &layers {
            h = layer.forward(&h)?.tanh()?;
        }
        opt.backward_step(&h.sqr()?.mean_all()?)?;
        opt.save_weights(&out)?;
        Ok(())
    });
    WATCHING.store(false, Ordering::SeqCst);
    for r in results {
        r.expect("no panic").expect("training works");
    }
    // The file holds every weight, whole.
    let saved = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    assert_eq!(saved["l2.weight"].dims(), [WIDTH, WIDTH]);
    LARGEST.load(Ordering::SeqCst)
}

#[test]
fn stage_3_from_the_start_never_allocates_a_whole_sharded_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let stage3 = run(dir.path(), Stage::Parameters);
    assert!(
        stage3 < WEIGHT_BYTES,
        "stage 3: an allocation of {stage3} bytes, a whole weight is {WEIGHT_BYTES}"
    );
    // The check can fail: stage 2 holds whole weights.
    let stage2 = run(dir.path(), Stage::Gradients);
    assert!(
        stage2 >= WEIGHT_BYTES,
        "stage 2's largest allocation: {stage2}"
    );
}
