//! The PyTorch peers of the benchmarks: runs a script of
//! `examples/pytorch/` ([`GPT_PEER`]: the trainer's GPT, [`HF_PEER`]: a
//! GPT-2 through `transformers`) in a child `python3` and reads back its one
//! JSON line, so that a benchmark can report our tokens/s and memory over
//! PyTorch's, measured on the same machine in the same run.
//!
//! Memory is not the same measure on both sides: on CUDA the peer reports
//! `torch.cuda.max_memory_allocated()` over its timed steps, on the CPU the
//! Python process's peak resident set size (interpreter and torch's
//! libraries included), while the Rust benchmarks count heap bytes.

use serde::Deserialize;
use std::io::ErrorKind;
use std::path::PathBuf;
use std::process::Command;
use zero_core::optim::AdamWConfig;

/// The command that installs PyTorch, named in errors.
pub const INSTALL_TORCH: &str = "`python3 -m pip install torch` (CPU-only wheel: \
     `python3 -m pip install torch --index-url https://download.pytorch.org/whl/cpu`)";

/// The exit code with which a script says it could not import what it
/// needs (torch; for [`HF_PEER`] also transformers).
const EXIT_NO_PACKAGE: i32 = 2;
/// The exit code with which the script says the device is unavailable.
const EXIT_NO_DEVICE: i32 = 3;

/// Where the peer computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerDevice {
    /// The CPU (`--device cpu`).
    Cpu,
    /// The first CUDA device (`--device cuda`).
    Cuda,
}

impl PeerDevice {
    /// The value of the scripts' `--device`.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

/// The peer's compute dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerDtype {
    /// f32 throughout (`--dtype f32`).
    F32,
    /// `torch.autocast` to bfloat16 with f32 weights (`--dtype bf16`).
    Bf16,
}

impl PeerDtype {
    /// The value of the scripts' `--dtype`.
    pub fn flag(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// How the peer computes attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerAttention {
    /// `q k^T / sqrt(d)` plus a causal `-inf` mask, softmax, `@ v`: the
    /// composition the Rust trainer uses (`--attention manual`).
    Manual,
    /// `F.scaled_dot_product_attention(is_causal=True)` (`--attention sdpa`).
    Sdpa,
}

/// The options of `gpt_peer.py`, one field per flag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerArgs {
    /// Transformer blocks (`--layers`).
    pub layers: usize,
    /// Attention heads per block (`--heads`); must divide `d_model`.
    pub heads: usize,
    /// Width of the residual stream (`--d-model`).
    pub d_model: usize,
    /// Sequence length in bytes (`--context`).
    pub context: usize,
    /// Sequences per step, global: ranks times the per-rank batch (`--batch`).
    pub batch: usize,
    /// Timed steps (`--steps`).
    pub steps: usize,
    /// Untimed steps before them (`--warmup`).
    pub warmup: usize,
    /// Where to compute (`--device`).
    pub device: PeerDevice,
    /// Compute dtype (`--dtype`).
    pub dtype: PeerDtype,
    /// Attention implementation (`--attention`).
    pub attention: PeerAttention,
    /// `torch.set_num_threads` (`--threads`); `None`: torch's default.
    pub threads: Option<usize>,
    /// Seed of the weights and the data (`--seed`).
    pub seed: u64,
    /// The Python interpreter to run (default `python3`).
    pub python: String,
}

impl Default for PeerArgs {
    /// `bench gpt`'s shape: 2 layers, 4 heads, d_model 64, context 64,
    /// 32 sequences (2 ranks x 16), 20 timed steps after 3, CPU, f32,
    /// manual attention.
    fn default() -> Self {
        Self {
            layers: 2,
            heads: 4,
            d_model: 64,
            context: 64,
            batch: 32,
            steps: 20,
            warmup: 3,
            device: PeerDevice::Cpu,
            dtype: PeerDtype::F32,
            attention: PeerAttention::Manual,
            threads: None,
            seed: 0,
            python: "python3".into(),
        }
    }
}

