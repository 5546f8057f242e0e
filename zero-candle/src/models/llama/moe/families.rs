//! Each family's [`MoeFamily`]: what its `config.json` leaves out of a
//! mixture of experts.

use super::MoeStyle;

/// How a family's config describes its mixture of experts: `transformers`'
/// defaults for what a file leaves out.
#[derive(Clone, Copy)]
pub(in crate::models::llama) struct MoeFamily {
    pub(in crate::models::llama) style: MoeStyle,
    pub(in crate::models::llama) num_experts: usize,
    pub(in crate::models::llama) experts_per_token: usize,
    /// `moe_intermediate_size` where the file leaves it out; `None`: the
    /// experts are `intermediate_size` wide (Mixtral, OLMoE).
    pub(in crate::models::llama) expert_size: Option<usize>,
    /// Whether the chosen experts' weights are divided by their sum.
    pub(in crate::models::llama) normalize: Normalize,
    /// How many of a group's best probabilities rank it in the grouped
    /// softmax router (DeepSeek-V2's one, Mistral 4's two).
    pub(in crate::models::llama) group_rank: usize,
    /// `topk_method` says whether the grouped softmax router uses its
    /// groups (DeepSeek-V2's `group_limited_greedy`; Mistral 4 always
    /// does).
    pub(in crate::models::llama) reads_topk_method: bool,
    /// `shared_expert_intermediate_size` where the file leaves it out, for
    /// a family with a shared expert (Qwen2-MoE).
    pub(in crate::models::llama) shared_expert_size: Option<usize>,
    /// `n_shared_experts` where the file leaves it out, for a family whose
    /// shared experts are one MLP without a gate (GLM-4.5's).
    pub(in crate::models::llama) shared_experts: usize,
    /// `decoder_sparse_step` and `mlp_only_layers` are read (Qwen).
    pub(in crate::models::llama) sparse_layers: bool,
    /// `first_k_dense_replace` where the file leaves it out (GLM-4.5's
    /// router: 1; dots.llm1's 0).
    pub(in crate::models::llama) first_dense: usize,
    /// `mlp_layer_types` (`"dense"`, `"sparse"`) says which layers are
    /// mixtures where the file gives it (GLM-4.7-Flash).
    pub(in crate::models::llama) layer_types: bool,
    /// `n_group` and `topk_group` where the file leaves them out.
    pub(in crate::models::llama) groups: (usize, usize),
    /// `routed_scaling_factor` where the file leaves it out.
    pub(in crate::models::llama) scale: f64,
    pub(in crate::models::llama) aux_loss_coef: f64,
    /// [`MoeConfig::router_in_f32`].
    pub(in crate::models::llama) router_in_f32: bool,
}

/// Whether a family divides the chosen experts' weights by their sum.
#[derive(Clone, Copy)]
pub(in crate::models::llama) enum Normalize {
    /// Always (Mixtral).
    Always,
    /// Never (DeepSeek-V2).
    Never,
    /// As `norm_topk_prob` says, this where the file leaves it out.
    Key(bool),
}

/// GLM-4.5's mixture (`glm4_moe`): the sigmoid router, `n_shared_experts`
/// shared experts of `moe_intermediate_size` as one MLP, the first
/// `first_k_dense_replace` layers dense; no load-balancing loss.
pub(in crate::models::llama) const GLM4_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Glm,
    num_experts: 128,
    experts_per_token: 8,
    expert_size: Some(1408),
    normalize: Normalize::Key(true),
    group_rank: 2,
    reads_topk_method: false,
    shared_expert_size: None,
    shared_experts: 1,
    sparse_layers: false,
    first_dense: 1,
    layer_types: false,
    groups: (1, 1),
    scale: 1.0,
    aux_loss_coef: 0.0,
    router_in_f32: true,
};

/// DeepSeek-V3's mixture (`deepseek_v3`): GLM-4.5's router and shared
/// experts, `transformers`' defaults (256 experts of 2048, 8 per token from
/// the 4 best of 8 groups, times 2.5, the first 3 layers dense).
pub(in crate::models::llama) const DEEPSEEK_V3_MOE: MoeFamily = MoeFamily {
    num_experts: 256,
    expert_size: Some(2048),
    first_dense: 3,
    groups: (8, 4),
    scale: 2.5,
    ..GLM4_MOE
};

