//! Dropping a stage-3 optimizer, right after a step or right after a
//! forward with its prefetches in flight, stops its gather thread (which
//! holds the rank's parameter shard): the memory is gone when the
//! optimizer is. Its own test binary, so no other test's gather threads
//! run beside it.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::sync::Arc;
use zero_candle::nn::{self, GradHook};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{ThreadComm, ThreadGroup};

/// The names of this process's threads (Linux).
fn thread_names() -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .map(|name| name.trim().to_string())
        .collect()
}

#[test]
fn dropping_a_stage_3_optimizer_stops_its_gather_thread() {
    if !std::path::Path::new("/proc/self/task").exists() {
        eprintln!("skipped: no /proc/self/task to list threads");
        return;
    }
    // Dropped right after a step, and right after a forward (its layers'
    // prefetches in flight on the gather thread).
    for after_forward in [false, true] {
        // One rank: no other rank's gather thread can be running when it looks.
        let left = ThreadGroup::new(1).run(|comm| -> zero_candle::Result<Vec<String>> {
            let hook = ZeroHook::<ThreadComm, f32>::new();
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
            let as_hook: Option<Arc<dyn GradHook>> = Some(hook.clone());
            let l1 = nn::linear(8, 32, vb.pp("l1"), as_hook.clone())?;
            let l2 = nn::linear(32, 4, vb.pp("l2"), as_hook)?;
            let config = EngineConfig::default()
                .with_stage(Stage::Parameters)
                .with_persist_numel(0);
            let adamw = AdamW::new(AdamWConfig::default())?;
            let mut opt =
                ZeroOptimizer::new(&varmap, comm, config, Box::new(adamw))?.with_hook(&hook)?;
            let x = Tensor::ones((3, 8), DType::F32, &Device::Cpu)?;
            for _ in 0..3 {
                let loss = l2.forward(&l1.forward(&x)?.tanh()?)?.sqr()?.mean_all()?;
                opt.backward_step(&loss)?;
            }
            let stats = opt
                .fetch_stats()
                .expect("stage 3 sharded after the first step");
            assert!(
                stats.gathers.iter().sum::<u64>() > 0,
                "the gather thread ran"
            );
            let gathering = |names: Vec<String>| -> Vec<String> {
                names
                    .into_iter()
                    .filter(|name| name.starts_with("zero-gather"))
                    .collect()
            };
            assert!(
                !gathering(thread_names()).is_empty(),
                "a gather thread runs"
            );
            // The fetcher is shared by the optimizer, the hook and (through the
            // hook) the layers: all go, then look at once.
            let forward = if after_forward {
                Some(l2.forward(&l1.forward(&x)?.tanh()?)?)
            } else {
                None
            };
            drop((opt, l1, l2, hook, forward));
            // Dropping joins the thread; the kernel lists a joined thread in
            // /proc a moment longer (it wakes the joiner before it unlists the
            // thread), so look until it is gone or 5 s have passed.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut left = gathering(thread_names());
            while !left.is_empty() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
                left = gathering(thread_names());
            }
            Ok(left)
        });
        for left in left {
            let left = left.expect("no panic").expect("training works");
            assert!(
                left.is_empty(),
                "dropped after a {}: gather threads still running: {left:?}",
                if after_forward { "forward" } else { "step" }
            );
        }
    }
}
