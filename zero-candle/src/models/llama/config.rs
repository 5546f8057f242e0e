//! [`LlamaConfig`]: a Llama-family `config.json` read as `transformers`
//! reads it, each family's differences from Llama in one table.

use super::moe::{
    expert_size_of, moe_of, MoeConfig, MoeFamily, MoeStyle, DOTS1_MOE, ERNIE4_5_MOE, GLM4_MOE,
    MINIMAX_M2_MOE, OLMOE_MOE, QWEN2_MOE, SOLAR_OPEN_MOE,
};
use crate::hub::HubDir;
use crate::models::rope::{Rope, RopeDialect};
use crate::nn::Activation;
use serde::Deserialize;

/// The `config.json` of a Llama checkpoint: what shapes the model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads per block.
    pub num_attention_heads: usize,
    /// Key/value heads per block; divides `num_attention_heads` (each
    /// serves a group of query heads).
    pub num_key_value_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// The values of each head that rotate, its first ones (`head_dim`, or
    /// Phi-3's `head_dim · partial_rotary_factor`); the rest pass through.
    pub rotary_dim: usize,
    /// The longest sequence the model is meant for.
    pub max_position_embeddings: usize,
    /// The norms' epsilon (`rms_norm_eps`; Cohere's `layer_norm_eps`,
    /// Starcoder2's `norm_epsilon`).
    pub rms_norm_eps: f64,
    /// The norms subtract the mean before they scale (Cohere's LayerNorm
    /// without a bias); else RMS norms.
    pub layer_norms: bool,
    /// The LayerNorms add a bias after they scale (`weight` and `bias`:
    /// Starcoder2's `nn.LayerNorm`); only with
    /// [`LlamaConfig::layer_norms`].
    pub norm_bias: bool,
    /// The norms scale by a weight of their own; without, OLMo's LayerNorms
    /// have no parameters (only with [`LlamaConfig::layer_norms`]).
    pub norm_weights: bool,
    /// The query, key and value projections' outputs clamped to `[-clip,
    /// clip]` (OLMo's and OLMoE's `clip_qkv`), no gradient past the bounds.
    pub clip_qkv: Option<f64>,
    /// Each block's attention and MLP read the same normed input and both
    /// add to the residual (Cohere's `x + attn(norm(x)) + mlp(norm(x))`).
    pub parallel_blocks: bool,
    /// In parallel blocks the MLP reads a norm of its own of the block's
    /// input (GPT-NeoX's `x + attn(norm1(x)) + mlp(norm2(x))`).
    pub parallel_mlp_norm: bool,
    /// Rotary embeddings.
    pub rope: Rope,
    /// The head is the token embedding (no `lm_head.weight` of its own).
    pub tie_word_embeddings: bool,
    /// The query, key and value projections have biases (Qwen2, and Llama
    /// with `attention_bias`).
    pub qkv_bias: bool,
    /// The output projection has a bias (Llama with `attention_bias`).
    pub o_bias: bool,
    /// The dense MLPs' projections have biases (Llama's `mlp_bias`,
    /// ERNIE's `use_bias`; a mixture's shared experts too, never its
    /// routed ones).
    pub mlp_bias: bool,
    /// The query, key and value projections are one weight
    /// (`self_attn.qkv_proj`: queries, then keys, then values), as Phi-3
    /// stores them.
    pub fused_qkv: bool,
    /// The fused projection's rows are head by head in the checkpoint (a
    /// head's query, key and value rows together: GPT-NeoX's
    /// `query_key_value`), reordered on load into queries, keys, values and
    /// put back on save.
    pub qkv_per_head: bool,
    /// The gate and up projections are one weight (`mlp.gate_up_proj`:
    /// gate, then up), as Phi-3 and GLM-4 store them.
    pub fused_gate_up: bool,
    /// The checkpoint's queries and keys rotate interleaved pairs
    /// (GLM's `(x0, x1), (x2, x3), …`). The model rotates halves
    /// (`rotate_half`'s `(x0, x(r/2)), …`) whatever the checkpoint: for
    /// these its query and key rows are reordered on load and put back on
    /// save ([`Llama::hub_layout`](super::Llama::hub_layout)), which
    /// changes no score.
    pub rope_interleaved: bool,
    /// The queries and keys are RMS-normalized before the rotation
    /// (`self_attn.q_norm` and `self_attn.k_norm`): each head (Qwen3's,
    /// Gemma 3's) or each projection whole (OLMo 2's).
    pub qk_norm: Option<QkNorm>,
    /// Each block normalizes its input and the MLP's (Llama's
    /// `input_layernorm` and `post_attention_layernorm`); without, OLMo 2's
    /// blocks normalize only the outputs ([`LlamaConfig::output_norms`]).
    pub input_norms: bool,
    /// Sliding-window attention, where the config asks for it (Mistral's
    /// `sliding_window`; Qwen2's and Qwen3's where `use_sliding_window`
    /// is on, in the layers `layer_types` or `max_window_layers` say).
    pub sliding_window: Option<SlidingWindow>,
    /// The standard deviation of a fresh model's weights.
    pub initializer_range: f64,
    /// The padding token (`pad_token_id`): its embedding row gets no
    /// gradient from the lookup, as `torch.nn.Embedding`'s `padding_idx`
    /// (a tied head still trains it).
    pub pad_token_id: Option<u32>,
    /// The final norm also normalizes the token embeddings before the first
    /// block (NanoChat's, whose norms have no parameters).
    pub embedding_norm: bool,
    /// The queries and keys turn by the negative angles (NanoChat's
    /// `rotate_half` swaps its halves the other way: `[x2, -x1]`).
    pub rope_negated: bool,
    /// The query and key norms read the heads after the rotation
    /// (Hunyuan's); else before it.
    pub qk_norm_after_rotation: bool,
    /// The MLP's gate: `act(gate_proj(x)) * up_proj(x)` with SiLU (Llama's
    /// SwiGLU) or GELU's tanh form (Gemma's `gelu_pytorch_tanh`); without
    /// a gate ([`LlamaConfig::ungated_mlp`]), the activation between its
    /// two projections.
    pub mlp_activation: Activation,
    /// The dense MLPs have no gate: `down(act(up(x)))`, under these names
    /// (Starcoder2's `c_fc` and `c_proj`, Phi's `fc1` and `fc2`); `None`:
    /// Llama's gated MLP.
    pub ungated_mlp: Option<UngatedMlp>,
    /// The names of the output projection, the query and key norms and the
    /// final norm (Phi's differ from Llama's).
    pub layer_names: LayerNames,
    /// The untied head has a bias (`lm_head.bias`: Phi's).
    pub head_bias: bool,
    /// Added to every RMS norm's weight before it scales: 1 for Gemma,
    /// whose norms compute `x̂ (1 + weight)` with the weight stored centred
    /// on zero; 0 for Llama.
    pub norm_weight_offset: f64,
    /// The token embeddings are multiplied by this (Gemma's
    /// `√hidden_size`, Granite's `embedding_multiplier`), rounded to the
    /// model's dtype.
    pub embedding_scale: Option<f64>,
    /// Gemma 2's and 3's norms of the attention's output and of the MLP's
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`), each
    /// before its residual add; the MLP's input norm is then
    /// `pre_feedforward_layernorm` (GLM-4's: [`NormNames::Glm4`]).
    pub output_norms: bool,
    /// The names of the norms where the blocks normalize outputs.
    pub norm_names: NormNames,
    /// The attention scores' scale where it is not `head_dim^-1/2`:
    /// Gemma 2's and 3's `query_pre_attn_scalar^-1/2`, Granite's
    /// `attention_multiplier`.
    pub attention_scale: Option<f64>,
    /// Each residual branch (the attention's output, the MLP's) multiplied
    /// by this before its add (Granite's `residual_multiplier`).
    pub residual_multiplier: Option<f64>,
    /// The logits divided by this (Granite's `logits_scaling`).
    pub logits_scaling: Option<f64>,
    /// The logits multiplied by this (Cohere's `logit_scale`).
    pub logit_scale: Option<f64>,
    /// Per layer, whether it applies rotary embeddings (SmolLM3's
    /// `no_rope_layers`: 1 rotates, 0 does not); `None`: every layer.
    pub rotated_layers: Option<Vec<bool>>,
    /// The checkpoint holds this model as the text model of Gemma 3 with
    /// vision (`model_type` `gemma3`, the config in `text_config`): its
    /// tensors under `language_model.`, the vision tower's beside them,
    /// kept as they are and saved back unchanged.
    pub text_of_multimodal: bool,
    /// The largest dropout probability the config asks for
    /// (`attention_dropout`, Phi-3's `resid_pdrop` and `embd_pdrop`), or
    /// Mixtral's `router_jitter_noise`, which training here leaves out.
    pub dropout: f64,
    /// The attention scores capped as `cap · tanh(scores / cap)` before the
    /// mask (Gemma 2's `attn_logit_softcapping`; computed in composed ops,
    /// [`crate::nn::ops::softcapped_attention`]).
    pub attn_logit_softcapping: Option<f64>,
    /// The logits capped as `cap · tanh(logits / cap)` (Gemma 2's and 3's
    /// `final_logit_softcapping`).
    pub final_logit_softcapping: Option<f64>,
    /// The rotation of the sliding-window layers where it differs from
    /// [`LlamaConfig::rope`] (Gemma 3's and OLMo 3's `sliding_attention`
    /// parameters, or Gemma 3's `rope_local_base_freq`).
    pub local_rope: Option<Rope>,
    /// A sparse mixture of experts in place of the MLP (Mixtral,
    /// Qwen2-MoE, Qwen3-MoE, OLMoE), in the layers it names.
    pub moe: Option<MoeConfig>,
}

/// The names of a block's norms where it normalizes the attention's and
/// the MLP's outputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NormNames {
    /// Gemma 2's (and OLMo 2's): `post_attention_layernorm` after the
    /// attention, `pre_feedforward_layernorm` before the MLP,
    /// `post_feedforward_layernorm` after it.
    #[default]
    Gemma,
    /// GLM-4's: `post_self_attn_layernorm` after the attention,
    /// `post_attention_layernorm` before the MLP (Llama's name),
    /// `post_mlp_layernorm` after it.
    Glm4,
}

impl NormNames {
    /// The norm of the attention's output.
    pub(super) fn attention_output(self) -> &'static str {
        match self {
            Self::Gemma => "post_attention_layernorm",
            Self::Glm4 => "post_self_attn_layernorm",
        }
    }

    /// The norm of the MLP's input, in blocks that also normalize outputs.
    pub(super) fn mlp_input(self) -> &'static str {
        match self {
            Self::Gemma => "pre_feedforward_layernorm",
            Self::Glm4 => "post_attention_layernorm",
        }
    }

    /// The norm of the MLP's output.
    pub(super) fn mlp_output(self) -> &'static str {
        match self {
            Self::Gemma => "post_feedforward_layernorm",
            Self::Glm4 => "post_mlp_layernorm",
        }
    }
}

/// The names of an MLP without a gate, `down(act(up(x)))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UngatedMlp {
    /// Starcoder2's: `mlp.c_fc` (up), `mlp.c_proj` (down).
    CFc,
    /// Phi's: `mlp.fc1` (up), `mlp.fc2` (down).
    Fc,
    /// Nemotron's and Arcee's: `mlp.up_proj`, `mlp.down_proj`.
    UpDown,
    /// GPT-NeoX's: `mlp.dense_h_to_4h`, `mlp.dense_4h_to_h`.
    NeoX,
}

