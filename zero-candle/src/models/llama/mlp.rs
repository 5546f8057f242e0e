//! A block's MLP: one gated MLP, or a sparse mixture of them (Mixtral,
//! Qwen2-MoE, Qwen3-MoE, OLMoE, GLM-4.5, MiniMax-M2, ERNIE 4.5).

use super::moe::ClampedSwiglu;
use super::xielu::Xielu;
use super::Projections;
use crate::nn::ops::Gating;
use crate::nn::{ops, tap, Activation, ExpertForm, ExpertMlps, Linear, OnDevice};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, Layout, Module, Shape, Tensor, Var, D,
};
use std::sync::{Arc, Mutex, PoisonError};

/// `down(act(gate(x)) * up(x))`, or gpt-oss's clamped unit in place of
/// `act(gate) * up`.
#[derive(Clone)]
pub(super) struct Mlp {
    pub(super) gate_up: Projections<2>,
    pub(super) down: Linear,
    pub(super) activation: Activation,
    pub(super) clamped: Option<ClampedSwiglu>,
}

impl Mlp {
    /// The MLP of `h` rows `[tokens, hidden]`.
    fn forward(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let [gate, up] = self.gate_up.forward(h)?;
        let gated = match (self.clamped, self.activation) {
            (Some(ClampedSwiglu { alpha, limit }), _) => {
                ops::clamped_swiglu(&gate, &up, alpha, limit)?
            }
            (None, Activation::Silu) => ops::swiglu(&gate, &up)?,
            (None, Activation::Gelu) => ops::geglu(&gate, &up)?,
            (None, other) => candle_core::bail!("no gated MLP with {other:?}"),
        };
        self.down.forward(&gated)
    }
}

/// `down(act(up(x)))`: an MLP without a gate (Starcoder2's), the
/// activation recomputed in the down projection's backward
/// ([`Linear::forward_on_activated`]) rather than kept.
#[derive(Clone)]
pub(super) struct Ungated {
    pub(super) up: Linear,
    pub(super) down: Linear,
    pub(super) activation: Activation,
    /// xIELU in place of `activation` (Apertus), composed and kept.
    pub(super) xielu: Option<Xielu>,
}

/// A block's feed-forward half.
#[derive(Clone)]
pub(super) enum FeedForward {
    Dense(Mlp),
    Ungated(Ungated),
    Experts(Box<Experts>),
}

impl FeedForward {
    /// The output for `h` rows `[tokens, hidden]`, and a mixture's router
    /// logits `[tokens, num_experts]` when `with_router_logits`.
    pub(super) fn forward(
        &self,
        h: &Tensor,
        with_router_logits: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        match self {
            Self::Dense(mlp) => Ok((mlp.forward(h)?, None)),
            Self::Ungated(mlp) => {
                let up = mlp.up.forward(h)?;
                let y = match &mlp.xielu {
                    Some(xielu) => mlp.down.forward(&xielu.forward(&up)?)?,
                    None => mlp.down.forward_on_activated(&up, mlp.activation)?,
                };
                Ok((y, None))
            }
            Self::Experts(experts) => {
                let (y, logits) = experts.forward(h)?;
                Ok((y, with_router_logits.then_some(logits)))
            }
        }
    }
}

/// How a mixture's router weighs its experts ([`super::MoeRouting`]).
#[derive(Clone)]
pub(super) enum Routing {
    /// A softmax over the experts, the most probable chosen.
    Softmax,
    /// GLM-4.5's and MiniMax-M2's sigmoid scores (in f32), chosen by score
    /// plus `bias` within the best groups.
    Sigmoid {
        /// `e_score_correction_bias`, f32 `[num_experts]` on the model's
        /// device.
        bias: Tensor,
        groups: usize,
        top_groups: usize,
        scale: f64,
        /// Added to the chosen scores' sum before it divides them.
        epsilon: f64,
    },
    /// DeepSeek-V2's and Mistral 4's softmax probabilities (in f32), the
    /// most probable chosen within the groups whose `ranked_by` best sum
    /// highest.
    GroupedSoftmax {
        groups: usize,
        top_groups: usize,
        /// How many of a group's best rank it.
        ranked_by: usize,
        scale: f64,
    },
    /// Granite MoE's: the experts of highest logit (in f32), weighted by
    /// the softmax of their logits.
    TopKSoftmax,
    /// ERNIE 4.5's softmax probabilities (in f32), chosen by probability
    /// plus `bias`.
    BiasedSoftmax {
        /// `e_score_correction_bias`, f32 `[num_experts]` on the model's
        /// device.
        bias: Tensor,
        /// The least sum that divides the chosen probabilities.
        min_sum: f64,
    },
}