impl PeerArgs {
    /// The script's command-line arguments (after its path).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "--layers".to_string(),
            self.layers.to_string(),
            "--heads".into(),
            self.heads.to_string(),
            "--d-model".into(),
            self.d_model.to_string(),
            "--context".into(),
            self.context.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--warmup".into(),
            self.warmup.to_string(),
            "--device".into(),
            self.device.flag().into(),
            "--dtype".into(),
            self.dtype.flag().into(),
            "--attention".into(),
            match self.attention {
                PeerAttention::Manual => "manual",
                PeerAttention::Sdpa => "sdpa",
            }
            .into(),
            "--seed".into(),
            self.seed.to_string(),
        ];
        if let Some(threads) = self.threads {
            args.push("--threads".into());
            args.push(threads.to_string());
        }
        args
    }
}

/// The model `hf_peer.py` trains.
#[derive(Clone, Debug, PartialEq)]
pub enum HfModel {
    /// A hub directory, loaded with `from_pretrained` (`--model-dir`).
    Dir(PathBuf),
    /// A fresh GPT-2 small (`GPT2Config()`, dropout off) with seeded random
    /// weights (`--random small`): [`Gpt2Config::gpt2_small`]'s shape.
    ///
    /// [`Gpt2Config::gpt2_small`]: zero_candle::models::Gpt2Config::gpt2_small
    RandomSmall,
    /// A fresh Llama of TinyLlama-1.1B's shape with seeded random weights
    /// (`--random tinyllama`).
    RandomTinyLlama,
    /// A fresh small Qwen3-MoE with seeded random weights (`--random
    /// qwen3moe_small`): [`QWEN3_MOE_SMALL`]'s shape.
    RandomQwen3MoeSmall,
}

/// `hf_peer.py`'s `qwen3moe_small` as a `config.json`: 4 layers of 256, 8
/// query heads of 32 sharing 4 key/value heads, every MLP 32 experts of 128
/// with 4 per token, vocabulary 384, untied (13.6M parameters).
pub const QWEN3_MOE_SMALL: &str = r#"{
    "model_type": "qwen3_moe", "vocab_size": 384, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 32, "num_experts": 32, "num_experts_per_tok": 4,
    "moe_intermediate_size": 128, "norm_topk_prob": true, "max_position_embeddings": 512,
    "tie_word_embeddings": false
}"#;

/// The options of `hf_peer.py`, one field per flag.
#[derive(Clone, Debug, PartialEq)]
pub struct HfPeerArgs {
    /// What to train (`--model-dir` or `--random`).
    pub model: HfModel,
    /// Predicted tokens per sequence (`--context`).
    pub context: usize,
    /// Sequences per step (`--batch`).
    pub batch: usize,
    /// Timed steps (`--steps`).
    pub steps: usize,
    /// Untimed steps before them (`--warmup`).
    pub warmup: usize,
    /// `torch.optim.AdamW`'s hyperparameters (`--lr`, `--betas`, `--eps`,
    /// `--weight-decay`).
    pub adamw: AdamWConfig,
    /// Where to compute (`--device`).
    pub device: PeerDevice,
    /// Compute dtype (`--dtype`; bf16 is autocast over f32 weights).
    pub dtype: PeerDtype,
    /// transformers' attention (`--attn-implementation`: `Manual` is its
    /// `eager`, `Sdpa` its `sdpa`); `None`: transformers chooses.
    pub attention: Option<PeerAttention>,
    /// `torch.set_num_threads` (`--threads`); `None`: torch's default.
    pub threads: Option<usize>,
    /// Seed of the data, and of `--random`'s weights (`--seed`).
    pub seed: u64,
}

impl HfPeerArgs {
    /// `bench gpu`'s `transformers` side: a fresh `model` on the first
    /// CUDA device, bf16 autocast, SDPA, `batch` sequences of `context`
    /// predicted tokens per step.
    pub fn random_cuda_bf16(
        model: HfModel,
        batch: usize,
        context: usize,
        steps: usize,
        warmup: usize,
        adamw: AdamWConfig,
        seed: u64,
    ) -> Self {
        Self {
            model,
            context,
            batch,
            steps,
            warmup,
            adamw,
            device: PeerDevice::Cuda,
            dtype: PeerDtype::Bf16,
            attention: Some(PeerAttention::Sdpa),
            threads: None,
            seed,
        }
    }

