//! [`HostMemory`]: the engine's buffers as `Vec<T>` in host memory, and
//! the host loops (copy, scale, norm, step) other memories reuse.

use super::narrow::{
    all_reduce_narrow, gather_narrow, gather_packed, packed_len, reduce_scatter_narrow,
};
use super::{
    host_step, GradPiece, HostGrad, HostTransfers, PackedGathers, ParamCopy, ParamStore,
    ShardMemory, ShardStep, StepPiece,
};
use crate::comm::{Communicator, Host, ReduceOp};
use crate::dtype::convert_slice;
use crate::engine::fetch::HostGathers;
use crate::engine::NormType;
use crate::optim::{FunctionalOptimizer, OptimizerState};
use crate::{DType, Element, Error, Result};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Arc;

/// Adds (or copies) `src`, converted to `T`, into `dst`: for a 16-bit
/// `src`, the values a widened copy of it would give, bit for bit.
fn flatten_into<T: Element, S: Element>(dst: &mut [T], src: &[S], add: bool) {
    if !add {
        return convert_slice(src, dst);
    }
    // Widened a stretch at a time (the fast conversions), then added.
    let mut wide = [T::default(); 1024];
    for (d, s) in dst.chunks_mut(wide.len()).zip(src.chunks(wide.len())) {
        let wide = &mut wide[..s.len().min(d.len())];
        convert_slice(s, wide);
        for (d, w) in d.iter_mut().zip(wide.iter()) {
            *d = T::from_acc(d.to_acc() + w.to_acc());
        }
    }
}

/// Host memory: buffers are `Vec<T>`, gradients [`HostGrad`]s, parameters
/// a [`ParamStore`], and the optimizer a [`FunctionalOptimizer`] that
/// keeps its own state.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostMemory;

impl<T: Element, C: Communicator<Memory = Host>> ShardMemory<T, C> for HostMemory {
    type Buffer = Vec<T>;
    type Gathers = HostGathers<T>;
    type Grad<'g> = HostGrad<'g, T>;
    type Params<'p> = dyn ParamStore<T> + 'p;

    fn grad_len(grad: &HostGrad<'_, T>) -> usize {
        grad.len()
    }

    fn alloc_zeroed(&mut self, numel: usize) -> Result<Vec<T>> {
        Ok(vec![T::default(); numel])
    }

    fn buffer_len(buffer: &Vec<T>) -> usize {
        buffer.len()
    }

    fn gathers(&self, comm: C) -> Result<HostGathers<T>> {
        Ok(host_gathers(comm))
    }

    fn zero(&mut self, buffer: &mut Vec<T>, range: Range<usize>) -> Result<()> {
        buffer[range].fill(T::default());
        Ok(())
    }

    fn flatten(
        &mut self,
        buffer: &mut Vec<T>,
        pieces: &[GradPiece<HostGrad<'_, T>>],
        add: bool,
    ) -> Result<()> {
        for piece in pieces {
            let dst = &mut buffer[piece.at..piece.at + piece.range.len()];
            let range = piece.range.clone();
            match piece.grad {
                HostGrad::Same(g) if !add => dst.copy_from_slice(&g[range]),
                HostGrad::Same(g) => flatten_into(dst, &g[range], true),
                HostGrad::Bf16(g) => flatten_into(dst, &g[range], add),
                HostGrad::F16(g) => flatten_into(dst, &g[range], add),
            }
        }
        Ok(())
    }

    fn copy_range(
        &mut self,
        dst: &mut Vec<T>,
        dst_at: usize,
        src: &Vec<T>,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()> {
        host_copy(
            &mut dst[dst_at..dst_at + src_range.len()],
            &src[src_range],
            add,
        );
        Ok(())
    }

    fn fork(&self) -> Option<Self> {
        Some(HostMemory)
    }

    fn narrows_wire(&self) -> bool {
        true
    }

    fn packed_gathers(&mut self) -> Option<&mut dyn PackedGathers<C, Vec<T>>> {
        Some(self)
    }

    fn read_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &mut Vec<T>,
    ) -> Result<()> {
        for c in copies {
            params.read(
                c.param,
                c.param_range.clone(),
                &mut buffer[c.at..c.at + c.param_range.len()],
            )?;
        }
        Ok(())
    }

    fn write_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &Vec<T>,
    ) -> Result<()> {
        for c in copies {
            params.write(
                c.param,
                c.param_range.clone(),
                &buffer[c.at..c.at + c.param_range.len()],
            )?;
        }
        Ok(())
    }

