//! A small decoder-only transformer (GPT-2 layout) over bytes, built from
//! `zero_candle::nn`'s layers and fused ops (attention, GELU and the loss
//! each one op with its own backward).
//!
//! Parameter names, stable across runs and ranks (checkpoints and `--init`
//! files use them): `wte.weight` `[256, d]`, `wpe.weight` `[context, d]`,
//! for each block `i`: `blocks.{i}.ln1.{weight,bias}`,
//! `blocks.{i}.attn.qkv.{weight,bias}` (`[3d, d]`),
//! `blocks.{i}.attn.proj.{weight,bias}`, `blocks.{i}.ln2.{weight,bias}`,
//! `blocks.{i}.mlp.fc.{weight,bias}` (`[4d, d]`),
//! `blocks.{i}.mlp.proj.{weight,bias}`; then `ln_f.{weight,bias}`. The
//! output head has no weight of its own: it is `wte.weight` again (tied),
//! so that variable's gradient is the sum of its two uses.

use crate::trainer::TrainError;
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::VarMap;
use std::sync::Arc;
use zero_candle::models::MAX_SIZE;
use zero_candle::nn::{ops, Activation, Embedding, GradHook, LayerNorm, Linear};
use zero_candle::ShardedVarMap;

/// Bytes: the vocabulary needs no tokenizer and no download.
pub const VOCAB: usize = 256;

/// The transformer's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block; must divide `d_model`.
    pub heads: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Longest sequence (positions) the model sees.
    pub context: usize,
}

impl GptConfig {
    /// Checks that the shape is buildable, naming the flag to change.
    pub fn validate(&self) -> Result<(), TrainError> {
        let sizes = [self.layers, self.heads, self.d_model, self.context];
        if sizes.iter().any(|&n| n == 0 || n > MAX_SIZE) {
            return Err(TrainError::Usage(format!(
                "--layers, --heads, --d-model and --context must be positive and at most \
                 {MAX_SIZE}; got {sizes:?}"
            )));
        }
        if self.d_model % self.heads != 0 {
            return Err(TrainError::Usage(format!(
                "--d-model {} is not a multiple of --heads {}; pick a width that the heads divide",
                self.d_model, self.heads
            )));
        }
        if usize::try_from(self.params()).is_err() {
            return Err(TrainError::Usage(format!(
                "--layers {} of --d-model {} make {} parameters, more than this machine can \
                 count",
                self.layers,
                self.d_model,
                self.params()
            )));
        }
        Ok(())
    }

    /// The parameters of a [`Gpt`] of this shape (the head is tied to the
    /// token embedding): per block two norms, the attention's input and
    /// output projections and the MLP's two, with biases (`usize::MAX`
    /// where more: [`GptConfig::validate`] refuses such a shape).
    pub fn num_params(&self) -> usize {
        usize::try_from(self.params()).unwrap_or(usize::MAX)
    }

    /// [`GptConfig::num_params`] in a type sizes up to [`MAX_SIZE`] do not
    /// overflow.
    fn params(&self) -> u128 {
        let [d, layers, context] = [self.d_model, self.layers, self.context].map(|n| n as u128);
        let per_layer = 12 * d * d + 13 * d;
        layers * per_layer + (VOCAB as u128 + context) * d + 2 * d
    }
}

/// How the attention, the GELU and the loss are computed. The parameters,
/// their initialization and the functions are the same (the values agree
/// to rounding); the memory kept for backward and the time are not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GptOps {
    /// `zero_candle::nn::ops`: causal attention, the MLP's GELU with its
    /// second Linear (`Linear::forward_on_activated`, which keeps the
    /// hidden layer once) and cross-entropy as single ops that keep only
    /// what their backward needs.
    #[default]
    Fused,
    /// [`GptOps::Fused`] with the MLP's GELU in its first Linear's
    /// epilogue (`Linear::forward_activated`): no recompute in the
    /// backward, but the graph keeps the hidden layer twice (the
    /// pre-activation and the GELU the projection reads). The benches
    /// measure what the recompute buys against it.
    FusedGeluKept,
    /// The same functions composed of Candle's tensor ops (a mask tensor,
    /// a `[batch, heads, time, time]` softmax, `Tensor::gelu`,
    /// `candle_nn::loss::cross_entropy`), each intermediate kept for
    /// backward: what the fused ops are measured against.
    Composed,
}

