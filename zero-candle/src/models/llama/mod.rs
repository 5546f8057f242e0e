//! Llama (`LlamaForCausalLM`): a token embedding, pre-norm blocks of
//! grouped-query attention with rotary position embeddings and a SwiGLU
//! MLP, RMS norms, and a head of its own or tied to the embedding. Mistral
//! (`MistralForCausalLM`), Qwen2 (`Qwen2ForCausalLM`) and Qwen3
//! (`Qwen3ForCausalLM`) share its layout: Mistral with sliding-window
//! attention, Qwen2 with biases on the query, key and value projections
//! (and sliding windows where switched on), Qwen3 with an RMS norm on each
//! query and key head before the rotation. Phi-3 (`Phi3ForCausalLM`) too,
//! its query, key and value projections one weight (`qkv_proj`) and its gate
//! and up projections another (`gate_up_proj`). And Gemma
//! (`GemmaForCausalLM`): RMS norms that scale by `1 + weight`, the token
//! embeddings times `√hidden_size`, a GELU-gated MLP; Gemma 2
//! (`Gemma2ForCausalLM`) adds norms of the attention's and the MLP's
//! outputs, its own score scale, windows in every other layer and
//! soft-capped scores and logits; Gemma 3's text model (`Gemma3ForCausalLM`)
//! has Gemma 2's norms and scale, norms of each query and key head, a
//! rotation of its own in the sliding-window layers and capped logits.
//! SmolLM3 (`SmolLM3ForCausalLM`): layers without rotary embeddings
//! (`no_rope_layers`). Granite (`GraniteForCausalLM`): multipliers on the
//! embeddings, the scores, the residual branches and the logits. OLMo 2
//! (`Olmo2ForCausalLM`) and 3: norms of the attention's and the MLP's
//! outputs instead of their inputs, the queries and keys normalized over
//! whole projections (OLMo 3: windows in three layers of four). And the
//! mixtures of experts in place of the MLP ([`MoeConfig`]): Mixtral
//! (`MixtralForCausalLM`), Qwen2-MoE (with a shared expert), Qwen3-MoE,
//! OLMoE, FlexOlmo (OLMo 2's norms), GLM-4.5 (`Glm4MoeForCausalLM`: a
//! sigmoid router steered by a bias, shared experts, dense first layers)
//! and MiniMax-M2 (`MiniMaxM2ForCausalLM`: that router on Mixtral's
//! mixture). GLM-4 (`GlmForCausalLM`, `Glm4ForCausalLM`: half of each
//! head rotating as interleaved pairs, gate and up in one weight; GLM-4-0414
//! with output norms) and Cohere (`CohereForCausalLM`, `Cohere2ForCausalLM`:
//! LayerNorms without bias, the attention and the MLP side by side, the
//! logits scaled). ERNIE 4.5 (`Ernie4_5ForCausalLM`: interleaved pairs,
//! biases on every projection; `Ernie4_5_MoeForCausalLM`: mixtures chosen
//! by probability plus a bias, shared experts). dots.llm1
//! (`Dots1ForCausalLM`: Qwen3's attention, GLM-4.5's mixtures). StarCoder2
//! (`Starcoder2ForCausalLM`: LayerNorms with biases, biases on every
//! projection, an MLP without a gate) and Phi (`PhiForCausalLM`: those,
//! Cohere's parallel blocks, a head with a bias, its own names). Arcee
//! (`ArceeForCausalLM`: an MLP without a gate, squared ReLU) and Nemotron
//! (`NemotronForCausalLM`: that MLP, LayerNorms scaling by `1 + weight`).
//! EXAONE 4 (`Exaone4ForCausalLM`: OLMo 2's norms, Qwen3's head norms,
//! Cohere 2's windows) and Seed-OSS (`SeedOssForCausalLM`: the output
//! projection's bias apart). GPT-NeoX (`GPTNeoXForCausalLM`, Pythia: its
//! own names, q, k and v in one weight head by head, a norm for each of its
//! parallel branches). StableLM (`StableLmForCausalLM`: biased
//! LayerNorms, a LayerNorm of each query and key head with a tensor per
//! head, parallel blocks where asked). OLMo (`OlmoForCausalLM`: LayerNorms
//! without parameters, the projections clamped). NanoChat
//! (`NanoChatForCausalLM`: RMS norms without parameters, the embeddings'
//! too, squared ReLU, rotation by the negative angles, capped logits).
//! Hunyuan (`HunYuanDenseV1ForCausalLM`: norms of the rotated query and key
//! heads, NTK's `alpha`; `HunYuanMoEV1ForCausalLM`: a mixture beside a shared
//! MLP in every layer). Sarvam MoE (`sarvam_moe`: GLM-4.5's model under its
//! files' names, [`LayerNames::Sarvam`]). Jais 2 (`Jais2ForCausalLM`: Nemotron's MLP, biased
//! LayerNorms and projections) and Helium (`HeliumForCausalLM`: interleaved
//! rotary pairs). Ministral and CWM (`MinistralForCausalLM`,
//! `CwmForCausalLM`: windows in the layers `layer_types` names). Solar Open
//! (`SolarOpenForCausalLM`: GLM-4.5's mixture in every layer). Ministral 3
//! (`Ministral3ForCausalLM`: YaRN, the queries scaled by position past the
//! original context), and the text model of Mistral 3
//! (`Mistral3ForConditionalGeneration`: Mistral Small 3, Ministral 3).
//! GPT-J (`GPTJForCausalLM`: GPT-2's keys and names, parallel blocks, part
//! of each head rotating as interleaved pairs). Falcon (`FalconForCausalLM`:
//! q, k and v in one weight in each architecture's order, parallel blocks).
//! DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`;
//! Sarvam MLA, `sarvam_mla`, as V3),
//! GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) and Mistral 4
//! (`Mistral4ForCausalLM`): multi-head latent attention
//! ([`LatentAttention`]) and their mixtures; Youtu-LLM
//! (`YoutuForCausalLM`: DeepSeek-V3's attention, dense MLPs) and MiniCPM3
//! (`MiniCPM3ForCausalLM`: the latent attention rotating halves, Granite's
//! multipliers under its own keys). InternLM3, IQuest-Coder and
//! EXAONE 3 (which `transformers` runs as Llama; EXAONE 3 under its files'
//! names, [`LayerNames::Exaone`]), Granite MoE (`GraniteMoeForCausalLM`:
//! Granite's multipliers, a mixture whose experts its files fuse), EXAONE
//! MoE and gpt-oss (`GptOssForCausalLM`: attention sinks, experts with
//! biases and a clamped SwiGLU). Granite SWA and Granite MoE SWA
//! (`GraniteSWAForCausalLM`, `GraniteMoeSWAForCausalLM`: windows, sinks, a
//! rotary base per layer), VaultGemma (`VaultGemmaForCausalLM`: Gemma 2's
//! without the norms of the outputs) and HyperCLOVA X
//! (`HyperCLOVAXForCausalLM`: Granite's multipliers with norms of the
//! outputs). Apertus (`ApertusForCausalLM`: head norms, an MLP without a
//! gate through xIELU, whose parameters it trains).
//!
//! The variables carry the hub's names (`model.embed_tokens.weight`,
//! `model.layers.{i}.self_attn.q_proj.weight`, ..., `model.norm.weight`,
//! `lm_head.weight` when the head is untied), stored as they are but for
//! the query and key rows of models whose checkpoints rotate interleaved
//! pairs (GLM's, Cohere's, ERNIE's), held in rotate_half's order
//! ([`Llama::hub_layout`]).

