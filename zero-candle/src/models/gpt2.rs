//! GPT-2 (`GPT2LMHeadModel`): token and position embeddings, pre-norm
//! blocks of causal self-attention and a GELU MLP, a final norm and a head
//! tied to the token embedding.
//!
//! The variables carry the hub's names (`transformer.wte.weight`,
//! `transformer.h.{i}.attn.c_attn.weight`, ..., `transformer.ln_f.bias`).
//! The hub stores the Conv1D weights `[in, out]`; here they are Linear
//! weights `[out, in]`, transposed on load and save by
//! [`Gpt2::hub_layout`]. The head has no variable of its own.

use super::config_json::{check_sizes, optional_size, read_keys, size};
use crate::hub::{HubDir, HubLayout};
use crate::nn::{ops, Activation, Embedding, GradHook, LayerNorm, Linear};
use crate::{Error, Result, ShardedVarMap};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, VarBuilder};
use serde::Deserialize;
use std::sync::Arc;

/// The `config.json` of a GPT-2 checkpoint: what shapes the model.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Gpt2Config {
    /// Tokens in the vocabulary.
    #[serde(deserialize_with = "size")]
    pub vocab_size: usize,
    /// The longest sequence (positions) the model sees.
    #[serde(deserialize_with = "size")]
    pub n_positions: usize,
    /// Width of the residual stream.
    #[serde(deserialize_with = "size")]
    pub n_embd: usize,
    /// Transformer blocks.
    #[serde(deserialize_with = "size")]
    pub n_layer: usize,
    /// Attention heads per block; divides `n_embd`.
    #[serde(deserialize_with = "size")]
    pub n_head: usize,
    /// Width of the MLP (`None`: 4 * `n_embd`).
    #[serde(default, deserialize_with = "optional_size")]
    pub n_inner: Option<usize>,
    /// The layer norms' epsilon.
    #[serde(default = "default_epsilon")]
    pub layer_norm_epsilon: f64,
    /// `gelu_new` (GPT-2's tanh approximation; also `gelu_pytorch_tanh`,
    /// `gelu_fast`) or `gelu` (the exact one).
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// The standard deviation of a fresh model's weights.
    #[serde(default = "default_initializer_range")]
    pub initializer_range: f64,
    /// Dropout probabilities, which training here does not apply.
    #[serde(default)]
    pub resid_pdrop: f64,
    /// See `resid_pdrop`.
    #[serde(default)]
    pub embd_pdrop: f64,
    /// See `resid_pdrop`.
    #[serde(default)]
    pub attn_pdrop: f64,
}

fn default_epsilon() -> f64 {
    1e-5
}

fn default_activation() -> String {
    "gelu_new".into()
}

fn default_initializer_range() -> f64 {
    0.02
}

/// Settings of a GPT-2 config.json this model does not implement, with the
/// value it implements; any other value is an error naming the key.
const FIXED: &[(&str, bool)] = &[
    ("scale_attn_weights", true),
    ("scale_attn_by_inverse_layer_idx", false),
    ("add_cross_attention", false),
    ("tie_word_embeddings", true),
];

impl Gpt2Config {
    /// GPT-2 small's shape (124M parameters) with dropout off.
    pub fn gpt2_small() -> Self {
        Self {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: None,
            layer_norm_epsilon: 1e-5,
            activation_function: default_activation(),
            initializer_range: 0.02,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
        }
    }

    /// Reads a hub `config.json`: an error names the key whose value this
    /// model cannot honour (another architecture, cross-attention, an
    /// untied head, an activation other than GELU, ...).
    pub fn from_json(config: &serde_json::Value) -> std::result::Result<Self, String> {
        if let Some(kind) = config.get("model_type").and_then(|v| v.as_str()) {
            if kind != "gpt2" {
                return Err(format!(
                    "`model_type` is {kind:?}; this model reads GPT-2 checkpoints (\"gpt2\")"
                ));
            }
        }
        super::check_architectures(config, &["GPT2LMHeadModel", "GPT2Model"])?;
        for (key, implemented) in FIXED {
            if let Some(value) = config.get(*key) {
                if !value.is_null() && value.as_bool() != Some(*implemented) {
                    return Err(format!(
                        "`{key}` is {value}; only {implemented} is supported"
                    ));
                }
            }
        }
        let parsed: Self = read_keys(config)?;
        parsed.validate()?;
        Ok(parsed)
    }

    /// The config of the hub directory `hub` ([`Gpt2Config::from_json`]),
    /// an error naming its `config.json` and the key.
    pub fn from_hub(hub: &HubDir) -> Result<Self> {
        super::config_of(hub, Self::from_json)
    }