    fn scale(&mut self, buffer: &mut Vec<T>, ranges: &[Range<usize>], factor: f64) -> Result<()> {
        host_scale(buffer, ranges, factor);
        Ok(())
    }

    fn norm_partial(
        &mut self,
        _comm: &C,
        buffer: &Vec<T>,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64> {
        Ok(host_norm(buffer, ranges, norm))
    }

    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        comm.all_reduce(&mut buffer[range], op)
    }

    fn reduce_scatter(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        comm.reduce_scatter(&send[send_range], &mut recv[recv_range], op)
    }

    fn all_gather(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        comm.all_gather(&send[send_range], &mut recv[recv_range])
    }

    fn all_reduce_as(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        let buffer = &mut buffer[range];
        match wire {
            _ if wire == T::DTYPE => comm.all_reduce(buffer, op),
            DType::BF16 => all_reduce_narrow::<T, bf16, C>(comm, buffer, op),
            DType::F16 => all_reduce_narrow::<T, f16, C>(comm, buffer, op),
            _ => comm.all_reduce(buffer, op),
        }
    }

    fn reduce_scatter_as(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        let (send, recv) = (&send[send_range], &mut recv[recv_range]);
        match wire {
            _ if wire == T::DTYPE => comm.reduce_scatter(send, recv, op),
            DType::BF16 => reduce_scatter_narrow::<T, bf16, C>(comm, send, recv, op),
            DType::F16 => reduce_scatter_narrow::<T, f16, C>(comm, send, recv, op),
            _ => comm.reduce_scatter(send, recv, op),
        }
    }

    fn all_gather_as(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        let (send, recv) = (&send[send_range], &mut recv[recv_range]);
        match wire {
            _ if wire == T::DTYPE => comm.all_gather(send, recv),
            DType::BF16 => gather_narrow::<T, bf16, C>(comm, send, recv),
            DType::F16 => gather_narrow::<T, f16, C>(comm, send, recv),
            // Never narrower than `T`: nothing to gain.
            DType::F32 | DType::F64 => comm.all_gather(send, recv),
        }
    }

    fn buffer_to_host(
        &mut self,
        _comm: &C,
        buffer: &Vec<T>,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        out.copy_from_slice(&buffer[range]);
        Ok(())
    }

    fn buffer_from_host(&mut self, buffer: &mut Vec<T>, at: usize, values: &[T]) -> Result<()> {
        buffer[at..at + values.len()].copy_from_slice(values);
        Ok(())
    }

    fn all_reduce_host<V: Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()> {
        comm.all_reduce(values, op)
    }

    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        comm.gather_varlen(send, counts, recv, root)
    }

    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut Vec<T>,
        grads: &Vec<T>,
        plan: ShardStep<'_>,
    ) -> Result<()> {
        host_step(optimizer, params, grads, plan)
    }

    fn export_state(
        &mut self,
        _comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        _pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<T>> {
        Ok(optimizer.export_state())
    }

    fn export_state_into(
        &mut self,
        _comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        _pieces: &[StepPiece<'_>],
        out: &mut OptimizerState<T>,
    ) -> Result<()> {
        optimizer.export_state_into(out);
        Ok(())
    }

    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        _pieces: &[StepPiece<'_>],
        state: OptimizerState<T>,
    ) -> Result<()> {
        optimizer.import_state(state)
    }

    fn state_bytes(&self, optimizer: &dyn FunctionalOptimizer<T>) -> usize {
        optimizer.state_bytes()
    }

    fn read_param_host(
        &mut self,
        _comm: &C,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        out: &mut [T],
    ) -> Result<()> {
        let len = out.len();
        params.read(param, 0..len, out)
    }

    fn write_param_host(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        values: &[T],
    ) -> Result<()> {
        params.write(param, 0..values.len(), values)
    }
}

impl<T: Element, C: Communicator<Memory = Host>> PackedGathers<C, Vec<T>> for HostMemory {
    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        n: usize,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        if packed_len::<T>(n) > send.len() {
            return Err(Error::BufferSize {
                op: "all_gather_packed",
                what: "packed chunk",
                got: send.len(),
                expected: packed_len::<T>(n),
            });
        }
        let recv = &mut recv[recv_range];
        match wire {
            DType::BF16 => gather_packed::<T, bf16, C>(comm, send, n, recv),
            DType::F16 => gather_packed::<T, f16, C>(comm, send, n, recv),
            other => Err(Error::State(format!(
                "internal: a packed gather in {other:?}, not a 16-bit dtype"
            ))),
        }
    }
}