#[derive(Clone)]
struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    attn_proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    mlp_proj: Linear,
}

impl Block {
    /// `x`, rows `[batch * time, d]` (sequences of `time` rows), through
    /// the block (pre-norm attention and MLP, each with its residual): rows
    /// throughout, no reshape around a Linear (see
    /// `causal_self_attention_rows`).
    fn forward(
        &self,
        x: &Tensor,
        (time, heads): (usize, usize),
        ops: GptOps,
        mask: Option<&Tensor>,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let x_norm = self.ln1.forward(x)?;
        let h = match mask {
            None => {
                let qkv = self.qkv.forward(&x_norm)?;
                let y = ops::causal_self_attention_rows(&qkv, time, heads)?;
                self.attn_proj.forward(&y)?
            }
            Some(mask) => self.composed_attention(&x_norm, (time, heads), mask, dtype)?,
        };
        // The fused ops add the residual in the norm's pass over the rows.
        let (x, normed) = match ops {
            GptOps::Fused | GptOps::FusedGeluKept => self.ln2.forward_residual(&h, x)?,
            GptOps::Composed => {
                let x = (x + h)?;
                let normed = self.ln2.forward(&x)?;
                (x, normed)
            }
        };
        // Fused: the GELU on the projection's input, so the graph keeps
        // the hidden layer once (recomputed for the backward).
        let mlp = match ops {
            GptOps::Fused => self
                .mlp_proj
                .forward_on_activated(&self.fc.forward(&normed)?, Activation::Gelu)?,
            GptOps::FusedGeluKept => self
                .mlp_proj
                .forward(&self.fc.forward_activated(&normed, Activation::Gelu)?)?,
            GptOps::Composed => self.mlp_proj.forward(&self.fc.forward(&normed)?.gelu()?)?,
        };
        x + mlp
    }

    /// Attention composed of Candle's ops ([`GptOps::Composed`]).
    fn composed_attention(
        &self,
        x: &Tensor,
        (time, heads): (usize, usize),
        mask: &Tensor,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let (rows, d) = x.dims2()?;
        // No positions: no sequences.
        let (batch, head_dim) = (rows / time.max(1), d / heads);
        let qkv = self
            .qkv
            .forward(x)?
            .reshape((batch, time, 3, heads, head_dim))?;
        // [batch, heads, time, head_dim] each.
        let part = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(2, i, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (head_dim as f64).sqrt())?;
        // The softmax in f32 (the mask is f32): exact for an f32 model, and
        // what autocast does for a 16-bit one.
        let scores = scores.to_dtype(DType::F32)?.broadcast_add(mask)?;
        let weights = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(dtype)?;
        let y = weights.matmul(&v)?.transpose(1, 2)?.reshape((rows, d))?;
        self.attn_proj.forward(&y)
    }
}

/// The model: embeddings, blocks, final norm and the tied head.
pub struct Gpt {
    config: GptConfig,
    ops: GptOps,
    /// Each block's activations recomputed in backward (`--checkpoint-activations`).
    checkpointed: bool,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `wte.weight` itself, used a second time as the output projection
    /// (a second hooked use: its gradient is handed over too, and the
    /// engine adds both).
    head: Linear,
}

/// Creates the variables through a [`ShardedVarMap`] in a fixed order.
struct Init<'a> {
    map: &'a ShardedVarMap,
    device: &'a Device,
    /// Where the layers hand their gradients during backward (`None`: to
    /// backward's GradStore).
    hook: Option<Arc<dyn GradHook>>,
    /// The variables' dtype (values computed in f64, then rounded).
    dtype: DType,
}

