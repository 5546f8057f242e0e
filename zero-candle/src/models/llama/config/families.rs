//! Each family read as Llama, and what sets it apart: one table.

use super::super::moe::families::{
    MoeFamily, Normalize, DEEPSEEK_V2_MOE, DEEPSEEK_V3_MOE, DOTS1_MOE, ERNIE4_5_MOE, EXAONE_MOE,
    GLM4_MOE, GLM4_MOE_LITE_MOE, GPT_OSS_MOE, GRANITE_MOE, GRANITE_MOE_SHARED, GRANITE_MOE_SWA,
    HUNYUAN_MOE, MINIMAX_M2_MOE, MISTRAL4_MOE, OLMOE_MOE, QWEN2_MOE, SARVAM_MLA_MOE, SARVAM_MOE,
    SOLAR_OPEN_MOE,
};
use super::super::moe::MoeStyle;
use super::family::{Family, Gemma, TypedRope, Windows, DEFAULT_WINDOW, LLAMA};
use super::latent::{minicpm3_keys, sarvam_mla_keys, LatentRope};
use super::{LayerNames, NormNames, QkNorm, UngatedMlp};
use crate::models::rope::RopeDialect;
use crate::nn::Activation;

/// Gemma's settings common to its generations.
pub(super) const GEMMA: Family = Family {
    model_type: "gemma",
    architectures: ["GemmaForCausalLM", "GemmaModel"],
    gemma: Some(Gemma::One),
    tied_by_default: true,
    ..LLAMA
};

/// OLMo 2: norms after the attention and the MLP instead of before, the
/// queries and keys normalized over whole projections.
pub(super) const OLMO2: Family = Family {
    model_type: "olmo2",
    default_rms_eps: 1e-5,
    architectures: ["Olmo2ForCausalLM", "Olmo2Model"],
    qk_norm: Some(QkNorm::Projection),
    input_norms: false,
    ..LLAMA
};

