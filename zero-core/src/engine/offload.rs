//! [`OffloadMemory`]: ZeRO-Offload over any device memory. The model, its
//! gradients, the bucket buffers and the collectives stay on the device;
//! the optimizer's side (the parameter shard, i.e. the master weights, the
//! gradient shard, the optimizer state and the step) lives in host memory.
//!
//! Every buffer is [`Placed`]: on the device or in host memory. The engine
//! asks for the shards through [`ShardMemory::alloc_shard`] (host memory
//! once offloading) and for everything else through
//! [`ShardMemory::alloc_zeroed`] (the device), and each operation runs where
//! its operands are, moving what crosses: a bucket reduce-scattered on the
//! device lands in the host's gradient shard ([`ShardMemory::download`]),
//! the host steps it (the engine's own [`FunctionalOptimizer`], on a pool of
//! `threads` threads), and the stepped chunk goes back up
//! ([`ShardMemory::buffer_from_host`]) to be all-gathered and written into
//! the model in its dtype. The engine's bucket-by-bucket schedules stay as
//! they are: each bucket's part lands in host memory as backward fills it;
//! with the interleaved schedule the host steps it at once (on the
//! communication thread, or, on a device without one, on a step thread of
//! the pass: [`ShardMemory::host_stepper`], whose buckets go back up as
//! soon as each is stepped, while it steps the rest, a 16-bit model's
//! rounded to its dtype on the host: [`ShardMemory::all_gather_packed`]),
//! otherwise bucket by bucket after backward while earlier buckets are
//! all-gathered. Without offload every buffer is on the device and every
//! call goes straight to the device memory.
//!
//! The logic is the same for any device memory: the CPU tests run it over
//! [`HostMemory`](super::HostMemory) standing in for the device.

