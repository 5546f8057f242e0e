//! `PlanCheck`: host memory that records every step plan the engine hands
//! it and, optionally, poses as a device memory (no communication thread,
//! collectives completing when settled), as the CUDA memory behaves.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use zero_core::comm::Host;
use zero_core::engine::{
    host_gathers, Deferral, GatherBudgets, GatherMemory, GradPiece, HostGather, HostGathers,
    HostGrad, HostMemory, HostTransfers, NormType, PackedGathers, ParamCopy, ParamStore,
    ShardMemory, ShardStep, StepPiece, UnitBucket,
};
use zero_core::optim::OptimizerState;
use zero_core::{Communicator, DType, Element, FunctionalOptimizer, ReduceOp, Result};

/// What the plans showed, across every step of one engine (and its forks).
#[derive(Default)]
pub struct Seen {
    /// Per piece `(name, offset)`: its shard position and length.
    pub positions: BTreeMap<(String, usize), (usize, usize)>,
    pub shard_len: Option<usize>,
    pub plans: usize,
    /// Plans whose buffers start inside the shard, or that step only some
    /// of the pieces: the cases a flat state gets wrong if the contract
    /// breaks.
    pub partial: usize,
    /// Reductions issued while the memory deferred their completion.
    pub deferred: usize,
    /// Fences that let a bucket buffer be reused before settling.
    pub fences: usize,
    /// Stage 3's all-gathers (one per bucket of a gathered unit).
    pub gathers: usize,
    /// The 16-bit dtype stage 3's gathers were asked to carry.
    pub gathered_in: Option<DType>,
    /// Gradient pieces flattened into a buffer by copying, and by adding.
    pub flattened: (usize, usize),
    /// Offload's downloads queued into page-locked host memory.
    pub queued_downloads: usize,
    /// Offload's uploads queued from page-locked host memory.
    pub queued_uploads: usize,
    /// Their bytes.
    pub uploaded_bytes: usize,
    /// Queued uploads whose source the host changed before they landed.
    pub changed_uploads: usize,
    /// Host buffers page-locked.
    pub pinned: usize,
    /// `land` calls that found copies in flight.
    pub full_lands: usize,
    /// Synchronous uploads (`buffer_from_host`): on a GPU, each waits for
    /// the device's queue to drain.
    pub synchronous_uploads: usize,
    /// `landing`s that landed copies (and none queued after they were
    /// taken).
    pub partial_lands: usize,
    /// `landing`s run on the thread that took them: it waited for copies
    /// it had just queued.
    pub taker_lands: usize,
    pub violations: Vec<String>,
}

impl Seen {
    pub fn check(&mut self, plan: &ShardStep<'_>, buffer_len: usize) {
        self.plans += 1;
        let shard_len = *self.shard_len.get_or_insert(plan.shard_len);
        if plan.shard_len != shard_len {
            self.violations
                .push(format!("shard_len {} after {shard_len}", plan.shard_len));
        }
        for bucket in plan.buckets {
            if bucket.end > buffer_len {
                self.violations
                    .push(format!("bucket {bucket:?} past a buffer of {buffer_len}"));
            }
        }
        for piece in plan.pieces {
            let at = plan.origin + piece.range.start;
            let key = (piece.key.name.clone(), piece.key.offset);
            let len = piece.range.len();
            if piece.range.end > buffer_len || at + len > shard_len {
                self.violations.push(format!(
                    "{key:?} at {at} ({:?} of a buffer of {buffer_len}) past a shard of \
                     {shard_len}",
                    piece.range
                ));
            }
            let first = *self.positions.entry(key.clone()).or_insert((at, len));
            if first != (at, len) {
                self.violations
                    .push(format!("{key:?} at {at} (+{len}), earlier at {first:?}"));
            }
        }
        if plan.origin > 0 || plan.pieces.len() < self.positions.len() {
            self.partial += 1;
        }
    }

