//! [`LlamaConfig`]: a Llama-family `config.json` read as `transformers`
//! reads it, each family's differences from Llama in one table
//! ([`families`]), the file's keys read in [`keys`].

mod families;
mod family;
mod keys;
mod latent;
mod names;
mod position_scale;

pub(crate) use families::{llama_types, reads};
pub use latent::{LatentAttention, LATENT_NORM_EPS};
pub use names::{LayerNames, NormNames, UngatedMlp};
use position_scale::position_scale_of;
pub use position_scale::PositionScale;

use super::moe::families::expert_size_of;
use super::moe::{moe_of, MoeConfig};
use crate::hub::HubDir;
use crate::models::config_json::{check_sizes, read_keys};
use crate::models::rope::Rope;
use crate::nn::Activation;
use families::FAMILIES;
use family::{Family, Gemma};
use keys::{
    falcon_keys, gptj_keys, layer_thetas, mlp_activation, neox_rotary_keys, ntk_alpha_as_theta,
    refuse_gemma_settings, rotated_layers, sliding_window_of, typed_ropes, with_default_rope,
    Plain,
};
use latent::{latent_of, score_mscale};

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
    /// vision (`model_type` `gemma3`) or of Mistral 3 (`mistral3`: Mistral
    /// Small 3, Ministral 3), the config in `text_config`: its tensors
    /// under `language_model.`, the vision tower's and the projector's
    /// beside them, kept as they are and saved back unchanged.
    pub text_of_multimodal: bool,
    /// The queries scaled by position (Ministral 3's
    /// `llama_4_scaling_beta`).
    pub position_scale: Option<PositionScale>,
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
    /// The keys and values from one latent per token (DeepSeek-V2's
    /// multi-head latent attention); every head its own K/V head.
    pub latent_attention: Option<LatentAttention>,
    /// The checkpoint holds each mixture layer's experts fused in two
    /// tensors (`experts.gate_up_proj` and `experts.down_proj`, as
    /// `transformers` 5 holds them), not one weight per expert: the
    /// variables stay one per expert's projection, each a part of its
    /// fused tensor ([`crate::hub::HubLayout::with_fused`]). Read from the
    /// files by [`LlamaConfig::from_hub`].
    pub fused_experts: bool,
    /// A sink per query head (`self_attn.sinks`): a logit in each row's
    /// softmax whose share goes nowhere (gpt-oss's;
    /// [`crate::nn::ops::sink_attention`]).
    pub attention_sinks: bool,
    /// The MLP without a gate applies xIELU with parameters of its own
    /// (Apertus's `hidden_act` "xielu": `mlp.act_fn.alpha_p` and `alpha_n`
    /// trained, `beta` and `eps` buffers of the checkpoint); its
    /// [`LlamaConfig::mlp_activation`] is then not used.
    pub xielu: bool,
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

