//! A [`Llama`](super::Llama)'s layers built from its config: each kind a
//! method of [`Builder`], which holds what they all read.

use super::latent::{Latent, LatentQuery};
use super::mlp::{Experts, FeedForward, Mlp, Routing, Ungated};
use super::xielu::Xielu;
use super::{
    buffer, expert_vars, gpt_oss_expert_vars, AttentionInput, Block, HeadNorm, LatentAttention,
    LlamaConfig, MoeConfig, MoeRouting, MoeStyle, Projections, QkNorm, QkNorms, LATENT_NORM_EPS,
};
use crate::nn::{GradHook, LayerNorm, Linear};
use crate::Result;
use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};
use std::sync::Arc;

/// What every layer of a model reads: its config, the hook their
/// gradients go to, and how a fresh model's weights are drawn.
pub(super) struct Builder<'a> {
    config: &'a LlamaConfig,
    hook: Option<Arc<dyn GradHook>>,
    /// Normal with standard deviation `initializer_range`, as
    /// `transformers` draws them.
    pub(super) normal: Init,
}

impl<'a> Builder<'a> {
    pub(super) fn new(config: &'a LlamaConfig, hook: Option<Arc<dyn GradHook>>) -> Self {
        Self {
            config,
            hook,
            normal: Init::Randn {
                mean: 0.0,
                stdev: config.initializer_range,
            },
        }
    }

    /// A Linear `d_in -> d_out` under `vb` (`weight`, and `bias` if `bias`).
    pub(super) fn linear_b(
        &self,
        vb: VarBuilder,
        d_in: usize,
        d_out: usize,
        bias: bool,
    ) -> Result<Linear> {
        let w = vb.get_with_hints((d_out, d_in), "weight", self.normal)?;
        let b = match bias {
            true => Some(vb.get_with_hints(d_out, "bias", Init::Const(0.0))?),
            false => None,
        };
        Ok(Linear::new(w, b, self.hook.clone()))
    }

    fn linear(&self, vb: VarBuilder, d_in: usize, d_out: usize) -> Result<Linear> {
        self.linear_b(vb, d_in, d_out, false)
    }

    /// A norm of the model's kind over `width` values.
    fn norm_of(&self, vb: VarBuilder, width: usize) -> Result<LayerNorm> {
        let config = self.config;
        let offset = config.norm_weight_offset;
        let w = match config.norm_weights {
            true => vb.get_with_hints(width, "weight", Init::Const(1.0 - offset))?,
            // OLMo's: ones, no variable.
            false => Tensor::ones(width, vb.dtype(), vb.device())?,
        };
        let (eps, hook) = (config.rms_norm_eps, self.hook.clone());
        Ok(match (config.layer_norms, config.norm_bias) {
            (true, true) => {
                let b = vb.get_with_hints(width, "bias", Init::Const(0.0))?;
                LayerNorm::new(w, b, eps, hook)
            }
            (true, false) => LayerNorm::new_no_bias(w, eps, hook),
            (false, _) => LayerNorm::rms_norm(w, eps, hook),
        }
        .with_weight_offset(offset))
    }

    /// A norm of the model's kind over the hidden state.
    pub(super) fn norm(&self, vb: VarBuilder) -> Result<LayerNorm> {
        self.norm_of(vb, self.config.hidden_size)
    }

    /// A norm of each of `heads` heads with weights of its own.
    fn head_norm(&self, vb: VarBuilder, heads: usize) -> Result<HeadNorm> {
        let config = self.config;
        let width = config.head_dim;
        Ok(HeadNorm {
            weights: match config.layer_names.head_norm_per_head() {
                true => (0..heads)
                    .map(|h| {
                        vb.pp(format!("norms.{h}")).get_with_hints(
                            width,
                            "weight",
                            Init::Const(1.0),
                        )
                    })
                    .collect::<std::result::Result<_, _>>()?,
                false => vec![vb.get_with_hints((heads, width), "weight", Init::Const(1.0))?],
            },
            eps: config.rms_norm_eps,
            remove_mean: config.layer_norms,
            hook: self.hook.clone(),
        })
    }

    /// A norm of a branch's output, where the model has them.
    fn output_norm(&self, vb: VarBuilder) -> Result<Option<LayerNorm>> {
        self.config.output_norms.then(|| self.norm(vb)).transpose()
    }

