//! [`OffloadMemory`]: ZeRO-Offload over any device memory. The model, its
//! gradients, the bucket buffers and the collectives stay on the device;
//! the optimizer's side (the parameter shard, i.e. the master weights, the
//! gradient shard, the optimizer state and the step) lives in host memory.
//!
//! Every buffer is [`Placed`]: on the device or in host memory. The engine
//! asks for the shards through [`HostOffload::alloc_shard`] (host memory
//! once offloading) and for everything else through
//! [`ShardMemory::alloc_zeroed`] (the device), and each operation runs where
//! its operands are, moving what crosses: a bucket reduce-scattered on the
//! device lands in the host's gradient shard ([`HostTransfers::download`]),
//! the host steps it (the engine's own [`FunctionalOptimizer`], on a pool of
//! `threads` threads), and the stepped chunk goes back up
//! ([`ShardMemory::buffer_from_host`]) to be all-gathered and written into
//! the model in its dtype. The engine's bucket-by-bucket schedules stay as
//! they are: each bucket's part lands in host memory as backward fills it;
//! with the interleaved schedule the host steps it at once (on the
//! communication thread, or, on a device without one, on a step thread of
//! the pass: [`HostOffload::host_stepper`], whose buckets go back up as
//! soon as each is stepped, while it steps the rest, a 16-bit model's
//! rounded to its dtype on the host: [`PackedGathers::all_gather_packed`]),
//! otherwise bucket by bucket after backward while earlier buckets are
//! all-gathered. Without offload every buffer is on the device and every
//! call goes straight to the device memory.
//!
//! The logic is the same for any device memory: the CPU tests run it over
//! [`HostMemory`](super::HostMemory) standing in for the device.

mod placed;

pub use placed::Placed;

use super::fetch::{GatherMemory, UnitBucket};
use super::host_buffer::{HostBuffer, HostRegion, Landing};
use super::shard_memory::{host_copy, host_norm, host_scale, HostStepper};
use super::GatherBudgets;
use super::{
    Deferral, GradPiece, HostOffload, HostTransfers, NormType, PackedGathers, ParamCopy,
    ShardMemory, ShardStep, StepPiece,
};
use crate::comm::{Communicator, ReduceOp};
use crate::optim::{FunctionalOptimizer, OptimizerState};
use crate::{DType, Element, Error, Result};
use placed::{all_reduce_placed, collective, host_copy_of, internal, shifted, span, upload};
use std::ops::Range;
use std::time::Duration;

/// Where the host's time went in offloaded steps whose host steps each
/// bucket as it lands (the interleaved schedule on a device), summed over
/// those steps ([`Engine::counters`](super::Engine::counters)):
/// what to look at when an offloaded step is slower than the device's own.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadTimes {
    /// The steps counted.
    pub steps: u64,
    /// The step thread, waiting for buckets' copies into host memory (the
    /// device behind the host).
    pub landing: std::time::Duration,
    /// The step thread, stepping buckets.
    pub stepping: std::time::Duration,
    /// The step thread, rounding a 16-bit model's stepped weights to its
    /// dtype for the write-back (see
    /// [`EngineConfig::gather_in_param_dtype`](super::EngineConfig::gather_in_param_dtype)).
    pub packing: std::time::Duration,
    /// The calling thread, after backward, waiting for the step thread:
    /// for each bucket to write back to be stepped, and at the end.
    pub join: std::time::Duration,
    /// The calling thread, writing the stepped weights back into the model
    /// (queuing the uploads, gathers and copies, and waiting where too many
    /// copies are in flight), its waits for the step thread apart.
    pub write_back: std::time::Duration,
}

/// Stage 3's gathers of an [`OffloadMemory`]: the device's, from the
/// parameter shard on the device, or, offloaded, from the host shard (each
/// bucket's chunk brought up first).
pub struct OffloadGathers<G>(G);

impl<T: Element, G: GatherMemory<T>> GatherMemory<T> for OffloadGathers<G> {
    type Shard = Placed<G::Shard, T>;
    type Buffer = G::Buffer;