    /// Fails on any violation, or if two pieces' positions overlap.
    pub fn assert_kept(&self, what: &str) {
        assert!(self.violations.is_empty(), "{what}: {:?}", self.violations);
        let mut spans: Vec<&(usize, usize)> = self.positions.values().collect();
        spans.sort();
        for pair in spans.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 <= pair[1].0,
                "{what}: pieces at {:?} and {:?} overlap",
                pair[0],
                pair[1]
            );
        }
    }
}

/// Host memory that records every step plan in `seen`. With `inline`, it
/// poses as a device memory: no communication thread (no `fork`), and
/// collectives "complete" only when settled (a `Deferral`), so the
/// engine reduces on the calling thread during backward.
pub struct PlanCheck {
    inner: HostMemory,
    seen: Arc<Mutex<Seen>>,
    /// Offload's queued downloads, as a device's: the values read when
    /// queued (in the stream's order) and written into the host buffer
    /// only when landed, so that a host read before `land` sees stale
    /// values. Shared with the forks, as one device's stream would be.
    queued: Queued,
    inline: bool,
    /// While deferring: reductions issued and not yet settled.
    deferring: Option<usize>,
    /// While deferring: the buffers reductions read (by address) and each
    /// reduction's number (1-based).
    reading: Vec<(usize, usize)>,
    /// While deferring: the reductions fenced (known complete to what is
    /// queued after the fence).
    fenced: usize,
    /// The optimizer kinds it steps, as a device with kernels for some
    /// only; `None`: any.
    steps_only: Option<&'static [&'static str]>,
}

/// What lands each queued copy (a download's write, an upload's check),
/// oldest first, numbered from `landed`.
#[derive(Default)]
struct Copies {
    landed: u64,
    pending: std::collections::VecDeque<Box<dyn FnOnce() + Send>>,
}

type Queued = Arc<Mutex<Copies>>;

fn queue(queued: &Queued, copy: Box<dyn FnOnce() + Send>) {
    queued
        .lock()
        .expect("no test thread panicked")
        .pending
        .push_back(copy);
}

/// Lands the copies numbered below `mark` (all: `u64::MAX`); returns how
/// many it landed.
fn land_up_to(queued: &Queued, mark: u64) -> usize {
    let mut landed = 0;
    loop {
        let copy = {
            let mut copies = queued.lock().expect("no test thread panicked");
            if copies.landed >= mark {
                break;
            }
            let Some(copy) = copies.pending.pop_front() else {
                break;
            };
            copies.landed += 1;
            copy
        };
        copy();
        landed += 1;
    }
    landed
}

fn land_all(queued: &Queued) -> usize {
    land_up_to(queued, u64::MAX)
}

/// A page-lock of a `PlanCheck`: unlocking lands every queued copy first
/// (as the CUDA memory's waits for its newest copy).
struct LandOnUnlock(Queued);

impl zero_core::engine::HostLock for LandOnUnlock {
    fn unlock(self: Box<Self>) -> bool {
        land_all(&self.0);
        true
    }
}

impl PlanCheck {
    pub fn new(seen: Arc<Mutex<Seen>>, inline: bool) -> Self {
        Self::sharing(seen, inline, Queued::default())
    }

    fn sharing(seen: Arc<Mutex<Seen>>, inline: bool, queued: Queued) -> Self {
        Self {
            inner: HostMemory,
            seen,
            queued,
            inline,
            deferring: None,
            reading: Vec::new(),
            fenced: 0,
            steps_only: None,
        }
    }