    /// The script's command-line arguments (after its path).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = match &self.model {
            HfModel::Dir(dir) => vec!["--model-dir".to_string(), dir.display().to_string()],
            HfModel::RandomSmall => vec!["--random".to_string(), "small".into()],
            HfModel::RandomTinyLlama => vec!["--random".to_string(), "tinyllama".into()],
            HfModel::RandomQwen3MoeSmall => vec!["--random".to_string(), "qwen3moe_small".into()],
        };
        args.extend([
            "--context".into(),
            self.context.to_string(),
            "--batch".into(),
            self.batch.to_string(),
            "--steps".into(),
            self.steps.to_string(),
            "--warmup".into(),
            self.warmup.to_string(),
            "--lr".into(),
            self.adamw.lr.to_string(),
            "--betas".into(),
            self.adamw.betas.0.to_string(),
            self.adamw.betas.1.to_string(),
            "--eps".into(),
            self.adamw.eps.to_string(),
            "--weight-decay".into(),
            self.adamw.weight_decay.to_string(),
            "--device".into(),
            self.device.flag().into(),
            "--dtype".into(),
            self.dtype.flag().into(),
            "--seed".into(),
            self.seed.to_string(),
        ]);
        if let Some(attention) = self.attention {
            args.push("--attn-implementation".into());
            args.push(
                match attention {
                    PeerAttention::Manual => "eager",
                    PeerAttention::Sdpa => "sdpa",
                }
                .into(),
            );
        }
        if let Some(threads) = self.threads {
            args.push("--threads".into());
            args.push(threads.to_string());
        }
        args
    }
}

/// What the peer measured.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerFigures {
    /// Tokens (predicted bytes) per second: `batch * context` over the
    /// median step time.
    pub tokens_per_s: f64,
    /// Median step time in milliseconds (batch, forward, backward, AdamW).
    pub step_ms: f64,
    /// Peak memory in bytes: on CUDA `torch.cuda.max_memory_allocated()`
    /// over the timed steps, on the CPU the process's peak RSS (see the
    /// module's doc: not the Rust side's heap measure); `None` when the
    /// script reported neither.
    pub peak_bytes: Option<u64>,
    /// The device's name (the GPU's, or the CPU's model name).
    pub device_name: String,
    /// `torch.__version__`.
    pub torch_version: String,
    /// The model's parameter count, where the script reports it.
    pub parameters: Option<u64>,
}

/// The script's JSON line (fields this module does not use are ignored).
#[derive(Debug, Deserialize)]
struct PeerLine {
    tokens_per_s: f64,
    step_ms_median: f64,
    #[serde(default)]
    peak_memory_bytes: Option<u64>,
    #[serde(default)]
    peak_rss_bytes: Option<u64>,
    device_name: String,
    torch_version: String,
    #[serde(default)]
    parameters: Option<u64>,
}

/// A peer script of `examples/pytorch/` and what it needs installed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerScript {
    /// Its file name in `examples/pytorch/`.
    pub file: &'static str,
    /// The Python packages it imports, as errors name them.
    pub needs: &'static str,
    /// The command that installs them, named in errors.
    pub install: &'static str,
}

impl PeerScript {
    /// Where the script is (see [`pytorch_script`]).
    pub fn path(&self) -> PathBuf {
        pytorch_script(self.file)
    }
}

/// `gpt_peer.py`: the trainer's GPT in plain PyTorch ([`PeerArgs`]).
pub const GPT_PEER: PeerScript = PeerScript {
    file: "gpt_peer.py",
    needs: "PyTorch",
    install: INSTALL_TORCH,
};

/// `hf_peer.py`: a GPT-2 (a hub directory, or a fresh GPT-2 small) trained
/// by `transformers` (`bench hf`, and `bench gpu`'s GPT-2 small).
pub const HF_PEER: PeerScript = PeerScript {
    file: "hf_peer.py",
    needs: "PyTorch or transformers",
    install: "`python3 -m pip install torch transformers`",
};

