//! [`MoeConfig`]: a mixture of experts in place of the MLP, and how each
//! family's `config.json` describes one.

use super::LlamaConfig;
use crate::hub::HubDir;
use crate::models::config_json::{check_sizes, optional_size, read_keys, size};
use serde::Deserialize;

pub(super) mod families;

use families::{MoeFamily, Normalize};

/// A sparse mixture of experts: a router (`gate`, no bias) gives each token
/// a score per expert, the token goes through the `experts_per_token` it
/// chooses ([`MoeRouting`]: the most probable, or the best scores plus a
/// bias), gated MLPs of `expert_size` with the model's activation, and
/// their outputs are summed, each times its weight.
///
/// Every expert runs in every forward, on the tokens routed to it or, when
/// none are, on one token whose output counts zero: each rank gathers the
/// same parameters at stage 3 however its tokens are routed, and an expert
/// no token chose gets a zero gradient, as `transformers` 5 (whose experts
/// are one fused weight) gives it. The load-balancing loss is each rank's
/// own, over its tokens (as under DDP).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer (`num_local_experts`, `num_experts`).
    pub num_experts: usize,
    /// Experts each token goes through (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// Width of each expert's MLP (`moe_intermediate_size`; Mixtral's and
    /// OLMoE's `intermediate_size`).
    pub expert_size: usize,
    /// The chosen experts' probabilities are divided by their sum
    /// (`norm_topk_prob`; always in Mixtral).
    pub normalize: bool,
    /// Qwen2-MoE's shared expert (`shared_expert_intermediate_size` wide),
    /// which every token goes through, its output times
    /// `sigmoid(shared_expert_gate(x))`.
    pub shared_expert_size: Option<usize>,
    /// Per layer, whether its MLP is the mixture; the others have a dense
    /// MLP of `intermediate_size` (Qwen's `mlp_only_layers` and
    /// `decoder_sparse_step`).
    pub layers: Vec<bool>,
    /// The load-balancing loss's weight where the config asks for it
    /// (`output_router_logits`, `router_aux_loss_coef`): the loss adds
    /// `coef · num_experts · Σ_e f_e · P_e` over all the mixture layers'
    /// tokens, `f_e` the share of choices that went to expert `e` and `P_e`
    /// its mean probability (Switch Transformer's, as `transformers`
    /// computes it).
    pub aux_loss_coef: Option<f64>,
    /// How the experts are named and weighted.
    pub style: MoeStyle,
    /// How the router chooses the experts and weighs them.
    pub routing: MoeRouting,
    /// gpt-oss's experts' activation in place of the model's
    /// (`swiglu_alpha`, `swiglu_limit`).
    pub clamped_swiglu: Option<ClampedSwiglu>,
    /// The router's logits are computed in f32 from a 16-bit model's input
    /// and weight, as `transformers` computes DeepSeek's, GLM-4.5's and
    /// ERNIE 4.5's (else in the model's dtype).
    pub router_in_f32: bool,
}

/// gpt-oss's gated unit: `(clamp(up, -limit, limit) + 1) · g · σ(alpha ·
/// g)` with `g = min(gate, limit)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClampedSwiglu {
    /// `swiglu_alpha`.
    pub alpha: f64,
    /// `swiglu_limit`.
    pub limit: f64,
}