mod build;
mod config;
mod latent;
mod mlp;
mod moe;
mod rotation;
mod xielu;

pub(crate) use config::{llama_types, reads};
pub use config::{
    LatentAttention, LayerNames, LlamaConfig, NormNames, PositionScale, QkNorm, SlidingWindow,
    UngatedMlp, LATENT_NORM_EPS,
};
pub use moe::{ClampedSwiglu, MoeConfig, MoeRouting, MoeStyle};

use super::rope::{halves_from_interleaved, RopeScaling};
use crate::hub::HubLayout;
use crate::nn::{ops, Embedding, GradHook, LayerNorm, Linear};
use crate::{Error, Result, ShardedVarMap};
use build::Builder;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use latent::{latent_rows, Latent};
use mlp::FeedForward;
use rotation::{RopeTables, Rotation};
use std::sync::Arc;

/// One pre-norm block: `x + attn(input_layernorm(x))`, then `x +
/// mlp(mlp_norm(x))`, the first add in the second norm's pass
/// ([`LayerNorm::forward_residual`]); with Gemma 2's and 3's output norms, `x +
/// attn_out_norm(attn(..))` and `x + mlp_out_norm(mlp(..))`; Cohere's
/// parallel blocks: `x + attn(h) + mlp(h)`, `h = input_layernorm(x)` (GPT-NeoX's
/// with `mlp(mlp_norm(x))`). The norms are RMS norms or LayerNorms (with or
/// without a bias, or OLMo's without parameters), as the config says.
#[derive(Clone)]
struct Block {
    /// The attention's input norm (all but OLMo 2's blocks).
    input_layernorm: Option<LayerNorm>,
    qkv: AttentionInput,
    o_proj: Linear,
    /// The norms of the queries and the keys: Qwen3's and Gemma 3's of
    /// each head, OLMo 2's of each whole projection, Command R+'s of each
    /// head with weights of its own.
    qk_norms: Option<QkNorms>,
    /// Gemma 2's and 3's norm of the attention's output (their
    /// `post_attention_layernorm`).
    attn_out_norm: Option<LayerNorm>,
    /// The MLP's input norm: Llama's `post_attention_layernorm`, Gemma 2's and 3's
    /// `pre_feedforward_layernorm` (none in OLMo 2).
    mlp_norm: Option<LayerNorm>,
    mlp: FeedForward,
    /// Gemma 2's and 3's norm of the MLP's output (`post_feedforward_layernorm`).
    mlp_out_norm: Option<LayerNorm>,
    /// The MLP reads the attention's input (Cohere's parallel blocks).
    parallel: bool,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The width of each value head: `head_dim` but in a latent
    /// attention.
    value_dim: usize,
    /// The queries' factor that turns the fused attention's `head_dim^-1/2`
    /// into the model's score scale (Gemma's `query_pre_attn_scalar`,
    /// Granite's `attention_multiplier`).
    query_factor: Option<f64>,
    /// Granite's factor on each residual branch.
    residual_multiplier: Option<f64>,
    /// OLMo's clamp of the queries, keys and values.
    clip_qkv: Option<f64>,
    /// The query and key norms read the rotated heads (Hunyuan's).
    norm_after_rotation: bool,
    /// Ministral 3's scale of the queries by position.
    position_scale: Option<PositionScale>,
    /// This layer applies rotary embeddings (all but SmolLM3's NoPE
    /// layers).
    rotates: bool,
    /// Gemma 2's cap on the attention scores.
    score_cap: Option<f64>,
    /// gpt-oss's sink per query head `[heads]`, and the hook its gradient
    /// goes to.
    sinks: Option<(Tensor, Option<Arc<dyn GradHook>>)>,
    /// The sliding window of this layer, if it has one.
    window: Option<usize>,
    /// This layer rotates with the local rotation (Gemma 3's sliding
    /// layers).
    local_rotation: bool,
}

