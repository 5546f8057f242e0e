//! Communicators: the collectives every backend implements, and the
//! in-process [`ThreadGroup`] backend.
//!
//! A [`Communicator`] moves typed buffers between the ranks of a group. Which
//! memory those buffers live in is the backend's [`MemoryKind`]: host slices
//! for the thread and MPI backends, device slices for NCCL. The engine asks
//! for `Communicator<Memory = Host>` where it needs host buffers, so a
//! backend's bounds stay at compile time.
//!
//! Every rank must issue the same collectives in the same order with the same
//! sizes. Backends check what they can (the thread backend checks everything)
//! and turn a rank that never arrives into an error after a deadline.

mod check;
mod communicator;
mod delayed;
mod thread;
mod work;

pub use check::{check_counts, check_len, check_root};
pub use communicator::{Buf, Communicator, Host, MemoryKind, ReduceOp, DEFAULT_TIMEOUT};
pub use delayed::Delayed;
pub use thread::{ThreadComm, ThreadGroup};
pub use work::Work;