impl Init<'_> {
    /// Uniform with standard deviation `std` (GPT-2 draws normal(0, 0.02);
    /// uniform with the same spread trains alike).
    fn uniform(&mut self, name: &str, shape: &[usize], std: f64) -> Result<Tensor, TrainError> {
        let bound = std * 3f64.sqrt();
        let init = candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        };
        Ok(self.map.get(shape, name, init, self.dtype, self.device)?)
    }

    fn constant(&mut self, name: &str, size: usize, value: f64) -> Result<Tensor, TrainError> {
        let init = candle_nn::Init::Const(value);
        Ok(self.map.get(size, name, init, self.dtype, self.device)?)
    }

    fn linear(
        &mut self,
        name: &str,
        d_in: usize,
        d_out: usize,
        std: f64,
    ) -> Result<Linear, TrainError> {
        let w = self.uniform(&format!("{name}.weight"), &[d_out, d_in], std)?;
        let b = self.constant(&format!("{name}.bias"), d_out, 0.0)?;
        Ok(Linear::new(w, Some(b), self.hook.clone()))
    }

    fn layer_norm(&mut self, name: &str, size: usize) -> Result<LayerNorm, TrainError> {
        let w = self.constant(&format!("{name}.weight"), size, 1.0)?;
        let b = self.constant(&format!("{name}.bias"), size, 0.0)?;
        Ok(LayerNorm::new(w, b, 1e-5, self.hook.clone()))
    }
}

impl Gpt {
    /// Creates the variables in `varmap` on `device`, initialized from
    /// `seed` identically on every rank (GPT-2's scheme: weights with
    /// standard deviation 0.02, residual projections scaled by
    /// 1/sqrt(2 * layers), biases zero, norms one).
    pub fn new(
        varmap: &VarMap,
        config: GptConfig,
        seed: u64,
        device: &Device,
    ) -> Result<Self, TrainError> {
        Self::with_hook(varmap, config, seed, device, None)
    }

    /// [`Gpt::new`] with layers that hand their gradients to `hook` during
    /// backward (a `zero_candle::ZeroHook`, for `ZeroOptimizer::backward_step`),
    /// the tied head's use of `wte.weight` included.
    pub fn with_hook(
        varmap: &VarMap,
        config: GptConfig,
        seed: u64,
        device: &Device,
        hook: Option<Arc<dyn GradHook>>,
    ) -> Result<Self, TrainError> {
        Self::with_hook_in(varmap, config, seed, device, hook, DType::F32)
    }

    /// [`Gpt::with_hook`] with variables of `dtype`: a 16-bit model computes
    /// in its dtype, with the norms' statistics, the attention softmax and
    /// the loss in f32 (as autocast does).
    pub fn with_hook_in(
        varmap: &VarMap,
        config: GptConfig,
        seed: u64,
        device: &Device,
        hook: Option<Arc<dyn GradHook>>,
        dtype: DType,
    ) -> Result<Self, TrainError> {
        let map = ShardedVarMap::seeded(seed);
        let gpt = Self::build(&map, config, device, hook, dtype)?;
        crate::trainer::model::copy_vars(&map, varmap)?;
        Ok(gpt)
    }

