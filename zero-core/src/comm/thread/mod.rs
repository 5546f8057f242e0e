//! The in-process backend: N ranks as N threads of one process, with
//! shared-memory collectives.
//!
//! Blocking collectives are zero-copy: each rank deposits pointers to its
//! own buffers in the collective's slot, waits until every rank has arrived,
//! then reads its peers' buffers directly and computes *its own* share of the
//! work (rank `r` reduces chunk `r`), and finally waits at a departure
//! barrier so that no rank returns (and frees its buffers) while a peer may
//! still read them. Asynchronous collectives deposit an owned copy of the
//! send data instead, so a leaked [`Work`] can never expose freed memory;
//! their receive side runs when the `Work` is polled.
//!
//! Reductions combine ranks in rank order (`r0 + r1 + ...`) with 16-bit
//! types accumulated in f32, so results are bitwise reproducible and equal
//! between the blocking and asynchronous forms.
//!
//! [`Communicator::bytes_sent`] counts what ring and tree algorithms would
//! send, for `N` ranks and a full buffer of `B` bytes (integer division):
//! all-reduce `2(N-1)B/N`; reduce-scatter and all-gather `(N-1)B/N`;
//! broadcast `B` on the root, 0 elsewhere; reduce `B` on every non-root, 0
//! on the root; `gather_varlen` a rank's own bytes on every non-root;
//! `all_gather_varlen` and `all_gather_bytes` every chunk except the one of
//! rank `r+1` (a ring); barrier and split 0.

mod kernels;
mod state;

use self::state::{Contribution, OpDesc, RawBuf, Shared};
use crate::comm::{check_len, Communicator, Host, ReduceOp, Work, DEFAULT_TIMEOUT};
use crate::{Element, Error, Result};
use std::any::{Any, TypeId};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A group of `world_size` in-process ranks.
///
/// ```
/// use zero_core::prelude::*;
///
/// let results = ThreadGroup::new(4).run(|comm| {
///     let mut x = [comm.rank() as f32 + 1.0];
///     comm.all_reduce(&mut x, ReduceOp::Sum)?;
///     Ok::<f32, Error>(x[0])
/// });
/// for r in results {
///     assert_eq!(r.unwrap().unwrap(), 10.0);
/// }
/// ```
#[derive(Clone, Debug)]
pub struct ThreadGroup {
    world_size: usize,
    timeout: Duration,
}

impl ThreadGroup {
    /// A group of `world_size` ranks with the [`DEFAULT_TIMEOUT`] deadline.
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Sets the deadline of every collective (and of subgroups split off).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The deadline of every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Creates fresh shared state and returns the handles of ranks
    /// `0..world_size`, in order, to move into threads of your own. Dropping
    /// a handle makes its rank leave the group: its peers' collectives fail.
    pub fn communicators(&self) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared::new(self.world_size, self.timeout));
        (0..self.world_size)
            .map(|rank| ThreadComm::new(shared.clone(), rank))
            .collect()
    }

    /// Runs `f` on every rank, each in its own scoped thread, and returns
    /// the ranks' results in rank order. A rank that panics yields
    /// [`Error::RankPanicked`] with its message; its peers' collectives fail
    /// with [`Error::PeerFailed`] instead of waiting for it.
    #[must_use = "a rank that failed or panicked says so only in its result; check every rank's"]
    pub fn run<R, F>(&self, f: F) -> Vec<Result<R>>
    where
        F: Fn(ThreadComm) -> R + Sync,
        R: Send,
    {
        let f = &f;
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .communicators()
                .into_iter()
                .map(|comm| {
                    let rank = comm.rank;
                    let spawned = std::thread::Builder::new()
                        .name(format!("zero-rank-{rank}"))
                        .spawn_scoped(scope, move || f(comm));
                    (rank, spawned)
                })
                .collect();
            handles
                .into_iter()
                .map(|(rank, spawned)| match spawned {
                    Ok(handle) => handle.join().map_err(|payload| Error::RankPanicked {
                        rank,
                        message: panic_message(payload.as_ref()),
                    }),
                    Err(e) => Err(Error::RankPanicked {
                        rank,
                        message: format!("could not spawn its thread: {e}"),
                    }),
                })
                .collect()
        })
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_string()
    }
}