/// A sparse mixture of experts ([`super::MoeConfig`]).
#[derive(Clone)]
pub(super) struct Experts {
    /// `gate`: `[num_experts, hidden]`, no bias.
    pub(super) router: Linear,
    pub(super) routing: Routing,
    pub(super) experts: Vec<Mlp>,
    /// A shared expert that every token goes through, with Qwen2-MoE's gate
    /// (`[1, hidden]`) on its output, or without one (GLM-4.5's, ERNIE's).
    pub(super) shared: Option<(Mlp, Option<Linear>)>,
    pub(super) top_k: usize,
    pub(super) normalize: bool,
    /// The probabilities are rounded to the model's dtype before they
    /// scale the outputs (Qwen's); else the outputs are scaled in f32
    /// (Mixtral's).
    pub(super) weights_in_model_dtype: bool,
    /// The router's logits are computed in f32 ([`super::MoeConfig::router_in_f32`]).
    pub(super) router_in_f32: bool,
    /// The experts as one op, when their gradients go to a hook.
    grouped: Option<ExpertMlps>,
}

impl Experts {
    /// A mixture of `experts`, routed by `router` as `routing` says to
    /// `top_k` of them per token (their weights renormalized when
    /// `normalize`), with a `shared` expert if any. With a hook the experts
    /// run as one op per layer ([`ExpertMlps`]); without one, or in a form
    /// the op does not take (biases on separate projections), each is its
    /// own layers.
    pub(super) fn new(
        (router, routing): (Linear, Routing),
        experts: Vec<Mlp>,
        shared: Option<(Mlp, Option<Linear>)>,
        (top_k, normalize, weights_in_model_dtype, router_in_f32): (usize, bool, bool, bool),
    ) -> candle_core::Result<Self> {
        let grouped = match grouped_weights(&experts) {
            Some((weights, form, gating, hook)) => {
                Some(ExpertMlps::new(weights, form, gating, hook)?)
            }
            None => None,
        };
        Ok(Self {
            router,
            routing,
            experts,
            shared,
            top_k,
            normalize,
            weights_in_model_dtype,
            router_in_f32,
            grouped,
        })
    }

    /// The mixture's output for `h` rows `[tokens, hidden]`, and the router
    /// logits `[tokens, num_experts]`.
    fn forward(&self, h: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (tokens, dtype, device) = (h.dim(0)?, h.dtype(), h.device());
        // Unhooked, each expert gathers its rows; their gradients meet in
        // one add into `h`'s ([`Collect`]), not one add as large as `h` per
        // expert. The router reads the same output, which so always has a
        // gradient of its own for `Collect`'s backward to add to. Hooked,
        // the experts are one op whose backward adds them.
        let pending = Pending::default();
        let h = &match self.grouped {
            Some(_) => h.clone(),
            None => h.apply_op1(Collect(pending.clone()))?,
        };
        let (logits, chosen, mut weights) = self.route(h)?;
        if self.weights_in_model_dtype {
            weights = weights.to_dtype(dtype)?;
        }
        // The experts' op gives an expert without rows its zero gradient
        // itself; one Linear per projection needs a row to report one.
        let with_idle_rows = self.grouped.is_none();
        let routes = Routes::new(&chosen, self.experts.len(), with_idle_rows);
        // One scaling and one add back, expert by expert in order, as
        // transformers adds them.
        let rows = Tensor::new(routes.rows.as_slice(), device)?;
        let outputs = match &self.grouped {
            Some(grouped) => grouped.forward(h, &rows, &routes.ranges)?,
            None => {
                let mut outputs = Vec::with_capacity(self.experts.len());
                for (expert, range) in self.experts.iter().zip(&routes.ranges) {
                    let rows = ExpertRows {
                        rows: Tensor::new(&routes.rows[range.clone()], device)?,
                        pending: pending.clone(),
                    };
                    outputs.push(expert.forward(&h.apply_op1(rows)?)?);
                }
                Tensor::cat(&outputs, 0)?
            }
        };
        let slots = Tensor::from_vec(routes.slots.clone(), routes.slots.len(), device)?;
        // The idle experts' rows count zero.
        let scale = Tensor::cat(
            &[
                &weights.flatten_all()?,
                &Tensor::zeros(1, weights.dtype(), device)?,
            ],
            0,
        )?
        .index_select(&slots, 0)?
        .unsqueeze(1)?;
        let scaled = match scale.dtype() == dtype {
            true => outputs.broadcast_mul(&scale)?,
            false => outputs
                .to_dtype(scale.dtype())?
                .broadcast_mul(&scale)?
                .to_dtype(dtype)?,
        };
        let mut y =
            Tensor::zeros((tokens, h.dim(1)?), dtype, device)?.index_add(&rows, &scaled, 0)?;
        if let Some((mlp, gate)) = &self.shared {
            let shared = mlp.forward(h)?;
            y = match gate {
                Some(gate) => {
                    let opened = candle_nn::ops::sigmoid(&gate.forward(h)?)?;
                    (y + shared.broadcast_mul(&opened)?)?
                }
                None => (y + shared)?,
            };
        }
        Ok((y, logits))
    }