    /// A gated MLP `width` wide under the family's names (Llama's but for
    /// EXAONE 3's), with biases if `bias`.
    fn gated(&self, vb: VarBuilder, width: usize, bias: bool) -> Result<Mlp> {
        let d = self.config.hidden_size;
        let [gate, up, down] = self.config.layer_names.gated_mlp();
        Ok(Mlp {
            gate_up: Projections::Separate([
                self.linear_b(vb.pp(gate), d, width, bias)?,
                self.linear_b(vb.pp(up), d, width, bias)?,
            ]),
            down: self.linear_b(vb.pp(down), width, d, bias)?,
            activation: self.config.mlp_activation,
            clamped: None,
        })
    }

    /// The dense MLP `width` wide under `vb`.
    fn dense(&self, vb: VarBuilder, width: usize) -> Result<Mlp> {
        self.gated(vb, width, self.config.mlp_bias)
    }

    /// A mixture's experts under `vb`, named as the files hold them
    /// ([`expert_vars`], [`gpt_oss_expert_vars`]).
    fn experts(&self, vb: &VarBuilder, moe: &MoeConfig) -> Result<Vec<Mlp>> {
        let (d, width) = (self.config.hidden_size, moe.expert_size);
        (0..moe.num_experts)
            .map(|e| match moe.style {
                MoeStyle::GptOss => {
                    // Each projection a Linear over its parts of the fused
                    // tensors: weight and bias.
                    let [gate_up, gate_up_bias, down, down_bias] = gpt_oss_expert_vars(moe, e);
                    let part = |weight: &str, bias: &str, d_in, d_out| -> Result<Linear> {
                        let w = vb.get_with_hints((d_out, d_in), weight, self.normal)?;
                        let b = vb.get_with_hints(d_out, bias, Init::Const(0.0))?;
                        Ok(Linear::new(w, Some(b), self.hook.clone()))
                    };
                    Ok(Mlp {
                        gate_up: Projections::Interleaved(part(
                            &gate_up,
                            &gate_up_bias,
                            d,
                            2 * width,
                        )?),
                        down: part(&down, &down_bias, width, d)?,
                        activation: self.config.mlp_activation,
                        clamped: moe.clamped_swiglu,
                    })
                }
                _ => {
                    let [gate, up, down] = expert_vars(self.config, moe, e);
                    Ok(Mlp {
                        gate_up: Projections::Separate([
                            self.linear(vb.pp(gate), d, width)?,
                            self.linear(vb.pp(up), d, width)?,
                        ]),
                        down: self.linear(vb.pp(down), width, d)?,
                        activation: self.config.mlp_activation,
                        clamped: None,
                    })
                }
            })
            .collect()
    }

    /// A mixture's router under `vb`; the sigmoid one's bias that steers
    /// its choice (GLM-4.5's, MiniMax-M2's) is a buffer of the checkpoint.
    fn router(&self, vb: &VarBuilder, moe: &MoeConfig) -> Result<(Linear, Routing)> {
        let (d, experts) = (self.config.hidden_size, moe.num_experts);
        let gate = self.linear_b(
            vb.pp(moe.style.router_name()),
            d,
            experts,
            moe.style.biased(),
        )?;
        let steering = || buffer(vb, (moe.style.bias_name(), "gate.weight"), experts);
        let routing = match moe.routing {
            MoeRouting::Softmax => Routing::Softmax,
            MoeRouting::TopKSoftmax => Routing::TopKSoftmax,
            MoeRouting::Sigmoid {
                groups,
                top_groups,
                scale,
            } => Routing::Sigmoid {
                bias: steering()?,
                groups,
                top_groups,
                scale,
                // transformers divides GLM-4.5's sums plus 1e-20.
                epsilon: if matches!(
                    moe.style,
                    MoeStyle::Glm | MoeStyle::Exaone | MoeStyle::Sarvam
                ) {
                    1e-20
                } else {
                    0.0
                },
            },
            MoeRouting::GroupedSoftmax {
                groups,
                top_groups,
                ranked_by,
                scale,
            } => Routing::GroupedSoftmax {
                groups,
                top_groups,
                ranked_by,
                scale,
            },
            MoeRouting::BiasedSoftmax { min_sum } => Routing::BiasedSoftmax {
                bias: steering()?,
                min_sum,
            },
        };
        Ok((gate, routing))
    }