/// One rank's handle on a [`ThreadGroup`]: a [`Communicator`] over host
/// buffers. Dropping it (also by unwinding from a panic) makes the rank
/// leave the group, so its peers fail fast.
pub struct ThreadComm {
    shared: Arc<Shared>,
    rank: usize,
    seq: AtomicU64,
    bytes_sent: AtomicU64,
}

impl std::fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("seq", &self.seq.load(Ordering::Relaxed))
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let reason = if std::thread::panicking() {
            "panicked"
        } else {
            "dropped its communicator (returned early?)"
        };
        self.shared.leave(self.rank, reason.to_string());
    }
}

/// Departs from a blocking collective when dropped, also when unwinding, so
/// a rank never frees buffers its peers may still be reading.
struct Departure<'a> {
    shared: &'a Shared,
    seq: u64,
    wait: bool,
}

impl Drop for Departure<'_> {
    fn drop(&mut self) {
        self.shared.depart(self.seq, self.wait);
    }
}

/// `[start, end)` of rank `rank`'s chunk when `len` elements are split into
/// `n` near-equal contiguous chunks.
fn chunk(len: usize, n: usize, rank: usize) -> (usize, usize) {
    (len * rank / n, len * (rank + 1) / n)
}

fn typed<T: Element>(op: &'static str) -> OpDesc {
    OpDesc {
        dtype: Some((T::DTYPE, TypeId::of::<T>())),
        ..OpDesc::new(op)
    }
}

fn size_of_bytes<T>(len: usize) -> u64 {
    (len * std::mem::size_of::<T>()) as u64
}

/// Copies `len` elements of `T`.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `len` elements, both
/// aligned for `T`, the ranges do not overlap and no other thread writes
/// them during the call.
unsafe fn copy_elems<T>(src: *const u8, dst: *mut u8, len: usize) {
    if len > 0 {
        // SAFETY: per the contract.
        unsafe { std::ptr::copy_nonoverlapping(src as *const T, dst as *mut T, len) };
    }
}

fn borrowed(c: &Contribution) -> RawBuf {
    match c {
        Contribution::Borrowed(raw) => *raw,
        // Every rank of a blocking collective deposits `Borrowed` (the
        // operation names differ from the async forms, so a mix is a
        // mismatch): an empty buffer reads and writes nothing.
        _ => RawBuf {
            send: std::ptr::NonNull::<u64>::dangling().as_ptr() as *const u8,
            send_len: 0,
            recv: std::ptr::NonNull::<u64>::dangling().as_ptr() as *mut u8,
        },
    }
}

fn owned<'c, T: Element>(op: &'static str, c: &'c Contribution) -> Result<&'c [T]> {
    match c {
        Contribution::Owned(any) => match any.downcast_ref::<Vec<T>>() {
            Some(v) => Ok(v),
            None => Err(internal(op)),
        },
        Contribution::Empty => Ok(&[]),
        Contribution::Borrowed(_) => Err(internal(op)),
    }
}

fn internal(op: &'static str) -> Error {
    Error::State(format!(
        "{op}: internal error: a peer deposited an unexpected buffer kind"
    ))
}

impl ThreadComm {
    fn new(shared: Arc<Shared>, rank: usize) -> Self {
        Self {
            shared,
            rank,
            seq: AtomicU64::new(0),
            bytes_sent: AtomicU64::new(0),
        }
    }

    /// The deadline of this communicator's collectives.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// The sequence number the next collective will get.
    pub fn next_seq(&self) -> u64 {
        self.seq.load(Ordering::Relaxed)
    }