impl UngatedMlp {
    /// The up and the down projection's names under `mlp`.
    pub(super) fn names(self) -> [&'static str; 2] {
        match self {
            Self::CFc => ["c_fc", "c_proj"],
            Self::Fc => ["fc1", "fc2"],
            Self::UpDown => ["up_proj", "down_proj"],
            Self::NeoX => ["dense_h_to_4h", "dense_4h_to_h"],
        }
    }
}

/// The names of the layers a family names its own way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LayerNames {
    /// Llama's: `self_attn.o_proj`, `self_attn.q_norm` and `k_norm`,
    /// `model.norm`.
    #[default]
    Llama,
    /// Phi's: `self_attn.dense`, `self_attn.q_layernorm` and
    /// `k_layernorm`, `model.final_layernorm`.
    Phi,
    /// GPT-NeoX's: `gpt_neox.embed_in`, `gpt_neox.layers.{i}.attention`
    /// with `query_key_value` and `dense`, `gpt_neox.final_layer_norm`,
    /// `embed_out`.
    NeoX,
    /// StableLM's: Llama's, but for the norms of each query and key head,
    /// `self_attn.q_layernorm.norms.{h}` and `k_layernorm.norms.{h}`, a
    /// tensor per head.
    StableLm,
    /// Hunyuan's: Llama's, but for the query and key norms,
    /// `self_attn.query_layernorm` and `key_layernorm`.
    Hunyuan,
}

impl LayerNames {
    /// What the model's tensors but the head's sit under.
    pub(super) fn model(self) -> &'static str {
        match self {
            Self::Llama | Self::Phi | Self::StableLm | Self::Hunyuan => "model",
            Self::NeoX => "gpt_neox",
        }
    }

    /// The token embedding, under [`LayerNames::model`].
    pub(super) fn embedding(self) -> &'static str {
        match self {
            Self::Llama | Self::Phi | Self::StableLm | Self::Hunyuan => "embed_tokens",
            Self::NeoX => "embed_in",
        }
    }

    /// A block's attention, under its layer.
    pub(super) fn attention(self) -> &'static str {
        match self {
            Self::Llama | Self::Phi | Self::StableLm | Self::Hunyuan => "self_attn",
            Self::NeoX => "attention",
        }
    }

    /// The query, key and value projections in one, under the attention.
    pub(super) fn fused_qkv(self) -> &'static str {
        match self {
            Self::Llama | Self::Phi | Self::StableLm | Self::Hunyuan => "qkv_proj",
            Self::NeoX => "query_key_value",
        }
    }

    /// The attention's output projection, under the attention.
    pub(super) fn output_projection(self) -> &'static str {
        match self {
            Self::Llama | Self::StableLm | Self::Hunyuan => "o_proj",
            Self::Phi | Self::NeoX => "dense",
        }
    }

    /// The query and the key norm, under the attention.
    pub(super) fn qk_norms(self) -> [&'static str; 2] {
        match self {
            Self::Llama | Self::NeoX => ["q_norm", "k_norm"],
            Self::Phi | Self::StableLm => ["q_layernorm", "k_layernorm"],
            Self::Hunyuan => ["query_layernorm", "key_layernorm"],
        }
    }

    /// The norms of each query and key head hold a tensor per head
    /// (`norms.{h}.weight`) rather than one `[heads, head_dim]` weight.
    pub(super) fn head_norm_per_head(self) -> bool {
        self == Self::StableLm
    }

    /// The norm after the last block, under [`LayerNames::model`].
    pub(super) fn final_norm(self) -> &'static str {
        match self {
            Self::Llama | Self::StableLm | Self::Hunyuan => "norm",
            Self::Phi => "final_layernorm",
            Self::NeoX => "final_layer_norm",
        }
    }

    /// The untied head.
    pub(super) fn head(self) -> &'static str {
        match self {
            Self::Llama | Self::Phi | Self::StableLm | Self::Hunyuan => "lm_head",
            Self::NeoX => "embed_out",
        }
    }
}

/// Where the queries and keys are normalized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// Each head over its `head_dim`, one weight shared by the heads
    /// (Qwen3, Gemma 3).
    PerHead,
    /// Each projection over all its heads (OLMo 2).
    Projection,
    /// Each head over its `head_dim`, with weights of its own (`[heads,
    /// head_dim]`: Command R+'s `use_qk_norm`, its norms of the model's
    /// kind).
    HeadWeights,
}

/// Sliding-window attention: each position of the layers that use it
/// attends to at most `size` positions, its own included (`transformers`'
/// mask: key `j` is seen by query `i` when `i - size < j <= i`).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions each query sees, its own included (at least 1).
    pub size: usize,
    /// Per layer, whether it attends within the window (the others attend
    /// to every position up to their own).
    pub layers: Vec<bool>,
}

/// The keys of `config.json` read as they are.
#[derive(Deserialize)]
struct Plain {
    vocab_size: usize,
    hidden_size: usize,
    /// Absent from Solar Open's files, whose every layer is a mixture.
    #[serde(default)]
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "default_positions")]
    max_position_embeddings: usize,
    #[serde(default)]
    rms_norm_eps: Option<f64>,
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    #[serde(default = "default_initializer_range")]
    initializer_range: f64,
    #[serde(default)]
    attention_bias: Option<bool>,
    #[serde(default)]
    pad_token_id: Option<u32>,
    /// Qwen's switch for `sliding_window` (off when absent).
    #[serde(default)]
    use_sliding_window: bool,
    /// Qwen's first windowed layer, where `layer_types` does not say.
    #[serde(default)]
    max_window_layers: Option<usize>,
    /// Qwen's and Gemma 3's attention per layer (transformers 5).
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    /// Gemma 3's windowed layers where `layer_types` does not say: all but
    /// every this-many-th (transformers 5 writes it with a leading `_`).
    #[serde(default, alias = "_sliding_window_pattern")]
    sliding_window_pattern: Option<WindowPattern>,
    #[serde(default)]
    query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    use_bidirectional_attention: Option<bool>,
    /// SmolLM3's layers with (1) and without (0) rotary embeddings.
    #[serde(default)]
    no_rope_layers: Option<Vec<u8>>,
    /// SmolLM3's NoPE layers where `no_rope_layers` does not say: every
    /// this-many-th.
    #[serde(default = "default_no_rope_interval")]
    no_rope_layer_interval: usize,
    #[serde(default)]
    embedding_multiplier: Option<f64>,
    #[serde(default)]
    attention_multiplier: Option<f64>,
    #[serde(default)]
    residual_multiplier: Option<f64>,
    #[serde(default)]
    logits_scaling: Option<f64>,
    #[serde(default)]
    attention_dropout: Option<f64>,
    #[serde(default)]
    resid_pdrop: Option<f64>,
    #[serde(default)]
    embd_pdrop: Option<f64>,
    #[serde(default)]
    residual_dropout: Option<f64>,
    #[serde(default)]
    embedding_dropout: Option<f64>,
    /// Seed-OSS's switch for the output projection's bias.
    #[serde(default)]
    attention_out_bias: Option<bool>,
    /// Qwen2-MoE's switch for the query, key and value biases.
    #[serde(default)]
    qkv_bias: Option<bool>,
    /// GLM-4.5's switch for the query and key norms.
    #[serde(default)]
    use_qk_norm: bool,
    /// Phi's switch for the query and key norms.
    #[serde(default)]
    qk_layernorm: bool,
    /// StableLM's switch for the query, key and value biases.
    #[serde(default)]
    use_qkv_bias: Option<bool>,
    /// GPT-NeoX's and StableLM's switch for their parallel blocks.
    #[serde(default)]
    use_parallel_residual: Option<bool>,
    #[serde(default)]
    hidden_dropout: Option<f64>,
    #[serde(default, alias = "norm_epsilon", alias = "norm_eps")]
    layer_norm_eps: Option<f64>,
    #[serde(default)]
    mlp_bias: Option<bool>,
    #[serde(default)]
    use_bias: Option<bool>,
    #[serde(default)]
    logit_scale: Option<f64>,
    #[serde(default)]
    router_jitter_noise: Option<f64>,
    #[serde(default)]
    clip_qkv: Option<f64>,
}

