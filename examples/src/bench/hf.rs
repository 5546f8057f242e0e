//! `bench hf`: a GPT-2, a Llama, a Mixtral and a GLM-4.5 read from hub directories, against
//! `transformers` on the same cores. The models are zero-candle's fixtures
//! `zero-candle/tests/fixtures/gpt2/tiny` (a random `GPT2LMHeadModel`: 2
//! layers, n_embd 32, 4 heads, vocabulary 384) and `llama/gqa` (a random
//! `LlamaForCausalLM`: 2 layers, hidden 32, 4 query heads sharing 2
//! key/value heads, an untied head) and `llama/mixtral` (the same shape
//! with 4 experts of 48 per MLP, 2 per token, the load-balancing loss on)
//! and `llama/glm4moe` (a dense layer, then 8 experts of 16 in 4 groups, 3
//! per token, beside the shared experts), opened with
//! [`CausalLm::open_hub`], and a small Qwen3-MoE with random
//! weights ([`QWEN3_MOE_SMALL`]: 32 experts of 128 per MLP, 4 per token;
//! `transformers` builds its own of the same shape),
//! and trained by [`ZeroOptimizer`] on the thread backend (stage 2, AdamW)
//! at world size 1 and 2; the peer (`examples/pytorch/hf_peer.py`) loads
//! the same directory with AutoModelForCausalLM.from_pretrained and trains
//! it with `torch.optim.AdamW` on the same hyperparameters. Both take 16
//! sequences of 32 predicted tokens per step (globally), of seeded random
//! token ids.
//!
//! Rounds are interleaved so that drift in the machine's load affects each
//! case alike; each figure is a median.

use super::torch_peer::{
    run_hf_peer, HfModel, HfPeerArgs, PeerDevice, PeerDtype, PeerFigures, QWEN3_MOE_SMALL,
};
use super::{interleaved_medians, median, Report};
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use zero_candle::models::{CausalLm, HubConfig, LlamaConfig};
use zero_candle::nn::GradHook;
use zero_candle::{ShardedVarMap, ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, ThreadComm, ThreadGroup};

/// The fixtures' directory, relative to the repository's root.
const FIXTURES: &str = "zero-candle/tests/fixtures";
/// The models measured: their figures' names and where they come from.
const MODELS: [(&str, Model); 6] = [
    ("tiny_gpt2", Model::Fixture("gpt2/tiny")),
    ("tiny_llama", Model::Fixture("llama/gqa")),
    ("tiny_mixtral", Model::Fixture("llama/mixtral")),
    ("tiny_glm4moe", Model::Fixture("llama/glm4moe")),
    ("tiny_gptoss", Model::Fixture("llama/gptoss")),
    ("qwen3moe_small", Model::Qwen3MoeSmall),
];

/// A model measured.
#[derive(Clone, Copy)]
enum Model {
    /// A fixture directory under [`FIXTURES`], both sides loading it.
    Fixture(&'static str),
    /// [`QWEN3_MOE_SMALL`] with seeded random weights on each side.
    Qwen3MoeSmall,
}

impl Model {
    /// The config and the variables (deferred until the optimizer fills
    /// them) of our side.
    fn open(self) -> zero_candle::Result<(HubConfig, ShardedVarMap)> {
        match self {
            Self::Fixture(fixture) => CausalLm::open_hub(fixture_dir(fixture)),
            Self::Qwen3MoeSmall => {
                let json = serde_json::from_str(QWEN3_MOE_SMALL).expect("a JSON object");
                let config = LlamaConfig::from_json(&json).map_err(|detail| {
                    zero_candle::Error::Variable {
                        name: "<qwen3moe_small>".into(),
                        detail,
                    }
                })?;
                Ok((HubConfig::Llama(config), ShardedVarMap::seeded(SEED)))
            }
        }
    }

