//! Models of the Hugging Face hub built from [`crate::nn`]'s layers and
//! fused ops, so that every stage (3 included, sharded from construction),
//! overlap, mixed precision and activation checkpointing work for them,
//! with their checkpoints read and written in the hub's layout
//! ([`crate::hub`]).

mod causal_lm;
pub(crate) mod config_json;
pub mod gpt2;
pub mod llama;
pub mod rope;

pub use causal_lm::{CausalLm, HubConfig};
pub use config_json::MAX_SIZE;
pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::{
    ClampedSwiglu, LatentAttention, LayerNames, Llama, LlamaConfig, MoeConfig, MoeRouting,
    MoeStyle, NormNames, PositionScale, QkNorm, SlidingWindow, UngatedMlp, LATENT_NORM_EPS,
};
pub use rope::{Llama3Scaling, LongRopeScaling, Rope, RopeScaling, YarnScaling};

/// The mean cross-entropy (f32) of predicting each next token of `ids`
/// `[batch, time + 1]` from `logits` rows `[batch * time, vocab]` of its
/// first `time`, as `transformers` computes it with `labels = ids`.
///
/// The models keep their activations as rows `[batch * time, width]` from
/// the embedding to the loss, the logits included: no reshape nodes (see
/// [`crate::nn::ops::causal_self_attention_rows`]).
fn next_token_loss(
    ids: &candle_core::Tensor,
    logits: impl FnOnce(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<candle_core::Tensor> {
    let (batch, time) = ids_dims(ids)?;
    if batch == 0 || time < 2 {
        candle_core::bail!(
            "token ids are {:?}: a loss needs a sequence of at least two tokens (each position \
             predicts the next)",
            ids.dims()
        )
    }
    let time = time - 1;
    let inputs = ids.narrow(1, 0, time)?.contiguous()?;
    let targets = ids.narrow(1, 1, time)?.flatten_all()?;
    crate::nn::ops::cross_entropy(&logits(&inputs)?, &targets)
}

/// The `(batch, time)` of token ids `[batch, time]`; an error for other
/// dims.
fn ids_dims(ids: &candle_core::Tensor) -> candle_core::Result<(usize, usize)> {
    match *ids.dims() {
        [batch, time] => Ok((batch, time)),
        _ => candle_core::bail!("token ids are {:?}: give them as [batch, time]", ids.dims()),
    }
}

/// The logits `[batch, time, vocab]` of `ids` `[batch, time]` (`rows`
/// computes them as rows `[batch * time, vocab]`); without a sequence or a
/// position, none (the blocks do not run).
fn logits_of(
    ids: &candle_core::Tensor,
    (vocab, dtype): (usize, candle_core::DType),
    rows: impl FnOnce(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<candle_core::Tensor> {
    let (batch, time) = ids_dims(ids)?;
    if batch * time == 0 {
        return candle_core::Tensor::zeros((batch, time, vocab), dtype, ids.device());
    }
    rows(ids)?.reshape((batch, time, vocab))
}

/// `x` through `blocks` in turn (`forward(block, x)`), each recomputed in
/// backward under the name `{prefix}.{i}` when `checkpointed`; `next` turns
/// each block's output into the next block's input (a block's output may
/// carry more than the residual stream, which `next` takes off).
fn through_blocks<B, F>(
    blocks: &[B],
    mut x: candle_core::Tensor,
    (checkpointed, prefix): (bool, &str),
    forward: F,
    mut next: impl FnMut(candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<candle_core::Tensor>
where
    B: Clone + Send + Sync + 'static,
    F: Fn(&B, &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>
        + Clone
        + Send
        + Sync
        + 'static,
{
    for (i, block) in blocks.iter().enumerate() {
        x = next(if checkpointed {
            let (block, forward) = (block.clone(), forward.clone());
            crate::checkpoint(&format!("{prefix}.{i}"), &x, move |x| forward(&block, x))?
        } else {
            forward(block, &x)?
        })?;
    }
    Ok(x)
}

/// Logits rows `[batch * time, vocab]`: the final norm of `x` rows
/// `[batch * time, width]`, then the head.
fn logits(
    norm: &impl candle_core::Module,
    head: &crate::nn::Linear,
    x: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    candle_core::Module::forward(head, &norm.forward(x)?)
}

/// `parse` of the `config.json` of the hub directory `hub`: an error names
/// the file and the key.
fn config_of<C>(
    hub: &crate::hub::HubDir,
    parse: impl FnOnce(&serde_json::Value) -> std::result::Result<C, String>,
) -> crate::Result<C> {
    parse(hub.config()).map_err(|detail| crate::Error::Hub {
        path: hub.dir().join(crate::hub::CONFIG_FILE),
        detail,
    })
}

/// An error naming the first of `config`'s `architectures` not among
/// `known` (whose first is the one this model reads).
fn check_architectures(
    config: &serde_json::Value,
    known: &[&str],
) -> std::result::Result<(), String> {
    let names = config.get("architectures").and_then(|v| v.as_array());
    match names
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str())
        .find(|n| !known.contains(n))
    {
        Some(other) => Err(format!(
            "`architectures` names {other:?}; this model reads {}",
            known[0]
        )),
        None => Ok(()),
    }
}

/// Opens the hub directory `dir`: its config (`config`) and a
/// [`crate::ShardedVarMap`] reading its weights where `layout` places them.
fn open_hub_as<C>(
    dir: impl AsRef<std::path::Path>,
    config: impl FnOnce(&crate::hub::HubDir) -> crate::Result<C>,
    layout: impl FnOnce(&C) -> crate::hub::HubLayout,
) -> crate::Result<(C, crate::ShardedVarMap)> {
    let hub = std::sync::Arc::new(crate::hub::HubDir::open(dir)?);
    let config = config(&hub)?;
    let source = crate::hub::HubSource::new(hub, layout(&config));
    Ok((config, crate::ShardedVarMap::new(source)))
}