    /// The router's logits for `h` rows, each token's chosen experts and
    /// their weights `[tokens, top_k]` (f32, with the gradient to the
    /// router).
    fn route(&self, h: &Tensor) -> candle_core::Result<(Tensor, Vec<Vec<u32>>, Tensor)> {
        let logits = match self.router_in_f32 {
            true => logits_in_f32(&self.router, h)?,
            false => self.router.forward(h)?,
        };
        let wide = logits.to_dtype(DType::F32)?;
        // Each expert's score, and the experts each token chooses: their
        // indices on the device and on the host.
        let (scores, index, chosen) = match &self.routing {
            Routing::GroupedSoftmax {
                groups,
                top_groups,
                ranked_by,
                ..
            } if top_groups < groups => {
                let probs = candle_nn::ops::softmax(&wide, D::Minus1)?;
                // DeepSeek-V2's groups, on the host.
                let rows = probs.detach().to_vec2::<f32>()?;
                let chosen = grouped_top_k(&rows, (*groups, *top_groups, *ranked_by), self.top_k);
                let index = Tensor::new(chosen.clone(), h.device())?;
                (probs, index, chosen)
            }
            // Ungrouped, DeepSeek-V2's choice is Mixtral's.
            Routing::Softmax | Routing::GroupedSoftmax { .. } => {
                let probs = candle_nn::ops::softmax(&wide, D::Minus1)?;
                let index = top_k(&probs, self.top_k)?;
                let chosen = index.to_vec2::<u32>()?;
                (probs, index, chosen)
            }
            Routing::TopKSoftmax => {
                let index = top_k(&wide, self.top_k)?;
                let chosen = index.to_vec2::<u32>()?;
                (wide.clone(), index, chosen)
            }
            Routing::BiasedSoftmax { bias, .. } => {
                let probs = candle_nn::ops::softmax(&wide, D::Minus1)?;
                // The choice only: no gradient flows through it.
                let index = top_k(&probs.detach().broadcast_add(bias)?, self.top_k)?;
                let chosen = index.to_vec2::<u32>()?;
                (probs, index, chosen)
            }
            Routing::Sigmoid {
                bias,
                groups,
                top_groups,
                ..
            } => {
                let scores = candle_nn::ops::sigmoid(&wide)?;
                // The choice only: no gradient flows through it.
                let choice = scores.detach().broadcast_add(bias)?;
                if top_groups < groups {
                    // DeepSeek-V3's groups, on the host.
                    let rows = choice.to_vec2::<f32>()?;
                    let chosen = grouped_top_k(&rows, (*groups, *top_groups, 2), self.top_k);
                    let index = Tensor::new(chosen.clone(), h.device())?;
                    (scores, index, chosen)
                } else {
                    let index = top_k(&choice, self.top_k)?;
                    let chosen = index.to_vec2::<u32>()?;
                    (scores, index, chosen)
                }
            }
        };
        let (epsilon, scale, min_sum) = match &self.routing {
            Routing::Softmax | Routing::TopKSoftmax => (0.0, 1.0, 0.0),
            Routing::Sigmoid { epsilon, scale, .. } => (*epsilon, *scale, 0.0),
            // Mistral 4 adds 1e-20 to the sum (DeepSeek-V2 never divides).
            Routing::GroupedSoftmax { scale, .. } => (1e-20, *scale, 0.0),
            Routing::BiasedSoftmax { min_sum, .. } => (0.0, 1.0, *min_sum),
        };
        let mut weights = scores.gather(&index, 1)?;
        if let Routing::TopKSoftmax = self.routing {
            // The chosen logits' softmax.
            weights = candle_nn::ops::softmax(&weights, D::Minus1)?;
        }
        if self.normalize {
            let mut sum = weights.sum_keepdim(1)?;
            if epsilon != 0.0 {
                sum = (sum + epsilon)?;
            }
            if min_sum != 0.0 {
                sum = sum.maximum(min_sum)?;
            }
            weights = weights.broadcast_div(&sum)?;
        }
        if scale != 1.0 {
            weights = (weights * scale)?;
        }
        Ok((logits, chosen, weights))
    }
}