/// The identity transfer: host memory is already where the host reads, so
/// [`OffloadMemory`](crate::engine::OffloadMemory) over it (the tests')
/// copies in order.
impl<T: Element, C: Communicator<Memory = Host>> HostTransfers<T, C> for HostMemory {
    fn download(&mut self, buffer: &Vec<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        out.copy_from_slice(&buffer[range]);
        Ok(())
    }
}

/// Stage 3's gathers on host memory over `comm`.
pub fn host_gathers<T: Element, C: Communicator<Memory = Host>>(comm: C) -> HostGathers<T> {
    let comm = Arc::new(comm);
    let (counted, bf16s, f16s) = (Arc::clone(&comm), Arc::clone(&comm), Arc::clone(&comm));
    HostGathers::new(Arc::new(move |send: &[T], recv: &mut [T]| {
        comm.all_gather(send, recv)
    }))
    .counting(Arc::new(move || counted.bytes_sent()))
    .narrowing(
        Arc::new(move |send: &[half::bf16], recv: &mut [half::bf16]| bf16s.all_gather(send, recv)),
        Arc::new(move |send: &[half::f16], recv: &mut [half::f16]| f16s.all_gather(send, recv)),
    )
}

/// Adds (`add`) or copies `src` into `dst`, in host memory.
pub(crate) fn host_copy<T: Element>(dst: &mut [T], src: &[T], add: bool) {
    if add {
        let n = dst.len().min(src.len());
        elementwise(&mut dst[..n], |d, at| {
            for (d, s) in d.iter_mut().zip(&src[at..]) {
                *d = T::from_acc(d.to_acc() + s.to_acc());
            }
        });
    } else {
        dst.copy_from_slice(src);
    }
}

/// Multiplies `buffer[range]` by `factor` for every range, in host memory.
pub(crate) fn host_scale<T: Element>(buffer: &mut [T], ranges: &[Range<usize>], factor: f64) {
    for range in ranges {
        elementwise(&mut buffer[range.clone()], |g, _| {
            for g in g {
                *g = T::from_f64(g.to_f64() * factor);
            }
        });
    }
}

/// Elements one task of [`elementwise`] takes.
const ELEMENTWISE_CHUNK: usize = 64 << 10;

/// Runs `work(chunk, offset)` over `values` in chunks, split across
/// rayon's threads when there is more than one chunk: for operations whose
/// elements are independent (the result is the same however it is split).
fn elementwise<T: Send>(values: &mut [T], work: impl Fn(&mut [T], usize) + Sync) {
    use rayon::prelude::*;
    if values.len() <= ELEMENTWISE_CHUNK {
        return work(values, 0);
    }
    values
        .par_chunks_mut(ELEMENTWISE_CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| work(chunk, i * ELEMENTWISE_CHUNK));
}

