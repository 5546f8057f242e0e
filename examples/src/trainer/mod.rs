//! The `train` binary's logic: flags, data, models (an MLP on rows, a GPT
//! on text) and the per-rank loop, kept in the library so tests can run it
//! in-process.

mod args;
mod config;
mod config_file;
mod data;
mod gpt;
mod hub;
mod launch;
mod metrics;
mod model;
mod optimizers;
mod outputs;
mod plot;
mod progress;
mod rank_model;
mod rank_optimizer;
mod sample;
mod text;
mod tokenizer;
mod train_loop;

pub use args::{
    Args, Backend, LrDecayArg, ModelKind, OffloadArg, OptimizerKind, OverlapArg, PartitionerArg,
    Precision, ReplicaDtype,
};
pub use config::{engine_config, overlap, shard_group};
pub use data::Dataset;
pub use gpt::{Gpt, GptConfig, GptOps, VOCAB};
pub use hub::HubText;
pub use launch::{run, run_with_preemption, train_rank};
pub use metrics::{GatherMetrics, OffloadMetrics, StepMetrics};
pub use model::{copy_vars, read_weights, Mlp};
pub use plot::LossHistory;
pub use text::{Document, TextData, DEFAULT_CORPUS_DIR};
pub use tokenizer::TextTokenizer;

use std::path::{Path, PathBuf};

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad flags.
    #[error("{0}")]
    Usage(String),
    /// The command line does not parse, or asks for `--help` or
    /// `--version`: `exit()` prints clap's message with its exit code.
    #[error(transparent)]
    CommandLine(#[from] clap::Error),
    /// A data, weights or metrics file is unusable.
    #[error("{path}: {detail}")]
    Data {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The engine, a communicator or a checkpoint failed.
    #[error(transparent)]
    Zero(#[from] zero_core::Error),
    /// The Candle adapter failed.
    #[error(transparent)]
    Adapter(#[from] zero_candle::Error),
    /// Candle failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A rank failed; the message says which and why.
    #[error("rank {rank}: {source}")]
    Rank {
        /// The rank.
        rank: usize,
        /// What happened.
        source: Box<TrainError>,
    },
    /// A broken internal invariant.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Loss of the last step.
    pub final_loss: f64,
    /// Steps run (including those before a resume).
    pub steps: u64,
    /// The last validation loss measured (GPT with `--eval-every`).
    pub val_loss: Option<f64>,
    /// The bytes `--sample` generated (GPT, rank 0).
    pub sample: Option<Vec<u8>>,
    /// Steps whose all-gathers ran into the next forward (rank 0;
    /// `--defer-gathers`).
    pub deferred_steps: u64,
    /// How the run ended.
    pub outcome: Outcome,
    /// The rank that returned this summary: 0, except under MPI and NCCL,
    /// where every process returns its own.
    pub rank: usize,
}

/// How a run ended (the `train` binary's exit status follows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It trained up to `--steps`.
    Finished,
    /// The checkpoint `--resume` names was saved at or past `--steps`:
    /// nothing was trained (`--save` still writes its weights), and the
    /// final loss is NaN.
    AlreadyDone {
        /// The step the checkpoint was saved at.
        checkpoint_step: u64,
    },
    /// A preemption signal (`--preempt-signals`) stopped every rank after
    /// `step`, with a checkpoint of it if there is a `--checkpoint-dir`;
    /// `train` exits with `--preempt-exit-code`. `--save`, `--sample` and
    /// `--plot` did not run.
    Preempted {
        /// The last step run.
        step: u64,
        /// The step directory saved (`None` without `--checkpoint-dir`).
        checkpoint: Option<PathBuf>,
    },
}

/// What `train` prints when a preemption stopped it: the step, where it
/// saved, and the command that resumes (`argv` with `--resume` pointed at
/// `--checkpoint-dir`, whose `latest` names the newest checkpoint).
pub fn preempted_message<I, T>(args: &Args, step: u64, checkpoint: Option<&Path>, argv: I) -> String
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString>,
{
    let stopped = format!(
        "preempted: stopped after step {step} of {} on a signal",
        args.steps
    );
    let (Some(checkpoint), Some(root)) = (checkpoint, &args.checkpoint_dir) else {
        return format!(
            "{stopped}; nothing was saved (no --checkpoint-dir): give one to save on a \
             preemption"
        );
    };
    let mut words: Vec<String> = Vec::new();
    let mut argv = argv
        .into_iter()
        .map(|a| a.into().to_string_lossy().into_owned());
    while let Some(arg) = argv.next() {
        if arg == "--resume" {
            argv.next();
        } else if !arg.starts_with("--resume=") {
            words.push(shell_word(&arg));
        }
    }
    words.push("--resume".into());
    words.push(shell_word(&root.to_string_lossy()));
    let launcher = match args.backend {
        Backend::Mpi | Backend::Nccl => " (under the same launcher)",
        Backend::Threads | Backend::CudaThreads => "",
    };
    format!(
        "{stopped}; checkpoint saved in {}\nresume with{launcher}: {}",
        checkpoint.display(),
        words.join(" ")
    )
}

/// `word` quoted for a POSIX shell where it needs to be.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// What a run trains on: rows for the MLP, text for the GPT.
#[derive(Clone, Debug)]
pub enum TrainingData {
    /// Rows of inputs and class targets.
    Rows(Dataset),
    /// Token ids of text (bytes for the byte GPT).
    Text(TextData),
    /// `--hf`: a Hugging Face model with its tokenizer and the text
    /// tokenized with it.
    Hub(Box<HubText>),
}

impl TrainingData {
    /// The data `--model` (or `--hf`) and `--data` name.
    pub fn from_args(args: &Args) -> Result<Self, TrainError> {
        if let Some(dir) = &args.hf {
            return Ok(Self::Hub(Box::new(HubText::load(args, dir)?)));
        }
        Ok(match args.model {
            ModelKind::Mlp => Self::Rows(match &args.data {
                Some(path) => Dataset::load(path)?,
                None => Dataset::synthetic(args.seed),
            }),
            ModelKind::Gpt => {
                let context = args.context as usize;
                Self::Text(match &args.data {
                    Some(path) => TextData::load(path, context)?,
                    None => TextData::default_corpus(context)?,
                })
            }
        })
    }
}