    fn queues(&self) -> bool {
        self.0.queues()
    }

    fn default_budgets(&self) -> GatherBudgets {
        self.0.default_budgets()
    }

    fn gather_in(&mut self, dtype: DType) {
        self.0.gather_in(dtype);
    }

    fn element_bytes(&self) -> usize {
        self.0.element_bytes()
    }

    fn shard_len(shard: &Self::Shard) -> usize {
        match shard {
            Placed::Device(shard) => G::shard_len(shard),
            Placed::Host(values) => values.len(),
        }
    }

    fn capacity(buffer: &G::Buffer) -> usize {
        G::capacity(buffer)
    }

    fn buffer(&self, reuse: Option<G::Buffer>, len: usize) -> Result<G::Buffer> {
        self.0.buffer(reuse, len)
    }

    fn gather(
        &self,
        shard: &Self::Shard,
        buckets: &[UnitBucket],
        buffer: &mut G::Buffer,
    ) -> Result<()> {
        match shard {
            Placed::Device(shard) => self.0.gather(shard, buckets, buffer),
            Placed::Host(values) => self.0.gather_from_host(values, buckets, buffer),
        }
    }

    fn ready(&self, buffer: &mut G::Buffer) -> Result<()> {
        self.0.ready(buffer)
    }

    fn read(&self, buffer: &G::Buffer, range: Range<usize>, out: &mut [T]) -> Result<()> {
        self.0.read(buffer, range, out)
    }

    fn bytes_sent(&self) -> u64 {
        self.0.bytes_sent()
    }
}

/// Device memory `D` whose optimizer side can be offloaded to host memory
/// (see the module documentation; the engine turns it on with
/// `EngineConfig::offload`).
pub struct OffloadMemory<D> {
    device: D,
    /// Whether the shards, the optimizer state and the step are in host
    /// memory.
    offload: bool,
    /// Whether the offloaded shards are page-locked.
    pin_memory: bool,
    /// Steps the host shard on the offload's threads.
    stepper: HostStepper,
}

impl OffloadTimes {
    /// Adds one step's times: waiting for landings, stepping, packing, and
    /// the calling thread's wait for the step thread.
    pub(crate) fn add_step(&mut self, [landing, stepping, packing, join]: [Duration; 4]) {
        self.steps += 1;
        self.landing += landing;
        self.stepping += stepping;
        self.packing += packing;
        self.join += join;
    }
}

impl<D: std::fmt::Debug> std::fmt::Debug for OffloadMemory<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadMemory")
            .field("device", &self.device)
            .field("offload", &self.offload)
            .field("stepper", &self.stepper)
            .finish()
    }
}

impl<D> OffloadMemory<D> {
    /// Lands the device's queued transfers ([`HostTransfers::land`]) where
    /// any of `buffers` is in host memory, before it is read or written.
    fn land_for<T: Element, C: Communicator>(
        &mut self,
        buffers: &[&Placed<D::Buffer, T>],
    ) -> Result<()>
    where
        D: HostTransfers<T, C>,
    {
        if buffers.iter().any(|b| matches!(b, Placed::Host(_))) {
            self.device.land()
        } else {
            Ok(())
        }
    }

    /// `device`, with nothing offloaded until the engine asks.
    pub fn new(device: D) -> Self {
        Self {
            device,
            offload: false,
            pin_memory: false,
            stepper: HostStepper::default(),
        }
    }

    /// The device memory.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// Whether the optimizer's side is in host memory.
    pub fn is_offloading(&self) -> bool {
        self.offload
    }
}

impl<T: Element, C: Communicator, D: HostTransfers<T, C>> ShardMemory<T, C> for OffloadMemory<D> {
    type Buffer = Placed<D::Buffer, T>;
    type Gathers = OffloadGathers<D::Gathers>;
    type Grad<'g>
        = D::Grad<'g>
    where
        Self: 'g;
    type Params<'p>
        = D::Params<'p>
    where
        Self: 'p;