/// This rank's part of a norm over `buffer[range]` for every range (see
/// [`ShardMemory::norm_partial`]), in host memory. A long range is taken
/// in chunks of [`ELEMENTWISE_CHUNK`] across rayon's threads, their parts
/// combined in order: the same value however many threads there are.
pub(crate) fn host_norm<T: Element>(buffer: &[T], ranges: &[Range<usize>], norm: NormType) -> f64 {
    use rayon::prelude::*;
    let part = |g: &[T]| -> f64 {
        match norm {
            NormType::L1 => g.iter().map(|x| x.to_f64().abs()).sum::<f64>(),
            NormType::L2 => g.iter().map(|x| x.to_f64().powi(2)).sum::<f64>(),
            // `f64::max` would drop a NaN: count it as infinite instead.
            NormType::Inf => g.iter().fold(0.0, |m: f64, x| {
                let a = x.to_f64().abs();
                if a.is_nan() {
                    f64::INFINITY
                } else {
                    m.max(a)
                }
            }),
        }
    };
    let mut local = 0.0f64;
    for range in ranges {
        let g = &buffer[range.clone()];
        let parts: Vec<f64> = if g.len() > ELEMENTWISE_CHUNK {
            g.par_chunks(ELEMENTWISE_CHUNK).map(part).collect()
        } else {
            vec![part(g)]
        };
        for p in parts {
            local = match norm {
                NormType::Inf => local.max(p),
                NormType::L1 | NormType::L2 => local + p,
            };
        }
    }
    local
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_norm_is_the_same_on_any_number_of_threads() {
        let n = 5 * ELEMENTWISE_CHUNK + 3;
        let mut values: Vec<f32> = (0..n)
            .map(|i| ((i * 37) % 1009) as f32 * 1e-3 - 0.4)
            .collect();
        let within = 1..n - 1;
        let ranges = std::slice::from_ref(&within);
        let on = |threads: usize, values: &[f32], norm: NormType| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
                .install(|| host_norm(values, ranges, norm))
        };
        for norm in [NormType::L1, NormType::L2, NormType::Inf] {
            let one = on(1, &values, norm);
            assert_eq!(one.to_bits(), on(3, &values, norm).to_bits(), "{norm:?}");
            let g = &values[within.clone()];
            let sequential = match norm {
                NormType::L1 => g.iter().map(|x| (*x as f64).abs()).sum::<f64>(),
                NormType::L2 => g.iter().map(|x| (*x as f64).powi(2)).sum::<f64>(),
                NormType::Inf => g.iter().map(|x| (*x as f64).abs()).fold(0.0, f64::max),
            };
            assert!((one - sequential).abs() <= 1e-12 * sequential, "{norm:?}");
        }
        // A NaN in a later chunk makes the infinity norm infinite.
        values[4 * ELEMENTWISE_CHUNK + 9] = f32::NAN;
        assert_eq!(on(2, &values, NormType::Inf), f64::INFINITY);
    }

    #[test]
    fn a_long_scale_or_sum_split_across_threads_is_the_element_by_element_one() {
        let n = 3 * ELEMENTWISE_CHUNK + 17;
        let values: Vec<f32> = (0..n).map(|i| (i % 1013) as f32 * 0.37 - 91.0).collect();
        let other: Vec<f32> = (0..n).map(|i| (i % 641) as f32 * -1.3 + 7.0).collect();

        let mut scaled = values.clone();
        // Two ranges, one of them short, and the elements between untouched.
        let ranges = [5..n - 3, 0..2];
        host_scale(&mut scaled, &ranges, 0.1);
        for (i, (got, v)) in scaled.iter().zip(&values).enumerate() {
            let want = if ranges.iter().any(|r| r.contains(&i)) {
                (*v as f64 * 0.1) as f32
            } else {
                *v
            };
            assert_eq!(got.to_bits(), want.to_bits(), "element {i}");
        }

        let mut summed = values.clone();
        host_copy(&mut summed, &other, true);
        for (i, ((got, v), o)) in summed.iter().zip(&values).zip(&other).enumerate() {
            assert_eq!(got.to_bits(), (v + o).to_bits(), "element {i}");
        }
        // A shorter source adds into the first elements only.
        let mut partly = values.clone();
        host_copy(&mut partly, &other[..n - 5], true);
        assert_eq!(partly[n - 5..], values[n - 5..]);
        assert_eq!(partly[n - 6], values[n - 6] + other[n - 6]);
    }
}
