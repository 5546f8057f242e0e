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
