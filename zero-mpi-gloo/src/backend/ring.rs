//! Ring reduce-scatter and all-gather over `MPI_Sendrecv`, and the element
//! arithmetic they share with the native paths.
//!
//! Why a ring: Open MPI's `MPI_Reduce_scatter_block` reduces to one rank and
//! scatters (or something close), and measured about 2.3x slower than this
//! ring on a shared-memory machine. The ring moves `(N-1)/N` of the buffer per
//! rank, the minimum, in `N-1` steps of one chunk each.
//!
//! Reduction order: chunk `c` is accumulated in the fixed order
//! `c+1, c+2, ..., c` (mod N), `acc = op(acc, own)`. The order does not depend
//! on timing, so results are bitwise reproducible from run to run, and in an
//! all-reduce every rank receives the same bits (the reduced chunk is copied,
//! not recomputed).

use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::point_to_point::send_receive_into;
use mpi::topology::{Communicator as _, Rank, SimpleCommunicator};
use zero_core::ReduceOp;

/// The floating-point types MPI reduces natively; 16-bit types are staged
/// through f32.
pub(crate) trait Real:
    Copy
    + Default
    + PartialOrd
    + Equivalence
    + Send
    + Sync
    + 'static
    + std::ops::Add<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
{
    /// `n` as this type (for averages).
    fn from_usize(n: usize) -> Self;
    /// The larger, ignoring NaN like `f32::max`.
    fn maximum(self, other: Self) -> Self;
    /// The smaller, ignoring NaN like `f32::min`.
    fn minimum(self, other: Self) -> Self;
}

impl Real for f32 {
    fn from_usize(n: usize) -> Self {
        n as f32
    }
    fn maximum(self, other: Self) -> Self {
        self.max(other)
    }
    fn minimum(self, other: Self) -> Self {
        self.min(other)
    }
}

impl Real for f64 {
    fn from_usize(n: usize) -> Self {
        n as f64
    }
    fn maximum(self, other: Self) -> Self {
        self.max(other)
    }
    fn minimum(self, other: Self) -> Self {
        self.min(other)
    }
}

/// The MPI operation that computes `op` (averages are sums divided after).
pub(crate) fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
        ReduceOp::Product => SystemOperation::product(),
    }
}

/// `acc[i] = op(acc[i], own[i])`; one tight loop per operation so that each
/// vectorizes.
pub(crate) fn combine<R: Real>(acc: &mut [R], own: &[R], op: ReduceOp) {
    debug_assert_eq!(acc.len(), own.len());
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, &b) in acc.iter_mut().zip(own) {
                *a = *a + b;
            }
        }
        ReduceOp::Product => {
            for (a, &b) in acc.iter_mut().zip(own) {
                *a = *a * b;
            }
        }
        ReduceOp::Max => {
            for (a, &b) in acc.iter_mut().zip(own) {
                *a = a.maximum(b);
            }
        }
        ReduceOp::Min => {
            for (a, &b) in acc.iter_mut().zip(own) {
                *a = a.minimum(b);
            }
        }
    }
}

/// Divides by the world size when `op` is an average.
pub(crate) fn finish_avg<R: Real>(buf: &mut [R], op: ReduceOp, world_size: usize) {
    if op == ReduceOp::Avg {
        let n = R::from_usize(world_size);
        for v in buf {
            *v = *v / n;
        }
    }
}

/// Chunk boundaries for cutting `len` elements into `parts` near-equal
/// contiguous chunks: `parts + 1` offsets, the first `len % parts` chunks one
/// element longer.
pub(crate) fn balanced_bounds(len: usize, parts: usize) -> Vec<usize> {
    let base = len / parts;
    let extra = len % parts;
    let mut bounds = Vec::with_capacity(parts + 1);
    let mut at = 0;
    bounds.push(0);
    for c in 0..parts {
        at += base + usize::from(c < extra);
        bounds.push(at);
    }
    bounds
}

/// Chunk boundaries for `parts` chunks of exactly `n` elements.
pub(crate) fn equal_bounds(n: usize, parts: usize) -> Vec<usize> {
    (0..=parts).map(|c| c * n).collect()
}

