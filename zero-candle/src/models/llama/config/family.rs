//! What sets a family read as Llama apart: [`Family`], and Llama itself.

use super::super::moe::families::MoeFamily;
use super::latent::LatentRope;
use super::{LayerNames, NormNames, QkNorm, UngatedMlp};
use crate::models::rope::RopeDialect;
use crate::nn::Activation;

/// `transformers`' `max_window_layers` (Qwen2, Qwen3).
pub(super) const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// `transformers`' `sliding_window` where a Mistral or Qwen file leaves it
/// out.
pub(super) const DEFAULT_WINDOW: usize = 4096;

/// How a family reads `sliding_window`.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Windows {
    /// In the layers `layer_types` names, or all but every
    /// `sliding_window_pattern`-th (`pattern` when absent) (Gemma 2, 3);
    /// `missing` where the file leaves `sliding_window` out.
    Typed { pattern: usize, missing: usize },
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

/// Rotary parameters per layer type (Gemma 3, OLMo 3): the bases where a
/// file leaves them out, as `transformers` defaults them.
#[derive(Clone, Copy)]
pub(super) struct TypedRope {
    /// The full-attention layers' `rope_theta` where absent.
    pub(super) global_theta: f64,
    /// The key of the sliding layers' base in earlier files (Gemma 3's
    /// `rope_local_base_freq`), if any.
    pub(super) local_theta_key: Option<&'static str>,
    /// The sliding layers' base where absent.
    pub(super) local_theta: f64,
}

/// What a Gemma generation changes from Llama.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Gemma {
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
    /// VaultGemma's: Gemma 2's without the norms of the attention's and
    /// the MLP's outputs.
    Vault,
}