/// How a mixture's router turns its logits into each token's experts and
/// their weights.
#[derive(Clone, Debug, PartialEq)]
pub enum MoeRouting {
    /// A softmax over the experts; the `experts_per_token` most probable,
    /// weighted by their probabilities (Mixtral, Qwen, OLMoE).
    Softmax,
    /// GLM-4.5's and MiniMax-M2's (DeepSeek-V3's): each expert's score is
    /// `sigmoid(logit)` in f32. A token chooses by `score + bias` (the
    /// checkpoint's `e_score_correction_bias`, which steers the choice
    /// only and is not trained): among the experts of the `top_groups` of
    /// `groups` equal groups whose two best sum highest, the
    /// `experts_per_token` best. Their weights are their scores (divided
    /// by their sum when normalized) times `scale`.
    Sigmoid {
        /// `n_group`.
        groups: usize,
        /// `topk_group`.
        top_groups: usize,
        /// `routed_scaling_factor`.
        scale: f64,
    },
    /// DeepSeek-V2's and Mistral 4's: a softmax over the experts in f32;
    /// a token chooses the `experts_per_token` most probable among the
    /// experts of the `top_groups` of `groups` equal groups whose
    /// `ranked_by` most probable experts sum highest (DeepSeek-V2's
    /// `group_limited_greedy`: its best; Mistral 4's: its two best; one
    /// group of all, V2's `greedy`). Their weights are their probabilities
    /// (divided by their sum plus 1e-20 when normalized: Mistral 4's
    /// `norm_topk_prob`, never DeepSeek-V2's) times `scale`.
    GroupedSoftmax {
        /// `n_group`.
        groups: usize,
        /// `topk_group`.
        top_groups: usize,
        /// How many of a group's best rank it.
        ranked_by: usize,
        /// `routed_scaling_factor`.
        scale: f64,
    },
    /// Granite MoE's (and gpt-oss's): a token chooses the
    /// `experts_per_token` experts of highest logit (f32); their weights
    /// are the softmax of those logits alone.
    TopKSoftmax,
    /// ERNIE 4.5's: a softmax over the experts in f32; a token chooses the
    /// `experts_per_token` best by probability plus the checkpoint's
    /// `moe_statics.e_score_correction_bias` (not trained); their weights
    /// are their probabilities divided by their sum, or by `min_sum`
    /// (`moe_norm_min`) where the sum is smaller.
    BiasedSoftmax {
        /// `moe_norm_min`.
        min_sum: f64,
    },
}

/// The layouts of a mixture of experts in hub checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeStyle {
    /// Mixtral's: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1`
    /// (gate), `w3` (up) and `w2` (down); the outputs scaled by the
    /// probabilities in f32.
    Mixtral,
    /// Qwen2-MoE's, Qwen3-MoE's, OLMoE's and FlexOlmo's: `mlp.gate`,
    /// `mlp.experts.{e}.{gate,up,down}_proj`; the probabilities rounded to
    /// the model's dtype first.
    Qwen,
    /// GLM-4.5's (and dots.llm1's): Qwen's names, beside the router (`mlp.gate.weight`) the
    /// buffer `mlp.gate.e_score_correction_bias`, and shared experts without
    /// a gate (`mlp.shared_experts.{gate,up,down}_proj`); the outputs scaled
    /// in f32.
    Glm,
    /// MiniMax-M2's: Mixtral's names and f32 scaling, the sigmoid router's
    /// bias beside it (`block_sparse_moe.e_score_correction_bias`).
    MiniMax,
    /// DeepSeek-V2's and Mistral 4's: GLM-4.5's names, shared experts and
    /// f32 scaling, without a routing bias.
    DeepSeek,
    /// EXAONE MoE's: GLM-4.5's, the routing bias beside the router
    /// (`mlp.e_score_correction_bias`).
    Exaone,
    /// Granite MoE's: `block_sparse_moe.router.layer`, the experts fused
    /// in `block_sparse_moe.input_linear.weight` (gate and up) and
    /// `output_linear.weight` (down) in every file, the weights rounded to
    /// the model's dtype; a shared MLP (`granitemoeshared`) beside the
    /// block's mixture, `shared_mlp.input_linear` (gate and up) and
    /// `output_linear`.
    Granite,
    /// Granite MoE SWA's: Granite MoE's under `transformers` 5's names
    /// (`block_sparse_moe.router`, `block_sparse_moe.experts.gate_up_proj`
    /// and `experts.down_proj`), the shared MLP Granite's.
    GraniteSwa,
    /// gpt-oss's: `mlp.router` with a bias; the experts fused in every
    /// file, with biases, gate and up interleaved and each projection
    /// stored `[in, out]` (`mlp.experts.gate_up_proj` `[experts, hidden, 2 *
    /// width]`, `gate_up_proj_bias`, `down_proj`, `down_proj_bias`); the
    /// weights rounded to the model's dtype.
    GptOss,
    /// ERNIE 4.5's: Qwen's names and rounding, the router's bias
    /// `mlp.moe_statics.e_score_correction_bias` (`[1, num_experts]`),
    /// shared experts without a gate as GLM-4.5's.
    Ernie,
    /// Sarvam MoE's: GLM-4.5's, the routing bias `mlp.gate.expert_bias`.
    Sarvam,
    /// Hunyuan MoE's: the router `mlp.gate.wg` (its logits in f32), Qwen's
    /// names for the experts, a shared MLP of `intermediate_size` without a
    /// gate (`mlp.shared_mlp`); the outputs scaled in f32.
    Hunyuan,
}