/// Where a block's queries, keys and values come from.
#[derive(Clone)]
enum AttentionInput {
    /// Projections of the block's input.
    Projections(Projections<3>),
    /// DeepSeek-V2's latent attention.
    Latent(Box<Latent>),
}

/// A block's norms of its queries and keys.
#[derive(Clone)]
enum QkNorms {
    /// One norm layer each: of each head, its weights shared by the heads
    /// ([`QkNorm::PerHead`]), or of the whole projection
    /// ([`QkNorm::Projection`]).
    Layers(QkNorm, LayerNorm, LayerNorm),
    /// Each head with weights of its own ([`QkNorm::HeadWeights`]).
    HeadWeights(HeadNorm, HeadNorm),
}

/// Command R+'s and StableLM's norm of each query or key head, with
/// weights a row per head: the statistics and the scale in f32 (a 16-bit
/// input rounded once, after the scale, as `transformers` rounds it), of
/// Candle's ops; the weights read through [`crate::nn::tap`], so their
/// gradients reach the hook.
#[derive(Clone)]
struct HeadNorm {
    /// One `[heads, head_dim]` weight (Command R+'s), or a `[head_dim]`
    /// weight per head (StableLM's).
    weights: Vec<Tensor>,
    eps: f64,
    /// The mean subtracted first (Cohere's LayerNorm); else an RMS norm.
    remove_mean: bool,
    hook: Option<Arc<dyn GradHook>>,
}

impl HeadNorm {
    /// `x` `[batch, time, heads, head_dim]` normalized head by head.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let tapped = |weight: &Tensor| match (&self.hook, weight.is_variable()) {
            (Some(hook), true) => {
                crate::nn::tap(&candle_core::Var::from_tensor(weight)?, Some(hook.clone()))
            }
            _ => Ok(weight.clone()),
        };
        let weight = match self.weights.as_slice() {
            [whole] => tapped(whole)?,
            heads => {
                let heads: Vec<Tensor> = heads
                    .iter()
                    .map(tapped)
                    .collect::<candle_core::Result<_>>()?;
                Tensor::stack(&heads, 0)?
            }
        };
        let dtype = x.dtype();
        let wide = match dtype {
            DType::F64 => DType::F64,
            _ => DType::F32,
        };
        let x = x.to_dtype(wide)?;
        let x = match self.remove_mean {
            true => x.broadcast_sub(&x.mean_keepdim(3)?)?,
            false => x,
        };
        let variance = x.sqr()?.mean_keepdim(3)?;
        let normed = x.broadcast_div(&(variance + self.eps)?.sqrt()?)?;
        normed
            .broadcast_mul(&weight.to_dtype(wide)?)?
            .to_dtype(dtype)
    }
}

/// Projections of the same input: one Linear each, or one Linear whose
/// output holds them side by side (Phi-3's `qkv_proj`, `gate_up_proj`).
#[derive(Clone)]
enum Projections<const N: usize> {
    Separate([Linear; N]),
    /// The Linear and each projection's width, in order.
    Fused(Linear, [usize; N]),
    /// One Linear whose output columns take the projections in turn:
    /// column `N·j + p` is projection `p`'s `j` (gpt-oss's `gate_up_proj`).
    Interleaved(Linear),
}

