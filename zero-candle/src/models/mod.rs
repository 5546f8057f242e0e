//! Models of the Hugging Face hub built from [`crate::nn`]'s layers and
//! fused ops, so that every stage (3 included, sharded from construction),
//! overlap, mixed precision and activation checkpointing work for them,
//! with their checkpoints read and written in the hub's layout
//! ([`crate::hub`]).

mod causal_lm;
pub mod gpt2;
pub mod llama;

pub use causal_lm::{CausalLm, HubConfig};
pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::{Llama, LlamaConfig, Rope};

/// The mean cross-entropy (f32) of predicting each next token of `ids`
/// `[batch, time + 1]` from `logits` `[batch, time, vocab]` of its first
/// `time`, as `transformers` computes it with `labels = ids`.
fn next_token_loss(
    ids: &candle_core::Tensor,
    logits: impl FnOnce(&candle_core::Tensor) -> candle_core::Result<candle_core::Tensor>,
) -> candle_core::Result<candle_core::Tensor> {
    let time = ids.dim(1)? - 1;
    let inputs = ids.narrow(1, 0, time)?.contiguous()?;
    let targets = ids.narrow(1, 1, time)?.flatten_all()?;
    crate::nn::ops::cross_entropy(&logits(&inputs)?.flatten_to(1)?, &targets)
}

/// `x` through `blocks` in turn (`forward(block, x)`), each recomputed in
/// backward under the name `{prefix}.{i}` when `checkpointed`.
fn through_blocks<B, F>(
    blocks: &[B],
    mut x: candle_core::Tensor,
    checkpointed: bool,
    prefix: &str,
    forward: F,
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
        x = if checkpointed {
            let (block, forward) = (block.clone(), forward.clone());
            crate::checkpoint(&format!("{prefix}.{i}"), &x, move |x| forward(&block, x))?
        } else {
            forward(block, &x)?
        };
    }
    Ok(x)
}

/// Logits `[batch, time, vocab]`: the final norm of `x` `[batch, time,
/// width]`, then the head.
fn logits(
    norm: &impl candle_core::Module,
    head: &crate::nn::Linear,
    x: &candle_core::Tensor,
    vocab: usize,
) -> candle_core::Result<candle_core::Tensor> {
    let (batch, time, width) = x.dims3()?;
    let x = norm.forward(x)?.reshape((batch * time, width))?;
    candle_core::Module::forward(head, &x)?.reshape((batch, time, vocab))
}