    /// Steps only optimizers of these kinds, as the CUDA memory runs the
    /// built-ins' kernels only, refusing the others at construction.
    pub fn stepping_only(mut self, kinds: &'static [&'static str]) -> Self {
        self.steps_only = Some(kinds);
        self
    }

    /// Counts a reduction issued while deferring, which reads `send`.
    fn issued<T>(&mut self, send: &[T]) {
        if let Some(n) = self.deferring.as_mut() {
            *n += 1;
            self.reading.push((send.as_ptr() as usize, *n));
        }
    }

    /// Records a violation if `buffer` is written while a deferred
    /// reduction that reads it is neither settled nor fenced: on a device
    /// the write could land before the reduction read it.
    fn written<T>(&mut self, buffer: &[T]) {
        let at = buffer.as_ptr() as usize;
        if let Some(&(_, k)) = self
            .reading
            .iter()
            .find(|&&(p, k)| p == at && k > self.fenced)
        {
            self.seen
                .lock()
                .expect("no test thread panicked")
                .violations
                .push(format!(
                    "a buffer written while reduction {k} still reads it (fenced: {})",
                    self.fenced
                ));
        }
    }
}

impl<T: Element, C: Communicator<Memory = Host>> ShardMemory<T, C> for PlanCheck {
    type Buffer = Vec<T>;
    type Gathers = PosedGathers<T>;
    type Grad<'g> = HostGrad<'g, T>;
    type Params<'p> = dyn ParamStore<T> + 'p;

    fn step(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        params: &mut Vec<T>,
        grads: &Vec<T>,
        plan: ShardStep<'_>,
    ) -> Result<()> {
        ShardMemory::<T, C>::check_optimizer(self, optimizer)?;
        self.seen
            .lock()
            .expect("no test thread panicked")
            .check(&plan, params.len().min(grads.len()));
        <HostMemory as ShardMemory<T, C>>::step(&mut self.inner, optimizer, params, grads, plan)
    }

    fn check_optimizer(&self, optimizer: &dyn FunctionalOptimizer<T>) -> Result<()> {
        match self.steps_only {
            Some(kinds) if !kinds.contains(&optimizer.kind()) => {
                Err(zero_core::Error::Config(format!(
                    "{:?}: no kernel here (the test's device steps {kinds:?})",
                    optimizer.kind()
                )))
            }
            _ => Ok(()),
        }
    }

    fn fork(&self) -> Option<Self> {
        (!self.inline).then(|| Self {
            steps_only: self.steps_only,
            ..Self::sharing(self.seen.clone(), false, self.queued.clone())
        })
    }

    /// Posing as a device: collectives complete when settled.
    fn deferral(&mut self) -> Option<&mut dyn Deferral<C>> {
        match self.inline {
            true => Some(self),
            false => None,
        }
    }

    fn packed_gathers(&mut self) -> Option<&mut dyn PackedGathers<C, Vec<T>>> {
        Some(self)
    }

    fn grad_len(grad: &HostGrad<'_, T>) -> usize {
        <HostMemory as ShardMemory<T, C>>::grad_len(grad)
    }

    fn alloc_zeroed(&mut self, numel: usize) -> Result<Vec<T>> {
        <HostMemory as ShardMemory<T, C>>::alloc_zeroed(&mut self.inner, numel)
    }

    fn buffer_len(buffer: &Vec<T>) -> usize {
        <HostMemory as ShardMemory<T, C>>::buffer_len(buffer)
    }

    fn gathers(&self, comm: C) -> Result<PosedGathers<T>> {
        Ok(PosedGathers {
            host: host_gathers(comm),
            device: self.inline,
            seen: self.seen.clone(),
        })
    }

    fn zero(&mut self, buffer: &mut Vec<T>, range: Range<usize>) -> Result<()> {
        self.written(buffer);
        <HostMemory as ShardMemory<T, C>>::zero(&mut self.inner, buffer, range)
    }