    fn grad_len(grad: &Self::Grad<'_>) -> usize {
        D::grad_len(grad)
    }

    fn alloc_zeroed(&mut self, numel: usize) -> Result<Self::Buffer> {
        Ok(Placed::Device(self.device.alloc_zeroed(numel)?))
    }

    fn buffer_len(buffer: &Self::Buffer) -> usize {
        match buffer {
            Placed::Device(b) => D::buffer_len(b),
            Placed::Host(v) => v.len(),
        }
    }

    fn gathers(&self, comm: C) -> Result<OffloadGathers<D::Gathers>> {
        Ok(OffloadGathers(self.device.gathers(comm)?))
    }

    fn zero(&mut self, buffer: &mut Self::Buffer, range: Range<usize>) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        match buffer {
            Placed::Device(b) => self.device.zero(b, range),
            Placed::Host(values) => {
                values[range].fill(T::default());
                Ok(())
            }
        }
    }

    fn flatten(
        &mut self,
        buffer: &mut Self::Buffer,
        pieces: &[GradPiece<Self::Grad<'_>>],
        add: bool,
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        let values = match buffer {
            Placed::Device(b) => return self.device.flatten(b, pieces, add),
            Placed::Host(values) => values,
        };
        // Gradients are on the device: flatten them there, then bring the
        // pieces (not the gaps between them) down.
        let span = span(pieces.iter().map(|p| (p.at, p.range.len())));
        let mut staged = self.device.alloc_zeroed(span.len())?;
        let moved: Vec<_> = pieces
            .iter()
            .map(|p| GradPiece {
                at: p.at - span.start,
                ..p.clone()
            })
            .collect();
        self.device.flatten(&mut staged, &moved, false)?;
        let mut down = vec![T::default(); span.len()];
        self.device.download(&staged, 0..span.len(), &mut down)?;
        for p in &moved {
            let n = p.range.len();
            host_copy(
                &mut values[span.start + p.at..][..n],
                &down[p.at..p.at + n],
                add,
            );
        }
        Ok(())
    }

    fn copy_range(
        &mut self,
        dst: &mut Self::Buffer,
        dst_at: usize,
        src: &Self::Buffer,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()> {
        let n = src_range.len();
        if let (Placed::Device(d), Placed::Host(s)) = (&mut *dst, src) {
            if s.is_pinned() {
                // Only a queued copy reads the host memory, after every copy
                // queued before it: no landing first, and no wait for the
                // device (the write-back of a stepped shard, bucket by
                // bucket).
                let staged = upload(&mut self.device, s, src_range)?;
                return self.device.copy_range(d, dst_at, &staged, 0..n, add);
            }
        }
        self.land_for::<T, C>(&[&*dst, src])?;
        match (dst, src) {
            (Placed::Device(d), Placed::Device(s)) => {
                self.device.copy_range(d, dst_at, s, src_range, add)
            }
            (Placed::Host(d), Placed::Host(s)) => {
                host_copy(d.range_mut(dst_at..dst_at + n), s.range(src_range), add);
                Ok(())
            }
            (Placed::Host(d), Placed::Device(s)) => {
                let mut down = vec![T::default(); n];
                self.device.download(s, src_range, &mut down)?;
                host_copy(d.range_mut(dst_at..dst_at + n), &down, add);
                Ok(())
            }
            (Placed::Device(d), Placed::Host(s)) if !add => {
                self.device.buffer_from_host(d, dst_at, s.range(src_range))
            }
            (Placed::Device(d), Placed::Host(s)) => {
                let mut staged = self.device.alloc_zeroed(n)?;
                self.device
                    .buffer_from_host(&mut staged, 0, s.range(src_range))?;
                self.device.copy_range(d, dst_at, &staged, 0..n, true)
            }
        }
    }

    fn fork(&self) -> Option<Self> {
        self.device.fork().map(|device| Self {
            device,
            offload: self.offload,
            pin_memory: self.pin_memory,
            stepper: self.stepper.clone(),
        })
    }

    fn deferral(&mut self) -> Option<&mut dyn Deferral<C>> {
        self.device.deferral()
    }

    fn narrows_wire(&self) -> bool {
        self.device.narrows_wire()
    }

    fn packed_gathers(&mut self) -> Option<&mut dyn PackedGathers<C, Self::Buffer>> {
        match self.device.packed_gathers() {
            Some(_) => Some(self),
            None => None,
        }
    }

    fn host_offload(&mut self) -> Option<&mut dyn HostOffload<C, Self::Buffer>> {
        Some(self)
    }

    fn read_params(
        &mut self,
        params: &mut Self::Params<'_>,
        copies: &[ParamCopy],
        buffer: &mut Self::Buffer,
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        let values = match buffer {
            Placed::Device(b) => return self.device.read_params(params, copies, b),
            Placed::Host(values) => values,
        };
        let span = span(copies.iter().map(|c| (c.at, c.param_range.len())));
        let moved = shifted(copies, span.start);
        let mut staged = self.device.alloc_zeroed(span.len())?;
        self.device.read_params(params, &moved, &mut staged)?;
        let mut down = vec![T::default(); span.len()];
        self.device.download(&staged, 0..span.len(), &mut down)?;
        for c in &moved {
            let n = c.param_range.len();
            values[span.start + c.at..][..n].copy_from_slice(&down[c.at..c.at + n]);
        }
        Ok(())
    }

    fn write_params(
        &mut self,
        params: &mut Self::Params<'_>,
        copies: &[ParamCopy],
        buffer: &Self::Buffer,
    ) -> Result<()> {
        self.land_for::<T, C>(&[buffer])?;
        let values = match buffer {
            Placed::Device(b) => return self.device.write_params(params, copies, b),
            Placed::Host(values) => values,
        };
        let span = span(copies.iter().map(|c| (c.at, c.param_range.len())));
        let staged = upload(&mut self.device, values, span.clone())?;
        self.device
            .write_params(params, &shifted(copies, span.start), &staged)
    }

    fn scale(
        &mut self,
        buffer: &mut Self::Buffer,
        ranges: &[Range<usize>],
        factor: f64,
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        match buffer {
            Placed::Device(b) => self.device.scale(b, ranges, factor),
            Placed::Host(values) => {
                host_scale(values, ranges, factor);
                Ok(())
            }
        }
    }

    fn norm_partial(
        &mut self,
        comm: &C,
        buffer: &Self::Buffer,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64> {
        self.land_for::<T, C>(&[buffer])?;
        match buffer {
            Placed::Device(b) => self.device.norm_partial(comm, b, ranges, norm),
            Placed::Host(values) => Ok(host_norm(values, ranges, norm)),
        }
    }

    // The plain collectives are the `_as` ones with the values in `T` on
    // the wire, which every memory treats as no rounding. A reduce-scatter
    // or all-gather does not land first: it touches a host buffer only
    // through copies on the device's queue, behind the copies already
    // queued there (a page-locked buffer), or with the synchronous copies
    // of a pageable one, which nothing queues for.
    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut Self::Buffer,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        self.all_reduce_as(comm, buffer, range, op, T::DTYPE)
    }

    fn reduce_scatter(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_as(comm, send, send_range, recv, recv_range, op, T::DTYPE)
    }

    fn all_gather(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
    ) -> Result<()> {
        self.all_gather_as(comm, send, send_range, recv, recv_range, T::DTYPE)
    }

    fn all_reduce_as(
        &mut self,
        comm: &C,
        buffer: &mut Self::Buffer,
        range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        all_reduce_placed(&mut self.device, buffer, range, |d, b, r| {
            d.all_reduce_as(comm, b, r, op, wire)
        })
    }

    fn reduce_scatter_as(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        collective(
            &mut self.device,
            send,
            send_range,
            recv,
            recv_range,
            |d, s, sr, r, rr| d.reduce_scatter_as(comm, s, sr, r, rr, op, wire),
        )
    }

    fn all_gather_as(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        send_range: Range<usize>,
        recv: &mut Self::Buffer,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        collective(
            &mut self.device,
            send,
            send_range,
            recv,
            recv_range,
            |d, s, sr, r, rr| d.all_gather_as(comm, s, sr, r, rr, wire),
        )
    }

    fn buffer_to_host(
        &mut self,
        comm: &C,
        buffer: &Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        self.land_for::<T, C>(&[buffer])?;
        match buffer {
            Placed::Device(b) => self.device.buffer_to_host(comm, b, range, out),
            Placed::Host(values) => {
                out.copy_from_slice(&values[range]);
                Ok(())
            }
        }
    }

    fn buffer_from_host(
        &mut self,
        buffer: &mut Self::Buffer,
        at: usize,
        values: &[T],
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*buffer])?;
        match buffer {
            Placed::Device(b) => self.device.buffer_from_host(b, at, values),
            Placed::Host(held) => {
                held[at..at + values.len()].copy_from_slice(values);
                Ok(())
            }
        }
    }

    fn all_reduce_host<V: Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()> {
        self.device.all_reduce_host(comm, values, op)
    }

    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.device
            .gather_varlen_host(comm, send, counts, recv, root)
    }

    /// Offloading: the host steps, with the engine's optimizer (which keeps
    /// the state), on the offload's threads; a buffer on the device (a
    /// stage's staging chunk) is brought down and its stepped values sent
    /// back up. Otherwise the device steps.
    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut Self::Buffer,
        grads: &Self::Buffer,
        plan: ShardStep<'_>,
    ) -> Result<()> {
        self.land_for::<T, C>(&[&*params, grads])?;
        if !self.offload {
            return match (params, grads) {
                (Placed::Device(p), Placed::Device(g)) => self.device.step(optimizer, p, g, plan),
                _ => Err(internal("a host buffer without offload")),
            };
        }
        let grads_down = host_copy_of(&mut self.device, grads)?;
        let params_down = host_copy_of(&mut self.device, params)?;
        let grads = match (&grads_down, grads) {
            (Some(down), _) => down.as_slice(),
            (None, Placed::Host(values)) => &values[..],
            (None, Placed::Device(_)) => return Err(internal("device gradients not brought down")),
        };
        let mut params_down = params_down;
        {
            let values = match (&mut params_down, &mut *params) {
                (Some(down), _) => down.as_mut_slice(),
                (None, Placed::Host(values)) => &mut values[..],
                (None, Placed::Device(_)) => {
                    return Err(internal("device parameters not brought down"))
                }
            };
            self.stepper.step(optimizer, values, grads, plan)?;
        }
        if let (Some(down), Placed::Device(p)) = (params_down, params) {
            self.device.buffer_from_host(p, 0, &down)?;
        }
        Ok(())
    }

    fn export_state(
        &mut self,
        comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<T>> {
        if self.offload {
            Ok(optimizer.export_state())
        } else {
            self.device.export_state(comm, optimizer, pieces)
        }
    }

    fn export_state_into(
        &mut self,
        comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
        out: &mut OptimizerState<T>,
    ) -> Result<()> {
        if self.offload {
            optimizer.export_state_into(out);
            Ok(())
        } else {
            self.device.export_state_into(comm, optimizer, pieces, out)
        }
    }

    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
        state: OptimizerState<T>,
    ) -> Result<()> {
        if self.offload {
            optimizer.import_state(state)
        } else {
            self.device.import_state(optimizer, pieces, state)
        }
    }

    fn check_optimizer(&self, optimizer: &dyn FunctionalOptimizer<T>) -> Result<()> {
        self.device.check_optimizer(optimizer)
    }

    fn state_bytes(&self, optimizer: &dyn FunctionalOptimizer<T>) -> usize {
        if self.offload {
            optimizer.state_bytes()
        } else {
            self.device.state_bytes(optimizer)
        }
    }

    fn read_param_host(
        &mut self,
        comm: &C,
        params: &mut Self::Params<'_>,
        param: usize,
        out: &mut [T],
    ) -> Result<()> {
        self.device.read_param_host(comm, params, param, out)
    }

    fn write_param_host(
        &mut self,
        params: &mut Self::Params<'_>,
        param: usize,
        values: &[T],
    ) -> Result<()> {
        self.device.write_param_host(params, param, values)
    }

    fn host_region(buffer: &mut Self::Buffer) -> Option<HostRegion<T>> {
        match buffer {
            Placed::Host(values) => Some(values.region()),
            Placed::Device(_) => None,
        }
    }

    fn offloaded(buffer: &Self::Buffer) -> bool {
        matches!(buffer, Placed::Host(_))
    }

    fn staging_bytes(&self) -> usize {
        self.device.staging_bytes()
    }
}

