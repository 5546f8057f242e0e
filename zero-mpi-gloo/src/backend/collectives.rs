//! The [`Communicator`](zero_core::Communicator) implementation of [`MpiComm`].
//!
//! Data movement (broadcast, gathers) goes through MPI as same-size unsigned
//! integers, so that bf16/f16 need no MPI datatype. Reductions run on f32 and
//! f64 (MPI's own operations or the ring); bf16/f16 are widened to f32,
//! reduced, and rounded once at the end, as the trait asks.

use super::ring::{
    balanced_bounds, equal_bounds, finish_avg, ring_all_gather_in_place, ring_reduce_scatter,
    system_op, Real,
};
use super::{Group, MpiComm};
use crate::error::Error;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use mpi::collective::{CommunicatorCollectives, Root};
use mpi::datatype::PartitionMut;
use mpi::environment::Threading;
use mpi::topology::{Color, Communicator as _, Rank};
use mpi::Count;
use zero_core::comm::check_len;
use zero_core::{DType, Element, Host, ReduceOp, Result, Work};

/// Largest element count MPI's `int` counts take.
const MAX_COUNT: usize = i32::MAX as usize;

fn count(op: &'static str, what: &'static str, value: usize) -> Result<Count> {
    Count::try_from(value).map_err(|_| {
        Error::CountOverflow {
            op,
            what,
            value,
            max: MAX_COUNT,
        }
        .into()
    })
}

fn cast<'a, T: Element, U: bytemuck::Pod>(op: &'static str, s: &'a [T]) -> Result<&'a [U]> {
    bytemuck::try_cast_slice(s).map_err(|e| unsupported_cast::<T>(op, e))
}

fn cast_mut<'a, T: Element, U: bytemuck::Pod>(
    op: &'static str,
    s: &'a mut [T],
) -> Result<&'a mut [U]> {
    bytemuck::try_cast_slice_mut(s).map_err(|e| unsupported_cast::<T>(op, e))
}

fn unsupported_cast<T: Element>(op: &'static str, e: bytemuck::PodCastError) -> zero_core::Error {
    zero_core::Error::Unsupported {
        op,
        detail: format!(
            "element type {} ({} bytes) cannot be viewed as its MPI type: {e:?}; \
             its `Element` impl disagrees with its size",
            T::DTYPE,
            std::mem::size_of::<T>()
        ),
    }
}

/// A host buffer viewed as the type MPI reduces it in.
enum RealMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
}