impl MoeStyle {
    /// Where a block's mixture sits: Mixtral's and MiniMax-M2's
    /// `block_sparse_moe`, the others' `mlp`.
    pub(super) fn prefix(self) -> &'static str {
        match self {
            Self::Mixtral | Self::MiniMax | Self::Granite | Self::GraniteSwa => "block_sparse_moe",
            Self::Qwen
            | Self::Glm
            | Self::DeepSeek
            | Self::Exaone
            | Self::Ernie
            | Self::GptOss
            | Self::Hunyuan
            | Self::Sarvam => "mlp",
        }
    }

    /// The routing bias's name under the mixture's prefix.
    pub(super) fn bias_name(self) -> &'static str {
        match self {
            Self::MiniMax | Self::Exaone => "e_score_correction_bias",
            Self::Ernie => "moe_statics.e_score_correction_bias",
            Self::Sarvam => "gate.expert_bias",
            _ => "gate.e_score_correction_bias",
        }
    }

    /// The router's name under the mixture's prefix.
    pub(super) fn router_name(self) -> &'static str {
        match self {
            Self::Granite => "router.layer",
            Self::GptOss | Self::GraniteSwa => "router",
            Self::Hunyuan => "gate.wg",
            _ => "gate",
        }
    }

    /// The names of the tensors that hold the experts fused, under the
    /// mixture's prefix, and the stems of their parts' variables: Granite
    /// MoE's own, else `transformers` 5's.
    pub(super) fn fused_names(self) -> [(&'static str, &'static str); 2] {
        match self {
            Self::Granite => [
                ("input_linear.weight", "input_linear"),
                ("output_linear.weight", "output_linear"),
            ],
            _ => [
                ("experts.gate_up_proj", "experts.gate_up_proj"),
                ("experts.down_proj", "experts.down_proj"),
            ],
        }
    }

    /// The experts' weights are named `w1`, `w3` and `w2` (Mixtral's).
    pub(super) fn w_names(self) -> bool {
        matches!(self, Self::Mixtral | Self::MiniMax)
    }

    /// The routing weights are rounded to the model's dtype before they
    /// scale the experts' outputs (else the outputs are scaled in f32).
    pub(super) fn weights_in_model_dtype(self) -> bool {
        matches!(
            self,
            Self::Qwen | Self::Ernie | Self::Granite | Self::GraniteSwa | Self::GptOss
        )
    }

    /// Granite MoE's mixture, under either names: a shared MLP of its own,
    /// the experts fused in every file.
    pub(super) fn granite(self) -> bool {
        matches!(self, Self::Granite | Self::GraniteSwa)
    }

    /// Every file holds the experts fused (Granite MoE's, gpt-oss's); the
    /// others' files say so by their names ([`LlamaConfig::settle_experts`]).
    pub(super) fn fused_in_every_file(self) -> bool {
        self.granite() || self == Self::GptOss
    }

    /// The router and the experts have biases (gpt-oss's).
    pub(super) fn biased(self) -> bool {
        self == Self::GptOss
    }

    /// The shared experts are one MLP without a gate (GLM-4.5's,
    /// DeepSeek's, ERNIE 4.5's), under `shared_experts`; else Qwen2-MoE's
    /// `shared_expert` with its `shared_expert_gate` (Granite's shared MLP
    /// is its own: [`MoeStyle::Granite`]).
    pub(super) fn ungated_shared_experts(self) -> bool {
        matches!(
            self,
            Self::Glm | Self::DeepSeek | Self::Exaone | Self::Ernie | Self::Sarvam
        )
    }
}