/// The grouped choice of [`super::MoeRouting::Sigmoid`] and
/// [`super::MoeRouting::GroupedSoftmax`] for each row of `choice` `[tokens,
/// experts]` (score plus bias, or probability): the `k` experts of highest
/// value among the `top_groups` of `groups` equal groups whose `best`
/// highest values (DeepSeek-V3's two, V2's one) sum highest, highest first
/// (ties to the lower index).
fn grouped_top_k(
    choice: &[Vec<f32>],
    (groups, top_groups, best): (usize, usize, usize),
    k: usize,
) -> Vec<Vec<u32>> {
    use rayon::prelude::*;
    // Indices by descending value (ties to the lower index).
    let ranked = |values: &[f32], among: &mut Vec<usize>| {
        among.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    };
    choice
        .par_iter()
        .map(|choice| {
            let experts = choice.len();
            let per_group = experts / groups.max(1);
            let mut among: Vec<usize> = (0..experts).collect();
            if top_groups < groups {
                let group_scores: Vec<f32> = choice
                    .chunks(per_group)
                    .map(|group| {
                        let mut ranks: Vec<usize> = (0..group.len()).collect();
                        ranked(group, &mut ranks);
                        ranks.iter().take(best).map(|&e| group[e]).sum::<f32>()
                    })
                    .collect();
                let mut chosen_groups: Vec<usize> = (0..groups).collect();
                ranked(&group_scores, &mut chosen_groups);
                chosen_groups.truncate(top_groups);
                among.retain(|e| chosen_groups.contains(&(e / per_group)));
            }
            ranked(choice, &mut among);
            among.iter().take(k).map(|&e| e as u32).collect()
        })
        .collect()
}

/// The logits `h·Wᵀ` of a `router` without a bias computed in f32 from a
/// 16-bit `h` and `W` (as `transformers` computes DeepSeek's, GLM-4.5's
/// and ERNIE 4.5's), the weight read through the router's hook
/// ([`tap`]: a copy, the router being small) and its gradient handed
/// to it; an f32 or f64 model's router as it is.
fn logits_in_f32(router: &Linear, h: &Tensor) -> candle_core::Result<Tensor> {
    let weight = router.weight();
    if matches!(h.dtype(), DType::F32 | DType::F64) || router.bias().is_some() {
        return router.forward(h);
    }
    let weight = match weight.is_variable() {
        true => tap(&Var::from_tensor(weight)?, router.hook().cloned())?,
        false => weight.clone(),
    };
    h.to_dtype(DType::F32)?
        .matmul(&weight.to_dtype(DType::F32)?.t()?)
}