/// GPT-NeoX's config with its transformers 4 rotary keys as later files
/// write them: `rotary_pct` as `partial_rotary_factor`, `rotary_emb_base`
/// as `rope_theta` (where those are absent).
fn neox_rotary_keys(config: &serde_json::Value) -> serde_json::Value {
    let mut config = config.clone();
    if let Some(object) = config.as_object_mut() {
        for (old, new) in [
            ("rotary_pct", "partial_rotary_factor"),
            ("rotary_emb_base", "rope_theta"),
        ] {
            if let Some(value) = object.remove(old) {
                object.entry(new).or_insert(value);
            }
        }
    }
    config
}

/// Hunyuan's config with its "dynamic" rotation with an `alpha` (NTK-aware
/// scaling, static: `transformers`' `ntk_alpha`) as the default rotation
/// of base `rope_theta · alpha^(d / (d - 2))`, `d` the head's width.
fn ntk_alpha_as_theta(
    config: &serde_json::Value,
) -> std::result::Result<serde_json::Value, String> {
    let mut config = config.clone();
    let Some(key) = ["rope_parameters", "rope_scaling"].into_iter().find(|key| {
        config
            .get(key)
            .and_then(|p| p.get("alpha"))
            .is_some_and(|a| !a.is_null())
    }) else {
        return Ok(config);
    };
    let params = &config[key];
    let kind = params.get("rope_type").or_else(|| params.get("type"));
    if kind.and_then(|k| k.as_str()) != Some("dynamic") {
        return Ok(config);
    }
    let alpha = params["alpha"]
        .as_f64()
        .filter(|a| *a > 0.0)
        .ok_or_else(|| {
            format!(
                "`{key}.alpha` is {}; a positive number is expected",
                params["alpha"]
            )
        })?;
    let theta = params
        .get("rope_theta")
        .or_else(|| config.get("rope_theta"))
        .and_then(|t| t.as_f64())
        .unwrap_or(10_000.0);
    let heads = config
        .get("num_attention_heads")
        .and_then(|h| h.as_u64())
        .unwrap_or(0);
    let hidden = config
        .get("hidden_size")
        .and_then(|h| h.as_u64())
        .unwrap_or(0);
    let width = match config.get("head_dim").and_then(|d| d.as_u64()) {
        Some(width) => width,
        None if heads > 0 => hidden / heads,
        None => 0,
    } as f64;
    if width <= 2.0 {
        return Err(format!(
            "heads of {width} values with an NTK `alpha`; the rotation needs heads wider than 2"
        ));
    }
    let base = theta * alpha.powf(width / (width - 2.0));
    let object = config
        .as_object_mut()
        .expect("a config with a rotation is an object");
    object.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_type": "default", "rope_theta": base}),
    );
    for old in ["rope_scaling", "rope_theta"] {
        object.remove(old);
    }
    Ok(config)
}

/// `config` with `rope` (a `rope_parameters` object) where it gives no
/// rotation (none of `rope_parameters`, `rope_scaling`, `rope_theta`).
fn with_default_rope(config: &serde_json::Value, rope: &str) -> serde_json::Value {
    let mut config = config.clone();
    let given = ["rope_parameters", "rope_scaling", "rope_theta"]
        .iter()
        .any(|key| config.get(key).is_some_and(|v| !v.is_null()));
    if let (false, Some(object)) = (given, config.as_object_mut()) {
        let rope: serde_json::Value =
            serde_json::from_str(rope).expect("a family's default rotation is JSON");
        object.insert("rope_parameters".into(), rope);
    }
    config
}

/// Gemma's and EXAONE 4's `sliding_window_pattern`: every this-many-th
/// layer full, or (EXAONE 4) letters repeating over the layers, `L` a
/// sliding one and `G` a full one (`"LLLG"`).
#[derive(Deserialize)]
#[serde(untagged)]
enum WindowPattern {
    Every(usize),
    Letters(String),
}

impl WindowPattern {
    /// Per layer of `n`, whether it is windowed.
    fn layers(&self, n: usize) -> std::result::Result<Vec<bool>, String> {
        match self {
            Self::Every(0) => Err("`sliding_window_pattern` is 0; set it to at least 1".into()),
            &Self::Every(every) => Ok((0..n).map(|i| (i + 1) % every != 0).collect()),
            Self::Letters(letters)
                if letters.is_empty() || letters.chars().any(|c| !matches!(c, 'L' | 'G')) =>
            {
                Err(format!(
                    "`sliding_window_pattern` is {letters:?}; give a number, or letters L \
                     (sliding) and G (full), one per layer, repeating"
                ))
            }
            Self::Letters(letters) => {
                let letters: Vec<char> = letters.chars().collect();
                Ok((0..n).map(|i| letters[i % letters.len()] == 'L').collect())
            }
        }
    }
}

/// `transformers`' `no_rope_layer_interval` (SmolLM3).
fn default_no_rope_interval() -> usize {
    4
}

fn default_positions() -> usize {
    2048
}

fn default_initializer_range() -> f64 {
    0.02
}

/// `transformers`' `max_window_layers` (Qwen2, Qwen3).
const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// `transformers`' `sliding_window` where a Mistral or Qwen file leaves it
/// out.
const DEFAULT_WINDOW: usize = 4096;

/// How a family reads `sliding_window`.
#[derive(Clone, Copy, PartialEq)]
enum Windows {
    /// In the layers `layer_types` names, or all but every
    /// `sliding_window_pattern`-th (`pattern` when absent) (Gemma 2, 3).
    Typed { pattern: usize },
    /// Where `use_sliding_window` is on, in the layers `layer_types` names
    /// (or those without rotary embeddings) (SmolLM3).
    NoRope,
    /// It does not (Llama).
    Never,
    /// In every layer (Mistral, Phi-3), `missing` where the file leaves
    /// `sliding_window` out (transformers' default).
    EveryLayer { missing: Option<usize> },
    /// Where `use_sliding_window` is on, in the layers `layer_types` names
    /// (or from `max_window_layers` on) (Qwen2, Qwen3).
    Switched,
    /// In the layers `layer_types` names, or from `max_window_layers`
    /// (`layers` when absent) on, without a switch (dots.llm1).
    FromLayer { layers: usize },
    /// In the layers `layer_types` names, else in every layer (Ministral,
    /// `every` 1) or in all but every `every`-th from the first (CWM's
    /// 4); `missing` where the file leaves `sliding_window` out.
    Listed { every: usize, missing: usize },
    /// Windows this model does not place as `transformers` does: an error
    /// where `use_sliding_window` is on (Qwen2-MoE, Qwen3-MoE, whose
    /// published checkpoints all have it off).
    Unsupported,
}

/// What a Gemma generation changes from Llama.
#[derive(Clone, Copy, PartialEq)]
enum Gemma {
    /// Norms scaling by `1 + weight`, embeddings times `√hidden_size`, a
    /// GELU-gated MLP (`hidden_act`), heads of 256 and a tied head unless
    /// the file says otherwise.
    One,
    /// Gemma's, with `hidden_activation`, norms of the attention's and the
    /// MLP's outputs, `query_pre_attn_scalar`, `attn_logit_softcapping`
    /// and `final_logit_softcapping`.
    Two,
    /// Gemma 2's without `attn_logit_softcapping` (which transformers
    /// does not apply), with norms of each query and key head and the
    /// rotary parameters per layer type.
    Three,
}