impl MoeConfig {
    /// Checks that the mixture is buildable in a model of `layers` layers.
    pub(super) fn validate(&self, layers: usize) -> std::result::Result<(), String> {
        check_sizes(&[
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.experts_per_token),
            ("moe_intermediate_size", self.expert_size),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_size.unwrap_or(1),
            ),
        ])?;
        if self.experts_per_token > self.num_experts {
            return Err(format!(
                "`num_experts_per_tok` {} is more than the {} experts",
                self.experts_per_token, self.num_experts
            ));
        }
        if self.layers.len() != layers {
            return Err(format!(
                "the mixture names {} layers of {layers}; give one flag per layer",
                self.layers.len()
            ));
        }
        if let MoeRouting::Sigmoid {
            groups,
            top_groups,
            scale,
        }
        | MoeRouting::GroupedSoftmax {
            groups,
            top_groups,
            scale,
            ..
        } = self.routing
        {
            // The sigmoid router ranks a group by its two best experts.
            let least = match self.routing {
                MoeRouting::GroupedSoftmax { ranked_by, .. } => ranked_by,
                _ => 2,
            };
            check_sizes(&[("n_group", groups), ("topk_group", top_groups)])?;
            if self.num_experts % groups != 0 || self.num_experts / groups < least {
                return Err(format!(
                    "{} experts in `n_group` {groups} groups: each group needs the same number of \
                     experts, at least {least} (a group is ranked by its {least} best)",
                    self.num_experts
                ));
            }
            if top_groups > groups {
                return Err(format!(
                    "`topk_group` {top_groups} is more than the {groups} groups"
                ));
            }
            if self.experts_per_token > top_groups * (self.num_experts / groups) {
                return Err(format!(
                    "`num_experts_per_tok` {} is more than the {} experts of the `topk_group` \
                     {top_groups} chosen groups",
                    self.experts_per_token,
                    top_groups * (self.num_experts / groups)
                ));
            }
            if !scale.is_finite() {
                return Err(format!(
                    "`routed_scaling_factor` is {scale}; set a finite number"
                ));
            }
        }
        if let Some(ClampedSwiglu { alpha, limit }) = self.clamped_swiglu {
            if !(alpha.is_finite() && limit.is_finite() && limit > 0.0) {
                return Err(format!(
                    "`swiglu_alpha` is {alpha} and `swiglu_limit` {limit}; set finite numbers, \
                     the limit above 0"
                ));
            }
        }
        if let MoeRouting::BiasedSoftmax { min_sum } = self.routing {
            if !(min_sum.is_finite() && min_sum >= 0.0) {
                return Err(format!(
                    "`moe_norm_min` is {min_sum}; set a finite number of at least 0"
                ));
            }
        }
        match self.aux_loss_coef {
            Some(c) if !c.is_finite() => Err(format!(
                "`router_aux_loss_coef` is {c}; set a finite number"
            )),
            _ => Ok(()),
        }
    }

    /// The parameters of one mixture layer in a model `hidden` wide (in a
    /// type no sizes up to the configs' bound overflow).
    pub(crate) fn num_params(&self, hidden: usize) -> u128 {
        let [hidden, experts, expert_size] =
            [hidden, self.num_experts, self.expert_size].map(|n| n as u128);
        // Qwen2-MoE's shared expert has a gate, GLM-4.5's and ERNIE's do not.
        let gate = u128::from(self.style == MoeStyle::Qwen);
        let shared = self
            .shared_expert_size
            .map_or(0, |s| 3 * hidden * s as u128 + gate * hidden);
        // gpt-oss's router and experts have biases.
        let biases = match self.style.biased() {
            true => 1 + 2 * expert_size + hidden,
            false => 0,
        };
        experts * (hidden + 3 * hidden * expert_size + biases) + shared
    }
}