    fn flatten(
        &mut self,
        buffer: &mut Vec<T>,
        pieces: &[GradPiece<HostGrad<'_, T>>],
        add: bool,
    ) -> Result<()> {
        self.written(buffer);
        {
            let mut seen = self.seen.lock().expect("no test thread panicked");
            match add {
                false => seen.flattened.0 += pieces.len(),
                true => seen.flattened.1 += pieces.len(),
            }
        }
        <HostMemory as ShardMemory<T, C>>::flatten(&mut self.inner, buffer, pieces, add)
    }

    fn copy_range(
        &mut self,
        dst: &mut Vec<T>,
        dst_at: usize,
        src: &Vec<T>,
        src_range: Range<usize>,
        add: bool,
    ) -> Result<()> {
        self.written(dst);
        <HostMemory as ShardMemory<T, C>>::copy_range(
            &mut self.inner,
            dst,
            dst_at,
            src,
            src_range,
            add,
        )
    }

    fn read_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &mut Vec<T>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::read_params(&mut self.inner, params, copies, buffer)
    }

    fn write_params(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        copies: &[ParamCopy],
        buffer: &Vec<T>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::write_params(&mut self.inner, params, copies, buffer)
    }

    fn scale(&mut self, buffer: &mut Vec<T>, ranges: &[Range<usize>], factor: f64) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::scale(&mut self.inner, buffer, ranges, factor)
    }

    fn norm_partial(
        &mut self,
        comm: &C,
        buffer: &Vec<T>,
        ranges: &[Range<usize>],
        norm: NormType,
    ) -> Result<f64> {
        <HostMemory as ShardMemory<T, C>>::norm_partial(&mut self.inner, comm, buffer, ranges, norm)
    }

    fn all_reduce(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_reduce(&mut self.inner, comm, buffer, range, op)
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
        <HostMemory as ShardMemory<T, C>>::reduce_scatter(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
            op,
        )
    }

    fn all_gather(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        send_range: Range<usize>,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_gather(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
        )
    }

    fn all_reduce_as(
        &mut self,
        comm: &C,
        buffer: &mut Vec<T>,
        range: Range<usize>,
        op: ReduceOp,
        wire: DType,
    ) -> Result<()> {
        self.issued(buffer);
        <HostMemory as ShardMemory<T, C>>::all_reduce_as(
            &mut self.inner,
            comm,
            buffer,
            range,
            op,
            wire,
        )
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
        self.issued(send);
        <HostMemory as ShardMemory<T, C>>::reduce_scatter_as(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
            op,
            wire,
        )
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
        <HostMemory as ShardMemory<T, C>>::all_gather_as(
            &mut self.inner,
            comm,
            send,
            send_range,
            recv,
            recv_range,
            wire,
        )
    }

    fn buffer_to_host(
        &mut self,
        comm: &C,
        buffer: &Vec<T>,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::buffer_to_host(&mut self.inner, comm, buffer, range, out)
    }

    /// As a device's: a synchronous copy, which waits for the device's
    /// queue first (counted).
    fn buffer_from_host(&mut self, buffer: &mut Vec<T>, at: usize, values: &[T]) -> Result<()> {
        self.seen
            .lock()
            .expect("no test thread panicked")
            .synchronous_uploads += 1;
        <HostMemory as ShardMemory<T, C>>::buffer_from_host(&mut self.inner, buffer, at, values)
    }

    fn all_reduce_host<V: Element>(
        &mut self,
        comm: &C,
        values: &mut [V],
        op: ReduceOp,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::all_reduce_host::<V>(&mut self.inner, comm, values, op)
    }

    fn gather_varlen_host(
        &mut self,
        comm: &C,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::gather_varlen_host(
            &mut self.inner,
            comm,
            send,
            counts,
            recv,
            root,
        )
    }

    fn export_state(
        &mut self,
        comm: &C,
        optimizer: &dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
    ) -> Result<OptimizerState<T>> {
        <HostMemory as ShardMemory<T, C>>::export_state(&mut self.inner, comm, optimizer, pieces)
    }

    fn import_state(
        &mut self,
        optimizer: &mut dyn FunctionalOptimizer<T>,
        pieces: &[StepPiece<'_>],
        state: OptimizerState<T>,
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::import_state(&mut self.inner, optimizer, pieces, state)
    }

    fn state_bytes(&self, optimizer: &dyn FunctionalOptimizer<T>) -> usize {
        <HostMemory as ShardMemory<T, C>>::state_bytes(&self.inner, optimizer)
    }

    fn read_param_host(
        &mut self,
        comm: &C,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        out: &mut [T],
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::read_param_host(
            &mut self.inner,
            comm,
            params,
            param,
            out,
        )
    }

    fn write_param_host(
        &mut self,
        params: &mut (dyn ParamStore<T> + '_),
        param: usize,
        values: &[T],
    ) -> Result<()> {
        <HostMemory as ShardMemory<T, C>>::write_param_host(&mut self.inner, params, param, values)
    }
}

impl<C: Communicator<Memory = Host>> Deferral<C> for PlanCheck {
    fn defer_completion(&mut self) {
        self.deferring.get_or_insert(0);
    }

    fn settle(&mut self, _comm: &C) -> Result<()> {
        if let Some(n) = self.deferring.take() {
            self.seen.lock().expect("no test thread panicked").deferred += n;
        }
        self.reading.clear();
        self.fenced = 0;
        Ok(())
    }

    fn deferred_count(&self) -> usize {
        self.deferring.unwrap_or(0)
    }

    fn fence_deferred(&mut self, count: usize) -> Result<()> {
        let count = count.min(self.deferring.unwrap_or(0));
        if count > self.fenced {
            self.fenced = count;
            self.seen.lock().expect("no test thread panicked").fences += 1;
        }
        Ok(())
    }
}

impl<T: Element, C: Communicator<Memory = Host>> PackedGathers<C, Vec<T>> for PlanCheck {
    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &Vec<T>,
        n: usize,
        recv: &mut Vec<T>,
        recv_range: Range<usize>,
        wire: DType,
    ) -> Result<()> {
        PackedGathers::<C, Vec<T>>::all_gather_packed(
            &mut self.inner,
            comm,
            send,
            n,
            recv,
            recv_range,
            wire,
        )
    }
}

