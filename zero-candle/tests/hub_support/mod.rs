//! Helpers shared by the hub models' tests (`gpt2.rs`, `llama.rs`): golden
//! values, comparisons, a hub directory's tensors, and a short training run
//! of whichever model a directory holds, saved back in its layout.

#![allow(dead_code)]

pub mod gpu_fixtures;

use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use zero_candle::hub::HubDir;
use zero_candle::models::CausalLm;
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

/// The SGD learning rate of the fixtures' golden step.
pub const LR: f64 = 0.5;

pub type Golden = std::collections::HashMap<String, Tensor>;

/// The goldens of a fixtures folder: its `golden.safetensors`, or every
/// file of its `golden/` folder (one per model) as one map.
pub fn golden(fixtures: &Path) -> Golden {
    let folder = fixtures.join("golden");
    if !folder.is_dir() {
        return candle_core::safetensors::load(fixtures.join("golden.safetensors"), &Device::Cpu)
            .unwrap();
    }
    let mut golden = Golden::new();
    for file in std::fs::read_dir(&folder).unwrap() {
        let path = file.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            golden.extend(candle_core::safetensors::load(&path, &Device::Cpu).unwrap());
        }
    }
    golden
}

/// The golden batch, `[2, 17]` token ids.
pub fn input_ids(golden: &Golden) -> Tensor {
    golden["input_ids"].to_dtype(DType::U32).unwrap()
}

/// The elements of `t` as f64, in row-major order.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// Largest difference relative to the largest golden magnitude.
pub fn relative_error(ours: &[f64], theirs: &[f64]) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    let scale = theirs.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let diff = ours
        .iter()
        .zip(theirs)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// Every tensor of every weights file of a hub directory, by name: dtype,
/// shape and bytes.
pub fn hub_tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let hub = HubDir::open(dir).unwrap();
    hub.names()
        .map(|name| {
            let t = hub.tensor(name).unwrap();
            (
                name.to_string(),
                (t.dtype.to_string(), t.shape.clone(), t.data.to_vec()),
            )
        })
        .collect()
}

/// How a run trains: its stage, ranks and SGD steps (lr [`LR`]), whether
/// each block is recomputed in backward, and the bytes stage 3 gathers at
/// a time if not the default.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub stage: Stage,
    pub world: usize,
    pub steps: usize,
    pub checkpointed: bool,
    pub gather_bytes: Option<usize>,
}

impl Run {
    pub fn new(stage: Stage, world: usize, steps: usize) -> Self {
        Self {
            stage,
            world,
            steps,
            checkpointed: false,
            gather_bytes: None,
        }
    }

    /// Loads the hub directory `dir` (GPT-2 or Llama), trains on `ids`
    /// (each rank its rows) and saves in the hub layout to `out`.
    pub fn train(self, dir: &Path, ids: &Tensor, out: &Path) {
        let (d, o, ids) = (dir.to_path_buf(), out.to_path_buf(), ids.clone());
        ThreadGroup::new(self.world)
            .run(move |comm| self.on_rank(comm, &d, &ids, &o))
            .into_iter()
            .for_each(|r| r.unwrap().unwrap());
    }

    fn on_rank(
        self,
        comm: ThreadComm,
        dir: &Path,
        ids: &Tensor,
        out: &Path,
    ) -> zero_candle::Result<()> {
        let (world, rank) = (comm.world_size(), comm.rank());
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let (config, map) = CausalLm::open_hub(dir)?;
        let as_hook: Arc<dyn zero_candle::nn::GradHook> = hook.clone();
        let model = CausalLm::new(
            map.builder(DType::F32, &Device::Cpu),
            &config,
            Some(as_hook),
        )?
        .with_checkpointing(self.checkpointed);
        let mut engine = EngineConfig::default()
            .with_stage(self.stage)
            .with_persist_numel(64)
            .with_bucket_bytes(16 << 10);
        if let Some(bytes) = self.gather_bytes {
            engine = engine.with_gather_bytes(bytes);
        }
        let sgd = Sgd::new(SgdConfig::default().with_lr(LR))?;
        let mut opt = ZeroOptimizer::new_sharded(&map, comm, engine, Box::new(sgd), &hook)?;
        let rows = ids.dim(0)? / world;
        for _ in 0..self.steps {
            opt.backward_step(&model.loss(&ids.narrow(0, rank * rows, rows)?)?)?;
        }
        let hub = HubDir::open(dir)?;
        opt.save_hub(out, &hub, &config.hub_layout())
    }
}

/// `[2, 17]` windows and the same reversed in time: four windows.
pub fn four_windows(base: &Tensor) -> Tensor {
    let reversed: Vec<u32> = {
        let v = base.to_vec2::<u32>().unwrap();
        v.iter().flat_map(|row| row.iter().rev().copied()).collect()
    };
    let reversed = Tensor::from_vec(reversed, (2, 17), &Device::Cpu).unwrap();
    Tensor::cat(&[base, &reversed], 0).unwrap()
}

/// Little-endian f32 bytes as f64 values.
pub fn f32_values(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect()
}