/// The keys of `config.json` that describe a mixture, read as they are.
#[derive(Deserialize)]
struct MoeKeys {
    #[serde(deserialize_with = "size")]
    num_hidden_layers: usize,
    #[serde(default, deserialize_with = "optional_size")]
    intermediate_size: Option<usize>,
    #[serde(
        default,
        alias = "num_local_experts",
        alias = "n_routed_experts",
        alias = "moe_num_experts",
        deserialize_with = "optional_size"
    )]
    num_experts: Option<usize>,
    /// Hunyuan's `moe_topk` is a number or one per layer (all equal here).
    #[serde(
        default,
        alias = "moe_k",
        alias = "moe_topk",
        deserialize_with = "one_or_same"
    )]
    num_experts_per_tok: Option<usize>,
    #[serde(default, deserialize_with = "optional_size")]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default, deserialize_with = "optional_size")]
    shared_expert_intermediate_size: Option<usize>,
    /// Granite MoE's shared MLP (0: none).
    #[serde(default, deserialize_with = "optional_size")]
    shared_intermediate_size: Option<usize>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    output_router_logits: bool,
    #[serde(default)]
    router_aux_loss_coef: Option<f64>,
    /// GLM-4.5's (DeepSeek-V3's); ERNIE 4.5's `moe_num_shared_experts`.
    #[serde(
        default,
        alias = "moe_num_shared_experts",
        deserialize_with = "optional_size"
    )]
    n_shared_experts: Option<usize>,
    #[serde(default)]
    routed_scaling_factor: Option<f64>,
    #[serde(default)]
    n_group: Option<usize>,
    #[serde(default)]
    topk_group: Option<usize>,
    #[serde(default)]
    first_k_dense_replace: Option<usize>,
    /// ERNIE 4.5's mixture layers: `(i + 1) % interval == 0` from `start`
    /// to `end` (-1: the last), both included.
    #[serde(default)]
    moe_layer_start_index: Option<usize>,
    #[serde(default)]
    moe_layer_end_index: Option<i64>,
    #[serde(default)]
    moe_layer_interval: Option<usize>,
    #[serde(default)]
    moe_norm_min: Option<f64>,
    /// DeepSeek-V2's choice: `greedy` or `group_limited_greedy`.
    #[serde(default)]
    topk_method: Option<String>,
    /// GLM-4.7-Flash's `"dense"` and `"sparse"` layers.
    #[serde(default)]
    mlp_layer_types: Option<Vec<String>>,
    /// gpt-oss's clamped SwiGLU.
    #[serde(default)]
    swiglu_alpha: Option<f64>,
    #[serde(default)]
    swiglu_limit: Option<f64>,
}

/// A number, or a list of one number per layer that are all the same (a
/// number per layer that differs is refused).
fn one_or_same<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(usize),
        Many(Vec<usize>),
    }
    match Option::<OneOrMany>::deserialize(deserializer)? {
        None => Ok(None),
        Some(OneOrMany::One(n)) => Ok(Some(n)),
        Some(OneOrMany::Many(list)) => match list.split_first() {
            Some((&first, rest)) if rest.iter().all(|&n| n == first) => Ok(Some(first)),
            _ => Err(serde::de::Error::custom(format!(
                "experts per token {list:?} differ by layer (or none is given); this model \
                 chooses as many in every layer: give one number"
            ))),
        },
    }
}