    /// The peer's model.
    fn peer(self) -> HfModel {
        match self {
            Self::Fixture(fixture) => HfModel::Dir(fixture_dir(fixture)),
            Self::Qwen3MoeSmall => HfModel::RandomQwen3MoeSmall,
        }
    }
}
/// Sequences per step, over all ranks.
const BATCH: usize = 16;
/// Predicted tokens per sequence: the fixture's `n_positions`.
const CONTEXT: usize = 32;
const WORLD_SIZES: [usize; 2] = [1, 2];
const WARMUP: usize = 5;
const STEPS: usize = 50;
const ROUNDS: usize = 3;
const SEED: u64 = 0;

/// Both sides' optimizer: PyTorch's AdamW defaults (betas (0.9, 0.999), eps
/// 1e-8, weight decay 1e-2) at lr 1e-3, passed to the peer as flags.
fn adamw_config() -> AdamWConfig {
    AdamWConfig::default().with_lr(1e-3)
}

/// A fixture's directory (`fixture` under [`FIXTURES`]): under the current
/// directory when it is the repository's root, else beside the examples
/// crate this binary was built from.
pub fn fixture_dir(fixture: &str) -> PathBuf {
    let here = PathBuf::from(FIXTURES).join(fixture);
    if here.is_dir() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(FIXTURES)
        .join(fixture)
}

/// Rank 0's median step time (batch, forward, backward, step) over `STEPS`
/// steps after `WARMUP` of `model`, at `world_size` threads, each rank
/// `BATCH / world_size` sequences.
fn engine_step(model: Model, world_size: usize) -> Result<f64, String> {
    let results = ThreadGroup::new(world_size).run(|comm| -> zero_candle::Result<f64> {
        let rank = comm.rank();
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let (config, map) = model.open()?;
        let as_hook: Arc<dyn GradHook> = hook.clone();
        let model = CausalLm::new(
            map.builder(DType::F32, &Device::Cpu),
            &config,
            Some(as_hook),
        )?;
        let engine = EngineConfig::default().with_stage(Stage::Gradients);
        let adamw = AdamW::new(adamw_config())?;
        let mut opt = ZeroOptimizer::new_sharded(&map, comm, engine, Box::new(adamw), &hook)?;
        let rows = BATCH / world_size;
        let vocab = config.vocab_size() as u32;
        let mut rng = StdRng::seed_from_u64(SEED + rank as u64);
        let mut times = Vec::with_capacity(STEPS);
        for step in 0..WARMUP + STEPS {
            let started = Instant::now();
            let ids: Vec<u32> = (0..rows * (CONTEXT + 1))
                .map(|_| rng.gen_range(0..vocab))
                .collect();
            let ids = Tensor::from_vec(ids, (rows, CONTEXT + 1), &Device::Cpu)?;
            opt.backward_step(&model.loss(&ids)?)?;
            if step >= WARMUP {
                times.push(started.elapsed().as_secs_f64());
            }
        }
        Ok(median(times))
    });
    match results.into_iter().next() {
        Some(Ok(Ok(t))) => Ok(t),
        Some(Ok(Err(e))) => Err(e.to_string()),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no rank ran".into()),
    }
}

/// `transformers`' run of `model` on the same global batch (one process,
/// as many threads as the machine has cores, as Candle uses at world size
/// 1).
fn transformers_run(model: Model) -> Result<PeerFigures, String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    run_hf_peer(&peer_args(model.peer(), threads))
}

/// The peer's options: `model` on the CPU in f32, the suite's batch and
/// AdamW, on `threads` threads.
fn peer_args(model: HfModel, threads: usize) -> HfPeerArgs {
    HfPeerArgs {
        model,
        context: CONTEXT,
        batch: BATCH,
        steps: STEPS,
        warmup: WARMUP,
        adamw: adamw_config(),
        device: PeerDevice::Cpu,
        dtype: PeerDtype::F32,
        attention: None,
        threads: Some(threads),
        seed: SEED,
    }
}