/// The experts' variables, form, unit and hook, when they can run as one
/// op ([`ExpertMlps`]): every projection a Linear hooked by one hook,
/// either separate without biases or gpt-oss's interleaved pair with
/// biases on it and on down.
#[allow(clippy::type_complexity)]
fn grouped_weights(
    experts: &[Mlp],
) -> Option<(
    Vec<Vec<Tensor>>,
    ExpertForm,
    Gating,
    Arc<dyn crate::nn::GradHook>,
)> {
    let first = experts.first()?;
    let hook = first.down.hook()?.clone();
    let form = match first.gate_up {
        Projections::Separate(_) => ExpertForm::Separate,
        Projections::Interleaved(_) => ExpertForm::Interleaved,
        Projections::Fused(..) => return None,
    };
    let gating = match first.clamped {
        Some(ClampedSwiglu { alpha, limit }) => Gating::Clamped { alpha, limit },
        None => Gating::Act(first.activation),
    };
    let mut weights = Vec::with_capacity(experts.len());
    for expert in experts {
        let (layers, biased) = match (&expert.gate_up, form) {
            (Projections::Separate([gate, up]), ExpertForm::Separate) => {
                (vec![gate, up, &expert.down], false)
            }
            (Projections::Interleaved(gate_up), ExpertForm::Interleaved) => {
                (vec![gate_up, &expert.down], true)
            }
            _ => return None,
        };
        let hooked = layers.iter().all(|l| {
            l.bias().is_some() == biased && l.hook().is_some_and(|h| Arc::ptr_eq(h, &hook))
        });
        if !hooked || expert.activation != first.activation || expert.clamped != first.clamped {
            return None;
        }
        let vars = layers.iter().flat_map(|l| [Some(l.weight()), l.bias()]);
        weights.push(vars.flatten().cloned().collect());
    }
    Some((weights, form, gating, hook))
}

/// The gradients of the experts' rows (the rows, u32, and their gradient)
/// that backward has reached, waiting for [`Collect`]'s backward.
type Pending = Arc<Mutex<Vec<(Tensor, Tensor)>>>;

/// The identity on the mixture's input, whose backward adds the gradients
/// its [`ExpertRows`] left in `Pending` into the input's, in one
/// `index_add`. Backward reaches it after every expert (they read its
/// output), and only through it: each expert's rows cost their own size,
/// where an `index_select` per expert would add a gradient as large as
/// the input per expert (`index_add` copies its destination), and a
/// `narrow` of one gather of all rows one as large as all the rows.
struct Collect(Pending);

/// Rows `rows` of its input (an `index_select` along the first dimension)
/// whose backward leaves their gradient to [`Collect`].
struct ExpertRows {
    rows: Tensor,
    pending: Pending,
}

/// A contiguous copy of `storage` seen through `layout`.
fn copied<S>(storage: &S, layout: &Layout) -> candle_core::Result<S>
where
    S: BackendStorage,
    S::Device: BackendDevice<Storage = S>,
{
    let mut out = storage
        .device()
        .zeros_impl(layout.shape(), storage.dtype())?;
    storage.copy_strided_src(&mut out, 0, layout)?;
    Ok(out)
}

impl CustomOp1 for Collect {
    fn name(&self) -> &'static str {
        "zero-moe-collect"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((copied(s, l)?, l.shape().clone()))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok((copied(s, l)?, l.shape().clone()))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let pending = std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner));
        if pending.is_empty() {
            return Ok(Some(grad_res.clone()));
        }
        let (rows, grads): (Vec<Tensor>, Vec<Tensor>) = pending.into_iter().unzip();
        let rows = Tensor::cat(&rows, 0)?;
        let grads = Tensor::cat(&grads, 0)?.to_dtype(grad_res.dtype())?;
        Ok(Some(grad_res.contiguous()?.index_add(&rows, &grads, 0)?))
    }
}

impl ExpertRows {
    /// The rows of `s` (its layout `l`), the row indices on its device.
    fn select<S: OnDevice>(&self, s: &S, l: &Layout) -> candle_core::Result<(S, Shape)> {
        let (ids, ids_layout) = self.rows.storage_and_layout();
        let Some(ids) = S::of(&ids) else {
            candle_core::bail!(
                "the experts' rows are on another device than their input; keep the model and \
                 its inputs on one device"
            );
        };
        let out = s.index_select(ids, l, ids_layout, 0)?;
        let shape = Shape::from((self.rows.dim(0)?, l.dims()[1]));
        Ok((out, shape))
    }
}

