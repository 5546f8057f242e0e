//! Stage 3 says what it does: `persist_numel` is set once, in the engine's
//! configuration, and a stage 3 that would shard nothing warns, naming it.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::io::Write;
use std::sync::{Arc, Mutex};
use zero_candle::{holds_values, nn, ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{ThreadComm, ThreadGroup};

/// What the subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f` on one rank on this thread and returns what it logged.
fn logged(f: impl FnOnce(ThreadComm)) -> String {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let comm = ThreadGroup::new(1).communicators().remove(0);
    tracing::subscriber::with_default(subscriber, || f(comm));
    let bytes = captured.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

fn sgd() -> Box<Sgd> {
    Box::new(Sgd::new(SgdConfig::default().with_lr(0.1)).unwrap())
}

/// A 32 x 32 layer (1,024 elements) from a `ShardedVarMap`, sharded from
/// construction with `persist_numel`; whether its weight was sharded.
fn sharded_from_start(comm: ThreadComm, persist_numel: usize) -> bool {
    let hook = ZeroHook::<ThreadComm, f32>::new();
    let map = ShardedVarMap::seeded(5);
    let layer = nn::linear(
        32,
        32,
        map.builder(DType::F32, &Device::Cpu).pp("l"),
        Some(hook.clone()),
    )
    .unwrap();
    let config = EngineConfig::default()
        .with_stage(Stage::Parameters)
        .with_persist_numel(persist_numel);
    let opt = ZeroOptimizer::new_sharded(&map, comm, config, sgd(), &hook).unwrap();
    // The bias (32 elements) is under the threshold either way: whole.
    assert!(holds_values(layer.bias().unwrap()));
    drop(opt);
    !holds_values(layer.weight())
}

#[test]
fn the_configs_persist_numel_alone_decides_what_a_sharded_var_map_shards() {
    let mut sharded = None;
    let log = logged(|comm| sharded = Some(sharded_from_start(comm, 100)));
    assert_eq!(sharded, Some(true), "1,024 elements above 100 are sharded");
    assert!(!log.contains("shards no parameter"), "{log}");

    let log = logged(|comm| sharded = Some(sharded_from_start(comm, 100_000)));
    assert_eq!(sharded, Some(false), "nothing above 100,000");
    assert!(
        log.contains("stage 3 shards no parameter")
            && log.contains("1024 elements")
            && log.contains("persist_numel = 100000")
            && log.contains("with_persist_numel"),
        "{log}"
    );
}

#[test]
fn a_plain_var_map_at_stage_3_warns_after_its_first_step_when_nothing_is_sharded() {
    let log = logged(|comm| {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let layer = nn::linear(8, 8, vb.pp("l"), Some(hook.clone())).unwrap();
        let config = EngineConfig::default().with_stage(Stage::Parameters);
        let mut opt = ZeroOptimizer::new(&varmap, comm, config, sgd())
            .unwrap()
            .with_hook(&hook)
            .unwrap();
        let x = Tensor::ones((2, 8), DType::F32, &Device::Cpu).unwrap();
        let loss = layer.forward(&x).unwrap().sqr().unwrap().sum_all().unwrap();
        opt.backward_step(&loss).unwrap();
        assert!(holds_values(layer.weight()));
    });
    assert!(
        log.contains("stage 3 shards no parameter") && log.contains("64 elements"),
        "{log}"
    );
}