/// Adds, per model (`tiny_gpt2`, `tiny_llama`, `tiny_mixtral`,
/// `tiny_glm4moe`, `tiny_gptoss`, `qwen3moe_small`),
/// `hf.<model>_tokens_per_s` (world size 1), its value at N=2 (`_n2_`),
/// transformers' as `hf.<model>_transformers_tokens_per_s` and the ratio
/// of the first over it, `hf.<model>_over_transformers`.
pub fn run(report: &mut Report) {
    for (name, model) in MODELS {
        println!(
            "bench hf: {name}, AdamW, stage 2, {BATCH} sequences of {CONTEXT} tokens per step, \
             median of {STEPS} steps after {WARMUP}, {ROUNDS} rounds interleaved"
        );
        if let Err(e) = throughput(report, name, model) {
            eprintln!("bench hf failed on {name}: {e}");
        }
    }
}

fn throughput(report: &mut Report, name: &str, model: Model) -> Result<(), String> {
    // transformers is measured only if it runs at all; its absence is
    // reported, not a failure of the suite.
    let peer = match transformers_run(model) {
        Ok(figures) => {
            println!(
                "bench hf: torch {} on {}",
                figures.torch_version, figures.device_name
            );
            true
        }
        Err(e) => {
            println!("bench hf: no transformers figure: {e}");
            false
        }
    };
    let mut names = vec!["zero-rs N=1", "zero-rs N=2"];
    if peer {
        names.push("transformers");
    }
    let medians = interleaved_medians(&names, ROUNDS, |case| match case {
        0 | 1 => engine_step(model, WORLD_SIZES[case]),
        _ => Ok(transformers_run(model)?.step_ms / 1e3),
    })?;
    let tokens = (BATCH * CONTEXT) as f64;
    let ours = tokens / medians[0];
    let figure = |what: &str| format!("hf.{name}_{what}");
    report.add(&figure("tokens_per_s"), ours, "tokens/s", None);
    report.add(
        &figure("n2_tokens_per_s"),
        tokens / medians[1],
        "tokens/s",
        None,
    );
    if peer {
        let theirs = tokens / medians[2];
        report.add(
            &figure("transformers_tokens_per_s"),
            theirs,
            "tokens/s",
            None,
        );
        report.add(&figure("over_transformers"), ours / theirs, "x", None);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::torch_peer::HF_PEER;

    #[test]
    fn passes_every_option_and_finds_its_files() {
        let args = peer_args(HfModel::Dir(PathBuf::from("tiny")), 2);
        assert_eq!(
            args.to_args().join(" "),
            "--model-dir tiny --context 32 --batch 16 --steps 50 --warmup 5 --lr 0.001 \
             --betas 0.9 0.999 --eps 0.00000001 --weight-decay 0.01 --device cpu --dtype f32 \
             --seed 0 --threads 2"
        );
        assert!(
            HF_PEER.path().is_file(),
            "{} is missing",
            HF_PEER.path().display()
        );
        for (name, model) in MODELS {
            if let Model::Fixture(fixture) = model {
                let dir = fixture_dir(fixture);
                assert!(
                    dir.join("config.json").is_file(),
                    "{} has no config.json",
                    dir.display()
                );
            }
            model.open().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    /// Both sides build the same small Qwen3-MoE: every setting of ours is
    /// in `hf_peer.py`'s `qwen3moe_small`, written as Python writes it.
    #[test]
    fn the_random_moe_has_the_peers_shape() {
        let script = std::fs::read_to_string(HF_PEER.path()).unwrap();
        let start = script
            .find("\"qwen3moe_small\": (")
            .expect("the peer's shape");
        let shape = &script[start..start + script[start..].find("),").unwrap()];
        let ours: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(QWEN3_MOE_SMALL).unwrap();
        for (key, value) in ours.iter().filter(|(k, _)| *k != "model_type") {
            let python = match value {
                serde_json::Value::Bool(b) => if *b { "True" } else { "False" }.to_string(),
                other => other.to_string(),
            };
            assert!(
                shape.contains(&format!("\"{key}\": {python},")),
                "hf_peer.py's qwen3moe_small lacks {key} = {python}"
            );
        }
        assert!(shape.contains("\"Qwen3MoeConfig\""));
    }
}