impl CustomOp1 for ExpertRows {
    fn name(&self) -> &'static str {
        "zero-moe-expert-rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.select(s, l)
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.select(s, l)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((self.rows.clone(), grad_res.clone()));
        Ok(None)
    }
}

/// Switch Transformer's load-balancing loss over the mixture layers' router
/// logits (each `[tokens, num_experts]`), as `transformers` computes it
/// (`load_balancing_loss_func`, no attention mask): `num_experts · Σ_e f_e ·
/// P_e`, `f_e` the choices of expert `e` over all layers' tokens per token
/// (the top `experts_per_token` of each, counted; no gradient), `P_e` the
/// mean of its probability; f32.
pub(super) fn load_balancing_loss(
    router_logits: &[Tensor],
    moe: &super::MoeConfig,
) -> candle_core::Result<Tensor> {
    let device = router_logits[0].device();
    // Counted on the device: no read of the choices back to the host.
    let mut counts = Tensor::zeros(moe.num_experts, DType::F32, device)?;
    let (mut rows, mut prob_sums) = (0, Vec::with_capacity(router_logits.len()));
    for logits in router_logits {
        let probs = candle_nn::ops::softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
        let chosen = top_k(&probs, moe.experts_per_token)?.flatten_all()?;
        let ones = Tensor::ones(chosen.dim(0)?, DType::F32, device)?;
        counts = counts.index_add(&chosen, &ones, 0)?;
        rows += probs.dim(0)?;
        prob_sums.push(probs.sum(0)?);
    }
    let share = (counts / rows as f64)?;
    let probability = (Tensor::stack(&prob_sums, 0)?.sum(0)? / rows as f64)?;
    (share * probability)?.sum_all()? * moe.num_experts as f64
}

/// The `k` largest of each row of `probs` `[tokens, experts]`: their
/// columns `[tokens, k]` (u32), largest first.
pub(super) fn top_k(probs: &Tensor, k: usize) -> candle_core::Result<Tensor> {
    probs
        .arg_sort_last_dim(false)?
        .narrow(1, 0, k)?
        .contiguous()
}

/// Which rows each expert takes: `rows[ranges[e]]` are expert `e`'s (in
/// token order), `slots` the same entries' places in the flattened
/// `[tokens, k]` choices (the index of the probability that scales each).
/// An expert no token chose takes nothing, or, `with_idle_rows` (for
/// layers that only report a gradient they compute), row 0 with the slot
/// `tokens · k`, whose scale is zero.
struct Routes {
    rows: Vec<u32>,
    slots: Vec<u32>,
    ranges: Vec<std::ops::Range<usize>>,
}