/// A family read as Llama: what sets it apart.
pub(super) struct Family {
    pub(super) model_type: &'static str,
    pub(super) architectures: [&'static str; 2],
    /// The query, key and value projections always have biases.
    pub(super) qkv_bias: bool,
    /// `attention_bias` where the file does not say (GLM's is on).
    pub(super) attention_bias: bool,
    /// `mlp_bias` gives the MLPs biases (Llama, SmolLM3, Granite).
    pub(super) reads_mlp_bias: bool,
    /// `use_bias` gives every projection a bias (ERNIE 4.5, Starcoder2).
    pub(super) reads_use_bias: bool,
    /// `use_bias` where the file does not say (Starcoder2's is on).
    pub(super) default_use_bias: bool,
    /// `mlp_bias` where the file does not say (Jais 2's is on).
    pub(super) default_mlp_bias: bool,
    /// `rms_norm_eps` where the file does not say (Helium's 1e-8).
    pub(super) default_rms_eps: f64,
    /// Every projection and the head have biases, whatever the file says;
    /// Phi's names; parallel blocks; `qk_layernorm` read (Phi).
    pub(super) phi: bool,
    /// GPT-NeoX's names, its rows of `query_key_value` head by head, its
    /// parallel blocks (`use_parallel_residual`) with a norm for each
    /// branch, its MLP biased whatever the file says.
    pub(super) neox: bool,
    /// StableLM's switches: `use_qkv_bias`, `qk_layernorm` (a LayerNorm of
    /// each head, a tensor per head), `use_parallel_residual` (one norm).
    pub(super) stablelm: bool,
    /// GPT-J's: GPT-2's keys (`n_embd`, ...), its names, parallel blocks
    /// after one norm, the MLP and the head biased, `rotary_dim` values of
    /// each head rotating as interleaved pairs.
    pub(super) gptj: bool,
    /// Falcon's: its keys and names, and its switches
    /// (`new_decoder_architecture`, `multi_query`, `parallel_attn`,
    /// `num_ln_in_parallel_attn`, `bias`).
    pub(super) falcon: bool,
    /// `attention_bias` gives the output projection a bias too (all but
    /// GLM-4.5, whose `attention_bias` is the query's, key's and value's).
    pub(super) o_bias: bool,
    /// `use_qk_norm` switches on an RMS norm of each query and key head
    /// (GLM-4.5).
    pub(super) switched_qk_norm: bool,
    /// The names of the layers that differ from Llama's.
    pub(super) names: LayerNames,
    /// The queries and keys are RMS-normalized.
    pub(super) qk_norm: Option<QkNorm>,
    /// The blocks normalize their inputs (all but OLMo 2).
    pub(super) input_norms: bool,
    /// Phi-3's `qkv_proj`.
    pub(super) fused_qkv: bool,
    /// Phi-3's and GLM's `gate_up_proj`.
    pub(super) fused_gate_up: bool,
    /// The blocks normalize the attention's and the MLP's outputs, under
    /// these names (GLM-4; Gemma 2's and OLMo 2's come with them).
    pub(super) output_norms: Option<NormNames>,
    /// `head_dim` where the file does not say (GLM's 128); else
    /// `hidden_size / num_attention_heads`.
    pub(super) default_head_dim: Option<usize>,
    /// How the rotary settings are read beyond Llama's: Phi-3's "su" and
    /// "yarn" meaning longrope, part of each head rotating (Phi-3, GLM-4.5,
    /// MiniMax-M2).
    pub(super) rope: RopeDialect,
    pub(super) windows: Windows,
    /// Gemma's differences, where it is one.
    pub(super) gemma: Option<Gemma>,
    /// `no_rope_layers` is read (SmolLM3).
    pub(super) nope_layers: bool,
    /// Cohere's: LayerNorms without bias, parallel blocks, `logit_scale`.
    pub(super) cohere: bool,
    /// LayerNorms with a bias, their epsilon `norm_epsilon` (Starcoder2),
    /// `layer_norm_eps` (Phi) or `norm_eps` (Nemotron).
    pub(super) biased_layer_norms: bool,
    /// The norms scale by `1 + weight` (Nemotron's LayerNorm1P; Gemma's
    /// RMS norms come with [`Gemma`]).
    pub(super) norm_plus_one: bool,
    /// LayerNorms without parameters, their epsilon 1e-5 whatever the file
    /// says (OLMo's).
    pub(super) parameter_free_norms: bool,
    /// `clip_qkv` is read (OLMo, OLMoE).
    pub(super) reads_clip_qkv: bool,
    /// The MLP has no gate (Starcoder2), its activation this where the
    /// file names none (`transformers`' default `hidden_act`).
    pub(super) ungated_mlp: Option<(UngatedMlp, Activation)>,
    /// The final norm also normalizes the embeddings before the first block
    /// (NanoChat's).
    pub(super) embedding_norm: bool,
    /// The rotation turns by the negative angles (NanoChat's).
    pub(super) rope_negated: bool,
    /// Hunyuan's names and norms of the rotated query and key heads, and
    /// its rotation's `alpha` (NTK: the base times `alpha^(d / (d - 2))`).
    pub(super) hunyuan: bool,
    /// The rotation (a `rope_parameters` object) where the file gives none
    /// (CWM's).
    pub(super) default_rope: Option<&'static str>,
    /// The rotary parameters' `llama_4_scaling_beta` scales the queries by
    /// position (Ministral 3).
    pub(super) position_scaled: bool,
    /// `final_logit_softcapping` is read, this where the file leaves it out
    /// (NanoChat's 15).
    pub(super) final_softcap: Option<Option<f64>>,
    /// Only the sliding-window layers rotate (Cohere 2).
    pub(super) rotary_in_windows_only: bool,
    /// With no window in any layer, every layer rotates (EXAONE 4; Cohere 2's
    /// none).
    pub(super) rotary_without_windows: bool,
    /// `attention_out_bias` gives the output projection its bias, apart
    /// from `attention_bias`'s query, key and value ones (Seed-OSS).
    pub(super) reads_attention_out_bias: bool,
    /// Granite's multipliers are read.
    pub(super) multipliers: bool,
    /// The head is tied where the file does not say.
    pub(super) tied_by_default: bool,
    /// `rope_theta` where the file does not say.
    pub(super) default_theta: f64,
    /// The rotary parameters are given per layer type (Gemma 3, OLMo 3).
    pub(super) typed_rope: Option<TypedRope>,
    /// The MLP is a mixture of experts.
    pub(super) moe: Option<MoeFamily>,
    /// Keys read as others where those are absent (InternLM3's
    /// `qkv_bias` as `attention_bias`, EXAONE 3's `num_layers` as
    /// `num_hidden_layers`); errors name the key the file gave.
    pub(super) key_aliases: &'static [(&'static str, &'static str)],
    /// `num_key_value_heads` where the file does not say (EXAONE 3's 8;
    /// else every query head's own).
    pub(super) default_kv_heads: Option<usize>,
    /// DeepSeek-V2's latent attention ([`super::LatentAttention`]), its
    /// rotated values stored as this says.
    pub(super) latent: Option<LatentRope>,
    /// A sink per query head (gpt-oss's `self_attn.sinks`).
    pub(super) sinks: bool,
    /// The file's keys rewritten before they are read (Sarvam MLA's as
    /// DeepSeek-V3's).
    pub(super) key_rewrite: Option<fn(&serde_json::Value) -> serde_json::Value>,
    /// The fused q, k and v follow `attention_bias` (GPT-NeoX, Falcon,
    /// Sarvam MoE; Phi-3's have no biases whatever the file says).
    pub(super) fused_qkv_biased: bool,
    /// `attention_bias` and `mlp_bias` must agree: the files switch them
    /// apart, but `transformers` runs the model as Llama, whose attention
    /// has one switch for q, k, v and o (InternLM3).
    pub(super) one_bias_switch: bool,
    /// `intermediate_size` is the experts' width where the file leaves it
    /// out (Solar Open, which has no dense layer).
    pub(super) dense_width_of_experts: bool,
    /// `layer_rope_theta` gives each layer's base, 0 where it does not
    /// rotate (Granite SWA).
    pub(super) layer_thetas: bool,
    /// `use_post_norm` switches [`Family::output_norms`] (on where absent:
    /// HyperCLOVA X's peri-layer norms).
    pub(super) switched_output_norms: bool,
    /// Granite's `logits_scaling` multiplies the logits rather than
    /// dividing them (HyperCLOVA X).
    pub(super) logits_scaling_multiplies: bool,
    /// `hidden_act` "xielu" (the default) is xIELU with parameters of its
    /// own in the MLP without a gate (Apertus).
    pub(super) xielu: bool,
}

/// Llama itself (but for `mlp_bias`, which its family list reads): what the
/// other families differ from.
pub(super) const LLAMA: Family = Family {
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
    gptj: false,
    falcon: false,
    o_bias: true,
    switched_qk_norm: false,
    names: LayerNames::Llama,
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
    position_scaled: false,
    final_softcap: None,
    rotary_in_windows_only: false,
    rotary_without_windows: false,
    reads_attention_out_bias: false,
    multipliers: false,
    tied_by_default: false,
    default_theta: 10_000.0,
    typed_rope: None,
    moe: None,
    latent: None,
    sinks: false,
    key_aliases: &[],
    default_kv_heads: None,
    key_rewrite: None,
    fused_qkv_biased: false,
    one_bias_switch: false,
    dense_width_of_experts: false,
    layer_thetas: false,
    switched_output_norms: false,
    logits_scaling_multiplies: false,
    xielu: false,
};