    /// Creates the variables through `map` (whose source gives their
    /// values; large ones may be deferred for stage 3), with layers that
    /// hand their gradients to `hook`.
    pub fn build(
        map: &ShardedVarMap,
        config: GptConfig,
        device: &Device,
        hook: Option<Arc<dyn GradHook>>,
        dtype: DType,
    ) -> Result<Self, TrainError> {
        config.validate()?;
        let mut init = Init {
            map,
            device,
            hook: hook.clone(),
            dtype,
        };
        let d = config.d_model;
        let std = 0.02;
        let residual_std = std / (2.0 * config.layers as f64).sqrt();
        let wte = init.uniform("wte.weight", &[VOCAB, d], std)?;
        let wpe = init.uniform("wpe.weight", &[config.context, d], std)?;
        let mut blocks = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let p = format!("blocks.{i}");
            blocks.push(Block {
                ln1: init.layer_norm(&format!("{p}.ln1"), d)?,
                qkv: init.linear(&format!("{p}.attn.qkv"), d, 3 * d, std)?,
                attn_proj: init.linear(&format!("{p}.attn.proj"), d, d, residual_std)?,
                ln2: init.layer_norm(&format!("{p}.ln2"), d)?,
                fc: init.linear(&format!("{p}.mlp.fc"), d, 4 * d, std)?,
                mlp_proj: init.linear(&format!("{p}.mlp.proj"), 4 * d, d, residual_std)?,
            });
        }
        let ln_f = init.layer_norm("ln_f", d)?;
        Ok(Self {
            config,
            ops: GptOps::Fused,
            checkpointed: false,
            wte: Embedding::new(wte.clone(), d, hook.clone()),
            wpe: Embedding::new(wpe, d, hook.clone()),
            blocks,
            ln_f,
            head: Linear::new(wte, None, hook),
        })
    }

    /// The model's shape.
    pub fn config(&self) -> GptConfig {
        self.config
    }

    /// The model computing with `ops` (the default is [`GptOps::Fused`]).
    pub fn with_ops(mut self, ops: GptOps) -> Self {
        self.ops = ops;
        self
    }

    /// With `on`, each block keeps only its input for backward and runs
    /// again there (`zero_candle::checkpoint`): the same gradients, the
    /// activations of one block at a time, one more forward per step.
    pub fn with_checkpointing(mut self, on: bool) -> Self {
        self.checkpointed = on;
        self
    }

    /// Logits `[batch * time, 256]` for byte ids `[batch, time]` (u32,
    /// `time <= context`); row `b * time + t` predicts the byte after
    /// position `t` of sequence `b`.
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (batch, time) = ids.dims2()?;
        let device = ids.device();
        if time > self.config.context {
            candle_core::bail!(
                "a sequence of {time} bytes is longer than the model's context of {}",
                self.config.context
            );
        }
        let positions = Tensor::arange(0u32, time as u32, device)?;
        let mut x = self
            .wte
            .forward(ids)?
            .broadcast_add(&self.wpe.forward(&positions)?)?
            .reshape((batch * time, self.config.d_model))?;
        let mask = match self.ops {
            GptOps::Fused | GptOps::FusedGeluKept => None,
            GptOps::Composed => Some(causal_mask(time, device)?),
        };
        let dtype = self.head.weight().dtype();
        let (shape, ops) = ((time, self.config.heads), self.ops);
        for (i, block) in self.blocks.iter().enumerate() {
            x = if self.checkpointed {
                let (block, mask) = (block.clone(), mask.clone());
                zero_candle::checkpoint(&format!("blocks.{i}"), &x, move |x| {
                    block.forward(x, shape, ops, mask.as_ref(), dtype)
                })?
            } else {
                block.forward(&x, shape, ops, mask.as_ref(), dtype)?
            };
        }
        let x = self.ln_f.forward(&x)?;
        // The tied head: the embedding table a second time.
        self.head.forward(&x)
    }

    /// Mean cross-entropy of predicting each next byte of `ids` `[batch,
    /// time + 1]`.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let time = ids.dim(1)? - 1;
        let inputs = ids.narrow(1, 0, time)?.contiguous()?;
        let targets = ids.narrow(1, 1, time)?.flatten_all()?;
        let logits = self.forward(&inputs)?;
        match self.ops {
            // The fused loss reads 16-bit logits in f32 and returns an f32
            // loss (a 16-bit loss would overflow under loss scaling).
            GptOps::Fused | GptOps::FusedGeluKept => ops::cross_entropy(&logits, &targets),
            GptOps::Composed => {
                candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, &targets)
            }
        }
    }

    /// `count` bytes continuing `prompt`: greedy when `temperature` is 0,
    /// otherwise sampled from the softmax at that temperature with a
    /// generator seeded by `seed` (the same text for the same seed).
    pub fn generate(
        &self,
        prompt: &[u8],
        count: usize,
        temperature: f64,
        seed: u64,
        device: &Device,
    ) -> candle_core::Result<Vec<u8>> {
        // An empty prompt starts from a newline, a byte every text has.
        let prompt: Vec<u32> = match prompt {
            [] => vec![b'\n' as u32],
            bytes => bytes.iter().map(|&b| b as u32).collect(),
        };
        let ids = super::sample::continue_ids(
            &prompt,
            count,
            self.config.context,
            temperature,
            seed,
            device,
            |ids| self.forward(ids),
        )?;
        // Every id is a byte: the head has 256 outputs.
        Ok(ids.into_iter().map(|id| id as u8).collect())
    }
}

/// `[time, time]`: 0 where a position may attend (itself and earlier),
/// -inf after it.
fn causal_mask(time: usize, device: &Device) -> candle_core::Result<Tensor> {
    let mask: Vec<f32> = (0..time)
        .flat_map(|i| (0..time).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (time, time), device)
}