impl<const N: usize> Projections<N> {
    /// The N projections of `h` rows (columns of one product when fused).
    fn forward(&self, h: &Tensor) -> candle_core::Result<[Tensor; N]> {
        let outputs: Vec<Tensor> = match self {
            Self::Separate(linears) => linears
                .iter()
                .map(|l| l.forward(h))
                .collect::<candle_core::Result<_>>()?,
            Self::Fused(linear, widths) => {
                let all = linear.forward(h)?;
                let mut at = 0;
                widths
                    .iter()
                    .map(|&w| {
                        at += w;
                        all.narrow(1, at - w, w)
                    })
                    .collect::<candle_core::Result<_>>()?
            }
            Self::Interleaved(linear) => {
                let all = linear.forward(h)?;
                let (rows, width) = all.dims2()?;
                let all = all.reshape((rows, width / N, N))?;
                (0..N)
                    .map(|p| all.narrow(2, p, 1)?.squeeze(2))
                    .collect::<candle_core::Result<_>>()?
            }
        };
        Ok(outputs
            .try_into()
            .unwrap_or_else(|_| unreachable!("N outputs")))
    }
}

impl Block {
    /// `x` rows `[batch * time, hidden]` through the block; with
    /// `with_router_logits`, a mixture's router logits `[batch * time,
    /// num_experts]` too.
    fn forward(
        &self,
        x: &Tensor,
        time: usize,
        rotations: &Rotations,
        with_router_logits: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let rotation = match (&rotations.local, self.local_rotation) {
            (Some(local), true) => local,
            _ => &rotations.global,
        };
        let h = match &self.input_layernorm {
            Some(norm) => norm.forward(x)?,
            None => x.clone(),
        };
        let y = self.attention(&h, time, rotation)?;
        let scaled = |branch: Tensor| match self.residual_multiplier {
            Some(factor) => branch.affine(factor, 0.0),
            None => Ok(branch),
        };
        let attended = scaled(normed_output(
            self.o_proj.forward(&y)?,
            self.attn_out_norm.as_ref(),
        )?)?;
        if self.parallel {
            // GPT-NeoX's MLP reads a norm of its own.
            let h = match &self.mlp_norm {
                Some(norm) => norm.forward(x)?,
                None => h,
            };
            let (y, router_logits) = self.mlp.forward(&h, with_router_logits)?;
            return Ok((((x + attended)? + y)?, router_logits));
        }
        let (x, h) = match &self.mlp_norm {
            Some(norm) => norm.forward_residual(&attended, x)?,
            None => {
                let x = (x + attended)?;
                (x.clone(), x)
            }
        };
        let (y, router_logits) = self.mlp.forward(&h, with_router_logits)?;
        let mlp = scaled(normed_output(y, self.mlp_out_norm.as_ref())?)?;
        Ok(((x + mlp)?, router_logits))
    }

    /// The attention of `h` rows `[batch * time, hidden]`, before the
    /// output projection: rows `[batch * time, heads * value_dim]`.
    fn attention(
        &self,
        h: &Tensor,
        time: usize,
        rotation: &Rotation,
    ) -> candle_core::Result<Tensor> {
        let rows = h.dim(0)?;
        // No sequences when there are no positions.
        let batch = rows / time.max(1);
        let [q, k, v] = match &self.qkv {
            AttentionInput::Projections(qkv) => {
                self.projected_heads(qkv, h, (batch, time), rotation)?
            }
            AttentionInput::Latent(latent) => {
                latent.heads(h, (batch, time), |x| rotation.apply(x))?
            }
        };
        let q = match self.query_factor {
            Some(factor) => q.affine(factor, 0.0)?,
            None => q,
        };
        // Ministral 3's scale by position, 1 up to its original context.
        let q = match self.position_scale.filter(|s| time > s.every) {
            Some(scale) => {
                let factors = Tensor::from_vec(scale.factors(time), (1, time, 1, 1), q.device())?;
                q.broadcast_mul(&factors.to_dtype(q.dtype())?)?
            }
            None => q,
        };
        // Each key/value head serves `heads / kv_heads` consecutive query
        // heads (`repeat_kv`), inside the op: no repeated copies.
        let y = match (self.score_cap, &self.sinks, self.window) {
            (Some(cap), _, window) => ops::softcapped_attention(&q, &k, &v, window, cap)?,
            (None, Some((sinks, hook)), window) => {
                ops::sink_attention(&q, &k, &v, sinks, window, hook.clone())?
            }
            (None, None, Some(window)) => ops::sliding_window_attention(&q, &k, &v, window)?,
            (None, None, None) => ops::causal_attention(&q, &k, &v)?,
        };
        // A latent attention's values were padded to the heads' width.
        let y = match self.value_dim < self.head_dim {
            true => y.narrow(3, 0, self.value_dim)?,
            false => y,
        };
        y.reshape((rows, self.heads * self.value_dim))
    }