/// GLM-4.7-Flash's mixture (`glm4_moe_lite`): GLM-4.5's, in the layers
/// `mlp_layer_types` names sparse (all but the first by default).
pub(in crate::models::llama) const GLM4_MOE_LITE_MOE: MoeFamily = MoeFamily {
    num_experts: 64,
    experts_per_token: 4,
    expert_size: Some(1536),
    layer_types: true,
    scale: 1.8,
    ..GLM4_MOE
};

/// DeepSeek-V2's mixture (`deepseek_v2`): the grouped softmax router
/// (`topk_method`), `n_shared_experts` (2) shared experts as one MLP,
/// from layer `first_k_dense_replace` (0) on; 64 experts of 1407, 6 per
/// token (the released files' number; `transformers` has no default).
pub(in crate::models::llama) const DEEPSEEK_V2_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::DeepSeek,
    num_experts: 64,
    experts_per_token: 6,
    expert_size: Some(1407),
    normalize: Normalize::Never,
    group_rank: 1,
    reads_topk_method: true,
    shared_experts: 2,
    first_dense: 0,
    ..GLM4_MOE
};

/// Mistral 4's mixture (`mistral4`): DeepSeek-V2's names and softmax
/// router, its groups ranked by their two best, the choices normalized;
/// 128 experts of 2048, 4 per token, a shared expert, every layer.
pub(in crate::models::llama) const MISTRAL4_MOE: MoeFamily = MoeFamily {
    num_experts: 128,
    experts_per_token: 4,
    expert_size: Some(2048),
    normalize: Normalize::Key(true),
    group_rank: 2,
    reads_topk_method: false,
    shared_experts: 1,
    router_in_f32: false,
    ..DEEPSEEK_V2_MOE
};

/// Granite MoE's mixture (`granitemoe`): experts of `intermediate_size`
/// (8, 2 per token), chosen by logit and weighted by the softmax of the
/// chosen logits, in every layer; the load-balancing loss where
/// `output_router_logits`.
pub(in crate::models::llama) const GRANITE_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Granite,
    num_experts: 8,
    experts_per_token: 2,
    expert_size: None,
    normalize: Normalize::Never,
    shared_expert_size: None,
    sparse_layers: false,
    ..MINIMAX_M2_MOE
};

/// Granite MoE with a shared MLP (`granitemoeshared`):
/// `shared_intermediate_size` wide (none where 0, the default), its gate and
/// up in one weight (`shared_mlp.input_linear`), beside the mixture.
pub(in crate::models::llama) const GRANITE_MOE_SHARED: MoeFamily = MoeFamily {
    shared_expert_size: Some(0),
    ..GRANITE_MOE
};

/// Granite MoE SWA's mixture (`granitemoe_swa`): Granite MoE Shared's under
/// `transformers` 5's names.
pub(in crate::models::llama) const GRANITE_MOE_SWA: MoeFamily = MoeFamily {
    style: MoeStyle::GraniteSwa,
    ..GRANITE_MOE_SHARED
};

/// EXAONE MoE's mixture (`exaone_moe`): GLM-4.5's router and shared
/// experts, the bias beside the router; 64 experts of 1024, 8 per token,
/// times 2.5, the layers `mlp_layer_types` names sparse (after the first
/// `first_k_dense_replace`, 1, by default).
pub(in crate::models::llama) const EXAONE_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Exaone,
    num_experts: 64,
    expert_size: Some(1024),
    layer_types: true,
    scale: 2.5,
    ..GLM4_MOE
};

/// gpt-oss's mixture (`gpt_oss`): experts of `intermediate_size` with
/// biases (128, 4 per token), chosen by logit plus the router's bias and
/// weighted by the softmax of the chosen logits, in every layer; the
/// load-balancing loss where `output_router_logits`.
pub(in crate::models::llama) const GPT_OSS_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::GptOss,
    num_experts: 128,
    experts_per_token: 4,
    ..GRANITE_MOE
};

/// Solar Open's mixture (`solar_open`): GLM-4.5's in every layer, experts
/// of 1280 by default.
pub(in crate::models::llama) const SOLAR_OPEN_MOE: MoeFamily = MoeFamily {
    expert_size: Some(1280),
    first_dense: 0,
    ..GLM4_MOE
};

/// The width of `family`'s experts in `config`: `moe_intermediate_size`, or
/// the family's default.
pub(in crate::models::llama) fn expert_size_of(
    config: &serde_json::Value,
    family: MoeFamily,
) -> std::result::Result<usize, String> {
    match (config.get("moe_intermediate_size"), family.expert_size) {
        (Some(width), _) if !width.is_null() => width
            .as_u64()
            .and_then(|w| usize::try_from(w).ok())
            .ok_or_else(|| {
                format!("`moe_intermediate_size` is {width}; a whole number is expected")
            }),
        (_, Some(default)) => Ok(default),
        (_, None) => Err("missing field `intermediate_size` (the MLP's width): use the config.json the checkpoint came with".into()),
    }
}