impl<T: Element, C: Communicator, D: HostTransfers<T, C>> PackedGathers<C, Placed<D::Buffer, T>>
    for OffloadMemory<D>
{
    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &Placed<D::Buffer, T>,
        n: usize,
        recv: &mut Placed<D::Buffer, T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        let packed = 0..super::packed_len::<T>(n).min(Self::buffer_len(send));
        collective(
            &mut self.device,
            send,
            packed,
            recv,
            recv_range,
            |d, s, sr, r, rr| match sr.start {
                0 => d
                    .packed_gathers()
                    .ok_or_else(|| internal("a packed gather on a device without them"))?
                    .all_gather_packed(comm, s, n, r, rr, wire),
                _ => Err(internal("a packed chunk not at its buffer's start")),
            },
        )
    }
}

impl<T: Element, C: Communicator, D: HostTransfers<T, C>> HostOffload<C, Placed<D::Buffer, T>>
    for OffloadMemory<D>
{
    fn offload_optimizer(&mut self, threads: usize, pin_memory: bool) -> Result<()> {
        self.stepper = HostStepper::new(threads)?;
        self.offload = true;
        self.pin_memory = pin_memory;
        Ok(())
    }

    fn copy_stream(&mut self) -> Result<()> {
        self.device.copy_stream()
    }

    /// Offloading on a device with no communication thread (the GPU's):
    /// the host steps each bucket on a thread of its own as it lands.
    fn host_stepper(&self) -> Option<HostStepper> {
        (self.offload && self.device.fork().is_none()).then(|| self.stepper.clone())
    }

    fn alloc_shard(&mut self, numel: usize) -> Result<Placed<D::Buffer, T>> {
        if self.offload {
            let host = if self.pin_memory && numel > 0 {
                HostBuffer::pinned(numel, |pages| self.device.pin_host(pages))?
            } else {
                HostBuffer::pageable(numel)
            };
            Ok(Placed::Host(host))
        } else {
            Ok(Placed::Device(self.device.alloc_zeroed(numel)?))
        }
    }

    fn landing(&mut self) -> Result<Option<Landing>> {
        self.device.landing()
    }
}

/// Bytes of host memory available to this process now (Linux:
/// `MemAvailable`), or `None` where unknown.
pub fn host_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Fails when `needed` bytes of host memory are more than `available`.
pub(super) fn check_host_room(needed: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(available) if needed > available => Err(Error::Config(format!(
            "offload keeps this rank's shard, its gradients and the optimizer state in host \
             memory: about {:.2} GiB, but the host has {:.2} GiB available; free host memory, \
             use more ranks (each keeps 1/N), or train without offload",
            needed as f64 / (1u64 << 30) as f64,
            available as f64 / (1u64 << 30) as f64
        ))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_too_small_is_refused_with_both_sizes() {
        let gib = 1u64 << 30;
        let err = check_host_room(6 * gib, Some(4 * gib))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("6.00 GiB") && err.contains("4.00 GiB"),
            "{err}"
        );
        assert!(check_host_room(3 * gib, Some(4 * gib)).is_ok());
        assert!(check_host_room(u64::MAX, None).is_ok());
    }
}