impl Routes {
    /// The routes of `chosen` (per token, its experts) over `experts`.
    fn new(chosen: &[Vec<u32>], experts: usize, with_idle_rows: bool) -> Self {
        let mut per_expert = vec![Vec::new(); experts];
        for (token, row) in chosen.iter().enumerate() {
            for (j, &e) in row.iter().enumerate() {
                per_expert[e as usize].push((token, token * row.len() + j));
            }
        }
        let idle = chosen.iter().map(Vec::len).sum::<usize>();
        let (mut rows, mut slots, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
        for routed in per_expert {
            let start = rows.len();
            if routed.is_empty() && with_idle_rows {
                rows.push(0);
                slots.push(idle as u32);
            }
            for (token, slot) in routed {
                rows.push(token as u32);
                slots.push(slot as u32);
            }
            ranges.push(start..rows.len());
        }
        Self {
            rows,
            slots,
            ranges,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a bf16 model an f32 router's logits are the f32 product of the
    /// bf16 input and weight, not the bf16 product; its weight's gradient
    /// reaches the hook, in the weight's dtype.
    #[test]
    fn a_router_in_f32_computes_its_logits_in_f32() -> candle_core::Result<()> {
        use crate::nn::{GradCollector, GradHook};
        let device = candle_core::Device::Cpu;
        let bf16 =
            |shape: (usize, usize)| Tensor::randn(0f32, 1.0, shape, &device)?.to_dtype(DType::BF16);
        let w = Var::from_tensor(&bf16((8, 64))?)?;
        let h = bf16((5, 64))?;
        let collector = Arc::new(GradCollector::new());
        let hook: Arc<dyn GradHook> = collector.clone();
        let router = Linear::new(w.as_tensor().clone(), None, Some(hook));
        let logits = logits_in_f32(&router, &h)?;
        let wide = |t: &Tensor| t.to_dtype(DType::F32);
        let want = wide(&h)?.matmul(&wide(w.as_tensor())?.t()?)?;
        assert_eq!(logits.dtype(), DType::F32);
        assert_eq!(logits.to_vec2::<f32>()?, want.to_vec2::<f32>()?);
        let rounded = wide(&router.forward(&h)?)?;
        let apart = (rounded - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(apart > 0.0, "the bf16 product is rounded");
        logits.sum_all()?.backward()?;
        let grad = collector.get(&w).expect("the router's gradient");
        assert_eq!(grad.dtype(), DType::BF16);
        // ∂/∂W of Σ h·Wᵀ: each row of W gets the column sums of h.
        let sums = wide(&h)?.sum_keepdim(0)?.broadcast_as((8, 64))?;
        let off = (wide(&grad)? - sums)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(off < 0.05, "the weight's gradient is off by {off}");
        Ok(())
    }

    #[test]
    fn routes_group_the_tokens_by_expert_and_give_idle_experts_a_zero_row_if_asked() {
        // Three tokens, two experts each, of four.
        let chosen = [vec![2, 0], vec![0, 3], vec![3, 2]];
        let routes = Routes::new(&chosen, 4, true);
        assert_eq!(routes.rows, vec![0, 1, 0, 0, 2, 1, 2]);
        assert_eq!(routes.slots, vec![1, 2, 6, 0, 5, 3, 4]);
        assert_eq!(routes.ranges, vec![0..2, 2..3, 3..5, 5..7]);
        let routes = Routes::new(&chosen, 4, false);
        assert_eq!(routes.rows, vec![0, 1, 0, 2, 1, 2]);
        assert_eq!(routes.slots, vec![1, 2, 0, 5, 3, 4]);
        assert_eq!(routes.ranges, vec![0..2, 2..2, 2..4, 4..6]);
    }

    #[test]
    fn top_k_takes_the_largest_first() {
        let probs = Tensor::new(
            &[[0.1f32, 0.5, 0.3, 0.1], [0.7, 0.0, 0.1, 0.2]],
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let chosen = top_k(&probs, 2).unwrap().to_vec2::<u32>().unwrap();
        assert_eq!(chosen, vec![vec![1, 2], vec![0, 3]]);
    }

    #[test]
    fn grouped_top_k_chooses_within_the_best_groups() {
        let choice = vec![
            vec![0.9f32, 0.1, 0.5, 0.6, 0.2, 0.3],
            vec![0.9f32, 0.1, 0.5, 0.6, 1.2, 0.3],
        ];
        // One group: the best three.
        assert_eq!(
            grouped_top_k(&choice[..1], (1, 1, 2), 3),
            vec![vec![0, 3, 2]]
        );
        // Three groups of two, ranked by their two best (1.0, 1.1, 0.5):
        // the best two groups' experts only.
        assert_eq!(
            grouped_top_k(&choice[..1], (3, 2, 2), 3),
            vec![vec![0, 3, 2]]
        );
        assert_eq!(
            grouped_top_k(&choice, (3, 1, 2), 2),
            vec![vec![3, 2], vec![4, 5]],
            "group 1 (0.5 + 0.6) beats group 0 (0.9 + 0.1); then group 2 (1.2 + 0.3)"
        );
        // Ranked by their best alone (DeepSeek-V2's), group 0 (0.9) wins
        // the first row, group 2 (1.2) the second.
        assert_eq!(
            grouped_top_k(&choice, (3, 1, 1), 2),
            vec![vec![0, 1], vec![4, 5]]
        );
        // Ties go to the lower index.
        assert_eq!(
            grouped_top_k(&[vec![0.5f32; 4]], (2, 1, 2), 2),
            vec![vec![0, 1]]
        );
    }
}