    /// A mixture of experts under `vb` (a block's), its shared experts as
    /// the style has them.
    fn mixture(&self, vb: &VarBuilder, moe: &MoeConfig) -> Result<Experts> {
        let d = self.config.hidden_size;
        let mixture = vb.pp(moe.style.prefix());
        let (router, experts) = (self.router(&mixture, moe)?, self.experts(&mixture, moe)?);
        let mlp = vb.pp("mlp");
        let shared = match moe.shared_expert_size {
            Some(width) if moe.style.granite() => {
                let shared = vb.pp("shared_mlp");
                Some((
                    Mlp {
                        gate_up: Projections::Fused(
                            self.linear(shared.pp("input_linear"), d, 2 * width)?,
                            [width; 2],
                        ),
                        down: self.linear(shared.pp("output_linear"), width, d)?,
                        activation: self.config.mlp_activation,
                        clamped: None,
                    },
                    None,
                ))
            }
            Some(width) if moe.style == MoeStyle::Hunyuan => {
                Some((self.dense(mlp.pp("shared_mlp"), width)?, None))
            }
            Some(width) if moe.style.ungated_shared_experts() => {
                Some((self.dense(mlp.pp("shared_experts"), width)?, None))
            }
            Some(width) => Some((
                self.dense(mlp.pp("shared_expert"), width)?,
                Some(self.linear(mlp.pp("shared_expert_gate"), d, 1)?),
            )),
            None => None,
        };
        Ok(Experts::new(
            router,
            experts,
            shared,
            (
                moe.experts_per_token,
                moe.normalize,
                moe.style.weights_in_model_dtype(),
                moe.router_in_f32,
            ),
        )?)
    }

    /// Block `i`'s feed-forward half under `vb` (the block's).
    fn feed_forward(&self, vb: &VarBuilder, i: usize) -> Result<FeedForward> {
        let config = self.config;
        let (d, width, bias) = (
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
        );
        let mlp = vb.pp("mlp");
        Ok(match &config.moe {
            Some(moe) if moe.layers[i] => FeedForward::Experts(Box::new(self.mixture(vb, moe)?)),
            _ if config.fused_gate_up => FeedForward::Dense(Mlp {
                gate_up: Projections::Fused(
                    self.linear_b(mlp.pp("gate_up_proj"), d, 2 * width, bias)?,
                    [width; 2],
                ),
                down: self.linear_b(mlp.pp("down_proj"), width, d, bias)?,
                activation: config.mlp_activation,
                clamped: None,
            }),
            _ => match config.ungated_mlp {
                Some(names) => {
                    let [up, down] = names.names();
                    FeedForward::Ungated(Ungated {
                        up: self.linear_b(mlp.pp(up), d, width, bias)?,
                        down: self.linear_b(mlp.pp(down), width, d, bias)?,
                        activation: config.mlp_activation,
                        xielu: match config.xielu {
                            true => Some(Xielu::new(mlp.pp("act_fn"), self.hook.clone())?),
                            false => None,
                        },
                    })
                }
                None => FeedForward::Dense(self.dense(mlp, width)?),
            },
        })
    }

    /// DeepSeek-V2's latent attention under `attn`.
    fn latent(&self, attn: &VarBuilder, shape: LatentAttention) -> Result<Latent> {
        let config = self.config;
        let (d, heads, bias) = (
            config.hidden_size,
            config.num_attention_heads,
            config.qkv_bias,
        );
        let latent_norm = |vb: VarBuilder, width| -> Result<LayerNorm> {
            let w = vb.get_with_hints(width, "weight", Init::Const(1.0))?;
            Ok(LayerNorm::rms_norm(w, LATENT_NORM_EPS, self.hook.clone()))
        };
        let q = heads * config.head_dim;
        Ok(Latent {
            query: match shape.query_rank {
                Some(rank) => LatentQuery::Ranked(
                    self.linear_b(attn.pp("q_a_proj"), d, rank, bias)?,
                    latent_norm(attn.pp("q_a_layernorm"), rank)?,
                    self.linear(attn.pp("q_b_proj"), rank, q)?,
                ),
                None => LatentQuery::Direct(self.linear(attn.pp("q_proj"), d, q)?),
            },
            kv_a: self.linear_b(
                attn.pp("kv_a_proj_with_mqa"),
                d,
                shape.kv_rank + config.rotary_dim,
                bias,
            )?,
            kv_norm: latent_norm(attn.pp("kv_a_layernorm"), shape.kv_rank)?,
            kv_b: self.linear(
                attn.pp("kv_b_proj"),
                shape.kv_rank,
                heads * (shape.nope_dim + shape.value_dim),
            )?,
            heads,
            shape,
            rotary_dim: config.rotary_dim,
        })
    }