/// `examples/pytorch/NAME`: under `$ZERO_PYTORCH_DIR` when set, else under
/// the current directory when it is the repository's root (a GPU bundle
/// run from a checkout elsewhere than where it was built), else in the
/// examples crate this binary was built from.
pub fn pytorch_script(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("ZERO_PYTORCH_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let here = PathBuf::from("examples").join("pytorch").join(name);
    if here.is_file() {
        return here;
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("pytorch")
        .join(name)
}

/// Finds the JSON line in a peer's stdout (the last line that is a JSON
/// object) and reads the figures from it.
pub fn parse_peer_output(stdout: &str) -> Result<PeerFigures, String> {
    let line = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| format!("the peer printed no JSON line; its output: {stdout:?}"))?;
    let parsed: PeerLine = serde_json::from_str(line)
        .map_err(|e| format!("cannot read the peer's JSON line ({e}): {line}"))?;
    Ok(PeerFigures {
        tokens_per_s: parsed.tokens_per_s,
        step_ms: parsed.step_ms_median,
        peak_bytes: parsed.peak_memory_bytes.or(parsed.peak_rss_bytes),
        device_name: parsed.device_name,
        torch_version: parsed.torch_version,
        parameters: parsed.parameters,
    })
}

/// Runs `gpt_peer.py` with `args` and returns its figures (see
/// [`run_peer`]).
pub fn run_gpt_peer(args: &PeerArgs) -> Result<PeerFigures, String> {
    run_peer(GPT_PEER, &args.python, &args.to_args())
}

/// Runs `hf_peer.py` under `python3` with `args` and returns its figures
/// (see [`run_peer`]).
pub fn run_hf_peer(args: &HfPeerArgs) -> Result<PeerFigures, String> {
    run_peer(HF_PEER, "python3", &args.to_args())
}

/// Runs `script` under `python` with `args` and returns its figures; an
/// error names what to do when `python` or a package the script needs is
/// missing or the device is unavailable.
pub fn run_peer(script: PeerScript, python: &str, args: &[String]) -> Result<PeerFigures, String> {
    let path = script.path();
    if !path.is_file() {
        return Err(format!("the PyTorch peer {} is missing", path.display()));
    }
    let output = Command::new(python)
        .arg(&path)
        .args(args)
        .output()
        .map_err(|e| match e.kind() {
            ErrorKind::NotFound => format!(
                "{python} not found: the PyTorch peer needs Python 3 with {}; install \
                 Python 3, then {}",
                script.needs, script.install
            ),
            _ => format!("cannot run {python} {}: {e}", path.display()),
        })?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stderr = stderr.trim();
    if !output.status.success() {
        return Err(match output.status.code() {
            Some(EXIT_NO_PACKAGE) => format!(
                "{} is not installed for {python}; install it with {}",
                script.needs, script.install
            ),
            Some(EXIT_NO_DEVICE) => format!("the PyTorch peer's device is unavailable: {stderr}"),
            _ => format!(
                "{python} {} failed ({}): {stderr}",
                path.display(),
                output.status
            ),
        });
    }
    parse_peer_output(&String::from_utf8_lossy(&output.stdout))
        .map_err(|e| format!("{}: {e}", script.file))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_cpu_line() {
        let out = "some warning\n{\"device\": \"cpu\", \"device_name\": \"AMD EPYC\", \
                   \"dtype\": \"f32\", \"attention\": \"manual\", \"tokens_per_s\": 51234.5, \
                   \"step_ms_median\": 39.97, \"peak_rss_bytes\": 412345344, \
                   \"torch_version\": \"2.5.1+cpu\", \"threads\": 2, \"parameters\": 120064}\n";
        let f = parse_peer_output(out).unwrap();
        assert_eq!(f.tokens_per_s, 51234.5);
        assert_eq!(f.step_ms, 39.97);
        assert_eq!(f.peak_bytes, Some(412_345_344));
        assert_eq!(f.device_name, "AMD EPYC");
        assert_eq!(f.torch_version, "2.5.1+cpu");
        assert_eq!(f.parameters, Some(120_064));
    }

    #[test]
    fn parses_a_cuda_line_and_rejects_garbage() {
        let out = r#"{"device": "cuda", "device_name": "NVIDIA H100", "dtype": "bf16", "attention": "sdpa", "tokens_per_s": 1e6, "step_ms_median": 2.0, "peak_memory_bytes": 1048576, "torch_version": "2.6.0", "threads": 16}"#;
        let f = parse_peer_output(out).unwrap();
        assert_eq!(f.peak_bytes, Some(1 << 20));
        assert_eq!(f.device_name, "NVIDIA H100");
        assert_eq!(f.parameters, None);
        assert!(parse_peer_output("no json here").is_err());
        assert!(parse_peer_output("{\"tokens_per_s\": 1}").is_err());
    }

    #[test]
    fn passes_every_option() {
        let args = PeerArgs {
            threads: Some(2),
            device: PeerDevice::Cuda,
            dtype: PeerDtype::Bf16,
            attention: PeerAttention::Sdpa,
            ..PeerArgs::default()
        };
        let line = args.to_args().join(" ");
        assert_eq!(
            line,
            "--layers 2 --heads 4 --d-model 64 --context 64 --batch 32 --steps 20 --warmup 3 \
             --device cuda --dtype bf16 --attention sdpa --seed 0 --threads 2"
        );
        assert!(
            GPT_PEER.path().is_file(),
            "{} is missing",
            GPT_PEER.path().display()
        );
    }

    /// What `hf_peer.py`'s own parser makes of `args` (its `parse_args`,
    /// which imports neither torch nor transformers): the options as one
    /// line, in the order of the script's flags.
    fn hf_peer_parses(args: &[String]) -> String {
        const PRINT: &str = "import sys; sys.path.insert(0, sys.argv[1]); import hf_peer; \
             a = hf_peer.parse_args(sys.argv[2:]); \
             print(a.model_dir, a.random, a.context, a.batch, a.steps, a.warmup, a.lr, \
             *a.betas, a.eps, a.weight_decay, a.device, a.dtype, a.attn_implementation, \
             a.threads, a.seed)";
        let dir = HF_PEER
            .path()
            .parent()
            .map(PathBuf::from)
            .unwrap_or_default();
        // -B: no __pycache__ left in examples/pytorch/.
        let out = Command::new("python3")
            .args(["-B", "-c", PRINT])
            .arg(&dir)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("python3: {e}; scripts/install-deps.sh installs it"));
        assert!(
            out.status.success(),
            "hf_peer.py refused {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    #[test]
    fn hf_peer_takes_the_gpu_case_and_the_hub_case() {
        let adamw = AdamWConfig::default().with_lr(1e-3);
        let cuda = HfPeerArgs::random_cuda_bf16(HfModel::RandomSmall, 8, 1024, 20, 3, adamw, 0);
        assert_eq!(
            cuda.to_args().join(" "),
            "--random small --context 1024 --batch 8 --steps 20 --warmup 3 --lr 0.001 \
             --betas 0.9 0.999 --eps 0.00000001 --weight-decay 0.01 --device cuda --dtype bf16 \
             --seed 0 --attn-implementation sdpa"
        );
        assert_eq!(
            hf_peer_parses(&cuda.to_args()),
            "None small 1024 8 20 3 0.001 0.9 0.999 1e-08 0.01 cuda bf16 sdpa None 0"
        );
        let hub = HfPeerArgs {
            model: HfModel::Dir(PathBuf::from("tiny")),
            device: PeerDevice::Cpu,
            dtype: PeerDtype::F32,
            attention: Some(PeerAttention::Manual),
            threads: Some(2),
            seed: 7,
            ..cuda
        };
        assert_eq!(
            hf_peer_parses(&hub.to_args()),
            "tiny None 1024 8 20 3 0.001 0.9 0.999 1e-08 0.01 cpu f32 eager 2 7"
        );
        let llama = HfPeerArgs {
            model: HfModel::RandomTinyLlama,
            ..cuda
        };
        assert!(
            hf_peer_parses(&llama.to_args()).starts_with("None tinyllama 1024 8 "),
            "{:?}",
            llama.to_args()
        );
    }
}