use super::fetch::{GatherMemory, UnitBucket};
use super::shard_memory::{host_copy, host_norm, host_scale, host_step};
use super::{GradPiece, NormType, ParamCopy, ShardMemory, ShardStep, StepPiece};
use crate::comm::{Communicator, ReduceOp};
use crate::optim::{FunctionalOptimizer, OptimizerState};
use crate::{DType, Element, Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// A buffer of [`OffloadMemory`]: in device memory `B`, or offloaded to
/// host memory.
#[derive(Debug)]
pub enum Placed<B, T> {
    /// On the device.
    Device(B),
    /// Offloaded to host memory.
    Host(HostBuffer<T>),
}

/// What keeps host memory page-locked (see [`ShardMemory::pin_host`]).
pub trait HostLock: Send + Sync {
    /// Unlocks the memory once no queued copy reads or writes it any more;
    /// `false` when one still may (it did not land within the device's
    /// deadline): then the memory stays locked and must not be freed.
    fn unlock(self: Box<Self>) -> bool;
}

/// A [`HostLock`] held by a buffer.
pub type HostPin = Box<dyn HostLock>;

/// Waits, within the device's deadline, for the transfers queued before it
/// was taken (see [`ShardMemory::landing`]) and none queued later.
pub type Landing = Box<dyn FnOnce() -> Result<()> + Send>;

/// Where the host's time went in offloaded steps whose host steps each
/// bucket as it lands (the interleaved schedule on a device), summed over
/// those steps ([`Engine::offload_times`](super::Engine::offload_times)):
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

/// An offloaded buffer in host memory, page-locked where the device memory
/// can (its transfers then run at the link's speed, without staging). Its
/// length is fixed: the locked range must not move.
pub struct HostBuffer<T> {
    /// Unlocked before the values are freed (see the `Drop`).
    pin: Option<HostPin>,
    values: Vec<T>,
    /// The buffer's elements within `values`.
    range: Range<usize>,
}

/// What a page-locked buffer is aligned to and padded to: whole pages of
/// its own (two buffers never lock the same page), on any page size up to
/// this.
const PIN_ALIGN: usize = 64 << 10;

impl<T: Clone + Default> HostBuffer<T> {
    /// `numel` zeros in pageable memory.
    pub fn pageable(numel: usize) -> Self {
        Self {
            pin: None,
            values: vec![T::default(); numel],
            range: 0..numel,
        }
    }

    /// `numel` zeros on pages of their own, locked by `lock` (given the
    /// whole pages; it returns what keeps them locked, `None` where
    /// nothing was locked).
    pub fn pinned(
        numel: usize,
        lock: impl FnOnce(&mut [T]) -> Result<Option<HostPin>>,
    ) -> Result<Self> {
        let size = std::mem::size_of::<T>().max(1);
        let pad = PIN_ALIGN.div_ceil(size);
        let mut values = vec![T::default(); numel + 2 * pad];
        let addr = values.as_ptr() as usize;
        let start = (addr.next_multiple_of(PIN_ALIGN) - addr) / size;
        let locked = (numel * size).next_multiple_of(PIN_ALIGN) / size;
        let pin = lock(&mut values[start..start + locked])?;
        Ok(Self {
            pin,
            values,
            range: start..start + numel,
        })
    }
}

impl<T> HostBuffer<T> {
    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.pin.is_some()
    }

    /// The elements `range`, without borrowing the rest of the buffer: a
    /// [`HostRegion`] of it lent to another thread may be writing other
    /// ranges meanwhile.
    ///
    /// # Panics
    /// If `range` is not within the buffer.
    pub fn range(&self, range: Range<usize>) -> &[T] {
        self.check(&range);
        // `Vec::as_ptr` makes no reference to the whole vector's elements.
        let start = self
            .values
            .as_ptr()
            .wrapping_add(self.range.start + range.start);
        // SAFETY: within `values` (checked above); a region's holder writes
        // only the ranges handed to it (`HostRegion::range_mut`), never one
        // read here.
        unsafe { std::slice::from_raw_parts(start, range.len()) }
    }

    /// The elements `range`, mutably, without borrowing the rest of the
    /// buffer (see [`HostBuffer::range`]).
    ///
    /// # Panics
    /// If `range` is not within the buffer.
    pub fn range_mut(&mut self, range: Range<usize>) -> &mut [T] {
        self.check(&range);
        // `Vec::as_mut_ptr` makes no reference to the whole vector's
        // elements, so the ranges lent through a region stay valid.
        let start = self
            .values
            .as_mut_ptr()
            .wrapping_add(self.range.start + range.start);
        // SAFETY: within `values` (checked above); `&mut self` excludes
        // every other borrow of the buffer, and a region's holder touches
        // only the ranges handed to it (`HostRegion::range_mut`), never
        // this one.
        unsafe { std::slice::from_raw_parts_mut(start, range.len()) }
    }

    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.range.len(),
            "range {range:?} of a host buffer of {}",
            self.range.len()
        );
    }

    /// A [`HostRegion`] over the whole buffer, for another thread to touch
    /// the ranges it is handed while this one goes on with the others.
    pub fn region(&mut self) -> HostRegion<T> {
        HostRegion {
            start: self.values.as_mut_ptr().wrapping_add(self.range.start),
            len: self.range.len(),
        }
    }
}

/// A [`HostBuffer`] lent to another thread for a while: the offload's step
/// thread reads (and averages) each bucket's gradients where they landed,
/// in the host shard, while the calling thread queues the next buckets'
/// copies into other ranges of it. It borrows nothing: whoever makes one
/// keeps the buffer alive and in place while it is used, and hands each
/// range to one thread at a time.
pub struct HostRegion<T> {
    start: *mut T,
    len: usize,
}

// SAFETY: a region is a pointer and a length; the thread it is sent to
// touches only the ranges handed to it, while the buffer is kept alive
// (`HostRegion::range_mut`'s contract), which moves `T`s between threads
// as sending them would.
unsafe impl<T: Send> Send for HostRegion<T> {}

impl<T> HostRegion<T> {
    /// The elements `range` of the buffer.
    ///
    /// # Safety
    /// The buffer is alive and in place, and nothing else reads or writes
    /// `range` while the returned slice lives.
    ///
    /// # Panics
    /// If `range` is not within the buffer.
    pub unsafe fn range_mut(&mut self, range: Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range {range:?} of a host region of {}",
            self.len
        );
        // SAFETY: within the buffer (checked above), alive and touched by
        // nothing else meanwhile (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.start.add(range.start), range.len()) }
    }
}