    /// Checks that the shape is buildable and the activation known.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_inner", self.inner()),
        ];
        check_sizes(&sizes)?;
        if self.n_embd % self.n_head != 0 {
            return Err(format!(
                "`n_embd` {} is not a multiple of `n_head` {}",
                self.n_embd, self.n_head
            ));
        }
        self.activation().map(drop)
    }

    /// The MLP's width.
    pub fn inner(&self) -> usize {
        self.n_inner.unwrap_or(self.n_embd.saturating_mul(4))
    }

    /// Whether the config asks for dropout, which training here leaves out
    /// (say so to the user once).
    pub fn asks_for_dropout(&self) -> bool {
        [self.resid_pdrop, self.embd_pdrop, self.attn_pdrop]
            .iter()
            .any(|&p| p > 0.0)
    }

    /// The parameters of a model of this shape (the head tied).
    pub fn num_params(&self) -> usize {
        let (d, inner) = (self.n_embd, self.inner());
        let per_layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d * inner + inner + d;
        self.n_layer * per_layer + (self.vocab_size + self.n_positions) * d + 2 * d
    }

    fn activation(&self) -> std::result::Result<Activation, String> {
        match self.activation_function.as_str() {
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::Gelu),
            "gelu" => Ok(Activation::GeluErf),
            other => Err(format!(
                "`activation_function` {other:?} is not supported (gelu_new, \
                 gelu_pytorch_tanh, gelu_fast or gelu)"
            )),
        }
    }
}

/// One pre-norm block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`, the
/// first add in `ln_2`'s pass ([`LayerNorm::forward_residual`]).
#[derive(Clone)]
struct Block {
    ln_1: LayerNorm,
    c_attn: Linear,
    attn_proj: Linear,
    ln_2: LayerNorm,
    c_fc: Linear,
    mlp_proj: Linear,
    heads: usize,
    /// The MLP's GELU, applied in `c_fc`'s op.
    gelu: Activation,
}

impl Block {
    /// `x` rows `[batch * time, width]` through the block.
    fn forward(&self, x: &Tensor, time: usize) -> candle_core::Result<Tensor> {
        let qkv = self.c_attn.forward(&self.ln_1.forward(x)?)?;
        let y = ops::causal_self_attention_rows(&qkv, time, self.heads)?;
        let (x, normed) = self
            .ln_2
            .forward_residual(&self.attn_proj.forward(&y)?, x)?;
        // The GELU on the projection's input: the graph keeps the hidden
        // layer once.
        let h = self.c_fc.forward(&normed)?;
        x + self.mlp_proj.forward_on_activated(&h, self.gelu)?
    }
}

/// GPT-2 with its language-model head, built from [`crate::nn`]'s layers.
pub struct Gpt2 {
    config: Gpt2Config,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `wte`'s table again, as the output projection (a second hooked use:
    /// the engine adds both gradients).
    head: Linear,
    /// Each block recomputed in backward (activation checkpointing).
    checkpointed: bool,
}