    /// Where the attention under `attn` takes its queries, keys and values
    /// from.
    fn attention_input(&self, attn: &VarBuilder) -> Result<AttentionInput> {
        let config = self.config;
        let (d, bias) = (config.hidden_size, config.qkv_bias);
        let (q, kv) = (
            config.num_attention_heads * config.head_dim,
            config.num_key_value_heads * config.head_dim,
        );
        Ok(match (config.latent_attention, config.fused_qkv) {
            (Some(shape), _) => AttentionInput::Latent(Box::new(self.latent(attn, shape)?)),
            (None, true) => {
                let fused = attn.pp(config.layer_names.fused_qkv());
                let qkv = self.linear_b(fused, d, q + 2 * kv, bias)?;
                AttentionInput::Projections(Projections::Fused(qkv, [q, kv, kv]))
            }
            (None, false) => AttentionInput::Projections(Projections::Separate([
                self.linear_b(attn.pp("q_proj"), d, q, bias)?,
                self.linear_b(attn.pp("k_proj"), d, kv, bias)?,
                self.linear_b(attn.pp("v_proj"), d, kv, bias)?,
            ])),
        })
    }

    /// The norms of the queries and keys under `attn`, if the model has
    /// them.
    fn qk_norms(&self, attn: &VarBuilder) -> Result<Option<QkNorms>> {
        let config = self.config;
        let names = config.layer_names;
        Ok(match config.qk_norm {
            Some(QkNorm::PerHead) => {
                let [q_norm, k_norm] = names.qk_norms();
                Some(QkNorms::Layers(
                    QkNorm::PerHead,
                    self.norm_of(attn.pp(q_norm), config.head_dim)?,
                    self.norm_of(attn.pp(k_norm), config.head_dim)?,
                ))
            }
            Some(QkNorm::Projection) => Some(QkNorms::Layers(
                QkNorm::Projection,
                self.norm_of(
                    attn.pp("q_norm"),
                    config.num_attention_heads * config.head_dim,
                )?,
                self.norm_of(
                    attn.pp("k_norm"),
                    config.num_key_value_heads * config.head_dim,
                )?,
            )),
            Some(QkNorm::HeadWeights) => {
                let [q_norm, k_norm] = names.qk_norms();
                Some(QkNorms::HeadWeights(
                    self.head_norm(attn.pp(q_norm), config.num_attention_heads)?,
                    self.head_norm(attn.pp(k_norm), config.num_key_value_heads)?,
                ))
            }
            None => None,
        })
    }

    /// Block `i` under `vb` (`model.layers.{i}`).
    pub(super) fn block(&self, vb: VarBuilder, i: usize) -> Result<Block> {
        let config = self.config;
        let names = config.layer_names;
        let attn = vb.pp(names.attention());
        let value_dim = config
            .latent_attention
            .map_or(config.head_dim, |l| l.value_dim);
        Ok(Block {
            input_layernorm: match (config.input_norms, config.parallel_mlp_norm) {
                (true, true) => Some(self.norm(vb.pp(names.branch_norms()[0]))?),
                (true, false) => Some(self.norm(vb.pp(names.input_norm()))?),
                (false, _) => None,
            },
            qkv: self.attention_input(&attn)?,
            o_proj: self.linear_b(
                attn.pp(names.output_projection()),
                config.num_attention_heads * value_dim,
                config.hidden_size,
                config.o_bias,
            )?,
            qk_norms: self.qk_norms(&attn)?,
            attn_out_norm: self.output_norm(vb.pp(config.norm_names.attention_output()))?,
            mlp_norm: match (config.input_norms, config.output_norms) {
                (false, _) => None,
                _ if config.parallel_blocks && !config.parallel_mlp_norm => None,
                (true, true) => Some(self.norm(vb.pp(config.norm_names.mlp_input()))?),
                (true, false) => Some(self.norm(vb.pp(match config.parallel_mlp_norm {
                    true => names.branch_norms()[1],
                    false => names.mlp_norm(),
                }))?),
            },
            mlp: self.feed_forward(&vb, i)?,
            mlp_out_norm: self.output_norm(vb.pp(config.norm_names.mlp_output()))?,
            parallel: config.parallel_blocks,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            value_dim,
            query_factor: config
                .attention_scale
                .map(|scale| scale * (config.head_dim as f64).sqrt())
                .filter(|&factor| factor != 1.0),
            residual_multiplier: config.residual_multiplier,
            clip_qkv: config.clip_qkv,
            norm_after_rotation: config.qk_norm_after_rotation,
            position_scale: config.position_scale,
            rotates: config.rotated_layers.as_ref().is_none_or(|r| r[i]),
            score_cap: config.attn_logit_softcapping,
            sinks: match config.attention_sinks {
                true => Some((
                    attn.get_with_hints(config.num_attention_heads, "sinks", self.normal)?,
                    self.hook.clone(),
                )),
                false => None,
            },
            window: config
                .sliding_window
                .as_ref()
                .filter(|w| w.layers[i])
                .map(|w| w.size),
            local_rotation: config.sliding_window.as_ref().is_some_and(|w| w.layers[i]),
        })
    }
}