impl<T> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        let Some(pin) = self.pin.take() else {
            return;
        };
        if !pin.unlock() {
            // A copy the device never finished may still write here: the
            // memory is leaked rather than freed under it.
            let values = std::mem::take(&mut self.values);
            tracing::warn!(
                bytes = values.len() * std::mem::size_of::<T>(),
                "offload: a copy to or from a page-locked host buffer did not land in time; \
                 its memory is kept, not freed"
            );
            std::mem::forget(values);
        }
    }
}

impl<T> std::ops::Deref for HostBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.values[self.range.clone()]
    }
}

impl<T> std::ops::DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.values[self.range.clone()]
    }
}

impl<T> std::fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("len", &self.range.len())
            .field("pinned", &self.is_pinned())
            .finish()
    }
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

/// The host step of an offloading memory, usable from any thread: the
/// engine's [`FunctionalOptimizer`] over host slices, on the offload's
/// threads (rayon's global pool without).
#[derive(Clone, Debug, Default)]
pub struct HostStepper {
    pool: Option<Arc<rayon::ThreadPool>>,
}

impl HostStepper {
    /// Steps the active pieces of `plan` (ranges of `params` and `grads`).
    pub(super) fn step<T: Element>(
        &self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut [T],
        grads: &[T],
        plan: ShardStep<'_>,
    ) -> Result<()> {
        self.run(|| host_step(optimizer, params, grads, plan))
    }

    /// Runs `work` with the offload's threads as rayon's pool.
    pub(super) fn run<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(work),
            None => work(),
        }
    }
}

impl<D: std::fmt::Debug> std::fmt::Debug for OffloadMemory<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadMemory")
            .field("device", &self.device)
            .field("offload", &self.offload)
            .field(
                "threads",
                &self.stepper.pool.as_ref().map(|p| p.current_num_threads()),
            )
            .finish()
    }
}