impl Gpt2 {
    /// Creates the variables through `vb` (`transformer.*` under its
    /// prefix; from a [`ShardedVarMap`]'s builder they are deferred until
    /// `ZeroOptimizer::new_sharded` fills them, a rank's shard only at
    /// stage 3), with layers that hand their gradients to `hook`. A fresh
    /// model is initialized as `transformers` does: weights normal with
    /// standard deviation `initializer_range`, the residual projections'
    /// scaled by 1/sqrt(2 * `n_layer`), biases zero, norms one.
    pub fn new(
        vb: VarBuilder,
        config: &Gpt2Config,
        hook: Option<Arc<dyn GradHook>>,
    ) -> Result<Self> {
        let gelu = config
            .validate()
            .and_then(|()| config.activation())
            .map_err(|detail| Error::Variable {
                name: "<gpt2 config>".into(),
                detail,
            })?;
        let (d, inner) = (config.n_embd, config.inner());
        let std = config.initializer_range;
        let residual_std = std / (2.0 * config.n_layer as f64).sqrt();
        let vb = vb.pp("transformer");
        let normal = |stdev| Init::Randn { mean: 0.0, stdev };
        let wte = vb.get_with_hints((config.vocab_size, d), "wte.weight", normal(std))?;
        let wpe = vb.get_with_hints((config.n_positions, d), "wpe.weight", normal(std))?;
        let linear = |vb: VarBuilder, d_in, d_out, std| -> Result<Linear> {
            let w = vb.get_with_hints((d_out, d_in), "weight", normal(std))?;
            let b = vb.get_with_hints(d_out, "bias", Init::Const(0.0))?;
            Ok(Linear::new(w, Some(b), hook.clone()))
        };
        let norm = |vb: VarBuilder| -> Result<LayerNorm> {
            let w = vb.get_with_hints(d, "weight", Init::Const(1.0))?;
            let b = vb.get_with_hints(d, "bias", Init::Const(0.0))?;
            Ok(LayerNorm::new(
                w,
                b,
                config.layer_norm_epsilon,
                hook.clone(),
            ))
        };
        let mut blocks = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let vb = vb.pp(format!("h.{i}"));
            blocks.push(Block {
                ln_1: norm(vb.pp("ln_1"))?,
                c_attn: linear(vb.pp("attn.c_attn"), d, 3 * d, std)?,
                attn_proj: linear(vb.pp("attn.c_proj"), d, d, residual_std)?,
                ln_2: norm(vb.pp("ln_2"))?,
                c_fc: linear(vb.pp("mlp.c_fc"), d, inner, std)?,
                mlp_proj: linear(vb.pp("mlp.c_proj"), inner, d, residual_std)?,
                heads: config.n_head,
                gelu,
            });
        }
        Ok(Self {
            config: config.clone(),
            wte: Embedding::new(wte.clone(), d, hook.clone()),
            wpe: Embedding::new(wpe, d, hook.clone()),
            blocks,
            ln_f: norm(vb.pp("ln_f"))?,
            head: Linear::new(wte, None, hook),
            checkpointed: false,
        })
    }

    /// Opens a hub directory of a GPT-2 checkpoint: its config, and a
    /// [`ShardedVarMap`] whose variables come from its weights (build the
    /// model with [`Gpt2::new`] through the map's builder). Errors name the
    /// config key or the file that is unusable.
    pub fn open_hub(dir: impl AsRef<std::path::Path>) -> Result<(Gpt2Config, ShardedVarMap)> {
        super::open_hub_as(dir, Gpt2Config::from_hub, Self::hub_layout)
    }

    /// Where the variables sit in a hub checkpoint: under `transformer.`
    /// (or without it, as the first GPT-2 checkpoints have them), the
    /// Conv1D weights transposed, `lm_head.weight` (where a file keeps
    /// it) the token embedding again.
    pub fn hub_layout(config: &Gpt2Config) -> HubLayout {
        let mut layout = HubLayout::new()
            .with_optional_prefix("transformer.")
            .with_tied("lm_head.weight", "transformer.wte.weight");
        for i in 0..config.n_layer {
            for conv in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
                layout = layout.with_transposed(format!("transformer.h.{i}.{conv}.weight"));
            }
        }
        layout
    }

    /// The model's config.
    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }

    /// With `on`, each block keeps only its input for backward and runs
    /// again there ([`crate::checkpoint`]): the same gradients, one block's
    /// activations at a time.
    pub fn with_checkpointing(mut self, on: bool) -> Self {
        self.checkpointed = on;
        self
    }

    /// Logits `[batch, time, vocab_size]` for token ids `[batch, time]`
    /// (u32, `time <= n_positions`); position `t` predicts token `t + 1`.
    /// A 16-bit model computes in its dtype, with the norms' statistics
    /// and the attention's softmax in f32.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let dims = (self.config.vocab_size, self.dtype());
        super::logits_of(ids, dims, |ids| self.logits_rows(ids))
    }

    /// [`Gpt2::forward`]'s logits as rows `[batch * time, vocab_size]`.
    fn logits_rows(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (_, time) = super::ids_dims(ids)?;
        if time > self.config.n_positions {
            candle_core::bail!(
                "a sequence of {time} tokens is longer than the model's n_positions {}",
                self.config.n_positions
            );
        }
        let positions = Tensor::arange(0u32, time as u32, ids.device())?;
        let x = self
            .wte
            .forward(ids)?
            .broadcast_add(&self.wpe.forward(&positions)?)?
            .flatten_to(1)?;
        let x = super::through_blocks(
            &self.blocks,
            x,
            (self.checkpointed, "transformer.h"),
            move |block: &Block, x: &Tensor| block.forward(x, time),
            Ok,
        )?;
        super::logits(&self.ln_f, &self.head, &x)
    }

    /// The mean cross-entropy (f32) of predicting each next token of `ids`
    /// `[batch, time + 1]`, as `transformers` computes it with
    /// `labels = ids`.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        super::next_token_loss(ids, |inputs| self.logits_rows(inputs))
    }

    /// The dtype the model computes in.
    pub fn dtype(&self) -> DType {
        self.head.weight().dtype()
    }

    /// The device the model's variables live on.
    pub fn device(&self) -> &Device {
        self.head.weight().device()
    }
}
