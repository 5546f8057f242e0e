//! The fetcher's state (the pass, the traces, the upcoming units, the
//! gathers issued, the pool, the counters) and the [`Board`] that shares it
//! with the gather thread.

use crate::Result;
use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Counters of the gathers of one [`Fetcher`](super::Fetcher), since it
/// was built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Per parameter, how many times a gather that brings it was issued.
    pub gathers: Vec<u64>,
    /// Requests whose gather had been issued before the request (prefetched).
    pub hits: u64,
    /// Requests that had to issue their own gather.
    pub misses: u64,
    /// The most gathered bytes alive at once (issued or in use).
    pub peak_live_bytes: usize,
    /// Times a forward or backward pass requested another sequence than
    /// the one recorded, and the new one replaced it.
    pub retraces: u64,
    /// Gathers of a backward issued while its forward was finishing.
    pub early: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    Forward,
    Backward,
}

/// A gather issued and not yet taken by a request.
pub(super) struct Issued<B> {
    pub(super) unit: usize,
    /// `None` until the gather completes (or, on a memory that queues
    /// gathers, is queued).
    pub(super) result: Option<Result<B>>,
    pub(super) ticket: u64,
}

pub(super) struct State<B> {
    pub(super) phase: Phase,
    /// Units the last complete forward / backward requested, in order.
    pub(super) forward_trace: Vec<usize>,
    pub(super) backward_trace: Option<Vec<usize>>,
    /// Units requested in the current pass.
    pub(super) log: Vec<usize>,
    /// Units to issue ahead, in order.
    pub(super) upcoming: VecDeque<usize>,
    /// Whether the forward has requested its whole trace and the upcoming
    /// units go on with the backward trace (the backward's first gathers
    /// then run during the end of the forward).
    pub(super) continued: bool,
    pub(super) issued: VecDeque<Issued<B>>,
    pub(super) next_ticket: u64,
    /// Bytes issued and not taken; bytes issued or in use.
    pub(super) ahead_bytes: usize,
    pub(super) live_bytes: usize,
    pub(super) pool: Vec<B>,
    pub(super) stats: FetchStats,
}

impl<B> State<B> {
    /// Before the first forward; `gathers`: a zero count per parameter.
    pub(super) fn new(gathers: Vec<u64>) -> Self {
        Self {
            phase: Phase::Forward,
            forward_trace: Vec::new(),
            backward_trace: None,
            log: Vec::new(),
            upcoming: VecDeque::new(),
            continued: false,
            issued: VecDeque::new(),
            next_ticket: 0,
            ahead_bytes: 0,
            live_bytes: 0,
            pool: Vec::new(),
            stats: FetchStats {
                gathers,
                ..FetchStats::default()
            },
        }
    }
}

/// What the caller's thread and the gather thread share: the state, and
/// the condition a request waits on for its gather.
pub(super) struct Board<B> {
    pub(super) state: Mutex<State<B>>,
    pub(super) done: Condvar,
}

impl<B> Board<B> {
    pub(super) fn lock(&self) -> MutexGuard<'_, State<B>> {
        // Every change to the state is made after the fallible work, so a
        // panic elsewhere leaves it consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
