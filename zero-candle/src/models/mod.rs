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