    /// The queries, keys and values `[batch, time, heads or kv_heads,
    /// head_dim]` that `qkv` projects from `h` rows, clamped, normalized
    /// and rotated as the block says.
    fn projected_heads(
        &self,
        qkv: &Projections<3>,
        h: &Tensor,
        (batch, time): (usize, usize),
        rotation: &Rotation,
    ) -> candle_core::Result<[Tensor; 3]> {
        let rows = h.dim(0)?;
        let [q, k, v] = qkv.forward(h)?;
        // OLMo's clamp of the projections.
        let [q, k, v] = match self.clip_qkv {
            Some(clip) => [q, k, v].map(|x| x.clamp(-clip, clip)),
            None => [q, k, v].map(Ok),
        };
        let (q, k, v) = (q?, k?, v?);
        // OLMo 2 normalizes each projection whole.
        let (q, k) = match &self.qk_norms {
            Some(QkNorms::Layers(QkNorm::Projection, q_norm, k_norm)) => {
                (q_norm.forward(&q)?, k_norm.forward(&k)?)
            }
            _ => (q, k),
        };
        let heads = |x: Tensor, n| x.reshape((batch, time, n, self.head_dim));
        // Qwen3 normalizes each head's row of `head_dim` values, its
        // weights shared by the heads; Command R+ each head with its own.
        let normed = |x: Tensor, query: bool| match &self.qk_norms {
            Some(QkNorms::Layers(QkNorm::PerHead, q, k)) => if query { q } else { k }
                .forward(&x.reshape((rows * x.dim(2)?, self.head_dim))?)?
                .reshape(x.shape()),
            Some(QkNorms::HeadWeights(q, k)) => if query { q } else { k }.forward(&x),
            _ => Ok(x),
        };
        let rotated = |x: Tensor| match self.rotates {
            true => rotation.apply(&x),
            false => Ok(x),
        };
        // Hunyuan normalizes the rotated heads.
        let turned = |x: Tensor, query: bool| match self.norm_after_rotation {
            true => normed(rotated(x)?, query),
            false => rotated(normed(x, query)?),
        };
        Ok([
            turned(heads(q, self.heads)?, true)?,
            turned(heads(k, self.kv_heads)?, false)?,
            heads(v, self.kv_heads)?,
        ])
    }
}

/// The names of expert `e`'s gate, up and down projections under its
/// mixture's prefix: the files' own (`experts.{e}.gate_proj`, Mixtral's
/// `experts.{e}.w1`, ...), or, where the files fuse the experts
/// ([`LlamaConfig::fused_experts`]), names under each fused tensor's that
/// sort in its order (`experts.gate_up_proj.{e}.gate`, `.up`,
/// `experts.down_proj.{e}`, `e` zero-padded; Granite MoE's
/// `input_linear.{e}.gate`, ...): the engine orders the variables by name,
/// and a fused tensor is written from its parts one after another.
fn expert_vars(config: &LlamaConfig, moe: &MoeConfig, e: usize) -> [String; 3] {
    if config.fused_experts {
        let digits = moe.num_experts.saturating_sub(1).max(1).to_string().len();
        let [(_, gate_up), (_, down)] = moe.style.fused_names();
        return [
            format!("{gate_up}.{e:0digits$}.gate"),
            format!("{gate_up}.{e:0digits$}.up"),
            format!("{down}.{e:0digits$}"),
        ];
    }
    let [gate, up, down] = match moe.style.w_names() {
        true => ["w1", "w3", "w2"],
        false => ["gate_proj", "up_proj", "down_proj"],
    };
    [gate, up, down].map(|name| format!("experts.{e}.{name}"))
}

/// The names of gpt-oss's expert `e`'s variables under its mixture's
/// prefix: its parts of the fused `experts.gate_up_proj`,
/// `gate_up_proj_bias`, `down_proj` and `down_proj_bias` (`e` zero-padded,
/// so that a tensor's parts sort together and in order).
fn gpt_oss_expert_vars(moe: &MoeConfig, e: usize) -> [String; 4] {
    let digits = moe.num_experts.saturating_sub(1).max(1).to_string().len();
    GPT_OSS_FUSED.map(|tensor| format!("experts.{tensor}.{e:0digits$}"))
}

/// gpt-oss's fused expert tensors, in [`gpt_oss_expert_vars`]' order.
const GPT_OSS_FUSED: [&str; 4] = [
    "gate_up_proj",
    "gate_up_proj_bias",
    "down_proj",
    "down_proj_bias",
];

/// The buffer `name` of `width` under `vb`, f32 on its device (a tensor of
/// the checkpoint the model reads but does not train: see
/// [`ShardedVarMap`]'s `get_unchecked`), zeros where the source holds none
/// (a fresh model, as `transformers` initializes one). A checkpoint that
/// holds `beside` (a variable next to the buffer) but not the buffer gets
/// zeros with a warning, as `transformers` initializes a missing one.
fn buffer(vb: &VarBuilder, (name, beside): (&str, &str), width: usize) -> Result<Tensor> {
    if !vb.contains_tensor(name) {
        if vb.contains_tensor(beside) {
            tracing::warn!(
                "{}.{name} is not in the checkpoint: zeros, as transformers initializes it",
                vb.prefix()
            );
        }
        return Ok(Tensor::zeros(width, DType::F32, vb.device())?);
    }
    let values = vb.get_unchecked_dtype(name, DType::F32)?;
    // ERNIE 4.5 keeps its bias as one row.
    let values = match values.dims() {
        [1, w] if *w == width => values.flatten_all()?,
        _ => values,
    };
    if values.dims() != [width] {
        return Err(Error::Variable {
            name: format!("{}.{name}", vb.prefix()),
            detail: format!(
                "the checkpoint holds it as {:?}, the model built from its config.json needs \
                 [{width}]; does config.json describe these weights?",
                values.dims()
            ),
        });
    }
    Ok(values.to_device(vb.device())?)
}