/// dots.llm1's mixture (`dots1`): GLM-4.5's, its choices unnormalized and
/// every layer a mixture unless the file says otherwise.
pub(in crate::models::llama) const DOTS1_MOE: MoeFamily = MoeFamily {
    normalize: Normalize::Key(false),
    first_dense: 0,
    ..GLM4_MOE
};

/// Qwen2-MoE's mixture, which Qwen3-MoE's and OLMoE's differ from.
pub(in crate::models::llama) const QWEN2_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Qwen,
    num_experts: 60,
    experts_per_token: 4,
    expert_size: Some(1408),
    normalize: Normalize::Key(false),
    group_rank: 2,
    reads_topk_method: false,
    shared_expert_size: Some(5632),
    shared_experts: 0,
    sparse_layers: true,
    first_dense: 0,
    layer_types: false,
    groups: (1, 1),
    scale: 1.0,
    aux_loss_coef: 0.001,
    router_in_f32: false,
};

/// OLMoE's mixture, which FlexOlmo's differs from.
pub(in crate::models::llama) const OLMOE_MOE: MoeFamily = MoeFamily {
    num_experts: 64,
    experts_per_token: 8,
    expert_size: None,
    shared_expert_size: None,
    sparse_layers: false,
    first_dense: 0,
    aux_loss_coef: 0.01,
    ..QWEN2_MOE
};

/// MiniMax-M2's mixture: Mixtral's with the sigmoid router (its choices
/// always normalized, neither grouped nor scaled).
pub(in crate::models::llama) const MINIMAX_M2_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::MiniMax,
    num_experts: 256,
    experts_per_token: 8,
    expert_size: None,
    normalize: Normalize::Always,
    group_rank: 2,
    reads_topk_method: false,
    shared_expert_size: None,
    shared_experts: 0,
    sparse_layers: false,
    first_dense: 0,
    layer_types: false,
    groups: (1, 1),
    scale: 1.0,
    aux_loss_coef: 0.001,
    router_in_f32: false,
};

/// ERNIE 4.5's mixture (`ernie4_5_moe`): the biased softmax router,
/// `moe_num_shared_experts` shared experts of `moe_intermediate_size` as
/// one MLP, mixtures from layer `moe_layer_start_index` (1).
pub(in crate::models::llama) const ERNIE4_5_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Ernie,
    num_experts: 64,
    experts_per_token: 6,
    expert_size: Some(1536),
    normalize: Normalize::Always,
    group_rank: 2,
    reads_topk_method: false,
    shared_expert_size: None,
    shared_experts: 2,
    sparse_layers: false,
    first_dense: 0,
    layer_types: false,
    groups: (1, 1),
    scale: 1.0,
    aux_loss_coef: 0.001,
    router_in_f32: true,
};

/// Sarvam MLA's mixture (`sarvam_mla`): DeepSeek-V3's over 128 experts,
/// all in one group, the first layer dense.
pub(in crate::models::llama) const SARVAM_MLA_MOE: MoeFamily = MoeFamily {
    num_experts: 128,
    first_dense: 1,
    groups: (1, 1),
    ..DEEPSEEK_V3_MOE
};

/// Sarvam MoE's mixture (`sarvam_moe`): GLM-4.5's, its bias under its own
/// name; 128 experts of 1024, 6 per token, times 2.5, the first layer
/// dense.
pub(in crate::models::llama) const SARVAM_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Sarvam,
    num_experts: 128,
    experts_per_token: 6,
    expert_size: Some(1024),
    scale: 2.5,
    ..GLM4_MOE
};

/// Hunyuan MoE's mixture (`hunyuan_v1_moe`): in every layer experts of
/// `intermediate_size` (`transformers`' defaults: 1 of them, 1 per token),
/// chosen by softmax, normalized, beside a shared MLP as wide; no
/// load-balancing loss.
pub(in crate::models::llama) const HUNYUAN_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Hunyuan,
    num_experts: 1,
    experts_per_token: 1,
    expert_size: None,
    normalize: Normalize::Always,
    aux_loss_coef: 0.0,
    router_in_f32: true,
    ..MINIMAX_M2_MOE
};
