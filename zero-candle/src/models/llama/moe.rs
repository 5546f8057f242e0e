//! [`MoeConfig`]: a mixture of experts in place of the MLP, and how each
//! family's `config.json` describes one.

use super::LlamaConfig;
use crate::hub::HubDir;
use serde::Deserialize;

/// A sparse mixture of experts: a router (`gate`, no bias) gives each token
/// a probability per expert, the token goes through the
/// `experts_per_token` most probable ones (gated MLPs of `expert_size`,
/// the model's activation), and their outputs are summed, each times its
/// probability.
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
}

/// The two layouts of a mixture of experts in hub checkpoints.
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
}

impl MoeConfig {
    /// Checks that the mixture is buildable in a model of `layers` layers.
    pub(super) fn validate(&self, layers: usize) -> std::result::Result<(), String> {
        crate::models::check_positive(&[
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
        match self.aux_loss_coef {
            Some(c) if !c.is_finite() => Err(format!(
                "`router_aux_loss_coef` is {c}; set a finite number"
            )),
            _ => Ok(()),
        }
    }

    /// The parameters of one mixture layer in a model `hidden` wide.
    pub fn num_params(&self, hidden: usize) -> usize {
        let shared = self
            .shared_expert_size
            .map_or(0, |s| 3 * hidden * s + hidden);
        self.num_experts * (hidden + 3 * hidden * self.expert_size) + shared
    }
}

/// How a family's config describes its mixture of experts: `transformers`'
/// defaults for what a file leaves out.
#[derive(Clone, Copy)]
pub(super) struct MoeFamily {
    pub(super) style: MoeStyle,
    pub(super) num_experts: usize,
    pub(super) experts_per_token: usize,
    /// `moe_intermediate_size` where the file leaves it out; `None`: the
    /// experts are `intermediate_size` wide (Mixtral, OLMoE).
    pub(super) expert_size: Option<usize>,
    /// `norm_topk_prob` where the file leaves it out; `None`: always
    /// normalized (Mixtral).
    pub(super) normalize: Option<bool>,
    /// `shared_expert_intermediate_size` where the file leaves it out, for
    /// a family with a shared expert (Qwen2-MoE).
    pub(super) shared_expert_size: Option<usize>,
    /// `decoder_sparse_step` and `mlp_only_layers` are read (Qwen).
    pub(super) sparse_layers: bool,
    pub(super) aux_loss_coef: f64,
}

/// Qwen2-MoE's mixture, which Qwen3-MoE's and OLMoE's differ from.
pub(super) const QWEN2_MOE: MoeFamily = MoeFamily {
    style: MoeStyle::Qwen,
    num_experts: 60,
    experts_per_token: 4,
    expert_size: Some(1408),
    normalize: Some(false),
    shared_expert_size: Some(5632),
    sparse_layers: true,
    aux_loss_coef: 0.001,
};

/// OLMoE's mixture, which FlexOlmo's differs from.
pub(super) const OLMOE_MOE: MoeFamily = MoeFamily {
    num_experts: 64,
    experts_per_token: 8,
    expert_size: None,
    shared_expert_size: None,
    sparse_layers: false,
    aux_loss_coef: 0.01,
    ..QWEN2_MOE
};

/// The keys of `config.json` that describe a mixture, read as they are.
#[derive(Deserialize)]
struct MoeKeys {
    num_hidden_layers: usize,
    intermediate_size: usize,
    #[serde(default, alias = "num_local_experts")]
    num_experts: Option<usize>,
    #[serde(default)]
    num_experts_per_tok: Option<usize>,
    #[serde(default)]
    moe_intermediate_size: Option<usize>,
    #[serde(default)]
    norm_topk_prob: Option<bool>,
    #[serde(default)]
    shared_expert_intermediate_size: Option<usize>,
    #[serde(default)]
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    output_router_logits: bool,
    #[serde(default)]
    router_aux_loss_coef: Option<f64>,
}

/// The mixture of experts `config` describes, `family`'s defaults where it
/// is silent.
pub(super) fn moe_of(
    config: &serde_json::Value,
    family: MoeFamily,
) -> std::result::Result<MoeConfig, String> {
    let plain = MoeKeys::deserialize(config).map_err(|e| format!("{e}"))?;
    let n = plain.num_hidden_layers;
    let layers = match family.sparse_layers {
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
    Ok(MoeConfig {
        num_experts: plain.num_experts.unwrap_or(family.num_experts),
        experts_per_token: plain
            .num_experts_per_tok
            .unwrap_or(family.experts_per_token),
        expert_size: match family.expert_size {
            Some(default) => plain.moe_intermediate_size.unwrap_or(default),
            None => plain.intermediate_size,
        },
        normalize: match family.normalize {
            Some(default) => plain.norm_topk_prob.unwrap_or(default),
            None => true,
        },
        shared_expert_size: family
            .shared_expert_size
            .map(|default| plain.shared_expert_intermediate_size.unwrap_or(default)),
        layers,
        aux_loss_coef: plain
            .output_router_logits
            .then(|| plain.router_aux_loss_coef.unwrap_or(family.aux_loss_coef)),
        style: family.style,
    })
}

impl LlamaConfig {
    /// An error where `hub`'s weights hold a mixture's experts as one
    /// tensor per layer (`mlp.experts.gate_up_proj`, as `transformers` 5
    /// holds them in memory) instead of one weight per expert, as its
    /// `save_pretrained` writes them and this model reads them.
    pub(crate) fn check_files(&self, hub: &HubDir) -> crate::Result<()> {
        if self.moe.is_none() {
            return Ok(());
        }
        let fused = hub
            .names()
            .find(|n| n.ends_with(".experts.gate_up_proj") || n.ends_with(".experts.down_proj"));
        match fused {
            Some(name) => Err(crate::Error::Hub {
                path: hub.dir().to_path_buf(),
                detail: format!(
                    "holds the experts of a layer fused in one tensor ({name}); this model reads \
                     one weight per expert (`experts.0.gate_proj.weight`, ...), as \
                     transformers' save_pretrained writes them: load the checkpoint with \
                     transformers and save it again with save_pretrained"
                ),
            }),
            None => Ok(()),
        }
    }
}
