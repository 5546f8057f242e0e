//! [`Delayed`]: a communicator that takes as long as a network link would.

use super::communicator::{Communicator, Host, ReduceOp};
use super::work::Work;
use crate::{Element, Result};
use std::sync::atomic::{AtomicU64, Ordering};
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
/// [`Delayed::between_machines`] models a cluster instead: consecutive
/// ranks share a machine, a collective among the ranks of one machine
/// takes the fast link's time and one that spans machines the slow one's
/// (a ring runs at its slowest edge), and each rank counts the bytes it
/// sends over the slow link ([`Delayed::slow_bytes`]): a ring's bytes where
/// its successor in the ring is on another machine.
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
    /// The link within a machine (every link without machines).
    fast: Link,
    /// With machines: their size in ranks and the link between them.
    machines: Option<(usize, Link)>,
    /// The world ranks of this communicator's ranks, in its rank order.
    members: Arc<Vec<usize>>,
}

/// One rank's link of one kind: its speed, when it is free again (`None`:
/// never used), and the bytes this rank sent over it; shared by the
/// communicators split from one.
#[derive(Clone, Debug)]
struct Link {
    latency: Duration,
    bytes_per_sec: f64,
    free_at: Arc<Mutex<Option<Instant>>>,
    sent: Arc<AtomicU64>,
}

impl Link {
    fn new(latency: Duration, bytes_per_sec: f64) -> Self {
        Self {
            latency,
            bytes_per_sec,
            free_at: Arc::default(),
            sent: Arc::default(),
        }
    }

    /// Sleeps as long as sending `bytes` over the link takes, booked
    /// behind what is already on it; counts `sent` of them as this rank's.
    fn wait(&self, bytes: usize, sent: usize) {
        self.sent.fetch_add(sent as u64, Ordering::Relaxed);
        let transfer = if self.bytes_per_sec.is_finite() && self.bytes_per_sec > 0.0 {
            Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec)
        } else {
            Duration::ZERO
        };
        let done = {
            let mut free_at = self.free_at.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            let done = free_at.map_or(now, |free| free.max(now)) + self.latency + transfer;
            *free_at = Some(done);
            done
        };
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
    }
}

impl<C: Communicator<Memory = Host>> Delayed<C> {
    /// `inner` with collectives slowed to a link of `latency` and
    /// `bytes_per_sec` (use `f64::INFINITY` for latency only).
    pub fn new(inner: C, latency: Duration, bytes_per_sec: f64) -> Self {
        let members = Arc::new((0..inner.world_size()).collect());
        Self {
            inner,
            fast: Link::new(latency, bytes_per_sec),
            machines: None,
            members,
        }
    }

    /// `inner` as ranks on machines of `ranks_per_machine` consecutive
    /// ranks: collectives within a machine take the time of the `fast`
    /// link, those that span machines that of the `slow` one (each a
    /// latency and bytes per second).
    pub fn between_machines(
        inner: C,
        ranks_per_machine: usize,
        fast: (Duration, f64),
        slow: (Duration, f64),
    ) -> Self {
        let mut delayed = Self::new(inner, fast.0, fast.1);
        delayed.machines = Some((ranks_per_machine.max(1), Link::new(slow.0, slow.1)));
        delayed
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// Bytes this rank sent over links between machines so far, on this
    /// communicator and those split from it (0 without machines).
    pub fn slow_bytes(&self) -> u64 {
        self.machines
            .as_ref()
            .map_or(0, |(_, slow)| slow.sent.load(Ordering::Relaxed))
    }

    /// Sleeps as long as a collective that sends `bytes` per rank takes on
    /// the link it runs on.
    fn wait(&self, bytes: usize) {
        let machine = |member: &usize| self.machines.as_ref().map_or(0, |(size, _)| member / size);
        let (Some((_, slow)), Some(first)) = (&self.machines, self.members.first()) else {
            return self.fast.wait(bytes, bytes);
        };
        if self.members.iter().all(|m| machine(m) == machine(first)) {
            return self.fast.wait(bytes, bytes);
        }
        // A ring: this rank sends to its successor, over the slow link if
        // that one is on another machine.
        let me = self.members[self.inner.rank()];
        let next = self.members[(self.inner.rank() + 1) % self.members.len()];
        let crosses = machine(&me) != machine(&next);
        slow.wait(bytes, if crosses { bytes } else { 0 });
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
        let members = ranks.iter().filter_map(|&r| self.members.get(r).copied());
        let members = Arc::new(members.collect());
        Ok(self.inner.split(ranks)?.map(|inner| Self {
            inner,
            fast: self.fast.clone(),
            machines: self.machines.clone(),
            members,
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

    /// Four ranks on two machines of two: a ring over the world crosses
    /// between machines at ranks 1 and 3, one within a machine never, one
    /// over a rank of each machine at every rank; only what spans machines
    /// waits for the slow link (100 kB/s: 6000 bytes, at least 60 ms).
    #[test]
    fn between_machines_counts_the_bytes_sent_across_them() {
        let results = ThreadGroup::new(4).run(|comm| -> Result<(u64, u64, u64, Duration)> {
            let fast = (Duration::ZERO, f64::INFINITY);
            let link = Delayed::between_machines(comm, 2, fast, (Duration::ZERO, 100e3));
            let rank = link.rank();
            let machine: Vec<usize> = if rank < 2 { vec![0, 1] } else { vec![2, 3] };
            let mine = (0..2)
                .map(|m| link.split(&[m * 2, m * 2 + 1]))
                .collect::<Result<Vec<_>>>()?;
            let local = mine
                .into_iter()
                .flatten()
                .next()
                .expect("in one machine's split");
            assert_eq!(local.members[..], machine[..]);
            let across = (0..2)
                .map(|j| link.split(&[j, j + 2]))
                .collect::<Result<Vec<_>>>()?;
            let replicas = across
                .into_iter()
                .flatten()
                .next()
                .expect("in one replica split");
            let mut x = vec![1.0f32; 1000];
            let started = Instant::now();
            link.all_reduce(&mut x[..], ReduceOp::Sum)?;
            let world = link.slow_bytes();
            let spanning = started.elapsed();
            local.all_reduce(&mut x[..], ReduceOp::Sum)?;
            let within = link.slow_bytes() - world;
            replicas.all_reduce(&mut x[..], ReduceOp::Sum)?;
            let pairs = link.slow_bytes() - world - within;
            Ok((world, within, pairs, spanning))
        });
        for (rank, result) in results.into_iter().enumerate() {
            let (world, within, pairs, spanning) = result.unwrap().unwrap();
            // 2 (N - 1) / N of 4000 bytes where the successor is on the
            // other machine; a pair's ring always crosses: 2 x 1/2 x 4000.
            assert_eq!(world, if rank % 2 == 1 { 6000 } else { 0 }, "rank {rank}");
            assert_eq!(within, 0, "rank {rank}");
            assert_eq!(pairs, 4000, "rank {rank}");
            assert!(spanning >= Duration::from_millis(60), "{spanning:?}");
        }
    }
}