/// A family read as Llama: what sets it apart.
struct Family {
    model_type: &'static str,
    architectures: [&'static str; 2],
    /// The query, key and value projections always have biases.
    qkv_bias: bool,
    /// `attention_bias` where the file does not say (GLM's is on).
    attention_bias: bool,
    /// `mlp_bias` gives the MLPs biases (Llama, SmolLM3, Granite).
    reads_mlp_bias: bool,
    /// `use_bias` gives every projection a bias (ERNIE 4.5, Starcoder2).
    reads_use_bias: bool,
    /// `use_bias` where the file does not say (Starcoder2's is on).
    default_use_bias: bool,
    /// `mlp_bias` where the file does not say (Jais 2's is on).
    default_mlp_bias: bool,
    /// `rms_norm_eps` where the file does not say (Helium's 1e-8).
    default_rms_eps: f64,
    /// Every projection and the head have biases, whatever the file says;
    /// Phi's names; parallel blocks; `qk_layernorm` read (Phi).
    phi: bool,
    /// GPT-NeoX's names, its rows of `query_key_value` head by head, its
    /// parallel blocks (`use_parallel_residual`) with a norm for each
    /// branch, its MLP biased whatever the file says.
    neox: bool,
    /// StableLM's switches: `use_qkv_bias`, `qk_layernorm` (a LayerNorm of
    /// each head, a tensor per head), `use_parallel_residual` (one norm).
    stablelm: bool,
    /// `attention_bias` gives the output projection a bias too (all but
    /// GLM-4.5, whose `attention_bias` is the query's, key's and value's).
    o_bias: bool,
    /// `use_qk_norm` switches on an RMS norm of each query and key head
    /// (GLM-4.5).
    switched_qk_norm: bool,
    /// The queries and keys are RMS-normalized.
    qk_norm: Option<QkNorm>,
    /// The blocks normalize their inputs (all but OLMo 2).
    input_norms: bool,
    /// Phi-3's `qkv_proj`.
    fused_qkv: bool,
    /// Phi-3's and GLM's `gate_up_proj`.
    fused_gate_up: bool,
    /// The blocks normalize the attention's and the MLP's outputs, under
    /// these names (GLM-4; Gemma 2's and OLMo 2's come with them).
    output_norms: Option<NormNames>,
    /// `head_dim` where the file does not say (GLM's 128); else
    /// `hidden_size / num_attention_heads`.
    default_head_dim: Option<usize>,
    /// How the rotary settings are read beyond Llama's: Phi-3's "su" and
    /// "yarn" meaning longrope, part of each head rotating (Phi-3, GLM-4.5,
    /// MiniMax-M2).
    rope: RopeDialect,
    windows: Windows,
    /// Gemma's differences, where it is one.
    gemma: Option<Gemma>,
    /// `no_rope_layers` is read (SmolLM3).
    nope_layers: bool,
    /// Cohere's: LayerNorms without bias, parallel blocks, `logit_scale`.
    cohere: bool,
    /// LayerNorms with a bias, their epsilon `norm_epsilon` (Starcoder2),
    /// `layer_norm_eps` (Phi) or `norm_eps` (Nemotron).
    biased_layer_norms: bool,
    /// The norms scale by `1 + weight` (Nemotron's LayerNorm1P; Gemma's
    /// RMS norms come with [`Gemma`]).
    norm_plus_one: bool,
    /// LayerNorms without parameters, their epsilon 1e-5 whatever the file
    /// says (OLMo's).
    parameter_free_norms: bool,
    /// `clip_qkv` is read (OLMo, OLMoE).
    reads_clip_qkv: bool,
    /// The MLP has no gate (Starcoder2), its activation this where the
    /// file names none (`transformers`' default `hidden_act`).
    ungated_mlp: Option<(UngatedMlp, Activation)>,
    /// The final norm also normalizes the embeddings before the first block
    /// (NanoChat's).
    embedding_norm: bool,
    /// The rotation turns by the negative angles (NanoChat's).
    rope_negated: bool,
    /// Hunyuan's names and norms of the rotated query and key heads, and
    /// its rotation's `alpha` (NTK: the base times `alpha^(d / (d - 2))`).
    hunyuan: bool,
    /// The rotation (a `rope_parameters` object) where the file gives none
    /// (CWM's).
    default_rope: Option<&'static str>,
    /// `final_logit_softcapping` is read, this where the file leaves it out
    /// (NanoChat's 15).
    final_softcap: Option<Option<f64>>,
    /// Only the sliding-window layers rotate (Cohere 2).
    rotary_in_windows_only: bool,
    /// With no window in any layer, every layer rotates (EXAONE 4; Cohere 2's
    /// none).
    rotary_without_windows: bool,
    /// `attention_out_bias` gives the output projection its bias, apart
    /// from `attention_bias`'s query, key and value ones (Seed-OSS).
    reads_attention_out_bias: bool,
    /// Granite's multipliers are read.
    multipliers: bool,
    /// The head is tied where the file does not say.
    tied_by_default: bool,
    /// `rope_theta` where the file does not say.
    default_theta: f64,
    /// The rotary parameters are given per layer type (Gemma 3, OLMo 3).
    typed_rope: Option<TypedRope>,
    /// The MLP is a mixture of experts.
    moe: Option<MoeFamily>,
}

/// Llama itself (but for `mlp_bias`, which its family list reads): what the
/// other families differ from.
const LLAMA: Family = Family {
    model_type: "llama",
    architectures: ["LlamaForCausalLM", "LlamaModel"],
    qkv_bias: false,
    attention_bias: false,
    reads_mlp_bias: false,
    reads_use_bias: false,
    default_use_bias: false,
    default_mlp_bias: false,
    default_rms_eps: 1e-6,
    phi: false,
    neox: false,
    stablelm: false,
    o_bias: true,
    switched_qk_norm: false,
    qk_norm: None,
    input_norms: true,
    fused_qkv: false,
    fused_gate_up: false,
    output_norms: None,
    default_head_dim: None,
    rope: RopeDialect {
        longrope_names: false,
        partial: None,
        interleaved: false,
    },
    windows: Windows::Never,
    gemma: None,
    nope_layers: false,
    cohere: false,
    biased_layer_norms: false,
    norm_plus_one: false,
    parameter_free_norms: false,
    reads_clip_qkv: false,
    ungated_mlp: None,
    embedding_norm: false,
    rope_negated: false,
    hunyuan: false,
    default_rope: None,
    final_softcap: None,
    rotary_in_windows_only: false,
    rotary_without_windows: false,
    reads_attention_out_bias: false,
    multipliers: false,
    tied_by_default: false,
    default_theta: 10_000.0,
    typed_rope: None,
    moe: None,
};

/// Gemma's settings common to its generations.
const GEMMA: Family = Family {
    model_type: "gemma",
    architectures: ["GemmaForCausalLM", "GemmaModel"],
    gemma: Some(Gemma::One),
    tied_by_default: true,
    ..LLAMA
};

/// OLMo 2: norms after the attention and the MLP instead of before, the
/// queries and keys normalized over whole projections.
const OLMO2: Family = Family {
    model_type: "olmo2",
    architectures: ["Olmo2ForCausalLM", "Olmo2Model"],
    qk_norm: Some(QkNorm::Projection),
    input_norms: false,
    ..LLAMA
};

/// GLM-4 (`glm`, GLM-4-9B): biases on q, k and v by default (none on o),
/// gate and up in one weight, half of each head rotating as interleaved
/// pairs.
const GLM: Family = Family {
    model_type: "glm",
    architectures: ["GlmForCausalLM", "GlmModel"],
    attention_bias: true,
    o_bias: false,
    fused_gate_up: true,
    default_head_dim: Some(128),
    rope: RopeDialect {
        partial: Some(0.5),
        interleaved: true,
        ..LLAMA.rope
    },
    ..LLAMA
};

/// Cohere's Command R (`cohere`): LayerNorms without bias, one per block
/// before the attention and the MLP side by side, every head rotating as
/// interleaved pairs, the logits times `logit_scale`, the head tied.
const COHERE: Family = Family {
    model_type: "cohere",
    architectures: ["CohereForCausalLM", "CohereModel"],
    cohere: true,
    tied_by_default: true,
    rope: RopeDialect {
        interleaved: true,
        ..LLAMA.rope
    },
    ..LLAMA
};

/// ERNIE 4.5 (`ernie4_5`): every head rotating as interleaved pairs (as
/// GLM's), `use_bias` giving every projection a bias, heads of 128 and a
/// tied head by default.
const ERNIE: Family = Family {
    model_type: "ernie4_5",
    architectures: ["Ernie4_5ForCausalLM", "Ernie4_5Model"],
    reads_use_bias: true,
    default_head_dim: Some(128),
    tied_by_default: true,
    default_theta: 500_000.0,
    rope: RopeDialect {
        interleaved: true,
        ..LLAMA.rope
    },
    ..LLAMA
};

/// The families read as Llama.
const FAMILIES: [Family; 42] = [
    Family {
        reads_mlp_bias: true,
        ..LLAMA
    },
    Family {
        model_type: "mistral",
        architectures: ["MistralForCausalLM", "MistralModel"],
        windows: Windows::EveryLayer {
            missing: Some(DEFAULT_WINDOW),
        },
        ..LLAMA
    },
    Family {
        model_type: "qwen2",
        architectures: ["Qwen2ForCausalLM", "Qwen2Model"],
        qkv_bias: true,
        windows: Windows::Switched,
        ..LLAMA
    },
    Family {
        model_type: "qwen3",
        architectures: ["Qwen3ForCausalLM", "Qwen3Model"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Switched,
        ..LLAMA
    },
    Family {
        model_type: "phi3",
        architectures: ["Phi3ForCausalLM", "Phi3Model"],
        fused_qkv: true,
        fused_gate_up: true,
        rope: RopeDialect {
            longrope_names: true,
            partial: Some(1.0),
            interleaved: false,
        },
        windows: Windows::EveryLayer { missing: None },
        ..LLAMA
    },
    GEMMA,
    Family {
        model_type: "gemma2",
        architectures: ["Gemma2ForCausalLM", "Gemma2Model"],
        windows: Windows::Typed { pattern: 2 },
        gemma: Some(Gemma::Two),
        ..GEMMA
    },
    Family {
        model_type: "gemma3_text",
        architectures: ["Gemma3ForCausalLM", "Gemma3TextModel"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Typed { pattern: 6 },
        gemma: Some(Gemma::Three),
        typed_rope: Some(TypedRope {
            global_theta: 1e6,
            local_theta_key: Some("rope_local_base_freq"),
            local_theta: 1e4,
        }),
        ..GEMMA
    },
    Family {
        model_type: "smollm3",
        reads_mlp_bias: true,
        architectures: ["SmolLM3ForCausalLM", "SmolLM3Model"],
        windows: Windows::NoRope,
        nope_layers: true,
        tied_by_default: true,
        default_theta: 2_000_000.0,
        ..LLAMA
    },
    Family {
        model_type: "granite",
        reads_mlp_bias: true,
        architectures: ["GraniteForCausalLM", "GraniteModel"],
        multipliers: true,
        ..LLAMA
    },
    OLMO2,
    Family {
        model_type: "olmo3",
        architectures: ["Olmo3ForCausalLM", "Olmo3Model"],
        windows: Windows::Typed { pattern: 4 },
        // transformers gives an earlier file's `rope_theta` to the full
        // layers only; the sliding ones keep the default.
        typed_rope: Some(TypedRope {
            global_theta: 5e5,
            local_theta_key: None,
            local_theta: 5e5,
        }),
        ..OLMO2
    },
    Family {
        model_type: "mixtral",
        architectures: ["MixtralForCausalLM", "MixtralModel"],
        windows: Windows::EveryLayer { missing: None },
        default_theta: 1_000_000.0,
        moe: Some(MoeFamily {
            style: MoeStyle::Mixtral,
            num_experts: 8,
            experts_per_token: 2,
            expert_size: None,
            normalize: None,
            shared_expert_size: None,
            sparse_layers: false,
            ..QWEN2_MOE
        }),
        ..LLAMA
    },
    Family {
        model_type: "qwen2_moe",
        architectures: ["Qwen2MoeForCausalLM", "Qwen2MoeModel"],
        qkv_bias: true,
        windows: Windows::Unsupported,
        moe: Some(QWEN2_MOE),
        ..LLAMA
    },
    Family {
        model_type: "qwen3_moe",
        architectures: ["Qwen3MoeForCausalLM", "Qwen3MoeModel"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Unsupported,
        moe: Some(MoeFamily {
            num_experts: 128,
            experts_per_token: 8,
            expert_size: Some(768),
            shared_expert_size: None,
            ..QWEN2_MOE
        }),
        ..LLAMA
    },
    Family {
        model_type: "olmoe",
        architectures: ["OlmoeForCausalLM", "OlmoeModel"],
        reads_clip_qkv: true,
        qk_norm: Some(QkNorm::Projection),
        moe: Some(OLMOE_MOE),
        ..LLAMA
    },
    Family {
        model_type: "flex_olmo",
        architectures: ["FlexOlmoForCausalLM", "FlexOlmoModel"],
        default_theta: 500_000.0,
        moe: Some(MoeFamily {
            num_experts: 7,
            experts_per_token: 5,
            ..OLMOE_MOE
        }),
        ..OLMO2
    },
    Family {
        model_type: "glm4_moe",
        architectures: ["Glm4MoeForCausalLM", "Glm4MoeModel"],
        o_bias: false,
        switched_qk_norm: true,
        rope: RopeDialect {
            partial: Some(0.5),
            ..LLAMA.rope
        },
        moe: Some(GLM4_MOE),
        ..LLAMA
    },
    Family {
        model_type: "minimax_m2",
        architectures: ["MiniMaxM2ForCausalLM", "MiniMaxM2Model"],
        qk_norm: Some(QkNorm::Projection),
        rope: RopeDialect {
            partial: Some(1.0),
            ..LLAMA.rope
        },
        default_theta: 5_000_000.0,
        moe: Some(MINIMAX_M2_MOE),
        ..LLAMA
    },
    GLM,
    Family {
        model_type: "glm4",
        architectures: ["Glm4ForCausalLM", "Glm4Model"],
        output_norms: Some(NormNames::Glm4),
        ..GLM
    },
    COHERE,
    Family {
        model_type: "cohere2",
        architectures: ["Cohere2ForCausalLM", "Cohere2Model"],
        windows: Windows::Typed { pattern: 4 },
        rotary_in_windows_only: true,
        ..COHERE
    },
    ERNIE,
    Family {
        model_type: "ernie4_5_moe",
        architectures: ["Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeModel"],
        moe: Some(ERNIE4_5_MOE),
        ..ERNIE
    },
    Family {
        model_type: "dots1",
        architectures: ["Dots1ForCausalLM", "Dots1Model"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::FromLayer { layers: 62 },
        moe: Some(DOTS1_MOE),
        ..LLAMA
    },
    // Starcoder2: LayerNorms with biases, `use_bias` (on by default) on
    // every projection, an MLP without a gate, windows in every layer
    // where the file sets one, the head tied by default.
    Family {
        model_type: "starcoder2",
        architectures: ["Starcoder2ForCausalLM", "Starcoder2Model"],
        reads_use_bias: true,
        default_use_bias: true,
        biased_layer_norms: true,
        ungated_mlp: Some((UngatedMlp::CFc, Activation::Gelu)),
        windows: Windows::EveryLayer { missing: None },
        tied_by_default: true,
        ..LLAMA
    },
    // Phi (1, 1.5, 2): LayerNorms with biases, one per block before the
    // attention and the MLP side by side, biases everywhere (the head's
    // too), an MLP without a gate, half of each head rotating by default,
    // Phi's names.
    Family {
        model_type: "phi",
        architectures: ["PhiForCausalLM", "PhiModel"],
        phi: true,
        biased_layer_norms: true,
        ungated_mlp: Some((UngatedMlp::Fc, Activation::Gelu)),
        rope: RopeDialect {
            partial: Some(0.5),
            ..LLAMA.rope
        },
        ..LLAMA
    },
    // Arcee (AFM): Llama with an MLP without a gate, squared ReLU.
    Family {
        model_type: "arcee",
        architectures: ["ArceeForCausalLM", "ArceeModel"],
        reads_mlp_bias: true,
        ungated_mlp: Some((UngatedMlp::UpDown, Activation::Relu2)),
        ..LLAMA
    },
    // Nemotron (Minitron, Nemotron-4): LayerNorms with biases scaling by
    // `1 + weight` (LayerNorm1P), Arcee's MLP, half of each head rotating by
    // default.
    Family {
        model_type: "nemotron",
        architectures: ["NemotronForCausalLM", "NemotronModel"],
        reads_mlp_bias: true,
        biased_layer_norms: true,
        norm_plus_one: true,
        ungated_mlp: Some((UngatedMlp::UpDown, Activation::Relu2)),
        rope: RopeDialect {
            partial: Some(0.5),
            ..LLAMA.rope
        },
        ..LLAMA
    },
    // EXAONE 4: OLMo 2's norms of the outputs, Qwen3's norms of each query
    // and key head, windows in three layers of four which alone rotate (all
    // rotate without windows).
    Family {
        model_type: "exaone4",
        architectures: ["Exaone4ForCausalLM", "Exaone4Model"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Typed { pattern: 4 },
        rotary_in_windows_only: true,
        rotary_without_windows: true,
        ..OLMO2
    },
    // Seed-OSS: biases on q, k and v by default (`attention_bias`), on o
    // where `attention_out_bias`, MLP biases where `mlp_bias`, heads of
    // 128 by default.
    Family {
        model_type: "seed_oss",
        architectures: ["SeedOssForCausalLM", "SeedOssModel"],
        attention_bias: true,
        reads_attention_out_bias: true,
        reads_mlp_bias: true,
        default_head_dim: Some(128),
        ..LLAMA
    },
    // GPT-NeoX (Pythia): biased LayerNorms, q, k and v in one weight head by
    // head, biases on the attention by default and on the MLP always, an MLP
    // without a gate (exact GELU), parallel blocks with a norm per branch
    // by default, a quarter of each head rotating by default.
    Family {
        model_type: "gpt_neox",
        architectures: ["GPTNeoXForCausalLM", "GPTNeoXModel"],
        neox: true,
        attention_bias: true,
        fused_qkv: true,
        biased_layer_norms: true,
        ungated_mlp: Some((UngatedMlp::NeoX, Activation::GeluErf)),
        rope: RopeDialect {
            partial: Some(0.25),
            ..LLAMA.rope
        },
        ..LLAMA
    },
    // StableLM (2): biased LayerNorms, q, k and v biased where
    // `use_qkv_bias`, LayerNorms of each head where `qk_layernorm`,
    // parallel blocks with one norm where `use_parallel_residual`, a
    // quarter of each head rotating by default.
    Family {
        model_type: "stablelm",
        architectures: ["StableLmForCausalLM", "StableLmModel"],
        stablelm: true,
        biased_layer_norms: true,
        rope: RopeDialect {
            partial: Some(0.25),
            ..LLAMA.rope
        },
        ..LLAMA
    },
    // OLMo (1): Llama with LayerNorms without parameters, `clip_qkv`.
    Family {
        model_type: "olmo",
        architectures: ["OlmoForCausalLM", "OlmoModel"],
        parameter_free_norms: true,
        reads_clip_qkv: true,
        ..LLAMA
    },
    // NanoChat: RMS norms without parameters (of the embeddings too, and of
    // each query and key head), an MLP without a gate (`fc1`, squared ReLU,
    // `fc2`), the logits capped (15 by default).
    Family {
        model_type: "nanochat",
        architectures: ["NanoChatForCausalLM", "NanoChatModel"],
        qk_norm: Some(QkNorm::PerHead),
        parameter_free_norms: true,
        embedding_norm: true,
        rope_negated: true,
        ungated_mlp: Some((UngatedMlp::Fc, Activation::Relu2)),
        final_softcap: Some(Some(15.0)),
        ..LLAMA
    },
    // Hunyuan (dense): RMS norms of each query and key head after the
    // rotation, under its names; its files' "dynamic" rotation with an
    // `alpha` is NTK's, static.
    Family {
        model_type: "hunyuan_v1_dense",
        architectures: ["HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Model"],
        qk_norm: Some(QkNorm::PerHead),
        hunyuan: true,
        ..LLAMA
    },
    // Jais 2: biased LayerNorms, biases on every projection by default
    // (`attention_bias`, `mlp_bias`), an MLP without a gate (squared ReLU).
    Family {
        model_type: "jais2",
        architectures: ["Jais2ForCausalLM", "Jais2Model"],
        attention_bias: true,
        reads_mlp_bias: true,
        default_mlp_bias: true,
        biased_layer_norms: true,
        ungated_mlp: Some((UngatedMlp::UpDown, Activation::Relu2)),
        ..LLAMA
    },
    // Helium (Kyutai): every head rotating as interleaved pairs, q, k and v
    // biased where `attention_bias` (o never), heads of 128 and epsilon
    // 1e-8 by default.
    Family {
        model_type: "helium",
        architectures: ["HeliumForCausalLM", "HeliumModel"],
        o_bias: false,
        reads_mlp_bias: true,
        default_head_dim: Some(128),
        default_rms_eps: 1e-8,
        rope: RopeDialect {
            interleaved: true,
            ..LLAMA.rope
        },
        ..LLAMA
    },
    // Ministral: Mistral's, its windows in the layers `layer_types` names
    // (every layer by default).
    Family {
        model_type: "ministral",
        architectures: ["MinistralForCausalLM", "MinistralModel"],
        windows: Windows::Listed {
            every: 1,
            missing: DEFAULT_WINDOW,
        },
        ..LLAMA
    },
    // CWM (Code World Model): windows of 8192 in the layers `layer_types`
    // names (all but every fourth from the first by default); llama3
    // scaling by default.
    Family {
        model_type: "cwm",
        architectures: ["CwmForCausalLM", "CwmModel"],
        windows: Windows::Listed {
            every: 4,
            missing: 8192,
        },
        default_rope: Some(CWM_ROPE),
        ..LLAMA
    },
    // Solar Open: Llama's attention (q, k and v biased where
    // `attention_bias`, o never), every layer GLM-4.5's mixture.
    Family {
        model_type: "solar_open",
        architectures: ["SolarOpenForCausalLM", "SolarOpenModel"],
        o_bias: false,
        default_head_dim: Some(128),
        default_theta: 1_000_000.0,
        moe: Some(SOLAR_OPEN_MOE),
        ..LLAMA
    },
];

/// CWM's rotation where its file gives none (`transformers`' default).
const CWM_ROPE: &str = r#"{"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0,
    "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}"#;

/// Whether `model_type` `kind` is read as Llama.
pub(crate) fn reads(kind: &str) -> bool {
    kind == "gemma3" || FAMILIES.iter().any(|f| f.model_type == kind)
}

/// The `model_type`s read as Llama, for messages.
pub(crate) const LLAMA_TYPES: &str =
    "\"llama\", \"mistral\", \"qwen2\", \"qwen3\", \"phi3\", \"gemma\", \"gemma2\", \
     \"gemma3_text\", \"gemma3\" (its text model), \"smollm3\", \"granite\", \"olmo2\", \"olmo3\", \
     \"mixtral\", \"qwen2_moe\", \"qwen3_moe\", \"olmoe\", \"flex_olmo\", \"glm4_moe\", \
     \"minimax_m2\", \"glm\", \"glm4\", \"cohere\", \"cohere2\", \"ernie4_5\", \"ernie4_5_moe\", \"dots1\", \"starcoder2\", \"phi\", \"arcee\", \"nemotron\", \"exaone4\", \"seed_oss\", \"gpt_neox\", \"stablelm\", \"olmo\", \"nanochat\", \"hunyuan_v1_dense\", \"jais2\", \"helium\", \"ministral\", \"cwm\" and \"solar_open\"";

impl LlamaConfig {
    /// Reads a hub `config.json` of a Llama, Mistral, Qwen2, Qwen3, Phi-3,
    /// Gemma, Gemma 2, Gemma 3 (text, or the text model of one with
    /// vision), SmolLM3, Granite, OLMo 2, OLMo 3, Mixtral, Qwen2-MoE,
    /// Qwen3-MoE, OLMoE, FlexOlmo, GLM-4.5 (`glm4_moe`), MiniMax-M2, GLM-4
    /// (`glm`, `glm4`), Cohere (`cohere`, `cohere2`), ERNIE 4.5
    /// (`ernie4_5`, `ernie4_5_moe`), dots.llm1 (`dots1`), Starcoder2, Phi, Arcee,
    /// Nemotron, EXAONE 4, Seed-OSS, GPT-NeoX, StableLM, OLMo, NanoChat, Hunyuan, Jais 2,
    /// Helium, Ministral, CWM or Solar Open model (by `model_type`; Llama without one): an error names the key whose value this model
    /// cannot honour (another architecture, MLP biases, another
    /// activation, a rotary scaling it does not implement, bidirectional
    /// attention, ...). Reads the rotary settings from `rope_parameters`
    /// (transformers 5) or from `rope_theta` and `rope_scaling` (earlier
    /// files).
    pub fn from_json(config: &serde_json::Value) -> std::result::Result<Self, String> {
        let kind = config
            .get("model_type")
            .and_then(|v| v.as_str())
            .unwrap_or("llama");
        if kind == "gemma3" {
            return Self::from_gemma3_with_vision(config);
        }
        let Some(family) = FAMILIES.iter().find(|f| f.model_type == kind) else {
            return Err(format!(
                "`model_type` is {kind:?}; this model reads {LLAMA_TYPES}"
            ));
        };
        let renamed;
        let config = match (family.neox, family.hunyuan, family.default_rope) {
            (true, ..) => {
                renamed = neox_rotary_keys(config);
                &renamed
            }
            (_, true, _) => {
                renamed = ntk_alpha_as_theta(config)?;
                &renamed
            }
            (.., Some(rope)) => {
                renamed = with_default_rope(config, rope);
                &renamed
            }
            _ => config,
        };
        crate::models::check_architectures(config, &family.architectures)?;
        let plain = Plain::deserialize(config).map_err(|e| format!("{e}"))?;
        if plain.mlp_bias == Some(true) && !family.reads_mlp_bias {
            return Err(format!(
                "`mlp_bias` is true; {kind}'s MLPs have no biases in transformers: set it to false"
            ));
        }
        let heads = plain.num_attention_heads;
        // Solar Open's dense width is its experts' (it has no dense layer).
        let intermediate_size = match (plain.intermediate_size, family.moe) {
            (Some(width), _) => width,
            (None, Some(moe)) if family.model_type == "solar_open" => expert_size_of(config, moe)?,
            (None, _) => return Err("missing field `intermediate_size`".into()),
        };
        let rotated_layers = match family.nope_layers {
            true => Some(rotated_layers(&plain)?),
            false => None,
        };
        let sliding_window =
            sliding_window_of(config, &plain, family.windows, rotated_layers.as_deref())?;
        // Cohere 2 and EXAONE 4 rotate in their sliding layers only;
        // without a window, Cohere 2 in none, EXAONE 4 in every one (as
        // transformers does).
        let rotated_layers = match (family.rotary_in_windows_only, &sliding_window) {
            (true, Some(window)) => Some(window.layers.clone()),
            (true, None) if family.rotary_without_windows => None,
            (true, None) => Some(vec![false; plain.num_hidden_layers]),
            (false, _) => rotated_layers,
        };
        if let Some(clip) = plain.clip_qkv.filter(|_| !family.reads_clip_qkv) {
            return Err(format!(
                "`clip_qkv` is {clip}; clipping the queries, keys and values is not implemented \
                 here: set it to null"
            ));
        }
        let gemma = family.gemma;
        if gemma.is_some() {
            refuse_gemma_settings(&plain)?;
        }
        let (rope, local_rope) = match family.typed_rope {
            Some(typed) => typed_ropes(config, plain.max_position_embeddings, typed)?,
            None => (
                Rope::from_json(
                    config,
                    plain.max_position_embeddings,
                    family.rope,
                    family.default_theta,
                )?,
                None,
            ),
        };
        let head_dim = match plain.head_dim.or(family.default_head_dim) {
            Some(width) => width,
            // transformers' default for Gemma.
            None if gemma.is_some() => 256,
            None if heads > 0 => plain.hidden_size / heads,
            None => 0,
        };
        let rotary_dim = match family.rope.partial {
            // MiniMax-M2's released files give `rotary_dim` instead of a
            // factor (read as transformers reads it: the factor wins).
            Some(missing) => {
                let missing = match config.get("rotary_dim").and_then(|v| v.as_f64()) {
                    Some(width) if head_dim > 0 => width / head_dim as f64,
                    _ => missing,
                };
                (head_dim as f64 * crate::models::rope::partial_rotary_factor(config, missing)?)
                    as usize
            }
            None => head_dim,
        };
        // Granite's multipliers (1, the default, is none).
        let granite = |value: Option<f64>| value.filter(|&v| family.multipliers && v != 1.0);
        let use_bias = family.phi
            || family.reads_use_bias && plain.use_bias.unwrap_or(family.default_use_bias);
        if use_bias && family.moe.is_some() {
            return Err(
                "`use_bias` is true: ERNIE 4.5's mixtures with biases (on the head too) are not \
                 implemented here (the released mixtures have none; a checkpoint without them \
                 loads with it false)"
                    .into(),
            );
        }
        let attention_bias = plain.attention_bias.unwrap_or(family.attention_bias) || use_bias;
        // Phi-3's fused projections have no biases whatever the file says;
        // GPT-NeoX's follow `attention_bias`.
        let biased_attention = !family.fused_qkv || family.neox;
        let parallel_blocks = family.cohere
            || family.phi
            || family.neox && plain.use_parallel_residual.unwrap_or(true)
            || family.stablelm && plain.use_parallel_residual == Some(true);
        // Gemma 2's and 3's settings (Gemma reads none of them).
        let later = |value: Option<f64>| value.filter(|_| gemma.is_some_and(|g| g != Gemma::One));
        let parsed = Self {
            vocab_size: plain.vocab_size,
            hidden_size: plain.hidden_size,
            intermediate_size,
            num_hidden_layers: plain.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: plain.num_key_value_heads.unwrap_or(heads),
            head_dim,
            rotary_dim,
            max_position_embeddings: plain.max_position_embeddings,
            rms_norm_eps: match family.cohere || family.biased_layer_norms {
                // OLMo's fixed epsilon.
                _ if family.parameter_free_norms && !family.embedding_norm => 1e-5,
                true => plain.layer_norm_eps.unwrap_or(1e-5),
                false => plain.rms_norm_eps.unwrap_or(family.default_rms_eps),
            },
            layer_norms: family.cohere
                || family.biased_layer_norms
                || family.parameter_free_norms && !family.embedding_norm,
            norm_weights: !family.parameter_free_norms,
            clip_qkv: plain.clip_qkv.filter(|_| family.reads_clip_qkv),
            norm_bias: family.biased_layer_norms,
            parallel_blocks,
            parallel_mlp_norm: family.neox && parallel_blocks,
            qkv_per_head: family.neox,
            rope,
            tie_word_embeddings: plain.tie_word_embeddings.unwrap_or(family.tied_by_default),
            initializer_range: plain.initializer_range,
            qkv_bias: biased_attention
                && (attention_bias
                    || plain.qkv_bias.unwrap_or(family.qkv_bias)
                    || family.stablelm && plain.use_qkv_bias == Some(true)),
            o_bias: match family.reads_attention_out_bias {
                true => plain.attention_out_bias.unwrap_or(false),
                false => biased_attention && family.o_bias && attention_bias,
            },
            mlp_bias: use_bias
                || family.neox
                || (family.reads_mlp_bias && plain.mlp_bias.unwrap_or(family.default_mlp_bias)),
            fused_qkv: family.fused_qkv,
            fused_gate_up: family.fused_gate_up,
            rope_interleaved: family.rope.interleaved,
            qk_norm: match (family.switched_qk_norm || family.cohere) && plain.use_qk_norm {
                true if family.cohere => Some(QkNorm::HeadWeights),
                true => Some(QkNorm::PerHead),
                false if family.phi && plain.qk_layernorm => Some(QkNorm::PerHead),
                false if family.stablelm && plain.qk_layernorm => Some(QkNorm::HeadWeights),
                false => family.qk_norm,
            },
            input_norms: family.input_norms,
            sliding_window,
            pad_token_id: plain.pad_token_id,
            mlp_activation: mlp_activation(config, gemma, family.ungated_mlp.map(|(_, a)| a))?,
            ungated_mlp: family.ungated_mlp.map(|(names, _)| names),
            embedding_norm: family.embedding_norm,
            rope_negated: family.rope_negated,
            qk_norm_after_rotation: family.hunyuan,
            layer_names: match (family.phi, family.neox, family.stablelm, family.hunyuan) {
                (true, ..) => LayerNames::Phi,
                (_, true, ..) => LayerNames::NeoX,
                (_, _, true, _) => LayerNames::StableLm,
                (.., true) => LayerNames::Hunyuan,
                _ => LayerNames::Llama,
            },
            head_bias: family.phi,
            norm_weight_offset: if gemma.is_some() || family.norm_plus_one {
                1.0
            } else {
                0.0
            },
            embedding_scale: match gemma {
                Some(_) => Some((plain.hidden_size as f64).sqrt()),
                None => granite(plain.embedding_multiplier),
            },
            output_norms: family.output_norms.is_some()
                || gemma.is_some_and(|g| g != Gemma::One)
                || !family.input_norms,
            norm_names: family.output_norms.unwrap_or_default(),
            attention_scale: match gemma {
                Some(_) => later(plain.query_pre_attn_scalar).map(|scalar| scalar.powf(-0.5)),
                None => granite(plain.attention_multiplier),
            },
            residual_multiplier: granite(plain.residual_multiplier),
            logits_scaling: granite(plain.logits_scaling),
            logit_scale: match family.cohere {
                true => Some(plain.logit_scale.unwrap_or(0.0625)).filter(|&s| s != 1.0),
                false => None,
            },
            rotated_layers,
            text_of_multimodal: false,
            dropout: [
                plain.attention_dropout,
                plain.resid_pdrop,
                plain.embd_pdrop,
                plain.residual_dropout,
                plain.embedding_dropout,
                plain.hidden_dropout,
                plain.router_jitter_noise,
            ]
            .into_iter()
            .flatten()
            .fold(0.0, f64::max),
            attn_logit_softcapping: plain
                .attn_logit_softcapping
                .filter(|_| gemma == Some(Gemma::Two)),
            final_logit_softcapping: match family.final_softcap {
                Some(missing) => plain.final_logit_softcapping.or(missing),
                None => later(plain.final_logit_softcapping),
            },
            local_rope,
            moe: family.moe.map(|moe| moe_of(config, moe)).transpose()?,
        };
        parsed.validate()?;
        Ok(parsed)
    }

    /// Gemma 3 with vision: its `text_config` read as `gemma3_text`'s.
    fn from_gemma3_with_vision(config: &serde_json::Value) -> std::result::Result<Self, String> {
        crate::models::check_architectures(config, &["Gemma3ForConditionalGeneration"])?;
        let Some(serde_json::Value::Object(text)) = config.get("text_config") else {
            return Err(
                "`model_type` is \"gemma3\" but there is no `text_config` object, which holds the \
                 text model's settings in Gemma 3's checkpoints: use the config.json the \
                 checkpoint came with"
                    .into(),
            );
        };
        let mut text = text.clone();
        text.insert("model_type".into(), "gemma3_text".into());
        text.remove("architectures");
        if let Some(tied) = config.get("tie_word_embeddings") {
            text.entry("tie_word_embeddings").or_insert(tied.clone());
        }
        let mut parsed = Self::from_json(&serde_json::Value::Object(text))
            .map_err(|e| format!("`text_config`: {e}"))?;
        parsed.text_of_multimodal = true;
        Ok(parsed)
    }

    /// The config of the hub directory `hub` ([`LlamaConfig::from_json`]),
    /// an error naming its `config.json` and the key, or saying that the
    /// weights store a mixture's experts fused.
    pub fn from_hub(hub: &HubDir) -> crate::Result<Self> {
        let config = crate::models::config_of(hub, Self::from_json)?;
        config.check_files(hub)?;
        Ok(config)
    }

    /// Checks that the shape is buildable.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        crate::models::check_positive(&sizes)?;
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return Err(format!(
                "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {}",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.rotary_dim % 2 != 0 || self.rotary_dim == 0 || self.rotary_dim > self.head_dim {
            return Err(format!(
                "heads of {} rotate {} values; rotary embeddings rotate pairs, at least one: \
                 check `head_dim` and `partial_rotary_factor`",
                self.head_dim, self.rotary_dim
            ));
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.num_hidden_layers)?;
        }
        if !self.norm_weights && (self.norm_bias || self.norm_weight_offset != 0.0) {
            return Err(
                "norms without parameters have no bias and no weight offset; clear `norm_bias` \
                 and `norm_weight_offset`, or set `norm_weights`"
                    .into(),
            );
        }
        if self.embedding_norm && self.norm_weights {
            return Err(
                "the final norm normalizes the embeddings only without parameters (NanoChat's); \
                 clear `norm_weights` or `embedding_norm`"
                    .into(),
            );
        }
        if let Some(clip) = self.clip_qkv.filter(|c| !(*c > 0.0 && c.is_finite())) {
            return Err(format!(
                "`clip_qkv` is {clip}; set a positive number, or null for no clamp"
            ));
        }
        if self.norm_bias && !self.layer_norms {
            return Err(
                "norms with a bias are LayerNorms; set `layer_norms` or clear `norm_bias`".into(),
            );
        }
        if self.ungated_mlp.is_some() && (self.fused_gate_up || self.moe.is_some()) {
            return Err(
                "an MLP without a gate has no fused gate and up projections and no mixture of \
                 experts here; clear `fused_gate_up` and `moe`, or `ungated_mlp`"
                    .into(),
            );
        }
        if self.parallel_mlp_norm && !self.parallel_blocks {
            return Err(
                "the MLP's own norm in parallel blocks needs parallel blocks; set \
                 `parallel_blocks` or clear `parallel_mlp_norm`"
                    .into(),
            );
        }
        if self.qkv_per_head
            && (!self.fused_qkv
                || self.rope_interleaved
                || self.num_key_value_heads != self.num_attention_heads)
        {
            return Err(
                "rows head by head are those of a fused query, key and value projection with as \
                 many key/value heads as query heads, rotating halves; set `fused_qkv` and \
                 `num_key_value_heads`, clear `rope_interleaved`, or clear `qkv_per_head`"
                    .into(),
            );
        }
        if self.head_bias && self.tie_word_embeddings {
            return Err(
                "a head with a bias tied to the embedding is not implemented here; untie it \
                 (`tie_word_embeddings` false) or clear `head_bias`"
                    .into(),
            );
        }
        if self.parallel_blocks && (self.output_norms || !self.input_norms) {
            return Err(
                "parallel blocks (Cohere's) have one input norm and no output norms; set \
                 `input_norms` and clear `output_norms`"
                    .into(),
            );
        }
        self.rope.validate()?;
        self.rope.validate_for(self.rotary_dim)?;
        if let Some(local) = &self.local_rope {
            local.validate()?;
        }
        if let Some(layers) = self
            .rotated_layers
            .as_ref()
            .filter(|l| l.len() != self.num_hidden_layers)
        {
            return Err(format!(
                "`no_rope_layers` has {} entries for {} layers; give one per layer",
                layers.len(),
                self.num_hidden_layers
            ));
        }
        let positive = [
            (
                "attention scale (`query_pre_attn_scalar`, `attention_multiplier`)",
                self.attention_scale,
            ),
            (
                "embedding scale (`embedding_multiplier`)",
                self.embedding_scale,
            ),
            ("residual_multiplier", self.residual_multiplier),
            ("logits_scaling", self.logits_scaling),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ];
        for (key, value) in positive {
            if let Some(v) = value.filter(|v| !(*v > 0.0 && v.is_finite())) {
                return Err(format!("`{key}` is {v}; set a positive number, or null"));
            }
        }
        if let Some(pad) = self.pad_token_id.filter(|&p| p as usize >= self.vocab_size) {
            return Err(format!(
                "`pad_token_id` {pad} is outside the vocabulary of {}: set it to a token id \
                 below that, or to null",
                self.vocab_size
            ));
        }
        if let Some(window) = &self.sliding_window {
            if window.size == 0 {
                return Err(
                    "`sliding_window` is 0; a position sees at least itself: set it to at least \
                     1, or to null for no window"
                        .into(),
                );
            }
            if window.layers.len() != self.num_hidden_layers {
                return Err(format!(
                    "`layer_types` has {} entries for {} layers; give one per layer",
                    window.layers.len(),
                    self.num_hidden_layers
                ));
            }
        }
        Ok(())
    }

    /// The parameters of a model of this shape.
    pub fn num_params(&self) -> usize {
        let (d, inner) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        );
        let biases = if self.qkv_bias { q + 2 * kv } else { 0 } + if self.o_bias { d } else { 0 };
        // Norms of the model's kind: with a bias where its norms have one.
        let biased = (1 + self.norm_bias as usize) * self.norm_weights as usize;
        let qk_norms = match self.qk_norm {
            Some(QkNorm::PerHead) => 2 * self.head_dim * biased,
            Some(QkNorm::Projection) => (q + kv) * biased,
            Some(QkNorm::HeadWeights) => q + kv,
            None => 0,
        };
        let norm = d * biased;
        let norms = match self.parallel_blocks {
            true => norm * (1 + self.parallel_mlp_norm as usize),
            false => 2 * norm * (self.input_norms as usize + self.output_norms as usize),
        };
        let per_layer = norms + 2 * d * q + 2 * d * kv + biases + qk_norms;
        let mlps: usize = (0..self.num_hidden_layers)
            .map(|i| match &self.moe {
                Some(moe) if moe.layers[i] => moe.num_params(d),
                _ => {
                    let projections = 2 + self.ungated_mlp.is_none() as usize;
                    let biases = (projections - 1) * inner + d;
                    projections * d * inner + if self.mlp_bias { biases } else { 0 }
                }
            })
            .sum();
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * (d + self.head_bias as usize)
        };
        self.num_hidden_layers * per_layer + mlps + self.vocab_size * d + norm + head
    }

    /// The rotary frequencies `1 / theta^(2i / rotary_dim)`, `i <
    /// rotary_dim / 2`, scaled as `transformers` scales them
    /// ([`Rope::inv_freq`]).
    pub fn inv_freq(&self) -> Vec<f64> {
        self.rope.inv_freq(self.rotary_dim)
    }
}

/// The sliding window as `transformers` applies it: Mistral's
/// `sliding_window` in every layer; Qwen's where `use_sliding_window` is on,
/// in the layers whose `layer_types` entry is `sliding_attention` (without
/// `layer_types`, those from `max_window_layers` on). `None` where no layer
/// uses one.
fn sliding_window_of(
    config: &serde_json::Value,
    plain: &Plain,
    windows: Windows,
    rotated_layers: Option<&[bool]>,
) -> std::result::Result<Option<SlidingWindow>, String> {
    if let Some(types) = &plain.layer_types {
        if let Some(other) = types
            .iter()
            .find(|t| !["full_attention", "sliding_attention"].contains(&t.as_str()))
        {
            return Err(format!(
                "`layer_types` has {other:?}; full and sliding attention only"
            ));
        }
    }
    if windows == Windows::Unsupported && plain.use_sliding_window {
        return Err(
            "`use_sliding_window` is true; this model type's sliding windows are not implemented \
             here: set it to false (as the published checkpoints have it)"
                .into(),
        );
    }
    let n = plain.num_hidden_layers;
    let typed = |types: &Vec<String>| types.iter().map(|t| t == "sliding_attention").collect();
    let layers = match windows {
        Windows::Never | Windows::Unsupported => return Ok(None),
        Windows::Switched | Windows::NoRope if !plain.use_sliding_window => return Ok(None),
        Windows::NoRope => match (&plain.layer_types, rotated_layers) {
            (Some(types), _) => typed(types),
            (None, Some(rotated)) => rotated.iter().map(|r| !r).collect(),
            (None, None) => vec![false; n],
        },
        Windows::EveryLayer { .. } => vec![true; n],
        Windows::Switched => match &plain.layer_types {
            Some(types) => typed(types),
            None => {
                let from = plain.max_window_layers.unwrap_or(DEFAULT_MAX_WINDOW_LAYERS);
                (0..n).map(|i| i >= from).collect()
            }
        },
        Windows::FromLayer { layers } => match &plain.layer_types {
            Some(types) => typed(types),
            None => {
                let from = plain.max_window_layers.unwrap_or(layers);
                (0..n).map(|i| i >= from).collect()
            }
        },
        Windows::Listed { every, .. } => match &plain.layer_types {
            Some(types) => typed(types),
            None if every <= 1 => vec![true; n],
            None => (0..n).map(|i| i % every != 0).collect(),
        },
        Windows::Typed { pattern } => match &plain.layer_types {
            Some(types) => typed(types),
            None => match &plain.sliding_window_pattern {
                Some(given) => given.layers(n)?,
                None => WindowPattern::Every(pattern).layers(n)?,
            },
        },
    };
    let missing = match windows {
        Windows::EveryLayer { missing } => missing,
        Windows::Listed { missing, .. } => Some(missing),
        Windows::NoRope => None,
        _ => Some(DEFAULT_WINDOW),
    };
    let size = match config.get("sliding_window") {
        None => missing,
        Some(v) if v.is_null() => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|w| usize::try_from(w).ok())
                .ok_or_else(|| format!("`sliding_window` is {v}; a whole number is expected"))?,
        ),
    };
    Ok(size
        .filter(|_| layers.contains(&true))
        .map(|size| SlidingWindow { size, layers }))
}

/// SmolLM3's layers with rotary embeddings: `no_rope_layers` (1 rotates, 0
/// does not), or all but every `no_rope_layer_interval`-th.
fn rotated_layers(plain: &Plain) -> std::result::Result<Vec<bool>, String> {
    match (&plain.no_rope_layers, plain.no_rope_layer_interval) {
        (Some(flags), _) => flags
            .iter()
            .map(|&f| match f {
                0 | 1 => Ok(f == 1),
                other => Err(format!(
                    "`no_rope_layers` holds {other}; 1 (rotary) or 0 (none) per layer"
                )),
            })
            .collect(),
        (None, 0) => Err("`no_rope_layer_interval` is 0; set it to at least 1".into()),
        (None, every) => Ok((0..plain.num_hidden_layers)
            .map(|i| (i + 1) % every != 0)
            .collect()),
    }
}

/// The MLP's activation: SiLU for Llama (`hidden_act`); GELU's tanh form for
/// Gemma (`hidden_act`, where transformers reads `gelu` as the tanh form too)
/// and Gemma 3 (`hidden_activation`); for an MLP without a gate
/// (StarCoder2's, Phi's, Nemotron's, Arcee's), `hidden_act` as
/// `transformers`' `ACT2FN` reads it: GELU's tanh forms, exact GELU
/// (`gelu`), SiLU or squared ReLU (`relu2`), the family's default where the
/// file names none.
fn mlp_activation(
    config: &serde_json::Value,
    gemma: Option<Gemma>,
    ungated: Option<Activation>,
) -> std::result::Result<Activation, String> {
    const TANH: [&str; 2] = ["gelu_pytorch_tanh", "gelu_new"];
    const UNGATED: [(&str, Activation); 6] = [
        ("gelu_pytorch_tanh", Activation::Gelu),
        ("gelu_new", Activation::Gelu),
        ("gelu_fast", Activation::Gelu),
        ("gelu", Activation::GeluErf),
        ("silu", Activation::Silu),
        ("relu2", Activation::Relu2),
    ];
    let ungated_names = UNGATED.map(|(name, _)| name);
    let (key, accepted): (&str, &[&str]) = match gemma {
        _ if ungated.is_some() => ("hidden_act", &ungated_names),
        None => ("hidden_act", &["silu"]),
        Some(Gemma::One) => ("hidden_act", &["gelu_pytorch_tanh", "gelu_new", "gelu"]),
        Some(Gemma::Two | Gemma::Three) => ("hidden_activation", &TANH),
    };
    let value = config.get(key).filter(|v| !v.is_null());
    match (value, ungated) {
        (Some(value), _) if !accepted.iter().any(|a| value == a) => Err(format!(
            "`{key}` is {value}; only {} is supported",
            accepted.join(" or ")
        )),
        (_, Some(missing)) => Ok(UNGATED
            .iter()
            .find(|(name, _)| value.is_some_and(|v| v == name))
            .map_or(missing, |&(_, kind)| kind)),
        _ if gemma.is_some() => Ok(Activation::Gelu),
        _ => Ok(Activation::Silu),
    }
}

/// An error naming the first Gemma setting this model does not implement.
fn refuse_gemma_settings(plain: &Plain) -> std::result::Result<(), String> {
    if plain.use_bidirectional_attention == Some(true) {
        return Err(
            "`use_bidirectional_attention` is true; only causal attention is supported: use a \
             causal (generative) checkpoint, or set it to false to fine-tune this one as one"
                .into(),
        );
    }
    Ok(())
}

/// Rotary parameters per layer type (Gemma 3, OLMo 3): the bases where a
/// file leaves them out, as `transformers` defaults them.
#[derive(Clone, Copy)]
struct TypedRope {
    /// The full-attention layers' `rope_theta` where absent.
    global_theta: f64,
    /// The key of the sliding layers' base in earlier files (Gemma 3's
    /// `rope_local_base_freq`), if any.
    local_theta_key: Option<&'static str>,
    /// The sliding layers' base where absent.
    local_theta: f64,
}

/// The rotations of the full-attention layers and of the sliding-window
/// layers, from `rope_parameters` per layer type (transformers 5) or from
/// `rope_theta` with `rope_scaling` for the full layers and `typed`'s local
/// key for the sliding ones (earlier files). The local one is `None` where
/// it is the same as the global one.
fn typed_ropes(
    config: &serde_json::Value,
    max_positions: usize,
    typed: TypedRope,
) -> std::result::Result<(Rope, Option<Rope>), String> {
    use serde_json::{json, Value};
    let get = |key: &str| config.get(key).filter(|v| !v.is_null());
    let per_type = get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    let (global, local) = match per_type {
        Some(p) => (
            p.get("full_attention").cloned(),
            p.get("sliding_attention").cloned(),
        ),
        None => (
            get("rope_parameters").or(get("rope_scaling")).cloned(),
            None,
        ),
    };
    // One layer type's parameters as a config of their own, the base
    // defaulted as transformers defaults it.
    let rope = |params: Option<Value>, theta_key: Option<&str>, default: f64| {
        let mut params = params.unwrap_or_else(|| json!({"rope_type": "default"}));
        if !params.is_object() {
            return Err(format!(
                "`rope_parameters` is {params}; an object is expected"
            ));
        }
        if params.get("rope_theta").is_none_or(Value::is_null) {
            params["rope_theta"] = theta_key.and_then(get).cloned().unwrap_or(default.into());
        }
        let mut alone = json!({ "rope_parameters": params });
        if let Some(partial) = get("partial_rotary_factor") {
            alone["partial_rotary_factor"] = partial.clone();
        }
        Rope::from_json(&alone, max_positions, RopeDialect::default(), default)
    };
    let global = rope(global, Some("rope_theta"), typed.global_theta)?;
    let local = rope(local, typed.local_theta_key, typed.local_theta)?;
    Ok((global.clone(), (local != global).then_some(local)))
}
