//! The model a rank trains (the MLP, the GPT or a hub model) with the data
//! it reads: its batches' loss and the validation loss.

use super::config::{gpt_config, widths};
use super::rank_optimizer::RankOptimizer;
use super::{Args, Dataset, Gpt, HubText, Mlp, TextData, TrainError, TrainingData};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;
use zero_candle::models::CausalLm;
use zero_candle::nn::GradHook;
use zero_candle::ShardedVarMap;

/// A language model's loss over windows of token ids.
type WindowLoss<'a> = Box<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + 'a>;

/// The model a rank trains, with the data it reads.
pub(super) enum Model<'a> {
    Mlp(Mlp, &'a Dataset),
    Gpt(Gpt, &'a TextData),
    /// `--hf`: a Hugging Face GPT-2 or Llama.
    Hub(Box<CausalLm>, &'a HubText),
}

impl<'a> Model<'a> {
    /// Creates the variables through `map`, the same on every rank. The
    /// layers hand their gradients to `hook` during backward.
    pub(super) fn new(
        args: &Args,
        data: &'a TrainingData,
        map: &ShardedVarMap,
        device: &Device,
        hook: Arc<dyn GradHook>,
    ) -> Result<Self, TrainError> {
        let hook = Some(hook);
        let dtype = args.precision.dtype();
        Ok(match data {
            TrainingData::Rows(rows) => Self::Mlp(
                Mlp::build(map, &widths(args, rows), device, hook, dtype)?,
                rows,
            ),
            TrainingData::Text(text) => Self::Gpt(
                Gpt::build(map, gpt_config(args), device, hook, dtype)?
                    .with_checkpointing(args.checkpoint_activations),
                text,
            ),
            TrainingData::Hub(hub) => Self::Hub(
                Box::new(
                    CausalLm::new(map.builder(dtype, device), &hub.config, hook)?
                        .with_checkpointing(args.checkpoint_activations),
                ),
                hub.as_ref(),
            ),
        })
    }

    /// A language model's text and its loss over windows of token ids
    /// `[batch, context + 1]`; `None` for the MLP.
    fn language_model(&self) -> Option<(&TextData, WindowLoss<'_>)> {
        match self {
            Self::Mlp(..) => None,
            Self::Gpt(model, text) => Some((text, Box::new(|ids| model.loss(ids)))),
            Self::Hub(model, hub) => Some((&hub.text, Box::new(|ids| model.loss(ids)))),
        }
    }

    /// The mean loss over this rank's part of the global micro-batch that
    /// starts at row (MLP) or sequence (GPT) `first_row`.
    pub(super) fn batch_loss(
        &self,
        args: &Args,
        first_row: u64,
        world_size: usize,
        rank: usize,
        device: &Device,
    ) -> Result<Tensor, TrainError> {
        let batch = args.batch_size as usize;
        let windows = |text: &TextData| {
            let context = args.context as usize;
            let ids = text.windows_at(first_row, rank, batch, context, args.seed);
            Tensor::from_vec(ids, (batch, context + 1), device)
        };
        Ok(match self {
            Self::Mlp(model, data) => {
                let (x, y) = data.batch_at(first_row, world_size, rank, batch);
                let x = Tensor::from_vec(x, (batch, data.width), device)?
                    .to_dtype(args.precision.dtype())?;
                let y = Tensor::from_vec(y, batch, device)?;
                // The loss in f32 whatever the model's dtype (as autocast).
                let logits = model.forward(&x)?.to_dtype(DType::F32)?;
                candle_nn::loss::cross_entropy(&logits, &y)?
            }
            Self::Gpt(model, text) => model.loss(&windows(text)?)?,
            Self::Hub(model, hub) => model.loss(&windows(&hub.text)?)?,
        })
    }

    /// The mean loss over `--eval-sequences` validation windows (GPT; None
    /// for the MLP, which has no validation split). Rank `r` evaluates
    /// windows `r, r + W, ...`; one collective mean makes every rank's
    /// answer the same.
    pub(super) fn validation_loss(
        &self,
        args: &Args,
        opt: &mut dyn RankOptimizer,
        world_size: usize,
        rank: usize,
        device: &Device,
    ) -> Result<Option<f64>, TrainError> {
        let Some((text, loss)) = self.language_model() else {
            return Ok(None);
        };
        let (count, context) = (args.eval_sequences as usize, args.context as usize);
        let mine: Vec<usize> = (rank..count).step_by(world_size).collect();
        let mut sum = 0.0;
        for chunk in mine.chunks(args.batch_size as usize) {
            let ids: Vec<u32> = chunk
                .iter()
                .flat_map(|&i| text.validation_window(i, count, context))
                .collect();
            let ids = Tensor::from_vec(ids, (chunk.len(), context + 1), device)?;
            let loss = loss(&ids)?.to_scalar::<f32>()? as f64;
            sum += loss * chunk.len() as f64;
        }
        // Avg over ranks of (sum * W / count) is the mean over all windows.
        let mean = opt.mean_over_ranks(sum * world_size as f64 / count as f64)?;
        Ok(Some(mean))
    }

    /// Tokens each sequence of a batch trains on (1 per row for the MLP).
    pub(super) fn tokens_per_row(&self, args: &Args) -> Option<usize> {
        match self {
            Self::Mlp(..) => None,
            Self::Gpt(..) | Self::Hub(..) => Some(args.context as usize),
        }
    }
}