/// Runs `f` on `buf` as f32/f64; bf16/f16 go through an f32 copy that is
/// written back (rounded once) when `write_back` holds.
fn with_real<T: Element>(
    op: &'static str,
    buf: &mut [T],
    write_back: bool,
    f: impl FnOnce(RealMut<'_>) -> Result<()>,
) -> Result<()> {
    match T::DTYPE {
        DType::F32 => f(RealMut::F32(cast_mut(op, buf)?)),
        DType::F64 => f(RealMut::F64(cast_mut(op, buf)?)),
        DType::BF16 => {
            let half: &mut [bf16] = cast_mut(op, buf)?;
            let mut wide = vec![0f32; half.len()];
            half.convert_to_f32_slice(&mut wide);
            f(RealMut::F32(&mut wide))?;
            if write_back {
                half.convert_from_f32_slice(&wide);
            }
            Ok(())
        }
        DType::F16 => {
            let half: &mut [f16] = cast_mut(op, buf)?;
            let mut wide = vec![0f32; half.len()];
            half.convert_to_f32_slice(&mut wide);
            f(RealMut::F32(&mut wide))?;
            if write_back {
                half.convert_from_f32_slice(&wide);
            }
            Ok(())
        }
    }
}

/// Runs `f` on a (send, receive) pair as f32/f64, staging bf16/f16 in f32.
fn with_real_pair<T: Element>(
    op: &'static str,
    send: &[T],
    recv: &mut [T],
    f: impl FnOnce(RealPair<'_>) -> Result<()>,
) -> Result<()> {
    fn staged<H: bytemuck::Pod>(
        send: &[H],
        recv: &mut [H],
        f: impl FnOnce(RealPair<'_>) -> Result<()>,
        widen: fn(&[H], &mut [f32]),
        narrow: fn(&mut [H], &[f32]),
    ) -> Result<()> {
        let mut wide_send = vec![0f32; send.len()];
        widen(send, &mut wide_send);
        let mut wide_recv = vec![0f32; recv.len()];
        f(RealPair::F32(&wide_send, &mut wide_recv))?;
        narrow(recv, &wide_recv);
        Ok(())
    }
    match T::DTYPE {
        DType::F32 => f(RealPair::F32(cast(op, send)?, cast_mut(op, recv)?)),
        DType::F64 => f(RealPair::F64(cast(op, send)?, cast_mut(op, recv)?)),
        DType::BF16 => staged::<bf16>(
            cast(op, send)?,
            cast_mut(op, recv)?,
            f,
            |s, d| s.convert_to_f32_slice(d),
            |d, s| d.convert_from_f32_slice(s),
        ),
        DType::F16 => staged::<f16>(
            cast(op, send)?,
            cast_mut(op, recv)?,
            f,
            |s, d| s.convert_to_f32_slice(d),
            |d, s| d.convert_from_f32_slice(s),
        ),
    }
}

enum RealPair<'a> {
    F32(&'a [f32], &'a mut [f32]),
    F64(&'a [f64], &'a mut [f64]),
}

/// Runs `$body` with `$send`/`$recv` viewed as the same-size unsigned integer
/// type (u16, u32 or u64) MPI moves them as.
macro_rules! as_words {
    (@shared $W:ty, $op:expr, $buf:expr) => { cast::<_, $W>($op, $buf)? };
    (@unique $W:ty, $op:expr, $buf:expr) => { cast_mut::<_, $W>($op, $buf)? };
    ($T:ty, $op:expr; $($kind:ident $name:ident = $buf:expr;)+ => $body:block) => {
        match std::mem::size_of::<$T>() {
            2 => { $(let $name = as_words!(@$kind u16, $op, $buf);)+ $body }
            4 => { $(let $name = as_words!(@$kind u32, $op, $buf);)+ $body }
            8 => { $(let $name = as_words!(@$kind u64, $op, $buf);)+ $body }
            size => Err(zero_core::Error::Unsupported {
                op: $op,
                detail: format!("elements of {size} bytes cannot be moved by MPI"),
            }),
        }
    };
}

impl Group {
    /// All-reduces `buf` (the caller holds the MPI lock).
    pub(crate) fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        with_real("all_reduce", buf, true, |b| match b {
            RealMut::F32(b) => self.all_reduce_real(b, op),
            RealMut::F64(b) => self.all_reduce_real(b, op),
        })
    }

    /// Reduce-scatters `send` into `recv`, whose sizes the caller has checked
    /// (and holds the MPI lock).
    pub(crate) fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        with_real_pair("reduce_scatter", send, recv, |p| match p {
            RealPair::F32(s, r) => self.reduce_scatter_real(s, r, op),
            RealPair::F64(s, r) => self.reduce_scatter_real(s, r, op),
        })
    }

    /// All-gathers `send` into `recv`, whose sizes the caller has checked
    /// (and holds the MPI lock).
    pub(crate) fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        const OP: &str = "all_gather";
        let w = self.world_size;
        let n = send.len();
        if w == 1 || n == 0 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        count(OP, "send length", n)?;
        let ring = self.algorithm.use_ring(std::mem::size_of_val(recv));
        as_words!(T, OP; shared s = send; unique r = &mut *recv; => {
            if ring {
                r[self.rank * n..(self.rank + 1) * n].copy_from_slice(s);
                ring_all_gather_in_place(&self.comm, r, &equal_bounds(n, w));
            } else {
                self.comm.all_gather_into(s, r);
            }
            Ok(())
        })
    }

    /// Broadcasts `buf` from `root`, which the caller has checked (and holds
    /// the MPI lock).
    pub(crate) fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        if self.world_size == 1 || buf.is_empty() {
            return Ok(());
        }
        count(OP, "buffer length", buf.len())?;
        as_words!(T, OP; unique b = &mut *buf; => {
            self.comm.process_at_rank(root as Rank).broadcast_into(b);
            Ok(())
        })
    }

    fn all_reduce_real<R: Real>(&self, buf: &mut [R], op: ReduceOp) -> Result<()> {
        let w = self.world_size;
        if w == 1 || buf.is_empty() {
            finish_avg(buf, op, w);
            return Ok(());
        }
        count("all_reduce", "buffer length", buf.len())?;
        let bytes = std::mem::size_of_val(buf);
        if self.algorithm.use_ring(bytes) {
            // Reduce-scatter into our chunk, average it, all-gather: every
            // rank ends up with the same bits.
            let bounds = balanced_bounds(buf.len(), w);
            let (lo, hi) = (bounds[self.rank], bounds[self.rank + 1]);
            let mut mine = vec![R::default(); hi - lo];
            ring_reduce_scatter(&self.comm, buf, &bounds, &mut mine, op);
            finish_avg(&mut mine, op, w);
            buf[lo..hi].copy_from_slice(&mine);
            ring_all_gather_in_place(&self.comm, buf, &bounds);
        } else {
            let send = buf.to_vec();
            self.comm.all_reduce_into(&send[..], buf, system_op(op));
            finish_avg(buf, op, w);
        }
        Ok(())
    }

    fn reduce_scatter_real<R: Real>(&self, send: &[R], recv: &mut [R], op: ReduceOp) -> Result<()> {
        let w = self.world_size;
        if w == 1 || recv.is_empty() {
            recv.copy_from_slice(send);
            finish_avg(recv, op, w);
            return Ok(());
        }
        count("reduce_scatter", "receive length", recv.len())?;
        if self.algorithm.use_ring(std::mem::size_of_val(send)) {
            let bounds = equal_bounds(recv.len(), w);
            ring_reduce_scatter(&self.comm, send, &bounds, recv, op);
        } else {
            self.comm
                .reduce_scatter_block_into(send, recv, system_op(op));
        }
        finish_avg(recv, op, w);
        Ok(())
    }

    fn reduce_real<R: Real>(&self, buf: &mut [R], op: ReduceOp, root: usize) -> Result<()> {
        let w = self.world_size;
        if w == 1 || buf.is_empty() {
            finish_avg(buf, op, w);
            return Ok(());
        }
        count("reduce", "buffer length", buf.len())?;
        let root_process = self.comm.process_at_rank(root as Rank);
        if self.rank == root {
            let send = buf.to_vec();
            root_process.reduce_into_root(&send[..], buf, system_op(op));
            finish_avg(buf, op, w);
        } else {
            root_process.reduce_into(&buf[..], system_op(op));
        }
        Ok(())
    }
}