/// `y`, or its norm where the model has one (Gemma 2's and 3's output
/// norms).
/// The query and key variables whose rows [`Llama::hub_layout`] reorders
/// where the checkpoint rotates interleaved pairs, with each one's order
/// ([`halves_from_interleaved`] per projection).
fn interleaved_rows(config: &LlamaConfig) -> Vec<(String, Arc<[usize]>)> {
    let (d, r) = (config.head_dim, config.rotary_dim);
    let q = halves_from_interleaved(config.num_attention_heads, d, r);
    let k = halves_from_interleaved(config.num_key_value_heads, d, r);
    let head: Arc<[usize]> = halves_from_interleaved(1, d, r).into();
    let mut qkv = q.clone();
    qkv.extend(k.iter().map(|&row| row + q.len()));
    qkv.extend(q.len() + k.len()..q.len() + 2 * k.len());
    let [q, k, qkv] = [q, k, qkv].map(Arc::<[usize]>::from);
    let mut vars = Vec::new();
    let names = config.layer_names;
    let [q_norm, k_norm] = names.qk_norms();
    for i in 0..config.num_hidden_layers {
        let attn = names.attention_at(i);
        let projections = match config.fused_qkv {
            true => vec![(names.fused_qkv(), &qkv)],
            false => vec![("q_proj", &q), ("k_proj", &k)],
        };
        for (name, rows) in projections {
            vars.push((format!("{attn}.{name}.weight"), rows.clone()));
            if config.qkv_bias {
                vars.push((format!("{attn}.{name}.bias"), rows.clone()));
            }
        }
        match config.qk_norm {
            Some(QkNorm::PerHead) => {
                vars.push((format!("{attn}.{q_norm}.weight"), head.clone()));
                vars.push((format!("{attn}.{k_norm}.weight"), head.clone()));
            }
            // Command R+'s `[heads, head_dim]` weights reorder as the
            // projections' rows, element by element.
            Some(QkNorm::Projection | QkNorm::HeadWeights) => {
                vars.push((format!("{attn}.{q_norm}.weight"), q.clone()));
                vars.push((format!("{attn}.{k_norm}.weight"), k.clone()));
            }
            None => {}
        }
    }
    vars
}

/// The rows of a fused query, key and value projection stored group by
/// group (Falcon's `[kv_heads, heads / kv_heads + 2, head_dim]`: a K/V
/// head's query heads, then its key and its value; GPT-NeoX's `[heads, 3,
/// head_dim]`, a group per head), in the model's order (queries, keys,
/// values): row `r` of the variable is the checkpoint's row `rows[r]`.
fn qkv_from_heads(config: &LlamaConfig) -> Arc<[usize]> {
    let (heads, kv_heads, width) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let group = heads / kv_heads.max(1);
    // The checkpoint's head (in head_dim rows) of each query, key and value
    // head in the model's order.
    let queries = (0..heads).map(|h| (h / group) * (group + 2) + h % group);
    let keys = (0..kv_heads).map(|g| g * (group + 2) + group);
    let values = (0..kv_heads).map(|g| g * (group + 2) + group + 1);
    queries
        .chain(keys)
        .chain(values)
        .flat_map(|head| (0..width).map(move |d| head * width + d))
        .collect()
}

fn normed_output(y: Tensor, norm: Option<&LayerNorm>) -> candle_core::Result<Tensor> {
    match norm {
        Some(norm) => norm.forward(&y),
        None => Ok(y),
    }
}

/// The rotations a forward applies: every layer's, and the sliding layers'
/// where they differ (Gemma 3).
#[derive(Clone)]
struct Rotations {
    global: Rotation,
    local: Option<Rotation>,
}

/// Llama with its language-model head, built from [`crate::nn`]'s layers.
pub struct Llama {
    config: Box<LlamaConfig>,
    embed_tokens: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    /// `lm_head`, or the embedding's table again when tied (a second
    /// hooked use: the engine adds both gradients).
    head: Linear,
    /// The rotary tables, built once per dtype and device.
    rotations: RopeTables,
    /// The sliding layers' tables where they differ (Gemma 3).
    local_rotations: Option<RopeTables>,
    /// Each block recomputed in backward (activation checkpointing).
    checkpointed: bool,
}