/// Ring reduce-scatter: `send` is cut at `bounds` (one chunk per rank); this
/// rank's reduced chunk lands in `out` (`bounds[r+1] - bounds[r]` elements).
///
/// The caller has checked sizes, that the world has at least two ranks, and
/// that every chunk fits MPI's 32-bit counts. Averages are left as sums.
pub(crate) fn ring_reduce_scatter<R: Real>(
    comm: &SimpleCommunicator,
    send: &[R],
    bounds: &[usize],
    out: &mut [R],
    op: ReduceOp,
) {
    let w = bounds.len() - 1;
    let r = comm.rank() as usize;
    debug_assert!(w >= 2);
    debug_assert_eq!(out.len(), bounds[r + 1] - bounds[r]);
    let right = comm.process_at_rank(((r + 1) % w) as Rank);
    let left = comm.process_at_rank(((r + w - 1) % w) as Rank);
    let chunk = |c: usize| &send[bounds[c]..bounds[c + 1]];
    let max_chunk = bounds.windows(2).map(|b| b[1] - b[0]).max().unwrap_or(0);
    // `incoming` receives the left neighbour's partial sum; `outgoing` holds
    // ours for the right neighbour. They swap roles every step.
    let mut incoming = vec![R::default(); if w > 2 { max_chunk } else { 0 }];
    let mut outgoing = vec![R::default(); if w > 2 { max_chunk } else { 0 }];
    for step in 0..w - 1 {
        let send_c = (r + w - step - 1) % w;
        let recv_c = (r + 2 * w - step - 2) % w;
        let to_send: &[R] = if step == 0 {
            chunk(send_c)
        } else {
            &outgoing[..bounds[send_c + 1] - bounds[send_c]]
        };
        let to_recv: &mut [R] = if step == w - 2 {
            &mut *out
        } else {
            &mut incoming[..bounds[recv_c + 1] - bounds[recv_c]]
        };
        send_receive_into(to_send, &right, to_recv, &left);
        combine(to_recv, chunk(recv_c), op);
        std::mem::swap(&mut incoming, &mut outgoing);
    }
}

/// Ring all-gather in place: this rank's chunk already sits at
/// `buf[bounds[r]..bounds[r+1]]`; afterwards every chunk does.
///
/// The caller has checked that the world has at least two ranks and that
/// every chunk fits MPI's 32-bit counts.
pub(crate) fn ring_all_gather_in_place<W: Equivalence>(
    comm: &SimpleCommunicator,
    buf: &mut [W],
    bounds: &[usize],
) {
    let w = bounds.len() - 1;
    let r = comm.rank() as usize;
    let right = comm.process_at_rank(((r + 1) % w) as Rank);
    let left = comm.process_at_rank(((r + w - 1) % w) as Rank);
    for step in 0..w - 1 {
        let send_c = (r + w - step) % w;
        let recv_c = (r + w - step - 1) % w;
        let (to_send, to_recv) = two_chunks(buf, bounds, send_c, recv_c);
        send_receive_into(to_send, &right, to_recv, &left);
    }
}

/// Chunk `a` shared and chunk `b` mutable, `a != b`.
fn two_chunks<'b, W>(
    buf: &'b mut [W],
    bounds: &[usize],
    a: usize,
    b: usize,
) -> (&'b [W], &'b mut [W]) {
    debug_assert_ne!(a, b);
    if a < b {
        let (lo, hi) = buf.split_at_mut(bounds[b]);
        (
            &lo[bounds[a]..bounds[a + 1]],
            &mut hi[..bounds[b + 1] - bounds[b]],
        )
    } else {
        let (lo, hi) = buf.split_at_mut(bounds[a]);
        (
            &hi[..bounds[a + 1] - bounds[a]],
            &mut lo[bounds[b]..bounds[b + 1]],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_bounds_cover_the_buffer() {
        assert_eq!(balanced_bounds(10, 4), vec![0, 3, 6, 8, 10]);
        assert_eq!(balanced_bounds(2, 4), vec![0, 1, 2, 2, 2]);
        assert_eq!(balanced_bounds(0, 3), vec![0, 0, 0, 0]);
        assert_eq!(equal_bounds(3, 2), vec![0, 3, 6]);
    }

    #[test]
    fn two_chunks_are_disjoint_and_right() {
        let mut buf = [0, 1, 2, 3, 4, 5];
        let bounds = [0, 2, 4, 6];
        let (a, b) = two_chunks(&mut buf, &bounds, 2, 0);
        assert_eq!(a, &[4, 5]);
        assert_eq!(b, &mut [0, 1]);
        let (a, b) = two_chunks(&mut buf, &bounds, 0, 1);
        assert_eq!(a, &[0, 1]);
        assert_eq!(b, &mut [2, 3]);
    }

    #[test]
    fn combine_applies_each_op() {
        let mut a = [1.0f32, 5.0];
        combine(&mut a, &[2.0, 3.0], ReduceOp::Sum);
        assert_eq!(a, [3.0, 8.0]);
        combine(&mut a, &[2.0, 3.0], ReduceOp::Product);
        assert_eq!(a, [6.0, 24.0]);
        combine(&mut a, &[7.0, 3.0], ReduceOp::Max);
        assert_eq!(a, [7.0, 24.0]);
        combine(&mut a, &[7.0, 3.0], ReduceOp::Min);
        assert_eq!(a, [7.0, 3.0]);
        finish_avg(&mut a, ReduceOp::Avg, 2);
        assert_eq!(a, [3.5, 1.5]);
    }
}