impl MpiComm {
    pub(crate) fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        zero_core::comm::check_root(op, root, self.group.world_size)
    }

    /// Prefix offsets of `counts` as MPI counts; checks they fit.
    fn displacements(op: &'static str, counts: &[usize]) -> Result<(Vec<Count>, Vec<Count>)> {
        let mut c = Vec::with_capacity(counts.len());
        let mut d = Vec::with_capacity(counts.len());
        let mut at = 0usize;
        for &n in counts {
            c.push(count(op, "count", n)?);
            d.push(count(op, "displacement", at)?);
            at += n;
        }
        count(op, "total count", at)?;
        Ok((c, d))
    }

    fn check_counts(&self, op: &'static str, send_len: usize, counts: &[usize]) -> Result<usize> {
        let group = (self.group.rank, self.group.world_size);
        zero_core::comm::check_counts(op, counts, send_len, group)
    }

    pub(crate) fn check_reduce_scatter<T>(
        &self,
        op: &'static str,
        send: &[T],
        recv: &[T],
    ) -> Result<()> {
        check_len(op, "send", send.len(), self.group.world_size * recv.len())
    }

    pub(crate) fn check_all_gather<T>(
        &self,
        op: &'static str,
        send: &[T],
        recv: &[T],
    ) -> Result<()> {
        check_len(op, "recv", recv.len(), self.group.world_size * send.len())
    }

    // The ring cost model of `bytes_sent`, shared by the blocking and the
    // asynchronous forms.

    pub(crate) fn count_all_reduce<T>(&self, buf: &[T]) {
        let w = self.group.world_size;
        self.count_sent(2 * (w - 1) * std::mem::size_of_val(buf) / w);
    }

    pub(crate) fn count_reduce_scatter<T>(&self, recv: &[T]) {
        self.count_sent((self.group.world_size - 1) * std::mem::size_of_val(recv));
    }

    pub(crate) fn count_all_gather<T>(&self, send: &[T]) {
        self.count_sent((self.group.world_size - 1) * std::mem::size_of_val(send));
    }

    pub(crate) fn count_broadcast<T>(&self, buf: &[T], root: usize) {
        if self.group.rank == root && self.group.world_size > 1 {
            self.count_sent(std::mem::size_of_val(buf));
        }
    }
}