impl Llama {
    /// Creates the variables through `vb` (from a [`ShardedVarMap`]'s
    /// builder they are deferred until `ZeroOptimizer::new_sharded` fills
    /// them, a rank's shard only at stage 3), with layers that hand their
    /// gradients to `hook`. A fresh model is initialized as `transformers`
    /// does: weights normal with standard deviation `initializer_range`,
    /// norms scaling by one (Gemma's weights zero).
    pub fn new(
        vb: VarBuilder,
        config: &LlamaConfig,
        hook: Option<Arc<dyn GradHook>>,
    ) -> Result<Self> {
        config.validate().map_err(|detail| Error::Variable {
            name: "<llama config>".into(),
            detail,
        })?;
        let d = config.hidden_size;
        let build = Builder::new(config, hook.clone());
        let names = config.layer_names;
        let model = vb.pp(names.model());
        let embed = model.pp(names.embedding()).get_with_hints(
            (config.vocab_size, d),
            "weight",
            build.normal,
        )?;
        let blocks = (0..config.num_hidden_layers)
            .map(|i| build.block(model.pp(format!("{}.{i}", names.layers())), i))
            .collect::<Result<Vec<_>>>()?;
        let head = if config.tie_word_embeddings {
            Linear::new(embed.clone(), None, hook.clone())
        } else {
            build.linear_b(vb.pp(names.head()), d, config.vocab_size, config.head_bias)?
        };
        Ok(Self {
            config: Box::new(config.clone()),
            embed_tokens: Embedding::new(embed, d, hook.clone()),
            blocks,
            norm: build.norm(model.pp(names.final_norm()))?,
            head,
            rotations: RopeTables::new(&config.rope, config.rotary_dim, config.rope_negated),
            local_rotations: config
                .local_rope
                .as_ref()
                .map(|rope| RopeTables::new(rope, config.rotary_dim, config.rope_negated)),
            checkpointed: false,
        })
    }

    /// Opens a hub directory of a Llama checkpoint: its config, and a
    /// [`ShardedVarMap`] whose variables come from its weights (build the
    /// model with [`Llama::new`] through the map's builder). Errors name
    /// the config key or the file that is unusable.
    pub fn open_hub(dir: impl AsRef<std::path::Path>) -> Result<(LlamaConfig, ShardedVarMap)> {
        super::open_hub_as(dir, LlamaConfig::from_hub, Self::hub_layout)
    }

    /// Where the variables sit in a hub checkpoint: under their own names
    /// (Gemma 3 with vision: `model.*` as `language_model.model.*`); with a
    /// tied head, `lm_head.weight` (where a file keeps it) is the token
    /// embedding again; where the checkpoint rotates interleaved pairs
    /// ([`LlamaConfig::rope_interleaved`]), the rows of the query and key
    /// projections (and of their norms) reordered to rotate_half's.
    pub fn hub_layout(config: &LlamaConfig) -> HubLayout {
        let mut layout = match config.text_of_multimodal {
            // Every variable under `language_model.` (a tied head's file
            // tensor, if any, copied back as read).
            true => HubLayout::new().with_renamed_prefix("", "language_model."),
            false => HubLayout::new(),
        };
        let names = config.layer_names;
        if config.tie_word_embeddings {
            layout = layout.with_tied(
                format!("{}.weight", names.head()),
                format!("{}.{}.weight", names.model(), names.embedding()),
            );
        }
        let reordered = match &config.latent_attention {
            Some(latent) => latent_rows(config, latent),
            None if config.rope_interleaved => interleaved_rows(config),
            None => Vec::new(),
        };
        for (var, rows) in reordered {
            layout = layout.with_rows_permuted(var, rows);
        }
        if let Some(moe) = config.moe.as_ref().filter(|_| config.fused_experts) {
            for i in (0..config.num_hidden_layers).filter(|&i| moe.layers[i]) {
                let mixture = format!(
                    "{}.{}.{i}.{}",
                    names.model(),
                    names.layers(),
                    moe.style.prefix()
                );
                if moe.style == MoeStyle::GptOss {
                    // Each projection's parts `[in, out]` in the files, a
                    // Linear's `[out, in]` here.
                    let parts = |k: usize| -> Vec<String> {
                        (0..moe.num_experts)
                            .map(|e| format!("{mixture}.{}", gpt_oss_expert_vars(moe, e)[k]))
                            .collect()
                    };
                    for (k, tensor) in GPT_OSS_FUSED.iter().enumerate() {
                        layout = layout.with_fused(format!("{mixture}.experts.{tensor}"), parts(k));
                    }
                    for var in parts(0).into_iter().chain(parts(2)) {
                        layout = layout.with_transposed(var);
                    }
                    continue;
                }
                let var = |name: &str| format!("{mixture}.{name}.weight");
                let parts = (0..moe.num_experts).map(|e| expert_vars(config, moe, e));
                let gate_up = parts.clone().flat_map(|[g, u, _]| [var(&g), var(&u)]);
                let [(gate_up_tensor, _), (down_tensor, _)] = moe.style.fused_names();
                layout = layout
                    .with_fused(format!("{mixture}.{gate_up_tensor}"), gate_up.collect())
                    .with_fused(
                        format!("{mixture}.{down_tensor}"),
                        parts.map(|[_, _, down]| var(&down)).collect(),
                    );
            }
        }
        if config.qkv_per_head {
            let rows = qkv_from_heads(config);
            for i in 0..config.num_hidden_layers {
                let fused = format!("{}.{}", names.attention_at(i), names.fused_qkv());
                layout = layout.with_rows_permuted(format!("{fused}.weight"), rows.clone());
                if config.qkv_bias {
                    layout = layout.with_rows_permuted(format!("{fused}.bias"), rows.clone());
                }
            }
        }
        layout
    }

