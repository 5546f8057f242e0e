//! The gather thread: the queued gathers of host memory, run in order.

use super::board::Board;
use super::memory::GatherMemory;
use super::units::Unit;
use crate::{Error, Result};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, PoisonError, RwLock};

/// A queued gather: its ticket, its unit, the buffer to gather into.
pub(super) type QueuedGather<B> = (u64, usize, B);

/// Runs the gathers of one unit into `buffer`.
pub(super) fn gather_unit<T, G: GatherMemory<T>>(
    gathers: &G,
    unit: &Unit,
    shard: &RwLock<Option<G::Shard>>,
    mut buffer: G::Buffer,
) -> Result<G::Buffer> {
    let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
    let len = shard.as_ref().map_or(0, G::shard_len);
    let (Some(shard), true) = (&*shard, unit.buckets.iter().all(|b| b.shard.end <= len)) else {
        return Err(Error::State(
            "stage 3: a parameter gather ran while the engine held the shard (during a step); \
             gather between steps"
                .into(),
        ));
    };
    gathers.gather(shard, &unit.buckets, &mut buffer)?;
    Ok(buffer)
}

/// The gather thread: runs the queued gathers in order and hands each
/// result to the fetcher. It holds the fetcher weakly, so dropping the
/// fetcher closes the queue and ends the thread.
pub(super) struct Worker<T, G: GatherMemory<T>> {
    pub(super) units: Vec<Unit>,
    pub(super) shard: Arc<RwLock<Option<G::Shard>>>,
    pub(super) gathers: Arc<G>,
    pub(super) board: Arc<Board<G::Buffer>>,
}

impl<T, G: GatherMemory<T>> Worker<T, G> {
    pub(super) fn run(self, jobs: Receiver<QueuedGather<G::Buffer>>) {
        while let Ok((ticket, unit, buffer)) = jobs.recv() {
            let result = gather_unit(&*self.gathers, &self.units[unit], &self.shard, buffer);
            let mut st = self.board.lock();
            if let Some(issued) = st.issued.iter_mut().find(|i| i.ticket == ticket) {
                issued.result = Some(result);
            }
            drop(st);
            self.board.done.notify_all();
        }
    }
}