impl<D> OffloadMemory<D> {
    /// Lands the device's queued transfers ([`ShardMemory::land`]) where
    /// any of `buffers` is in host memory, before it is read or written.
    fn land_for<T: Element, C: Communicator>(
        &mut self,
        buffers: &[&Placed<D::Buffer, T>],
    ) -> Result<()>
    where
        D: ShardMemory<T, C>,
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

/// The span of buffer positions `[at, at + len)` of every item.
fn span(items: impl Iterator<Item = (usize, usize)>) -> Range<usize> {
    let mut span: Option<Range<usize>> = None;
    for (at, len) in items {
        let (lo, hi) = span.map_or((at, at + len), |s| (s.start.min(at), s.end.max(at + len)));
        span = Some(lo..hi);
    }
    span.unwrap_or(0..0)
}

/// The copies with their buffer positions shifted down by `by`.
fn shifted(copies: &[ParamCopy], by: usize) -> Vec<ParamCopy> {
    copies
        .iter()
        .map(|c| ParamCopy {
            at: c.at - by,
            ..c.clone()
        })
        .collect()
}

fn internal(what: &str) -> Error {
    Error::State(format!("internal: offload: {what}"))
}

/// `buffer[range]` in device memory: the buffer itself, or a device copy
/// of a host buffer's range (then at `0..len`).
fn staged_up<T: Element, C: Communicator, D: ShardMemory<T, C>>(
    device: &mut D,
    buffer: &Placed<D::Buffer, T>,
    range: Range<usize>,
) -> Result<Option<D::Buffer>> {
    match buffer {
        Placed::Device(_) => Ok(None),
        Placed::Host(values) => upload(device, values, range).map(Some),
    }
}

/// A device buffer holding `values[range]`: only queued from page-locked
/// memory.
fn upload<T: Element, C: Communicator, D: ShardMemory<T, C>>(
    device: &mut D,
    values: &HostBuffer<T>,
    range: Range<usize>,
) -> Result<D::Buffer> {
    if values.is_pinned() {
        // SAFETY: `values` is locked by this device's `pin_host` (whose unlock
        // waits for queued copies), its length is fixed, and nothing writes
        // `range` on the host before the copy lands: `OffloadMemory` lands
        // before it writes host memory (`land_for`), and the step thread
        // writes no bucket of either shard (the parameters, or the weights
        // packed in the gradients' place) after reporting it stepped, until
        // a landing taken once the bucket was reduced in the next pass,
        // behind this copy.
        unsafe { device.upload_queued(values.range(range)) }
    } else {
        let mut staged = device.alloc_zeroed(range.len())?;
        device.buffer_from_host(&mut staged, 0, values.range(range))?;
        Ok(staged)
    }
}

/// Runs the device collective `op(device, send, send_range, recv,
/// recv_range)` over buffers wherever they are: host ranges are staged
/// on the device, and a host `recv` gets the result back.
fn collective<T: Element, C: Communicator, D: ShardMemory<T, C>>(
    device: &mut D,
    send: &Placed<D::Buffer, T>,
    send_range: Range<usize>,
    recv: &mut Placed<D::Buffer, T>,
    recv_range: Range<usize>,
    op: impl FnOnce(&mut D, &D::Buffer, Range<usize>, &mut D::Buffer, Range<usize>) -> Result<()>,
) -> Result<()> {
    let staged_send = staged_up(device, send, send_range.clone())?;
    let (send, send_range) = match (&staged_send, send) {
        (Some(staged), _) => (staged, 0..send_range.len()),
        (None, Placed::Device(send)) => (send, send_range),
        (None, Placed::Host(_)) => return Err(internal("host send not staged")),
    };
    match recv {
        Placed::Device(recv) => op(device, send, send_range, recv, recv_range),
        Placed::Host(values) => {
            let n = recv_range.len();
            let mut staged = device.alloc_zeroed(n)?;
            op(device, send, send_range, &mut staged, 0..n)?;
            if values.is_pinned() {
                // SAFETY: `values` is locked by this device's `pin_host`
                // (whose unlock waits for queued copies), its length is fixed,
                // and `OffloadMemory` lands before it touches host memory
                // (`land_for`), as the engine does before it reads a host
                // shard itself; the offload's step thread reads a bucket
                // only after a landing taken once its copy was queued.
                unsafe { device.download_queued(staged, 0..n, values.range_mut(recv_range)) }
            } else {
                device.download(&staged, 0..n, values.range_mut(recv_range))
            }
        }
    }
}

/// Runs the device all-reduce `op` over `buffer[range]` wherever it is.
fn all_reduce_placed<T: Element, C: Communicator, D: ShardMemory<T, C>>(
    device: &mut D,
    buffer: &mut Placed<D::Buffer, T>,
    range: Range<usize>,
    op: impl FnOnce(&mut D, &mut D::Buffer, Range<usize>) -> Result<()>,
) -> Result<()> {
    match buffer {
        Placed::Device(b) => op(device, b, range),
        Placed::Host(values) => {
            let n = range.len();
            let mut staged = device.alloc_zeroed(n)?;
            device.buffer_from_host(&mut staged, 0, &values[range.clone()])?;
            op(device, &mut staged, 0..n)?;
            device.download(&staged, 0..n, &mut values[range])
        }
    }
}

/// `buffer` whole in host memory: itself, or a downloaded copy.
fn host_copy_of<T: Element, C: Communicator, D: ShardMemory<T, C>>(
    device: &mut D,
    buffer: &Placed<D::Buffer, T>,
) -> Result<Option<Vec<T>>> {
    match buffer {
        Placed::Host(_) => Ok(None),
        Placed::Device(b) => {
            let n = D::buffer_len(b);
            let mut values = vec![T::default(); n];
            device.download(b, 0..n, &mut values)?;
            Ok(Some(values))
        }
    }
}

impl<T: Element, C: Communicator, D: ShardMemory<T, C>> ShardMemory<T, C> for OffloadMemory<D> {
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