    /// The model's config.
    pub fn config(&self) -> &LlamaConfig {
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
    /// (u32); position `t` predicts token `t + 1`. A 16-bit model computes
    /// in its dtype, with the norms' statistics and the attention's
    /// softmax in f32.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let dims = (self.config.vocab_size, self.dtype());
        super::logits_of(ids, dims, |ids| Ok(self.logits_rows(ids, false)?.0))
    }

    /// [`Llama::forward`]'s logits as rows `[batch * time, vocab_size]`;
    /// with `with_router_logits`, each mixture layer's router logits.
    fn logits_rows(
        &self,
        ids: &Tensor,
        with_router_logits: bool,
    ) -> candle_core::Result<(Tensor, Vec<Tensor>)> {
        let (_, time) = super::ids_dims(ids)?;
        let longest = self.config.max_position_embeddings;
        if matches!(self.config.rope.scaling, RopeScaling::Dynamic { .. }) && time > longest {
            candle_core::bail!(
                "a sequence of {time} tokens is longer than max_position_embeddings {longest}, past \
                 which `dynamic` RoPE scaling changes the frequencies (not implemented here): use \
                 sequences of at most {longest}"
            );
        }
        let (dtype, device) = (self.dtype(), ids.device());
        let rotations = Rotations {
            global: self.rotations.get(time, dtype, device)?,
            local: match &self.local_rotations {
                Some(cache) => Some(cache.get(time, dtype, device)?),
                None => None,
            },
        };
        // A mixture layer's router logits leave its block (checkpointed
        // or not) as columns beside the residual stream.
        let width = self.config.hidden_size;
        let mut router_logits = Vec::new();
        let x = super::through_blocks(
            &self.blocks,
            self.embed(ids)?,
            (self.checkpointed, "model.layers"),
            move |block: &Block, x: &Tensor| match block.forward(
                x,
                time,
                &rotations,
                with_router_logits,
            )? {
                (y, Some(logits)) => Tensor::cat(&[&y, &logits], 1),
                (y, None) => Ok(y),
            },
            |out: Tensor| {
                let columns = out.dim(1)?;
                if columns == width {
                    return Ok(out);
                }
                router_logits.push(out.narrow(1, width, columns - width)?);
                out.narrow(1, 0, width)?.contiguous()
            },
        )?;
        let logits = super::logits(&self.norm, &self.head, &x)?;
        let logits = match self.config.logits_scaling {
            Some(scaling) => (logits / scaling)?,
            None => logits,
        };
        let logits = match self.config.logit_scale {
            Some(scale) => (logits * scale)?,
            None => logits,
        };
        let logits = match self.config.final_logit_softcapping {
            Some(cap) => ((logits / cap)?.tanh()? * cap)?,
            None => logits,
        };
        Ok((logits, router_logits))
    }

    /// The mean cross-entropy (f32) of predicting each next token of `ids`
    /// `[batch, time + 1]`, as `transformers` computes it with
    /// `labels = ids`; plus, where the config asks for it, the mixture's
    /// load-balancing loss times its weight ([`MoeConfig::aux_loss_coef`]).
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let balanced = self
            .config
            .moe
            .as_ref()
            .and_then(|moe| Some((moe, moe.aux_loss_coef?)));
        let mut router_logits = Vec::new();
        let loss = super::next_token_loss(ids, |inputs| {
            let (logits, routers) = self.logits_rows(inputs, balanced.is_some())?;
            router_logits = routers;
            Ok(logits)
        })?;
        match balanced {
            Some((moe, coef)) if !router_logits.is_empty() => {
                loss + mlp::load_balancing_loss(&router_logits, moe)?.affine(coef, 0.0)?
            }
            _ => Ok(loss),
        }
    }

    /// The token embeddings of `ids` as rows `[batch * time, hidden]`
    /// (times Gemma's scale); the padding token's rows pass no gradient
    /// back to the table.
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let rows = self.embed_tokens.forward(ids)?.flatten_to(1)?;
        let rows = match self.config.pad_token_id {
            Some(pad) => {
                let padding = ids.flatten_all()?.eq(pad)?.unsqueeze(1)?;
                padding
                    .broadcast_as(rows.shape())?
                    .where_cond(&rows.detach(), &rows)?
            }
            None => rows,
        };
        let rows = match self.config.embedding_scale {
            // The scale as transformers takes it (an f32 buffer rounded
            // to the weights' dtype: `affine` rounds its factor to the
            // rows' dtype), with no tensor uploaded per step.
            Some(scale) => rows.affine(scale as f32 as f64, 0.0)?,
            None => rows,
        };
        match self.config.embedding_norm {
            // NanoChat's: the final norm (without parameters) first here.
            true => self.norm.forward(&rows),
            false => Ok(rows),
        }
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