    fn take_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    fn count(&self, bytes: u64) {
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Ring cost of a reduce-scatter or all-gather of `full` bytes.
    fn ring_bytes(&self, full: u64) -> u64 {
        let n = self.shared.world_size as u64;
        full * (n - 1) / n
    }

    /// Validates the arguments of collective `desc`. On failure the sequence
    /// number is used up and the collective aborted for the peers.
    fn validate(&self, desc: &OpDesc, check: Result<()>) -> Result<()> {
        if let Err(e) = check {
            let seq = self.take_seq();
            self.shared.fail(self.rank, seq, desc, &e);
            return Err(e);
        }
        Ok(())
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        super::check_root(op, root, self.shared.world_size)
    }

    fn check_counts(&self, op: &'static str, counts: &[usize], send_len: usize) -> Result<()> {
        super::check_counts(op, counts, send_len, (self.rank, self.shared.world_size)).map(drop)
    }

    /// Runs a blocking zero-copy collective: joins with `raw`, waits for all
    /// ranks, runs `body` on every rank's buffers, then departs (waiting for
    /// every peer to be done with our buffers when `wait_departure`).
    fn blocking<R>(
        &self,
        desc: &OpDesc,
        raw: Option<RawBuf>,
        wait_departure: bool,
        body: impl FnOnce(&[RawBuf]) -> R,
    ) -> Result<R> {
        let start = Instant::now();
        let seq = self.take_seq();
        let contribution = raw.map_or(Contribution::Empty, Contribution::Borrowed);
        self.shared.join(self.rank, seq, desc, contribution)?;
        let contributions = self.shared.wait_arrived(self.rank, seq, desc, start)?;
        let _departure = Departure {
            shared: &self.shared,
            seq,
            wait: wait_departure,
        };
        let peers: Vec<RawBuf> = contributions.iter().map(borrowed).collect();
        Ok(body(&peers))
    }

    /// Starts an asynchronous collective: joins with `contribution` (an owned
    /// copy) and returns a `Work` whose completion runs `finish` on every
    /// rank's contribution.
    fn start_async<'a>(
        &'a self,
        desc: OpDesc,
        contribution: Contribution,
        mut finish: impl FnMut(&[Contribution]) -> Result<()> + Send + 'a,
    ) -> Result<Work<'a>> {
        let start = Instant::now();
        let seq = self.take_seq();
        self.shared.join(self.rank, seq, &desc, contribution)?;
        Ok(Work::new(move |block| {
            let contributions = if block {
                self.shared.wait_arrived(self.rank, seq, &desc, start)?
            } else {
                match self.shared.poll_arrived(self.rank, seq, &desc, start)? {
                    Some(c) => c,
                    None => return Ok(false),
                }
            };
            let result = finish(&contributions);
            self.shared.depart(seq, false);
            result.map(|()| true)
        }))
    }
}

impl Communicator for ThreadComm {
    type Memory = Host;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn barrier(&self) -> Result<()> {
        self.blocking(&OpDesc::new("barrier"), None, false, |_| ())
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let desc = OpDesc {
            reduce: Some(op),
            len: Some(buf.len()),
            ..typed::<T>("all_reduce")
        };
        self.validate(&desc, kernels::check_layout::<T>(desc.op))?;
        let n = self.shared.world_size;
        let len = buf.len();
        let ptr = buf.as_mut_ptr() as *mut u8;
        let raw = RawBuf {
            send: ptr,
            send_len: len,
            recv: ptr,
        };
        self.blocking(&desc, Some(raw), true, |peers| {
            let (lo, hi) = chunk(len, n, self.rank);
            let srcs: Vec<*const u8> = peers.iter().map(|p| p.send).collect();
            let dsts: Vec<*mut u8> = peers.iter().map(|p| p.recv).collect();
            // SAFETY: every peer's buffer is `len` elements of T (the
            // descriptors matched) and stays borrowed until every rank has
            // departed; chunk [lo, hi) of every buffer is read and written by
            // this rank only; the layout was checked.
            unsafe { kernels::reduce::<T>(&srcs, lo, &dsts, lo, hi - lo, op, n) };
        })?;
        self.count(2 * self.ring_bytes(size_of_bytes::<T>(len)));
        Ok(())
    }

    fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        let desc = OpDesc {
            reduce: Some(op),
            len: Some(recv.len()),
            ..typed::<T>("reduce_scatter")
        };
        let n = self.shared.world_size;
        let per_rank = recv.len();
        let check = kernels::check_layout::<T>(desc.op)
            .and_then(|()| check_len(desc.op, "send", send.len(), n * per_rank));
        self.validate(&desc, check)?;
        let raw = RawBuf {
            send: send.as_ptr() as *const u8,
            send_len: send.len(),
            recv: recv.as_mut_ptr() as *mut u8,
        };
        let rank = self.rank;
        self.blocking(&desc, Some(raw), true, |peers| {
            let srcs: Vec<*const u8> = peers.iter().map(|p| p.send).collect();
            // SAFETY: every peer's send holds n * per_rank elements of T
            // (matching descriptors) and is only read; our own receive
            // buffer is written by us only; the layout was checked.
            unsafe {
                kernels::reduce::<T>(&srcs, rank * per_rank, &[raw.recv], 0, per_rank, op, n)
            };
        })?;
        self.count(self.ring_bytes(size_of_bytes::<T>(send.len())));
        Ok(())
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let desc = OpDesc {
            len: Some(send.len()),
            ..typed::<T>("all_gather")
        };
        let n = self.shared.world_size;
        let per_rank = send.len();
        let check = check_len(desc.op, "recv", recv.len(), n * per_rank);
        self.validate(&desc, check)?;
        let recv_len = recv.len();
        let dst = recv.as_mut_ptr() as *mut u8;
        let raw = RawBuf {
            send: send.as_ptr() as *const u8,
            send_len: per_rank,
            recv: dst,
        };
        self.blocking(&desc, Some(raw), true, |peers| {
            for (k, peer) in peers.iter().enumerate() {
                // SAFETY: peer k's send holds per_rank elements (matching
                // descriptors), only read while borrowed; our receive buffer
                // holds n * per_rank elements and is written by us only.
                unsafe {
                    copy_elems::<T>(
                        peer.send,
                        dst.add(k * per_rank * std::mem::size_of::<T>()),
                        per_rank,
                    )
                };
            }
        })?;
        self.count(self.ring_bytes(size_of_bytes::<T>(recv_len)));
        Ok(())
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let desc = OpDesc {
            len: Some(buf.len()),
            root: Some(root),
            ..typed::<T>("broadcast")
        };
        self.validate(&desc, self.check_root(desc.op, root))?;
        let len = buf.len();
        let ptr = buf.as_mut_ptr() as *mut u8;
        let raw = RawBuf {
            send: ptr,
            send_len: len,
            recv: ptr,
        };
        let rank = self.rank;
        self.blocking(&desc, Some(raw), true, |peers| {
            if rank != root {
                // SAFETY: root's buffer holds len elements and is only read
                // during the collective; ours is written by us only.
                unsafe { copy_elems::<T>(peers[root].send, ptr, len) };
            }
        })?;
        if rank == root {
            self.count(size_of_bytes::<T>(len));
        }
        Ok(())
    }

    fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let desc = OpDesc {
            reduce: Some(op),
            len: Some(buf.len()),
            root: Some(root),
            ..typed::<T>("reduce")
        };
        let check =
            kernels::check_layout::<T>(desc.op).and_then(|()| self.check_root(desc.op, root));
        self.validate(&desc, check)?;
        let n = self.shared.world_size;
        let len = buf.len();
        let ptr = buf.as_mut_ptr() as *mut u8;
        let raw = RawBuf {
            send: ptr,
            send_len: len,
            recv: ptr,
        };
        let rank = self.rank;
        self.blocking(&desc, Some(raw), true, |peers| {
            let (lo, hi) = chunk(len, n, rank);
            let srcs: Vec<*const u8> = peers.iter().map(|p| p.send).collect();
            // SAFETY: every buffer holds len elements; chunk [lo, hi) of
            // every buffer (the root's included) is touched by this rank
            // only; the layout was checked.
            unsafe { kernels::reduce::<T>(&srcs, lo, &[peers[root].recv], lo, hi - lo, op, n) };
        })?;
        if rank != root {
            self.count(size_of_bytes::<T>(len));
        }
        Ok(())
    }

    fn gather_varlen<T: Element>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        let total: usize = counts.iter().sum();
        let desc = OpDesc {
            len: Some(total),
            root: Some(root),
            list: Some(counts.to_vec()),
            ..typed::<T>("gather_varlen")
        };
        let rank = self.rank;
        let mut recv_ptr = std::ptr::NonNull::<T>::dangling().as_ptr() as *mut u8;
        let check = self
            .check_root(desc.op, root)
            .and_then(|()| self.check_counts(desc.op, counts, send.len()))
            .and_then(|()| {
                if rank != root {
                    return Ok(());
                }
                match recv {
                    Some(r) if r.len() == total => {
                        recv_ptr = r.as_mut_ptr() as *mut u8;
                        Ok(())
                    }
                    Some(r) => Err(Error::BufferSize {
                        op: desc.op,
                        what: "recv",
                        got: r.len(),
                        expected: total,
                    }),
                    None => Err(Error::Config(format!(
                        "gather_varlen: the root (rank {root}) must pass a receive buffer"
                    ))),
                }
            });
        self.validate(&desc, check)?;
        let raw = RawBuf {
            send: send.as_ptr() as *const u8,
            send_len: send.len(),
            recv: recv_ptr,
        };
        let offset: usize = counts[..rank].iter().sum();
        self.blocking(&desc, Some(raw), true, |peers| {
            // SAFETY: the root's receive buffer holds sum(counts) elements;
            // [offset, offset + counts[rank]) is written by this rank only;
            // our send buffer holds counts[rank] elements.
            unsafe {
                copy_elems::<T>(
                    raw.send,
                    peers[root].recv.add(offset * std::mem::size_of::<T>()),
                    counts[rank],
                )
            };
        })?;
        if rank != root {
            self.count(size_of_bytes::<T>(send.len()));
        }
        Ok(())
    }

    fn all_gather_varlen<T: Element>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: &mut [T],
    ) -> Result<()> {
        let total: usize = counts.iter().sum();
        let desc = OpDesc {
            len: Some(total),
            list: Some(counts.to_vec()),
            ..typed::<T>("all_gather_varlen")
        };
        let check = self
            .check_counts(desc.op, counts, send.len())
            .and_then(|()| check_len(desc.op, "recv", recv.len(), total));
        self.validate(&desc, check)?;
        let dst = recv.as_mut_ptr() as *mut u8;
        let raw = RawBuf {
            send: send.as_ptr() as *const u8,
            send_len: send.len(),
            recv: dst,
        };
        self.blocking(&desc, Some(raw), true, |peers| {
            let mut offset = 0;
            for (peer, &count) in peers.iter().zip(counts) {
                // SAFETY: peer's send holds `count` elements (counts
                // matched, each rank checked its own), only read; our
                // receive buffer holds sum(counts) and is written by us only.
                unsafe {
                    copy_elems::<T>(peer.send, dst.add(offset * std::mem::size_of::<T>()), count)
                };
                offset += count;
            }
        })?;
        let n = self.shared.world_size;
        let next = (self.rank + 1) % n;
        self.count(size_of_bytes::<T>(total - counts[next]));
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        let desc = OpDesc::new("all_gather_bytes");
        let raw = RawBuf {
            send: send.as_ptr(),
            send_len: send.len(),
            recv: std::ptr::null_mut(),
        };
        let gathered = self.blocking(&desc, Some(raw), true, |peers| {
            peers
                .iter()
                .map(|p| {
                    if p.send_len == 0 {
                        return Vec::new();
                    }
                    // SAFETY: the peer's send slice (send_len bytes) stays
                    // borrowed and unmodified until every rank has departed.
                    unsafe { std::slice::from_raw_parts(p.send, p.send_len) }.to_vec()
                })
                .collect::<Vec<Vec<u8>>>()
        })?;
        let n = self.shared.world_size;
        let total: usize = gathered.iter().map(Vec::len).sum();
        self.count((total - gathered[(self.rank + 1) % n].len()) as u64);
        Ok(gathered)
    }

    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        let desc = OpDesc {
            reduce: Some(op),
            len: Some(buf.len()),
            ..typed::<T>("all_reduce_async")
        };
        self.validate(&desc, kernels::check_layout::<T>(desc.op))?;
        let n = self.shared.world_size;
        let len = buf.len();
        self.count(2 * self.ring_bytes(size_of_bytes::<T>(len)));
        let copy: Arc<dyn Any + Send + Sync> = Arc::new(buf.to_vec());
        self.start_async(desc, Contribution::Owned(copy), move |contributions| {
            let srcs = contributions
                .iter()
                .map(|c| owned::<T>("all_reduce_async", c).map(|v| v.as_ptr() as *const u8))
                .collect::<Result<Vec<_>>>()?;
            let dst = buf.as_mut_ptr() as *mut u8;
            // SAFETY: every copy holds len elements (matching descriptors)
            // and is kept alive by `contributions`; `buf` is ours,
            // exclusively borrowed by this Work; the layout was checked.
            unsafe { kernels::reduce::<T>(&srcs, 0, &[dst], 0, len, op, n) };
            Ok(())
        })
    }

    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        let desc = OpDesc {
            reduce: Some(op),
            len: Some(recv.len()),
            ..typed::<T>("reduce_scatter_async")
        };
        let n = self.shared.world_size;
        let per_rank = recv.len();
        let check = kernels::check_layout::<T>(desc.op)
            .and_then(|()| check_len(desc.op, "send", send.len(), n * per_rank));
        self.validate(&desc, check)?;
        self.count(self.ring_bytes(size_of_bytes::<T>(send.len())));
        let copy: Arc<dyn Any + Send + Sync> = Arc::new(send.to_vec());
        let rank = self.rank;
        self.start_async(desc, Contribution::Owned(copy), move |contributions| {
            let srcs = contributions
                .iter()
                .map(|c| owned::<T>("reduce_scatter_async", c).map(|v| v.as_ptr() as *const u8))
                .collect::<Result<Vec<_>>>()?;
            let dst = recv.as_mut_ptr() as *mut u8;
            // SAFETY: every copy holds n * per_rank elements and is kept
            // alive by `contributions`; `recv` is exclusively ours.
            unsafe { kernels::reduce::<T>(&srcs, rank * per_rank, &[dst], 0, per_rank, op, n) };
            Ok(())
        })
    }

    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<Work<'a>> {
        let desc = OpDesc {
            len: Some(send.len()),
            ..typed::<T>("all_gather_async")
        };
        let n = self.shared.world_size;
        let per_rank = send.len();
        let check = check_len(desc.op, "recv", recv.len(), n * per_rank);
        self.validate(&desc, check)?;
        self.count(self.ring_bytes(size_of_bytes::<T>(recv.len())));
        let copy: Arc<dyn Any + Send + Sync> = Arc::new(send.to_vec());
        self.start_async(desc, Contribution::Owned(copy), move |contributions| {
            for (k, c) in contributions.iter().enumerate() {
                let part = owned::<T>("all_gather_async", c)?;
                if part.len() != per_rank {
                    return Err(internal("all_gather_async"));
                }
                recv[k * per_rank..(k + 1) * per_rank].copy_from_slice(part);
            }
            Ok(())
        })
    }

    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<Work<'a>> {
        let desc = OpDesc {
            len: Some(buf.len()),
            root: Some(root),
            ..typed::<T>("broadcast_async")
        };
        self.validate(&desc, self.check_root(desc.op, root))?;
        let rank = self.rank;
        let contribution = if rank == root {
            self.count(size_of_bytes::<T>(buf.len()));
            Contribution::Owned(Arc::new(buf.to_vec()))
        } else {
            Contribution::Empty
        };
        self.start_async(desc, contribution, move |contributions| {
            if rank != root {
                let data = owned::<T>("broadcast_async", &contributions[root])?;
                if data.len() != buf.len() {
                    return Err(internal("broadcast_async"));
                }
                buf.copy_from_slice(data);
            }
            Ok(())
        })
    }

    fn split(&self, ranks: &[usize]) -> Result<Option<Self>> {
        let desc = OpDesc {
            list: Some(ranks.to_vec()),
            ..OpDesc::new("split")
        };
        let n = self.shared.world_size;
        let check = if let Some(&bad) = ranks.iter().find(|&&r| r >= n) {
            Err(Error::InvalidRank {
                op: "split",
                rank: bad,
                world_size: n,
            })
        } else if ranks.windows(2).any(|w| w[0] >= w[1]) {
            Err(Error::Config(format!(
                "split: ranks {ranks:?} must be sorted and distinct"
            )))
        } else {
            Ok(())
        };
        self.validate(&desc, check)?;
        // Every rank offers a fresh group state; all members adopt the one
        // offered by the subgroup's first rank.
        let offer: Arc<dyn Any + Send + Sync> =
            Arc::new(Arc::new(Shared::new(ranks.len(), self.shared.timeout)));
        let start = Instant::now();
        let seq = self.take_seq();
        self.shared
            .join(self.rank, seq, &desc, Contribution::Owned(offer))?;
        let contributions = self.shared.wait_arrived(self.rank, seq, &desc, start)?;
        let adopted = ranks
            .first()
            .and_then(|&first| match &contributions[first] {
                Contribution::Owned(any) => any.downcast_ref::<Arc<Shared>>().cloned(),
                _ => None,
            });
        self.shared.depart(seq, false);
        let Some(position) = ranks.iter().position(|&r| r == self.rank) else {
            return Ok(None);
        };
        match adopted {
            Some(shared) => Ok(Some(ThreadComm::new(shared, position))),
            None => Err(internal("split")),
        }
    }
}