    fn alloc_shard(&mut self, numel: usize) -> Result<Self::Buffer> {
        if self.offload {
            let host = if self.pin_memory && numel > 0 {
                HostBuffer::pinned(numel, |pages| self.device.pin_host(pages))?
            } else {
                HostBuffer::pageable(numel)
            };
            Ok(Placed::Host(host))
        } else {
            Ok(Placed::Device(self.device.alloc_shard(numel)?))
        }
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

    fn launches_async(&self) -> bool {
        self.device.launches_async()
    }

    fn defer_completion(&mut self) {
        self.device.defer_completion();
    }

    fn settle(&mut self, comm: &C) -> Result<()> {
        self.device.settle(comm)
    }

    fn deferred_count(&self) -> usize {
        self.device.deferred_count()
    }

    fn fence_deferred(&mut self, count: usize) -> Result<()> {
        self.device.fence_deferred(count)
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

    fn gathers_packed(&self) -> bool {
        self.device.gathers_packed()
    }

    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &Self::Buffer,
        n: usize,
        recv: &mut Self::Buffer,
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
                0 => d.all_gather_packed(comm, s, n, r, rr, wire),
                _ => Err(internal("a packed chunk not at its buffer's start")),
            },
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

    fn download(
        &mut self,
        buffer: &Self::Buffer,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        self.land_for::<T, C>(&[buffer])?;
        match buffer {
            Placed::Device(b) => self.device.download(b, range, out),
            Placed::Host(values) => {
                out.copy_from_slice(&values[range]);
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

    fn landing(&mut self) -> Result<Option<Landing>> {
        self.device.landing()
    }

    fn land(&mut self) -> Result<()> {
        self.device.land()
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

    fn offload_optimizer(&mut self, threads: usize, pin_memory: bool) -> Result<()> {
        if threads > 0 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("zero-offload-{i}"))
                .build()
                .map_err(|e| {
                    Error::Config(format!(
                        "could not start {threads} offload threads ({e}); ask for fewer \
                         (offload_threads, 0 for rayon's global pool)"
                    ))
                })?;
            self.stepper.pool = Some(Arc::new(pool));
        }
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

    fn host_region(buffer: &mut Self::Buffer) -> Option<HostRegion<T>> {
        match buffer {
            Placed::Host(values) => Some(values.region()),
            Placed::Device(_) => None,
        }
    }

    fn offloaded(buffer: &Self::Buffer) -> bool {
        matches!(buffer, Placed::Host(_))
    }

    fn state_offloaded(&self) -> bool {
        self.offload
    }

    fn staging_bytes(&self) -> usize {
        self.device.staging_bytes()
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
    fn span_covers_every_item_and_nothing_before_the_first() {
        assert_eq!(span([(8, 4), (2, 3), (20, 0)].into_iter()), 2..20);
        assert_eq!(span(std::iter::empty()), 0..0);
    }

    /// A pinned buffer (its elements start past the padding) lent as a
    /// region: another thread writes the ranges handed to it while the
    /// owner writes the rest through `range_mut`, and both land where the
    /// buffer's own view sees them.
    #[test]
    fn a_region_and_the_owner_write_their_own_ranges_of_one_buffer() {
        let mut buffer = HostBuffer::<u32>::pinned(100_000, |_| Ok(None)).expect("no lock");
        let mut region = buffer.region();
        let (handed, ranges) = std::sync::mpsc::channel::<Range<usize>>();
        let other = std::thread::spawn(move || {
            for range in ranges {
                // SAFETY: `buffer` outlives the thread (joined below) and
                // the owner never writes a range it handed over.
                let values = unsafe { region.range_mut(range.clone()) };
                for (v, i) in values.iter_mut().zip(range) {
                    *v = 2 * i as u32;
                }
            }
        });
        for k in 0..10 {
            let range = k * 10_000..(k + 1) * 10_000;
            if k % 2 == 0 {
                handed.send(range).expect("the thread runs");
            } else {
                for (v, i) in buffer.range_mut(range.clone()).iter_mut().zip(range) {
                    *v = 3 * i as u32;
                }
            }
        }
        drop(handed);
        other.join().expect("no panic");
        for (i, v) in buffer.iter().enumerate() {
            let k = i / 10_000;
            assert_eq!(*v, if k % 2 == 0 { 2 } else { 3 } * i as u32, "element {i}");
        }
        assert_eq!(buffer.len(), 100_000);
    }

    #[test]
    #[should_panic(expected = "range 5..11 of a host buffer of 10")]
    fn a_range_past_the_buffer_panics_instead_of_reaching_past_it() {
        let mut buffer = HostBuffer::<f32>::pageable(10);
        let _ = buffer.range_mut(5..11);
    }

    thread_local! {
        /// Elements of [`Counted`] dropped on this thread.
        static DROPPED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[derive(Clone, Default)]
    struct Counted(#[allow(dead_code)] u32);

    impl Drop for Counted {
        fn drop(&mut self) {
            DROPPED.with(|d| d.set(d.get() + 1));
        }
    }

    /// Unlocks by noting how many elements were freed before it; says
    /// whether the memory may go (`landed`).
    struct Lock {
        unlocked: Arc<std::sync::Mutex<Option<usize>>>,
        landed: bool,
    }

    impl HostLock for Lock {
        fn unlock(self: Box<Self>) -> bool {
            *self.unlocked.lock().unwrap() = Some(DROPPED.with(|d| d.get()));
            self.landed
        }
    }

    #[test]
    fn a_pinned_buffer_locks_whole_pages_of_its_own_and_unlocks_before_its_memory_goes() {
        let numel = 1000;
        let mut locked = (0, 0);
        let unlocked = Arc::new(std::sync::Mutex::new(None));
        let lock = Lock {
            unlocked: Arc::clone(&unlocked),
            landed: true,
        };
        let buffer = HostBuffer::<Counted>::pinned(numel, |pages| {
            locked = (pages.as_ptr() as usize, std::mem::size_of_val(pages));
            Ok(Some(Box::new(lock)))
        })
        .unwrap();
        let (at, bytes) = locked;
        assert!(buffer.is_pinned());
        assert_eq!(buffer.len(), numel);
        assert_eq!(
            buffer.as_ptr() as usize,
            at,
            "the buffer starts the locked pages"
        );
        assert_eq!(at % PIN_ALIGN, 0, "locked from a page boundary");
        assert_eq!(bytes % PIN_ALIGN, 0, "whole pages locked");
        assert!(bytes >= numel * std::mem::size_of::<Counted>());
        DROPPED.with(|d| d.set(0));
        drop(buffer);
        assert_eq!(
            *unlocked.lock().unwrap(),
            Some(0),
            "unlocked before any element was freed"
        );
        assert!(DROPPED.with(|d| d.get()) > numel, "the padding goes too");
    }

    #[test]
    fn a_buffer_whose_copy_never_landed_is_kept_not_freed() {
        let unlocked = Arc::new(std::sync::Mutex::new(None));
        let lock = Lock {
            unlocked: Arc::clone(&unlocked),
            landed: false,
        };
        let buffer = HostBuffer::<Counted>::pinned(100, |_| Ok(Some(Box::new(lock)))).unwrap();
        DROPPED.with(|d| d.set(0));
        drop(buffer);
        assert_eq!(*unlocked.lock().unwrap(), Some(0), "unlocking was tried");
        assert_eq!(
            DROPPED.with(|d| d.get()),
            0,
            "memory a copy may still write was freed"
        );
    }

    #[test]
    fn a_lock_that_fails_fails_the_allocation_and_pageable_buffers_lock_nothing() {
        let failed =
            HostBuffer::<f32>::pinned(10, |_| Err(Error::Config("cannot lock host memory".into())));
        assert!(failed.unwrap_err().to_string().contains("cannot lock"));
        let pageable = HostBuffer::<f32>::pageable(10);
        assert!(!pageable.is_pinned());
        assert_eq!(&pageable[..], &[0.0; 10]);
    }

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
