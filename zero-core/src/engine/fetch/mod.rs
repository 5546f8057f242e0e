//! Stage 3's parameter gathers: each sharded parameter is all-gathered from
//! the ranks' shards just before a layer uses it, into a pooled buffer that
//! goes back to the pool right after, with the next layers' gathers issued
//! ahead (prefetch) on a thread of their own.
//!
//! A *unit* is what one gather brings: the buckets of the plan that hold a
//! run of consecutive sharded parameters (parameters that share a bucket
//! share a unit, so consecutive small layers travel in one collective per
//! bucket). With the interleaved plan, bucket `k` is one stretch of the
//! parameter sequence split evenly over the ranks, so all-gathering it
//! yields that stretch in order: a parameter's values are one contiguous
//! range of its unit's buffer.
//!
//! A unit above the engine's `gather_bytes` is gathered in *pieces*
//! instead: piece `j` of a bucket all-gathers slice `j` of every rank's
//! chunk, so it brings `N` stretches of the sequence, one per rank. A
//! parameter is then a list of [`Span`]s over several units, which the
//! framework computes with one piece at a time: its whole values never
//! exist on a rank.
//!
//! Every rank must issue the same gathers in the same order (they are
//! collectives on a communicator of their own). Decisions to issue are
//! therefore taken only on the caller's thread, from the upcoming units
//! (the units to prefetch next, in order) and the bytes alive, never from
//! how far a gather has got:
//! - a forward's upcoming units replay the units the previous forward
//!   requested (the trace), a backward's the previous backward's, or before
//!   there is one the order the engine predicts from the graph;
//! - a request for a unit among the upcoming ones further on takes it out
//!   and issues it alone; one not among them is issued alone;
//! - after each request (and after the optimizer step has updated the
//!   shard) upcoming units are issued while at most `prefetch_bytes`
//!   are issued and not yet taken (one unit always may, so that a layer
//!   larger than the budget is still prefetched), and at most
//!   `max_live_bytes` are gathered in all.
//!
//! A rank whose model requests other units than its peers still issues the
//! upcoming gathers, so the collectives stay matched; the engine compares a
//! fingerprint of each forward's requests across ranks when backward
//! begins, and a difference is an error on every rank.

mod board;
mod fetcher;
mod memory;
mod schedule;
#[cfg(test)]
mod tests;
mod units;
mod worker;

pub use board::FetchStats;
pub use fetcher::{Fetcher, Gathered};
pub use memory::{GatherFn, GatherMemory, HostGather, HostGathers};
pub use units::UnitBucket;
pub(super) use units::{Span, Unit};
