//! [`CausalLm`]: whichever supported model a hub checkpoint holds, chosen
//! by its `config.json`'s `model_type` ([`HubConfig`]).

use super::llama::{self, llama_types};
use super::{Gpt2, Gpt2Config, Llama, LlamaConfig};
use crate::hub::{HubDir, HubLayout};
use crate::nn::GradHook;
use crate::{Result, ShardedVarMap};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::sync::Arc;

/// The config of a supported hub checkpoint.
// Read once per run: the variants' sizes do not matter, and boxing one
// would only change how callers match them.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum HubConfig {
    /// `model_type` `gpt2`.
    Gpt2(Gpt2Config),
    /// `model_type` `llama`, `mistral`, `qwen2`, `qwen3`, `phi3`, `gemma`,
    /// `gemma2`, `gemma3_text`, `gemma3` (its text model), `smollm3`,
    /// `granite`, `olmo2` or `olmo3`.
    Llama(LlamaConfig),
}

impl HubConfig {
    /// Reads a hub `config.json` by its `model_type`; an error names the
    /// key this library cannot honour.
    pub fn from_json(config: &serde_json::Value) -> std::result::Result<Self, String> {
        match config.get("model_type").and_then(|v| v.as_str()) {
            Some("gpt2") => Gpt2Config::from_json(config).map(Self::Gpt2),
            Some(kind) if llama::reads(kind) => LlamaConfig::from_json(config).map(Self::Llama),
            Some(other) => Err(format!(
                "`model_type` is {other:?}; the models here are \"gpt2\", {}",
                llama_types()
            )),
            None => Err(format!(
                "no `model_type`; the models here are \"gpt2\", {}",
                llama_types()
            )),
        }
    }

    /// The config of the hub directory `hub` ([`HubConfig::from_json`]),
    /// an error naming its `config.json` and the key.
    pub fn from_hub(hub: &HubDir) -> Result<Self> {
        let mut config = super::config_of(hub, Self::from_json)?;
        if let Self::Llama(llama) = &mut config {
            llama.settle_with_files(hub)?;
        }
        Ok(config)
    }

    /// Where the model's variables sit in its checkpoints.
    pub fn hub_layout(&self) -> HubLayout {
        match self {
            Self::Gpt2(config) => Gpt2::hub_layout(config),
            Self::Llama(config) => Llama::hub_layout(config),
        }
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Gpt2(config) => config.vocab_size,
            Self::Llama(config) => config.vocab_size,
        }
    }

    /// The longest sequence the model is meant for, and the key that says
    /// so.
    pub fn max_positions(&self) -> (usize, &'static str) {
        match self {
            Self::Gpt2(config) => (config.n_positions, "n_positions"),
            Self::Llama(config) => (config.max_position_embeddings, "max_position_embeddings"),
        }
    }

    /// The model's parameters.
    pub fn num_params(&self) -> usize {
        match self {
            Self::Gpt2(config) => config.num_params(),
            Self::Llama(config) => config.num_params(),
        }
    }

    /// Whether the config asks for dropout (or Mixtral's router jitter),
    /// which training here leaves out.
    pub fn asks_for_dropout(&self) -> bool {
        match self {
            Self::Gpt2(config) => config.asks_for_dropout(),
            Self::Llama(config) => config.dropout > 0.0,
        }
    }
}

/// A causal language model of the hub: GPT-2 or Llama (Mistral, Qwen2,
/// Qwen3, Phi-3, Gemma 1-3, SmolLM3, Granite, OLMo 2-3, Mixtral, Qwen2-MoE,
/// Qwen3-MoE, OLMoE and FlexOlmo included).
pub enum CausalLm {
    /// GPT-2.
    Gpt2(Gpt2),
    /// Llama.
    Llama(Llama),
}

impl CausalLm {
    /// Creates the model `config` describes through `vb` (see
    /// [`Gpt2::new`], [`Llama::new`]).
    pub fn new(
        vb: VarBuilder,
        config: &HubConfig,
        hook: Option<Arc<dyn GradHook>>,
    ) -> Result<Self> {
        Ok(match config {
            HubConfig::Gpt2(config) => Self::Gpt2(Gpt2::new(vb, config, hook)?),
            HubConfig::Llama(config) => Self::Llama(Llama::new(vb, config, hook)?),
        })
    }

    /// Opens a hub directory: its config, and a [`ShardedVarMap`] whose
    /// variables come from its weights (build the model with
    /// [`CausalLm::new`] through the map's builder).
    pub fn open_hub(dir: impl AsRef<std::path::Path>) -> Result<(HubConfig, ShardedVarMap)> {
        super::open_hub_as(dir, HubConfig::from_hub, HubConfig::hub_layout)
    }

    /// With `on`, each block is recomputed in backward.
    pub fn with_checkpointing(self, on: bool) -> Self {
        match self {
            Self::Gpt2(model) => Self::Gpt2(model.with_checkpointing(on)),
            Self::Llama(model) => Self::Llama(model.with_checkpointing(on)),
        }
    }

    /// Logits `[batch, time, vocab_size]` for token ids `[batch, time]`.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Gpt2(model) => model.forward(ids),
            Self::Llama(model) => model.forward(ids),
        }
    }

    /// The mean cross-entropy of predicting each next token of `ids`
    /// `[batch, time + 1]`.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Gpt2(model) => model.loss(ids),
            Self::Llama(model) => model.loss(ids),
        }
    }

    /// The dtype the model computes in.
    pub fn dtype(&self) -> DType {
        match self {
            Self::Gpt2(model) => model.dtype(),
            Self::Llama(model) => model.dtype(),
        }
    }

    /// The device the model's variables live on.
    pub fn device(&self) -> &Device {
        match self {
            Self::Gpt2(model) => model.device(),
            Self::Llama(model) => model.device(),
        }
    }
}