impl<T: Element, C: Communicator<Memory = Host>> HostTransfers<T, C> for PlanCheck {
    /// As a device's: after every deferred reduction.
    fn download(&mut self, buffer: &Vec<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        self.fenced = self.deferring.unwrap_or(0);
        <HostMemory as HostTransfers<T, C>>::download(&mut self.inner, buffer, range, out)
    }

    fn pin_host(&mut self, _values: &mut [T]) -> Result<Option<zero_core::engine::HostPin>> {
        self.seen.lock().expect("no test thread panicked").pinned += 1;
        Ok(Some(Box::new(LandOnUnlock(self.queued.clone()))))
    }

    /// As a device's: after every deferred reduction, read now, written
    /// into `out` when landed.
    unsafe fn download_queued(
        &mut self,
        buffer: Vec<T>,
        range: Range<usize>,
        out: &mut [T],
    ) -> Result<()> {
        self.fenced = self.deferring.unwrap_or(0);
        assert_eq!(range.len(), out.len(), "a download into another length");
        let values = buffer[range].to_vec();
        let at = out.as_mut_ptr() as usize;
        queue(
            &self.queued,
            Box::new(move || {
                // SAFETY: the caller keeps `out` allocated and untouched
                // until landed, and every page-lock's unlock lands first.
                let out = unsafe { std::slice::from_raw_parts_mut(at as *mut T, values.len()) };
                out.copy_from_slice(&values);
            }),
        );
        self.seen
            .lock()
            .expect("no test thread panicked")
            .queued_downloads += 1;
        Ok(())
    }