impl zero_core::Communicator for MpiComm {
    type Memory = Host;

    fn rank(&self) -> usize {
        self.group.rank
    }

    fn world_size(&self) -> usize {
        self.group.world_size
    }

    /// Ring cost model in bytes of the element type (16-bit reductions are
    /// counted at 16 bits even though they travel as f32): all-reduce
    /// `2(N-1)/N` of the buffer, reduce-scatter and all-gather `(N-1)/N` of the
    /// full buffer, broadcast the buffer on the root, reduce the buffer on
    /// every other rank, gathers this rank's contribution once per receiver.
    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn barrier(&self) -> Result<()> {
        let _guard = self.enter("barrier")?;
        self.group.comm.barrier();
        Ok(())
    }

    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let _guard = self.enter("all_reduce")?;
        self.group.all_reduce(buf, op)?;
        self.count_all_reduce(buf);
        Ok(())
    }

    fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let _guard = self.enter(OP)?;
        self.check_reduce_scatter(OP, send, recv)?;
        self.group.reduce_scatter(send, recv, op)?;
        self.count_reduce_scatter(recv);
        Ok(())
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        const OP: &str = "all_gather";
        let _guard = self.enter(OP)?;
        self.check_all_gather(OP, send, recv)?;
        self.group.all_gather(send, recv)?;
        self.count_all_gather(send);
        Ok(())
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        let _guard = self.enter(OP)?;
        self.check_root(OP, root)?;
        self.group.broadcast(buf, root)?;
        self.count_broadcast(buf, root);
        Ok(())
    }

    fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        const OP: &str = "reduce";
        let _guard = self.enter(OP)?;
        self.check_root(OP, root)?;
        with_real(OP, buf, self.group.rank == root, |b| match b {
            RealMut::F32(b) => self.group.reduce_real(b, op, root),
            RealMut::F64(b) => self.group.reduce_real(b, op, root),
        })?;
        if self.group.rank != root {
            self.count_sent(std::mem::size_of_val(buf));
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
        const OP: &str = "gather_varlen";
        let _guard = self.enter(OP)?;
        self.check_root(OP, root)?;
        let total = self.check_counts(OP, send.len(), counts)?;
        let (c, d) = Self::displacements(OP, counts)?;
        let root_process = self.group.comm.process_at_rank(root as Rank);
        if self.group.rank == root {
            let Some(recv) = recv else {
                return Err(zero_core::Error::Config(format!(
                    "{OP}: the root (rank {root}) must pass a receive buffer of {total} elements"
                )));
            };
            check_len(OP, "recv", recv.len(), total)?;
            as_words!(T, OP; shared s = send; unique r = recv; => {
                let mut partition = PartitionMut::new(r, &c[..], &d[..]);
                root_process.gather_varcount_into_root(s, &mut partition);
                Ok(())
            })?;
        } else {
            as_words!(T, OP; shared s = send; => {
                root_process.gather_varcount_into(s);
                Ok(())
            })?;
            self.count_sent(std::mem::size_of_val(send));
        }
        Ok(())
    }

    fn all_gather_varlen<T: Element>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: &mut [T],
    ) -> Result<()> {
        const OP: &str = "all_gather_varlen";
        let _guard = self.enter(OP)?;
        let total = self.check_counts(OP, send.len(), counts)?;
        check_len(OP, "recv", recv.len(), total)?;
        let (c, d) = Self::displacements(OP, counts)?;
        as_words!(T, OP; shared s = send; unique r = recv; => {
            let mut partition = PartitionMut::new(r, &c[..], &d[..]);
            self.group.comm.all_gather_varcount_into(s, &mut partition);
            Ok(())
        })?;
        self.count_sent((self.group.world_size - 1) * std::mem::size_of_val(send));
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        const OP: &str = "all_gather_bytes";
        let _guard = self.enter(OP)?;
        let w = self.group.world_size;
        let mut lengths = vec![0u64; w];
        self.group
            .comm
            .all_gather_into(&(send.len() as u64), &mut lengths[..]);
        let counts: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let (c, d) = Self::displacements(OP, &counts)?;
        let total: usize = counts.iter().sum();
        let mut all = vec![0u8; total];
        // Every rank knows the lengths, so all skip an empty gather together.
        // Open MPI defines MPI_IN_PLACE as the address 1, which is exactly
        // where an empty `[u8]` points: an empty send must point elsewhere.
        if total > 0 {
            let placeholder = [0u8; 1];
            let send = if send.is_empty() {
                &placeholder[..0]
            } else {
                send
            };
            let mut partition = PartitionMut::new(&mut all[..], &c[..], &d[..]);
            self.group
                .comm
                .all_gather_varcount_into(send, &mut partition);
        }
        self.count_sent((w - 1) * (send.len() + 8));
        let mut out = Vec::with_capacity(w);
        let mut at = 0;
        for n in counts {
            out.push(all[at..at + n].to_vec());
            at += n;
        }
        Ok(out)
    }

    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        self.start_all_reduce(buf, op)
    }

    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
        op: ReduceOp,
    ) -> Result<Work<'a>> {
        self.start_reduce_scatter(send, recv, op)
    }

    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a [T],
        recv: &'a mut [T],
    ) -> Result<Work<'a>> {
        self.start_all_gather(send, recv)
    }

    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut [T],
        root: usize,
    ) -> Result<Work<'a>> {
        self.start_broadcast(buf, root)
    }

    /// Where MPI provides `MPI_THREAD_MULTIPLE`: a collective holds its own
    /// communicator's lock. Otherwise every MPI call of the process holds one
    /// lock, so a collective blocked on a peer would keep another
    /// communicator's collective (on which that peer may be waiting) from
    /// starting.
    fn concurrent_groups(&self) -> bool {
        self.threading == Threading::Multiple
    }

    /// `MPI_Comm_split` with color 0 for members (key: position in `ranks`)
    /// and `MPI_UNDEFINED` for the others. Before splitting, ranks compare
    /// `ranks` (an all-gather), so a disagreement is an error on every rank
    /// rather than a hang.
    fn split(&self, ranks: &[usize]) -> Result<Option<Self>> {
        const OP: &str = "split";
        let w = self.group.world_size;
        if let Some(&bad) = ranks.iter().find(|&&r| r >= w) {
            return Err(zero_core::Error::InvalidRank {
                op: OP,
                rank: bad,
                world_size: w,
            });
        }
        if ranks.windows(2).any(|p| p[0] >= p[1]) {
            return Err(zero_core::Error::Config(format!(
                "{OP}: ranks {ranks:?} must be sorted and distinct"
            )));
        }
        let encoded: Vec<u8> = ranks
            .iter()
            .flat_map(|&r| (r as u64).to_le_bytes())
            .collect();
        let everyone = self.all_gather_bytes(&encoded)?;
        if let Some((other_rank, _)) = everyone.iter().enumerate().find(|(_, e)| **e != encoded) {
            let decode = |b: &[u8]| -> Vec<u64> {
                b.chunks_exact(8)
                    .map(|c| {
                        let mut word = [0u8; 8];
                        word.copy_from_slice(c);
                        u64::from_le_bytes(word)
                    })
                    .collect()
            };
            return Err(zero_core::Error::CollectiveMismatch {
                seq: 0,
                rank: self.group.rank,
                this: format!("split({ranks:?})"),
                other_rank,
                other: format!("split({:?})", decode(&everyone[other_rank])),
            });
        }
        let _guard = self.enter(OP)?;
        let position = ranks.iter().position(|&r| r == self.group.rank);
        let color = match position {
            Some(_) => Color::with_value(0),
            None => Color::undefined(),
        };
        let key = count(OP, "key", position.unwrap_or(0))?;
        let Some(sub) = self.group.comm.split_by_color_with_key(color, key) else {
            return Ok(None);
        };
        Ok(Some(
            MpiComm::wrap(
                super::Handle::new(sub, self.threading),
                self.world_rank,
                self.threading,
                self.universe.clone(),
            )
            .with_algorithm(self.group.algorithm)
            .with_timeout(self.timeout),
        ))
    }
}