/// GLM-4 (`glm`, GLM-4-9B): biases on q, k and v by default (none on o),
/// gate and up in one weight, half of each head rotating as interleaved
/// pairs.
pub(super) const GLM: Family = Family {
    model_type: "glm",
    default_rms_eps: 1.5625e-7,
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
pub(super) const COHERE: Family = Family {
    model_type: "cohere",
    default_theta: 500_000.0,
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
pub(super) const ERNIE: Family = Family {
    model_type: "ernie4_5",
    default_rms_eps: 1e-5,
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
pub(super) static FAMILIES: [Family; 66] = [
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
        default_head_dim: Some(128),
        architectures: ["Qwen3ForCausalLM", "Qwen3Model"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Switched,
        ..LLAMA
    },
    Family {
        model_type: "phi3",
        default_rms_eps: 1e-5,
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
        windows: Windows::Typed {
            pattern: 2,
            missing: DEFAULT_WINDOW,
        },
        gemma: Some(Gemma::Two),
        ..GEMMA
    },
    // VaultGemma: Gemma 2's without the norms of the outputs, the MLP's
    // norm under Gemma 2's name.
    Family {
        model_type: "vaultgemma",
        architectures: ["VaultGemmaForCausalLM", "VaultGemmaModel"],
        names: LayerNames::VaultGemma,
        windows: Windows::Typed {
            pattern: 2,
            missing: DEFAULT_WINDOW,
        },
        gemma: Some(Gemma::Vault),
        ..GEMMA
    },
    Family {
        model_type: "gemma3_text",
        architectures: ["Gemma3ForCausalLM", "Gemma3TextModel"],
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Typed {
            pattern: 6,
            missing: DEFAULT_WINDOW,
        },
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
        windows: Windows::Typed {
            pattern: 4,
            missing: DEFAULT_WINDOW,
        },
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
        default_rms_eps: 1e-5,
        architectures: ["MixtralForCausalLM", "MixtralModel"],
        windows: Windows::EveryLayer { missing: None },
        default_theta: 1_000_000.0,
        moe: Some(MoeFamily {
            style: MoeStyle::Mixtral,
            num_experts: 8,
            experts_per_token: 2,
            expert_size: None,
            normalize: Normalize::Always,
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
        default_rms_eps: 1e-5,
        architectures: ["OlmoeForCausalLM", "OlmoeModel"],
        reads_clip_qkv: true,
        qk_norm: Some(QkNorm::Projection),
        moe: Some(OLMOE_MOE),
        ..LLAMA
    },
    Family {
        model_type: "flex_olmo",
        default_rms_eps: 1e-6,
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
        default_rms_eps: 1e-5,
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
        default_head_dim: Some(128),
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
        default_theta: 10_000.0,
        architectures: ["Cohere2ForCausalLM", "Cohere2Model"],
        windows: Windows::Typed {
            pattern: 4,
            missing: DEFAULT_WINDOW,
        },
        rotary_in_windows_only: true,
        ..COHERE
    },
    ERNIE,
    Family {
        model_type: "ernie4_5_moe",
        default_head_dim: None,
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
        names: LayerNames::Phi,
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
        default_rms_eps: 1e-5,
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
        windows: Windows::Typed {
            pattern: 4,
            missing: DEFAULT_WINDOW,
        },
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
        fused_qkv_biased: true,
        names: LayerNames::NeoX,
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
        names: LayerNames::StableLm,
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
        default_rms_eps: 1e-5,
        architectures: ["HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Model"],
        qk_norm: Some(QkNorm::PerHead),
        hunyuan: true,
        names: LayerNames::Hunyuan,
        ..LLAMA
    },
    // Sarvam MoE: GLM-4.5 (`transformers` runs it as GLM-4.5) under its
    // files' names (`LayerNames::Sarvam`: q, k and v in one weight), the
    // head norms on by default (`use_qk_norm`), the whole head rotating,
    // rotary base 8,000,000, heads of 64 and 4 key/value heads by default;
    // its released keys `num_shared_experts` and `use_qkv_bias` read as
    // GLM-4.5's.
    Family {
        model_type: "sarvam_moe",
        architectures: ["SarvamMoEForCausalLM", "Glm4MoeForCausalLM"],
        names: LayerNames::Sarvam,
        fused_qkv_biased: true,
        fused_qkv: true,
        o_bias: false,
        switched_qk_norm: true,
        qk_norm: Some(QkNorm::PerHead),
        default_head_dim: Some(64),
        default_kv_heads: Some(4),
        default_theta: 8_000_000.0,
        rope: RopeDialect {
            partial: Some(1.0),
            ..LLAMA.rope
        },
        key_aliases: &[
            ("num_shared_experts", "n_shared_experts"),
            ("use_qkv_bias", "attention_bias"),
        ],
        moe: Some(SARVAM_MOE),
        ..LLAMA
    },
    // Hunyuan MoE: Hunyuan's attention; in every layer a mixture of
    // experts (`mlp.gate.wg`, softmax, normalized) beside a shared MLP.
    Family {
        model_type: "hunyuan_v1_moe",
        default_rms_eps: 1e-5,
        architectures: ["HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Model"],
        qk_norm: Some(QkNorm::PerHead),
        hunyuan: true,
        names: LayerNames::Hunyuan,
        moe: Some(HUNYUAN_MOE),
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
        default_theta: 100_000.0,
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
        default_head_dim: Some(128),
        default_rms_eps: 1e-5,
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
        default_rms_eps: 1e-5,
        architectures: ["SolarOpenForCausalLM", "SolarOpenModel"],
        o_bias: false,
        default_head_dim: Some(128),
        default_theta: 1_000_000.0,
        moe: Some(SOLAR_OPEN_MOE),
        dense_width_of_experts: true,
        ..LLAMA
    },
    // Ministral 3 (the text model of Mistral's Ministral 3 and Mistral
    // Small 3): Mistral's, YaRN by default, the queries scaled by position
    // past the original context (`llama_4_scaling_beta`).
    Family {
        model_type: "ministral3",
        default_head_dim: Some(128),
        default_rms_eps: 1e-5,
        architectures: ["Ministral3ForCausalLM", "Ministral3Model"],
        windows: Windows::EveryLayer { missing: None },
        default_rope: Some(MINISTRAL3_ROPE),
        position_scaled: true,
        default_theta: 1_000_000.0,
        ..LLAMA
    },
    // GPT-J: GPT-2's keys, parallel blocks after one biased LayerNorm, q,
    // k, v and out without biases, `fc_in` -> GELU -> `fc_out`, the first
    // `rotary_dim` values of each head rotating as interleaved pairs, the
    // head biased.
    Family {
        model_type: "gptj",
        architectures: ["GPTJForCausalLM", "GPTJModel"],
        gptj: true,
        names: LayerNames::GptJ,
        biased_layer_norms: true,
        ungated_mlp: Some((UngatedMlp::FcInOut, Activation::Gelu)),
        rope: RopeDialect {
            partial: Some(1.0),
            interleaved: true,
            ..LLAMA.rope
        },
        ..LLAMA
    },
    // Falcon: biased LayerNorms, q, k and v in one weight (head by head, or
    // group by group in the new architecture, or all queries then one key
    // and one value with `multi_query`), parallel blocks (a norm per branch
    // in the new architecture), an MLP without a gate (exact GELU), biases
    // where `bias`, the head tied by default.
    Family {
        model_type: "falcon",
        architectures: ["FalconForCausalLM", "FalconModel"],
        falcon: true,
        fused_qkv_biased: true,
        names: LayerNames::Falcon,
        fused_qkv: true,
        biased_layer_norms: true,
        ungated_mlp: Some((UngatedMlp::NeoX, Activation::GeluErf)),
        tied_by_default: true,
        ..LLAMA
    },
    // DeepSeek-V2 (and V2-Lite): the latent attention, its rotated values
    // as interleaved pairs; from layer `first_k_dense_replace` on, a
    // mixture chosen by softmax probability (within the best groups with
    // `group_limited_greedy`), beside shared experts.
    Family {
        model_type: "deepseek_v2",
        architectures: ["DeepseekV2ForCausalLM", "DeepseekV2Model"],
        latent: Some(LatentRope::Pairs),
        moe: Some(DEEPSEEK_V2_MOE),
        ..LLAMA
    },
    // DeepSeek-V3 (and Kimi K2, Moonlight): the latent attention
    // (`rope_interleave`), GLM-4.5's mixture from layer
    // `first_k_dense_replace` (3) on.
    Family {
        model_type: "deepseek_v3",
        architectures: ["DeepseekV3ForCausalLM", "DeepseekV3Model"],
        latent: Some(LatentRope::Switched),
        moe: Some(DEEPSEEK_V3_MOE),
        ..LLAMA
    },
    // Sarvam MLA (Sarvam-105B; run by `transformers` as DeepSeek-V3):
    // one `q_proj` where `q_lora_rank` is absent, 128 experts in one group
    // from layer 1 on by default; its released keys (`num_shared_experts`,
    // "deepseek_yarn") read as DeepSeek-V3's.
    Family {
        model_type: "sarvam_mla",
        architectures: ["SarvamMLAForCausalLM", "DeepseekV3ForCausalLM"],
        latent: Some(LatentRope::Switched),
        moe: Some(SARVAM_MLA_MOE),
        key_rewrite: Some(sarvam_mla_keys),
        key_aliases: &[("num_shared_experts", "n_shared_experts")],
        ..LLAMA
    },
    // GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's latent attention,
    // GLM-4.5's mixture in the layers `mlp_layer_types` names sparse (all
    // but the first by default).
    Family {
        model_type: "glm4_moe_lite",
        architectures: ["Glm4MoeLiteForCausalLM", "Glm4MoeLiteModel"],
        latent: Some(LatentRope::Switched),
        default_rms_eps: 1e-5,
        moe: Some(GLM4_MOE_LITE_MOE),
        ..LLAMA
    },
    // Mistral 4: DeepSeek-V3's latent attention with Ministral 3's scale of
    // the queries by position, YaRN by default; in every layer a mixture
    // chosen by softmax probability within the best groups (by their two
    // best), normalized, beside a shared expert.
    Family {
        model_type: "mistral4",
        architectures: ["Mistral4ForCausalLM", "Mistral4Model"],
        latent: Some(LatentRope::Switched),
        position_scaled: true,
        default_rope: Some(MISTRAL4_ROPE),
        rope: RopeDialect {
            // Its files give the rotated share of each head, which the
            // latent attention's widths say.
            partial: Some(1.0),
            ..LLAMA.rope
        },
        moe: Some(MISTRAL4_MOE),
        ..LLAMA
    },
    // MiniCPM3: DeepSeek-V2's latent attention rotating halves, a dense MLP
    // in every layer, its multipliers read as Granite's (`minicpm3_keys`);
    // `rms_norm_eps` 1e-5 and the head tied by default.
    Family {
        model_type: "minicpm3",
        architectures: ["MiniCPM3ForCausalLM", "MiniCPM3Model"],
        latent: Some(LatentRope::Halves),
        multipliers: true,
        key_rewrite: Some(minicpm3_keys),
        default_rms_eps: 1e-5,
        tied_by_default: true,
        ..LLAMA
    },
    // Youtu-LLM: DeepSeek-V3's latent attention (`rope_interleave`, on by
    // default), a dense MLP in every layer, the head tied by default.
    Family {
        model_type: "youtu",
        architectures: ["YoutuForCausalLM", "YoutuModel"],
        latent: Some(LatentRope::Switched),
        tied_by_default: true,
        ..LLAMA
    },
    // Apertus: Llama's attention with an RMS norm of each query and key
    // head, the blocks' norms its own names (`attention_layernorm`,
    // `feedforward_layernorm`), an MLP without a gate (`mlp.up_proj`, `mlp.down_proj`) through
    // xIELU (its `hidden_act`, with parameters of its own) or the activation
    // `hidden_act` names; llama3 scaling on a base of 12,000,000 and
    // `rms_norm_eps` 1e-5 by default.
    Family {
        model_type: "apertus",
        architectures: ["ApertusForCausalLM", "ApertusModel"],
        names: LayerNames::Apertus,
        qk_norm: Some(QkNorm::PerHead),
        ungated_mlp: Some((UngatedMlp::UpDown, Activation::Relu2)),
        xielu: true,
        default_rope: Some(APERTUS_ROPE),
        default_rms_eps: 1e-5,
        ..LLAMA
    },
    // InternLM3: Llama (`transformers` runs it as Llama) with heads of 128
    // and `rms_norm_eps` 1e-5 by default, its files' `qkv_bias` and `bias`
    // read as `attention_bias` and `mlp_bias`.
    Family {
        model_type: "internlm3",
        architectures: ["InternLM3ForCausalLM", "LlamaForCausalLM"],
        reads_mlp_bias: true,
        default_head_dim: Some(128),
        default_rms_eps: 1e-5,
        key_aliases: &[("qkv_bias", "attention_bias"), ("bias", "mlp_bias")],
        one_bias_switch: true,
        ..LLAMA
    },
    // IQuest-Coder: Llama (run as Llama) with heads of 128 and
    // `rms_norm_eps` 1e-5 by default; `use_sliding_window` refused, as
    // `transformers` refuses it.
    Family {
        model_type: "iquestcoder",
        architectures: ["IQuestCoderForCausalLM", "LlamaForCausalLM"],
        reads_mlp_bias: true,
        default_head_dim: Some(128),
        default_rms_eps: 1e-5,
        windows: Windows::Unsupported,
        ..LLAMA
    },
    // EXAONE 3 and 3.5: Llama (`transformers` runs them as Llama) under
    // their own names (`transformer.h.{i}.attn.attention`, `ln_1`, `ln_2`,
    // `mlp.c_fc_0`, ...) and keys (`num_layers`, `layer_norm_epsilon`,
    // `activation_function`); rotary base 500,000, `rms_norm_eps` 1e-5 and
    // 8 key/value heads by default.
    Family {
        model_type: "exaone",
        architectures: ["ExaoneForCausalLM", "LlamaForCausalLM"],
        names: LayerNames::Exaone,
        reads_mlp_bias: true,
        default_rms_eps: 1e-5,
        default_theta: 500_000.0,
        default_kv_heads: Some(8),
        key_aliases: &[
            ("num_layers", "num_hidden_layers"),
            ("layer_norm_epsilon", "rms_norm_eps"),
            ("activation_function", "hidden_act"),
        ],
        ..LLAMA
    },
    // Granite MoE: Granite's multipliers, in every layer a mixture chosen by
    // logit and weighted by the chosen logits' softmax, its experts fused in
    // `input_linear` and `output_linear`.
    Family {
        model_type: "granitemoe",
        architectures: ["GraniteMoeForCausalLM", "GraniteMoeModel"],
        multipliers: true,
        moe: Some(GRANITE_MOE),
        ..LLAMA
    },
    // Granite MoE with a shared MLP beside each mixture.
    Family {
        model_type: "granitemoeshared",
        architectures: ["GraniteMoeSharedForCausalLM", "GraniteMoeSharedModel"],
        multipliers: true,
        moe: Some(GRANITE_MOE_SHARED),
        ..LLAMA
    },
    // HyperCLOVA X: Granite's multipliers but `logits_scaling` multiplying
    // the logits, norms of the attention's and the MLP's outputs
    // (`post_norm1`, `post_norm2`) where `use_post_norm` (on by default).
    Family {
        model_type: "hyperclovax",
        architectures: ["HyperCLOVAXForCausalLM", "HyperCLOVAXModel"],
        reads_mlp_bias: true,
        multipliers: true,
        output_norms: Some(NormNames::HyperClovaX),
        switched_output_norms: true,
        logits_scaling_multiplies: true,
        ..LLAMA
    },
    // Granite SWA: Granite with windows of 128 in the layers `layer_types`
    // names (all but every fourth from the first by default), a sink per
    // query head, a base per layer (`layer_rope_theta`, 0 where the layer
    // does not rotate); the head tied, `rms_norm_eps` 1e-5 and 4 key/value
    // heads by default.
    Family {
        model_type: "granite_swa",
        architectures: ["GraniteSWAForCausalLM", "GraniteSWAModel"],
        reads_mlp_bias: true,
        multipliers: true,
        windows: GRANITE_SWA_WINDOWS,
        sinks: true,
        layer_thetas: true,
        default_rms_eps: 1e-5,
        tied_by_default: true,
        default_kv_heads: Some(4),
        ..LLAMA
    },
    // Granite MoE SWA: Granite MoE Shared's mixture (the shared MLP off by
    // default) beneath Granite SWA's attention.
    Family {
        model_type: "granitemoe_swa",
        architectures: ["GraniteMoeSWAForCausalLM", "GraniteMoeSWAModel"],
        multipliers: true,
        windows: GRANITE_SWA_WINDOWS,
        sinks: true,
        layer_thetas: true,
        moe: Some(GRANITE_MOE_SWA),
        ..LLAMA
    },
    // EXAONE MoE (K-EXAONE): EXAONE 4's attention (head norms, windows in
    // three layers of four which alone rotate) in pre-norm blocks, GLM-4.5's
    // mixture with its bias beside the router, `num_shared_experts`.
    Family {
        model_type: "exaone_moe",
        architectures: ["ExaoneMoeForCausalLM", "ExaoneMoeModel"],
        default_rms_eps: 1e-5,
        qk_norm: Some(QkNorm::PerHead),
        windows: Windows::Typed {
            pattern: 4,
            missing: DEFAULT_WINDOW,
        },
        rotary_in_windows_only: true,
        rotary_without_windows: true,
        key_aliases: &[("num_shared_experts", "n_shared_experts")],
        moe: Some(EXAONE_MOE),
        ..LLAMA
    },
    // gpt-oss: a sink per query head, windows in every other layer from the
    // first, biases on the attention, YaRN by default; a mixture in every
    // layer, its experts with biases and the clamped SwiGLU, fused in the
    // files.
    Family {
        model_type: "gpt_oss",
        architectures: ["GptOssForCausalLM", "GptOssModel"],
        default_rms_eps: 1e-5,
        attention_bias: true,
        default_head_dim: Some(64),
        windows: Windows::Typed {
            pattern: 2,
            missing: 128,
        },
        default_theta: 150_000.0,
        default_rope: Some(GPT_OSS_ROPE),
        sinks: true,
        moe: Some(GPT_OSS_MOE),
        ..LLAMA
    },
];

/// Granite SWA's windows: of 128, in all but every fourth layer from the
/// first where `layer_types` does not say.
const GRANITE_SWA_WINDOWS: Windows = Windows::Listed {
    every: 4,
    missing: 128,
};

/// gpt-oss's rotation where its file gives none (`transformers`' default).
pub(super) const GPT_OSS_ROPE: &str = r#"{"rope_type": "yarn", "rope_theta": 150000.0,
    "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
    "original_max_position_embeddings": 4096}"#;

/// Apertus's rotation where its file gives none (`transformers`' default).
pub(super) const APERTUS_ROPE: &str = r#"{"rope_type": "llama3", "rope_theta": 12000000.0,
    "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0}"#;

/// Mistral 4's rotation where its file gives none (`transformers`'
/// default).
pub(super) const MISTRAL4_ROPE: &str = r#"{"rope_type": "yarn", "rope_theta": 10000.0,
    "factor": 128.0, "original_max_position_embeddings": 8192, "beta_fast": 32.0,
    "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}"#;

/// Ministral 3's rotation where its file gives none (`transformers`'
/// default).
pub(super) const MINISTRAL3_ROPE: &str = r#"{"rope_type": "yarn", "rope_theta": 1000000.0,
    "factor": 16.0, "original_max_position_embeddings": 16384, "beta_fast": 32.0,
    "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}"#;

/// CWM's rotation where its file gives none (`transformers`' default).
pub(super) const CWM_ROPE: &str = r#"{"rope_type": "llama3", "rope_theta": 1000000.0, "factor": 16.0,
    "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}"#;

/// The multimodal `model_type`s whose text model is read as Llama (its
/// `text_config`).
pub(super) const TEXT_MODELS_OF: [&str; 2] = ["gemma3", "mistral3"];

/// Whether `model_type` `kind` is read as Llama.
pub(crate) fn reads(kind: &str) -> bool {
    TEXT_MODELS_OF.contains(&kind) || FAMILIES.iter().any(|f| f.model_type == kind)
}

/// The `model_type`s read as Llama, for messages.
pub(crate) fn llama_types() -> String {
    let families = FAMILIES.iter().map(|f| format!("{:?}", f.model_type));
    let wrappers = TEXT_MODELS_OF.map(|kind| format!("{kind:?} (its text model)"));
    let mut names: Vec<String> = families.chain(wrappers).collect();
    let last = names.pop().unwrap_or_default();
    format!("{} and {last}", names.join(", "))
}

#[cfg(test)]
mod tests {
    use super::{llama_types, reads, FAMILIES, TEXT_MODELS_OF};

    #[test]
    fn the_message_names_every_model_type_read_once() {
        let message = llama_types();
        for kind in FAMILIES.iter().map(|f| f.model_type).chain(TEXT_MODELS_OF) {
            assert!(reads(kind), "{kind}");
            let quoted = format!("{kind:?}");
            assert_eq!(message.matches(&quoted).count(), 1, "{kind} in {message}");
        }
        assert!(message.starts_with("\"llama\", \"mistral\""), "{message}");
        assert!(
            message.ends_with(", \"gemma3\" (its text model) and \"mistral3\" (its text model)")
        );
    }
}