/// The mixture of experts `config` describes, `family`'s defaults where it
/// is silent.
pub(super) fn moe_of(
    config: &serde_json::Value,
    family: MoeFamily,
) -> std::result::Result<MoeConfig, String> {
    let plain: MoeKeys = read_keys(config)?;
    let n = plain.num_hidden_layers;
    let glm = matches!(
        family.style,
        MoeStyle::Glm | MoeStyle::Exaone | MoeStyle::Sarvam
    );
    let deepseek = family.style == MoeStyle::DeepSeek;
    let ernie = family.style == MoeStyle::Ernie;
    let hunyuan = family.style == MoeStyle::Hunyuan;
    let layers = match family.sparse_layers {
        false if family.layer_types && plain.mlp_layer_types.is_some() => {
            let types = plain.mlp_layer_types.as_deref().unwrap_or_default();
            if types.len() != n {
                return Err(format!(
                    "`mlp_layer_types` has {} entries for {n} layers; give one per layer",
                    types.len()
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sparse" => Ok(true),
                    "dense" => Ok(false),
                    other => Err(format!(
                        "`mlp_layer_types` holds {other:?}; each entry is \"dense\" or \"sparse\""
                    )),
                })
                .collect::<Result<_, _>>()?
        }
        // GLM-4.5's and DeepSeek's first layers are dense.
        false if glm || deepseek => {
            let dense = plain.first_k_dense_replace.unwrap_or(family.first_dense);
            (0..n).map(|i| i >= dense).collect()
        }
        false if ernie => {
            let start = plain.moe_layer_start_index.unwrap_or(1);
            let end = match plain.moe_layer_end_index.unwrap_or(-1) {
                -1 => n.saturating_sub(1),
                end => usize::try_from(end).map_err(|_| {
                    format!("`moe_layer_end_index` is {end}; a layer index or -1 is expected")
                })?,
            };
            let every = plain.moe_layer_interval.unwrap_or(1);
            if every == 0 {
                return Err("`moe_layer_interval` is 0; set it to at least 1".into());
            }
            (0..n)
                .map(|i| (i + 1) % every == 0 && i >= start && i <= end)
                .collect()
        }
        false => vec![true; n],
        true => {
            let only = plain.mlp_only_layers.clone().unwrap_or_default();
            if let Some(past) = only.iter().find(|&&i| i >= n) {
                return Err(format!(
                    "`mlp_only_layers` names layer {past} of {n}; name layers below {n}"
                ));
            }
            let step = plain.decoder_sparse_step.unwrap_or(1);
            if step == 0 {
                return Err("`decoder_sparse_step` is 0; set it to at least 1".into());
            }
            (0..n)
                .map(|i| !only.contains(&i) && (i + 1) % step == 0)
                .collect()
        }
    };
    let expert_size = match family.expert_size {
        Some(default) => plain.moe_intermediate_size.unwrap_or(default),
        None => plain
            .intermediate_size
            .ok_or("missing field `intermediate_size` (the MLP's width): use the config.json the checkpoint came with")?,
    };
    if ernie && plain.output_router_logits {
        return Err(
            "`output_router_logits` is true: ERNIE 4.5's load-balancing loss is not implemented \
             here; set it to false"
                .into(),
        );
    }
    // GLM-4.5's and ERNIE's shared experts are one MLP as wide as all of
    // them.
    let shared_expert_size = match family.style.ungated_shared_experts() {
        true => {
            let shared = plain.n_shared_experts.unwrap_or(family.shared_experts);
            Some(expert_size * shared).filter(|&s| s > 0)
        }
        // Hunyuan's shared MLP is as wide as the dense one.
        false if hunyuan => Some(
            plain
                .intermediate_size
                .ok_or("missing field `intermediate_size` (the MLP's width): use the config.json the checkpoint came with")?,
        ),
        // Granite's shared MLP, where its family has one.
        false if family.style.granite() => family
            .shared_expert_size
            .map(|default| plain.shared_intermediate_size.unwrap_or(default))
            .filter(|&s| s > 0),
        false => family
            .shared_expert_size
            .map(|default| plain.shared_expert_intermediate_size.unwrap_or(default)),
    };
    Ok(MoeConfig {
        num_experts: plain.num_experts.unwrap_or(family.num_experts),
        experts_per_token: plain
            .num_experts_per_tok
            .unwrap_or(family.experts_per_token),
        expert_size,
        normalize: match family.normalize {
            Normalize::Always => true,
            Normalize::Never => false,
            Normalize::Key(default) => plain.norm_topk_prob.unwrap_or(default),
        },
        shared_expert_size,
        layers,
        // transformers adds no load-balancing loss to GLM-4.5's,
        // DeepSeek's or Hunyuan's.
        aux_loss_coef: (plain.output_router_logits && !glm && !deepseek && !hunyuan)
            .then(|| plain.router_aux_loss_coef.unwrap_or(family.aux_loss_coef)),
        style: family.style,
        routing: match family.style {
            MoeStyle::Glm | MoeStyle::Exaone | MoeStyle::Sarvam | MoeStyle::MiniMax => {
                MoeRouting::Sigmoid {
                    groups: plain.n_group.unwrap_or(family.groups.0),
                    top_groups: plain.topk_group.unwrap_or(family.groups.1),
                    scale: plain.routed_scaling_factor.unwrap_or(family.scale),
                }
            }
            MoeStyle::DeepSeek => {
                // Mistral 4 always uses its groups; DeepSeek-V2 as
                // `topk_method` says.
                let defaults = || {
                    (
                        plain.n_group.unwrap_or(family.groups.0),
                        plain.topk_group.unwrap_or(family.groups.1),
                    )
                };
                let method = plain
                    .topk_method
                    .as_deref()
                    .filter(|_| family.reads_topk_method);
                let (groups, top_groups) = match method {
                    None if !family.reads_topk_method => defaults(),
                    None | Some("greedy") => (1, 1),
                    Some("group_limited_greedy") => (
                        plain.n_group.ok_or(
                            "`topk_method` is \"group_limited_greedy\" but `n_group` is not \
                             set: give the number of expert groups",
                        )?,
                        plain.topk_group.ok_or(
                            "`topk_method` is \"group_limited_greedy\" but `topk_group` is not \
                             set: give the number of groups each token chooses from",
                        )?,
                    ),
                    Some(other) => {
                        return Err(format!(
                            "`topk_method` is {other:?}; DeepSeek-V2 chooses \"greedy\" or \
                             \"group_limited_greedy\" (DeepSeek-V3's \"noaux_tc\" is \
                             model_type \"deepseek_v3\")"
                        ))
                    }
                };
                MoeRouting::GroupedSoftmax {
                    groups,
                    top_groups,
                    ranked_by: family.group_rank,
                    scale: plain.routed_scaling_factor.unwrap_or(family.scale),
                }
            }
            MoeStyle::Ernie => MoeRouting::BiasedSoftmax {
                min_sum: plain.moe_norm_min.unwrap_or(1e-12),
            },
            MoeStyle::Mixtral | MoeStyle::Qwen | MoeStyle::Hunyuan => MoeRouting::Softmax,
            MoeStyle::Granite | MoeStyle::GraniteSwa | MoeStyle::GptOss => MoeRouting::TopKSoftmax,
        },
        router_in_f32: family.router_in_f32,
        clamped_swiglu: (family.style == MoeStyle::GptOss).then(|| ClampedSwiglu {
            alpha: plain.swiglu_alpha.unwrap_or(1.702),
            limit: plain.swiglu_limit.unwrap_or(7.0),
        }),
    })
}

impl LlamaConfig {
    /// Reads from `hub`'s weights whether they hold each mixture layer's
    /// experts fused in two tensors (`experts.gate_up_proj`, `[experts, 2 *
    /// width, hidden]`, and `experts.down_proj`, `[experts, hidden,
    /// width]`: `transformers` 5's own layout, which its `save_pretrained`
    /// writes for the models it has no older layout for, Mistral 4's) or
    /// one weight per expert ([`LlamaConfig::fused_experts`]).
    pub(crate) fn settle_experts(&mut self, hub: &HubDir) {
        self.fused_experts = match &self.moe {
            Some(moe) if moe.style.fused_in_every_file() => true,
            Some(_) => hub
                .names()
                .any(|n| n.ends_with(".experts.gate_up_proj") || n.ends_with(".experts.down_proj")),
            None => false,
        };
    }
}