    /// As a device's: the values are needed on the "device" now (what
    /// follows on its stream reads them), and the source must not change
    /// until landed: checked then, against what was copied.
    unsafe fn upload_queued(&mut self, values: &[T]) -> Result<Vec<T>> {
        let copied = values.to_vec();
        let (from, seen) = (values.as_ptr() as usize, self.seen.clone());
        queue(
            &self.queued,
            Box::new(move || {
                // SAFETY: the caller keeps `values` allocated until landed,
                // and every page-lock's unlock lands first.
                let now = unsafe { std::slice::from_raw_parts(from as *const T, copied.len()) };
                if now != copied.as_slice() {
                    seen.lock()
                        .expect("no test thread panicked")
                        .changed_uploads += 1;
                }
            }),
        );
        let mut seen = self.seen.lock().expect("no test thread panicked");
        seen.queued_uploads += 1;
        seen.uploaded_bytes += std::mem::size_of_val(values);
        Ok(values.to_vec())
    }

    /// As a device's: waits for the copies queued so far, from any thread.
    fn landing(&mut self) -> Result<Option<zero_core::engine::Landing>> {
        let mark = {
            let copies = self.queued.lock().expect("no test thread panicked");
            copies.landed + copies.pending.len() as u64
        };
        let (queued, seen) = (self.queued.clone(), self.seen.clone());
        let taker = std::thread::current().id();
        Ok(Some(Box::new(move || {
            let landed = land_up_to(&queued, mark);
            let mut seen = seen.lock().expect("no test thread panicked");
            if landed > 0 {
                seen.partial_lands += 1;
            }
            if std::thread::current().id() == taker {
                seen.taker_lands += 1;
            }
            Ok(())
        })))
    }

    fn land(&mut self) -> Result<()> {
        if land_all(&self.queued) > 0 {
            self.seen
                .lock()
                .expect("no test thread panicked")
                .full_lands += 1;
        }
        Ok(())
    }
}

/// Stage 3's gathers of a [`PlanCheck`]: host gathers that count their
/// collectives in `seen` (and the 16-bit dtype they are asked to gather
/// in) and, where the memory poses as a device, take a device's budgets
/// ([`GatherBudgets::DEVICE`]).
pub struct PosedGathers<T> {
    host: HostGathers<T>,
    device: bool,
    seen: Arc<Mutex<Seen>>,
}

impl<T: Element> GatherMemory<T> for PosedGathers<T> {
    type Shard = Vec<T>;
    type Buffer = HostGather<T>;

    fn default_budgets(&self) -> GatherBudgets {
        match self.device {
            true => GatherBudgets::DEVICE,
            false => GatherBudgets::HOST,
        }
    }

    fn gather_in(&mut self, dtype: DType) {
        self.seen
            .lock()
            .expect("no test thread panicked")
            .gathered_in = Some(dtype);
        self.host.gather_in(dtype);
    }

    fn element_bytes(&self) -> usize {
        self.host.element_bytes()
    }

    fn shard_len(shard: &Vec<T>) -> usize {
        shard.len()
    }

    fn capacity(buffer: &HostGather<T>) -> usize {
        <HostGathers<T> as GatherMemory<T>>::capacity(buffer)
    }

    fn buffer(&self, reuse: Option<HostGather<T>>, len: usize) -> Result<HostGather<T>> {
        self.host.buffer(reuse, len)
    }

    fn bytes_sent(&self) -> u64 {
        self.host.bytes_sent()
    }

    fn gather(
        &self,
        shard: &Vec<T>,
        buckets: &[UnitBucket],
        buffer: &mut HostGather<T>,
    ) -> Result<()> {
        self.gather_from_host(shard, buckets, buffer)
    }

    fn gather_from_host(
        &self,
        shard: &[T],
        buckets: &[UnitBucket],
        buffer: &mut HostGather<T>,
    ) -> Result<()> {
        self.seen.lock().expect("no test thread panicked").gathers += buckets.len();
        self.host.gather_from_host(shard, buckets, buffer)
    }

    fn read(&self, buffer: &HostGather<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        self.host.read(buffer, range, out)
    }
}
