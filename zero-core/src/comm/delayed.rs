//! [`Delayed`]: a communicator that takes as long as a network link would.

use super::communicator::{Communicator, Host, ReduceOp};
use super::work::Work;
use crate::{Element, Result};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Wraps a host communicator and makes every collective take as long as on
/// a link of the given latency and bandwidth, by sleeping before it:
/// `latency + bytes / bytes_per_sec`, with `bytes` what a ring sends per
/// rank (`(N-1)/N` of the full buffer for reduce-scatter and all-gather,
/// twice that for all-reduce).
///
/// On one machine the thread backend's collectives are memory copies, far
/// faster than any network, so whether communication overlaps computation
/// hardly shows. Benchmarks use this to show it (`bench overlap`), and tests
/// to make a collective slow on purpose. The sleep happens on whichever
/// thread issues the collective, as a slow link would block it.
///
/// One rank has one link: communicators [split](Communicator::split) from a
/// `Delayed` share it with it, so collectives issued at once (from two
/// threads, or on two communicators) take turns on it, in the order they
/// were issued, as on one network interface, instead of each getting the
/// whole bandwidth.
///
/// ```
/// use std::time::Duration;
/// use zero_core::comm::Delayed;
/// use zero_core::{Communicator, ReduceOp, ThreadGroup};
///
/// let results = ThreadGroup::new(2).run(|comm| {
///     let link = Delayed::new(comm, Duration::from_millis(1), 1e9);
///     let mut x = [1.0f32; 4];
///     link.all_reduce(&mut x[..], ReduceOp::Sum)?;
///     Ok::<_, zero_core::Error>(x)
/// });
/// assert_eq!(results[0].as_ref().unwrap().as_ref().unwrap(), &[2.0; 4]);
/// ```
#[derive(Debug)]
pub struct Delayed<C> {
    inner: C,
    latency: Duration,
    bytes_per_sec: f64,
    /// When this rank's link is free again (`None`: never used).
    link: Arc<Mutex<Option<Instant>>>,
}

impl<C: Communicator<Memory = Host>> Delayed<C> {
    /// `inner` with collectives slowed to a link of `latency` and
    /// `bytes_per_sec` (use `f64::INFINITY` for latency only).
    pub fn new(inner: C, latency: Duration, bytes_per_sec: f64) -> Self {
        Self {
            inner,
            latency,
            bytes_per_sec,
            link: Arc::default(),
        }
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Sleeps as long as sending `bytes` over the link takes.
    fn wait(&self, bytes: usize) {
        let transfer = if self.bytes_per_sec.is_finite() && self.bytes_per_sec > 0.0 {
            Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec)
        } else {
            Duration::ZERO
        };
        // Booked on the link behind what is already on it, then waited for.
        let done = {
            let mut free_at = self.link.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            let done = free_at.map_or(now, |free| free.max(now)) + self.latency + transfer;
            *free_at = Some(done);
            done
        };
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
    }

    /// What a ring sends per rank to reduce-scatter or all-gather `elems`
    /// elements of `T` in all.
    fn ring<T>(&self, elems: usize) -> usize {
        let n = self.inner.world_size().max(1);
        elems * std::mem::size_of::<T>() * (n - 1) / n
    }
}

impl<C: Communicator<Memory = Host>> Communicator for Delayed<C> {
    type Memory = Host;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent()
    }

    fn barrier(&self) -> Result<()> {
        self.wait(0);
        self.inner.barrier()
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.wait(2 * self.ring::<T>(buf.len()));
        self.inner.all_reduce(buf, op)
    }

    fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        self.wait(self.ring::<T>(send.len()));
        self.inner.reduce_scatter(send, recv, op)
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.wait(self.ring::<T>(recv.len()));
        self.inner.all_gather(send, recv)
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.wait(std::mem::size_of_val(buf));
        self.inner.broadcast(buf, root)
    }

    fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.wait(std::mem::size_of_val(buf));
        self.inner.reduce(buf, op, root)
    }

    fn gather_varlen<T: Element>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.wait(std::mem::size_of_val(send));
        self.inner.gather_varlen(send, counts, recv, root)
    }

    fn all_gather_varlen<T: Element>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: &mut [T],
    ) -> Result<()> {
        self.wait(self.ring::<T>(recv.len()));
        self.inner.all_gather_varlen(send, counts, recv)
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        self.wait(send.len());
        self.inner.all_gather_bytes(send)
    }

    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        self.wait(2 * self.ring::<T>(buf.len()));
        self.inner.all_reduce_async(buf, op)
    }

    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        self.wait(self.ring::<T>(send.len()));
        self.inner.reduce_scatter_async(send, recv, op)
    }

    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<Work<'a>> {
        self.wait(self.ring::<T>(recv.len()));
        self.inner.all_gather_async(send, recv)
    }

    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<Work<'a>> {
        self.wait(std::mem::size_of_val(buf));
        self.inner.broadcast_async(buf, root)
    }

    fn concurrent_groups(&self) -> bool {
        self.inner.concurrent_groups()
    }

    fn split(&self, ranks: &[usize]) -> Result<Option<Self>> {
        Ok(self.inner.split(ranks)?.map(|inner| Self {
            inner,
            latency: self.latency,
            bytes_per_sec: self.bytes_per_sec,
            link: Arc::clone(&self.link),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ThreadGroup;

    /// Two all-reduces of 1000 f32 at once from two threads of each rank,
    /// on the communicator and on one split from it, over a 100 kB/s link:
    /// each sends 2 x 1/2 x 4000 bytes, 40 ms, so together at least 80 ms
    /// when they share the link (40 ms if each had its own).
    #[test]
    fn communicators_split_from_one_share_its_link() {
        let results = ThreadGroup::new(2).run(|comm| -> Result<Duration> {
            let link = Delayed::new(comm, Duration::ZERO, 100e3);
            let split = link.split(&[0, 1])?.expect("every rank is in the split");
            let started = Instant::now();
            std::thread::scope(|scope| {
                let other = scope.spawn(|| {
                    let mut x = vec![1.0f32; 1000];
                    split.all_reduce(&mut x[..], ReduceOp::Sum)
                });
                let mut y = vec![1.0f32; 1000];
                let here = link.all_reduce(&mut y[..], ReduceOp::Sum);
                let there = other.join().expect("no panic");
                here.and(there)
            })?;
            Ok(started.elapsed())
        });
        for result in results {
            let elapsed = result.expect("no panic").expect("the all-reduces work");
            assert!(elapsed >= Duration::from_millis(80), "took {elapsed:?}");
        }
    }
}