impl LlamaConfig {
    /// Reads a hub `config.json` of a Llama, Mistral, Qwen2, Qwen3, Phi-3,
    /// Gemma, Gemma 2, Gemma 3 (text, or the text model of one with
    /// vision), SmolLM3, Granite, OLMo 2, OLMo 3, Mixtral, Qwen2-MoE,
    /// Qwen3-MoE, OLMoE, FlexOlmo, GLM-4.5 (`glm4_moe`), MiniMax-M2, GLM-4
    /// (`glm`, `glm4`), Cohere (`cohere`, `cohere2`), ERNIE 4.5
    /// (`ernie4_5`, `ernie4_5_moe`), dots.llm1 (`dots1`), Starcoder2, Phi, Arcee,
    /// Nemotron, EXAONE 4, Seed-OSS, GPT-NeoX, StableLM, OLMo, NanoChat, Hunyuan (dense
    /// and MoE), Sarvam (MoE and MLA), Jais 2,
    /// Helium, Ministral, CWM, Solar Open, Ministral 3, GPT-J, Falcon,
    /// DeepSeek-V2, DeepSeek-V3, GLM-4.7-Flash (`glm4_moe_lite`), Mistral 4,
    /// InternLM3, IQuest-Coder, EXAONE 3, Granite MoE (`granitemoe`,
    /// `granitemoeshared`), EXAONE MoE or gpt-oss model
    /// (by `model_type`; Llama without one): an error names the key whose value this model
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
        if families::TEXT_MODELS_OF.contains(&kind) {
            return Self::from_text_of_multimodal(config, kind);
        }
        let Some(family) = FAMILIES.iter().find(|f| f.model_type == kind) else {
            return Err(format!(
                "`model_type` is {kind:?}; this model reads {}",
                llama_types()
            ));
        };
        // A family's aliases, read as the keys they stand for; an error
        // names the key the file gave.
        match family.key_aliases {
            [] => Self::of_family(config, family, kind),
            aliases => {
                let mut renamed = config.clone();
                if let Some(object) = renamed.as_object_mut() {
                    keys::rename_keys(object, aliases);
                }
                Self::of_family(&renamed, family, kind).map_err(|mut err| {
                    for (theirs, ours) in aliases {
                        if config.get(theirs).is_some() {
                            err = err.replace(&format!("`{ours}`"), &format!("`{theirs}`"));
                        }
                    }
                    err
                })
            }
        }
    }

    /// [`LlamaConfig::from_json`] for `family`'s `config` (of `model_type`
    /// `kind`), its aliases read.
    fn of_family(
        config: &serde_json::Value,
        family: &'static Family,
        kind: &str,
    ) -> std::result::Result<Self, String> {
        let mut falcon = None;
        let rewritten = if family.falcon {
            let (keys, switches) = falcon_keys(config)?;
            falcon = Some(switches);
            Some(keys)
        } else if family.gptj {
            Some(gptj_keys(config))
        } else if family.neox {
            Some(neox_rotary_keys(config))
        } else if family.hunyuan {
            Some(ntk_alpha_as_theta(config)?)
        } else if let Some(rewrite) = family.key_rewrite {
            Some(rewrite(config))
        } else {
            family
                .default_rope
                .map(|rope| with_default_rope(config, rope))
        };
        let config = rewritten.as_ref().unwrap_or(config);
        crate::models::check_architectures(config, &family.architectures)?;
        let plain: Plain = read_keys(config)?;
        if plain.mlp_bias == Some(true) && !family.reads_mlp_bias {
            return Err(format!(
                "`mlp_bias` is true; {kind}'s MLPs have no biases in transformers: set it to false"
            ));
        }
        if family.one_bias_switch
            && plain.attention_bias.unwrap_or(false) != plain.mlp_bias.unwrap_or(false)
        {
            return Err(format!(
                "{kind}'s `attention_bias` differs from its `mlp_bias`: transformers (and this \
                 model) runs it as Llama, whose attention has one bias switch for q, k, v and o; \
                 set both the same"
            ));
        }
        let heads = plain.num_attention_heads;
        // Solar Open's dense width is its experts' (it has no dense layer).
        let intermediate_size = match (plain.intermediate_size, family.moe) {
            (Some(width), _) => width,
            (None, Some(moe)) if family.dense_width_of_experts => expert_size_of(config, moe)?,
            (None, _) => return Err("missing field `intermediate_size` (the MLP's width): use the config.json the checkpoint came with".into()),
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
        // Apertus's xIELU (its `hidden_act` where the file names none).
        let xielu = family.xielu
            && config
                .get("hidden_act")
                .and_then(|v| v.as_str())
                .is_none_or(|act| act == "xielu");
        // Granite SWA's base per layer.
        let layer_ropes = match family.layer_thetas {
            true => layer_thetas(&plain, sliding_window.as_ref(), &rope)?,
            false => None,
        };
        let (rotated_layers, rope, local_rope) = match layer_ropes {
            Some(ropes) => (Some(ropes.rotated), ropes.global, ropes.local),
            None => (rotated_layers, rope, local_rope),
        };
        let head_dim = match plain.head_dim.or(family.default_head_dim) {
            Some(width) => width,
            // transformers' default for Gemma.
            None if gemma.is_some() => 256,
            None if heads > 0 => plain.hidden_size / heads,
            None => 0,
        };
        // DeepSeek-V2's latent attention: heads of `qk_nope_head_dim +
        // qk_rope_head_dim`, the second part rotating.
        let latent = match family.latent {
            Some(stored) => Some(latent_of(config, stored)?),
            None => None,
        };
        let head_dim = match latent {
            Some((latent, rope, _)) => latent.nope_dim + rope,
            None => head_dim,
        };
        let rotary_dim = match family.rope.partial {
            _ if latent.is_some() => latent.map_or(0, |(_, rope, _)| rope),
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
            || falcon.as_ref().is_some_and(|f| f.bias)
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
        // GPT-NeoX's and Sarvam MoE's follow `attention_bias`.
        let biased_attention = !family.fused_qkv || family.fused_qkv_biased;
        let parallel_blocks = family.cohere
            || family.phi
            || family.gptj
            || falcon.as_ref().is_some_and(|f| f.parallel)
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
            num_key_value_heads: match latent {
                Some(_) => heads,
                None => plain
                    .num_key_value_heads
                    .or(family.default_kv_heads)
                    .unwrap_or(heads),
            },
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
            parallel_mlp_norm: family.neox && parallel_blocks
                || falcon.as_ref().is_some_and(|f| f.norm_per_branch),
            // Falcon's fused rows are in the model's order only with one key
            // and one value head.
            qkv_per_head: family.neox || falcon.as_ref().is_some_and(|f| !f.multi_query),
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
                || family.gptj
                || (family.reads_mlp_bias && plain.mlp_bias.unwrap_or(family.default_mlp_bias)),
            fused_qkv: family.fused_qkv,
            fused_gate_up: family.fused_gate_up,
            rope_interleaved: latent.map_or(family.rope.interleaved, |(_, _, i)| i),
            qk_norm: match plain
                .use_qk_norm
                .filter(|_| family.switched_qk_norm || family.cohere)
            {
                Some(true) if family.cohere => Some(QkNorm::HeadWeights),
                Some(true) => Some(QkNorm::PerHead),
                Some(false) => None,
                None if family.phi && plain.qk_layernorm => Some(QkNorm::PerHead),
                None if family.stablelm && plain.qk_layernorm => Some(QkNorm::HeadWeights),
                None => family.qk_norm,
            },
            input_norms: family.input_norms,
            sliding_window,
            pad_token_id: plain.pad_token_id,
            mlp_activation: match xielu {
                true => Activation::Silu,
                false => mlp_activation(config, gemma, family.ungated_mlp.map(|(_, a)| a))?,
            },
            ungated_mlp: family.ungated_mlp.map(|(names, _)| names),
            embedding_norm: family.embedding_norm,
            rope_negated: family.rope_negated,
            qk_norm_after_rotation: family.hunyuan,
            layer_names: family.names,
            head_bias: family.phi || family.gptj,
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
                && (!family.switched_output_norms || plain.use_post_norm.unwrap_or(true))
                || matches!(gemma, Some(Gemma::Two | Gemma::Three))
                || !family.input_norms,
            norm_names: family.output_norms.unwrap_or_default(),
            attention_scale: match gemma {
                Some(_) => later(plain.query_pre_attn_scalar).map(|scalar| scalar.powf(-0.5)),
                None if latent.is_some() => Some(score_mscale(config)?)
                    .filter(|&m| m != 1.0)
                    .map(|m| m / (head_dim as f64).sqrt()),
                None => granite(plain.attention_multiplier),
            },
            residual_multiplier: granite(plain.residual_multiplier),
            logits_scaling: granite(plain.logits_scaling)
                .filter(|_| !family.logits_scaling_multiplies),
            logit_scale: match family.cohere {
                true => Some(plain.logit_scale.unwrap_or(0.0625)).filter(|&s| s != 1.0),
                false if family.logits_scaling_multiplies => granite(plain.logits_scaling),
                false => None,
            },
            rotated_layers,
            text_of_multimodal: false,
            position_scale: match family.position_scaled {
                true => position_scale_of(config)?,
                false => None,
            },
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
                .filter(|_| matches!(gemma, Some(Gemma::Two | Gemma::Vault))),
            final_logit_softcapping: match family.final_softcap {
                Some(missing) => plain.final_logit_softcapping.or(missing),
                None => later(plain.final_logit_softcapping),
            },
            local_rope,
            moe: family.moe.map(|moe| moe_of(config, moe)).transpose()?,
            latent_attention: latent.map(|(latent, _, _)| latent),
            fused_experts: family
                .moe
                .is_some_and(|moe| moe.style.fused_in_every_file()),
            attention_sinks: family.sinks,
            xielu,
        };
        parsed.validate()?;
        Ok(parsed)
    }

    /// Gemma 3 with vision: its `text_config` read as `gemma3_text`'s.
    fn from_text_of_multimodal(
        config: &serde_json::Value,
        kind: &str,
    ) -> std::result::Result<Self, String> {
        let architecture = match kind {
            "gemma3" => "Gemma3ForConditionalGeneration",
            _ => "Mistral3ForConditionalGeneration",
        };
        crate::models::check_architectures(config, &[architecture])?;
        let Some(serde_json::Value::Object(text)) = config.get("text_config") else {
            return Err(format!(
                "`model_type` is {kind:?} but there is no `text_config` object, which holds the \
                 text model's settings in {architecture}'s checkpoints: use the config.json the \
                 checkpoint came with"
            ));
        };
        let mut text = text.clone();
        text.remove("architectures");
        let tied = config.get("tie_word_embeddings").filter(|t| !t.is_null());
        if kind == "gemma3" {
            text.insert("model_type".into(), "gemma3_text".into());
            if let Some(tied) = tied {
                text.entry("tie_word_embeddings").or_insert(tied.clone());
            }
        } else {
            // Mistral 3's text model is Mistral or Ministral 3; its head is
            // tied as the outer config says (`transformers`' default: tied).
            let inner = text
                .get("model_type")
                .and_then(|t| t.as_str())
                .unwrap_or("mistral");
            if !matches!(inner, "mistral" | "ministral3" | "mistral4") {
                return Err(format!(
                    "`text_config.model_type` is {inner:?}; Mistral 3's text model is \"mistral\", \
                     \"ministral3\" or \"mistral4\" here"
                ));
            }
            text.insert("model_type".into(), inner.into());
            text.insert(
                "tie_word_embeddings".into(),
                tied.cloned().unwrap_or(serde_json::Value::Bool(true)),
            );
        }
        let mut parsed = Self::from_json(&serde_json::Value::Object(text))
            .map_err(|e| format!("`text_config`: {e}"))?;
        parsed.text_of_multimodal = true;
        Ok(parsed)
    }

    /// The config of the hub directory `hub` ([`LlamaConfig::from_json`]),
    /// or an error naming its `config.json` and the key; whether its
    /// weights hold a mixture's experts fused is read from them.
    pub fn from_hub(hub: &HubDir) -> crate::Result<Self> {
        let mut config = crate::models::config_of(hub, Self::from_json)?;
        config.settle_with_files(hub)?;
        Ok(config)
    }

    /// What the config leaves to the files: whether they hold a mixture's
    /// experts fused ([`LlamaConfig::fused_experts`]); and a head
    /// the config ties but the files hold apart from the embedding, with
    /// other values, untied, as `transformers` 5 unties it (warning that the
    /// config and the checkpoint disagree). Mistral 3's outer config, for
    /// one, ties by default while Mistral Small's files hold their own
    /// head.
    pub(crate) fn settle_with_files(&mut self, hub: &HubDir) -> crate::Result<()> {
        self.settle_experts(hub);
        if !self.tie_word_embeddings {
            return Ok(());
        }
        let layout = super::super::Llama::hub_layout(self);
        let names = self.layer_names;
        let head = format!("{}.weight", names.head());
        let embedding = format!("{}.{}.weight", names.model(), names.embedding());
        let tensor = |var: &str| {
            layout
                .tensor_of(hub, var)
                .and_then(|name| Some((hub.tensor(&name)?, name)))
        };
        if let (Some((head, name)), Some((embedding, _))) = (tensor(&head), tensor(&embedding)) {
            let same = head.dtype == embedding.dtype
                && head.shape == embedding.shape
                && head.data == embedding.data;
            if !same {
                tracing::warn!(
                    "config.json ties the head to the embedding, but {} holds {name} apart, with \
                     other values: the head is untied, as transformers unties it",
                    hub.dir().display()
                );
                self.tie_word_embeddings = false;
            }
        }
        Ok(())
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
        ];
        check_sizes(&sizes)?;
        // Compared with a sequence's length only: no bound.
        if self.max_position_embeddings == 0 {
            return Err("`max_position_embeddings` must be positive".into());
        }
        if self.xielu && self.ungated_mlp.is_none() {
            return Err(
                "`xielu` is set for a gated MLP; xIELU is the activation of an MLP without a \
                 gate (`ungated_mlp`): set one, or clear `xielu`"
                    .into(),
            );
        }
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
        if let Some(latent) = &self.latent_attention {
            latent.validate(self.head_dim, self.rotary_dim)?;
            if self.num_key_value_heads != self.num_attention_heads
                || self.fused_qkv
                || self.qk_norm.is_some()
                || self.clip_qkv.is_some()
            {
                return Err(
                    "a latent attention has a K/V head per query head, no fused projection, no \
                     query or key norms and no clamp; set `num_key_value_heads` to \
                     `num_attention_heads` and clear the others"
                        .into(),
                );
            }
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
        if self.qkv_per_head && (!self.fused_qkv || self.rope_interleaved) {
            return Err(
                "rows group by group are those of a fused query, key and value projection whose \
                 heads rotate halves; set `fused_qkv` and clear `rope_interleaved`, or clear \
                 `qkv_per_head`"
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
        let params = self.params();
        if usize::try_from(params).is_err() {
            return Err(format!(
                "the sizes make a model of {params} parameters, more than this machine can \
                 count: check `num_hidden_layers` and the widths"
            ));
        }
        Ok(())
    }

    /// The parameters of a model of this shape (`usize::MAX` where they
    /// are more: [`LlamaConfig::validate`] refuses such a shape).
    pub fn num_params(&self) -> usize {
        usize::try_from(self.params()).unwrap_or(usize::MAX)
    }

    /// [`LlamaConfig::num_params`] in a type no shape of sizes up to
    /// [`MAX_SIZE`](crate::models::MAX_SIZE) overflows.
    fn params(&self) -> u128 {
        let [d, inner, head_dim, layers, vocab] = [
            self.hidden_size,
            self.intermediate_size,
            self.head_dim,
            self.num_hidden_layers,
            self.vocab_size,
        ]
        .map(|n| n as u128);
        let (q, kv) = (
            self.num_attention_heads as u128 * head_dim,
            self.num_key_value_heads as u128 * head_dim,
        );
        let biases = if self.qkv_bias { q + 2 * kv } else { 0 } + if self.o_bias { d } else { 0 };
        // Norms of the model's kind: with a bias where its norms have one.
        let biased = (1 + self.norm_bias as u128) * self.norm_weights as u128;
        let qk_norms = match self.qk_norm {
            Some(QkNorm::PerHead) => 2 * head_dim * biased,
            Some(QkNorm::Projection) => (q + kv) * biased,
            Some(QkNorm::HeadWeights) => q + kv,
            None => 0,
        };
        let norm = d * biased;
        let norms = match self.parallel_blocks {
            true => norm * (1 + self.parallel_mlp_norm as u128),
            false => 2 * norm * (self.input_norms as u128 + self.output_norms as u128),
        };
        let attention = match &self.latent_attention {
            Some(latent) => latent.num_params(
                self.hidden_size,
                (self.num_attention_heads, self.head_dim, self.rotary_dim),
                self.qkv_bias,
            ),
            None => 2 * d * q + 2 * d * kv + biases + qk_norms,
        };
        let sinks = self.num_attention_heads as u128 * self.attention_sinks as u128;
        let per_layer = norms + attention + sinks;
        let dense = {
            let projections = 2 + self.ungated_mlp.is_none() as u128;
            let biases = (projections - 1) * inner + d;
            // xIELU's alpha_p and alpha_n.
            let activation = 2 * self.xielu as u128;
            projections * d * inner + if self.mlp_bias { biases } else { 0 } + activation
        };
        let mlps = match &self.moe {
            Some(moe) => {
                let mixtures = moe.layers.iter().filter(|&&mixture| mixture).count() as u128;
                mixtures * moe.num_params(self.hidden_size)
                    + layers.saturating_sub(mixtures) * dense
            }
            None => layers * dense,
        };
        let head = match self.tie_word_embeddings {
            true => 0,
            false => vocab * (d + self.head_bias as u128),
        };
        layers * per_layer + mlps + vocab * d + norm + head
    }

    /// The rotary frequencies `1 / theta^(2i / rotary_dim)`, `i <
    /// rotary_dim / 2`, scaled as `transformers` scales them
    /// ([`Rope::inv_freq`]).
    pub fn inv_freq(&self) -> Vec<f64> {
        self.rope.inv_freq(self.rotary_dim)
    }
}
