//! The device engine's state and step.

use super::optimizer::DeviceOptimizer;
use super::segments::{plan_segments, PieceSlot};
use crate::kernels::{FusedKernels, NormAccumulator, NormKind};
use crate::NcclComm;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError};
use std::ops::Range;
use std::sync::Arc;
use zero_core::engine::{
    check_rank_consistency, EngineConfig, Layout, MemoryReport, NormType, ShardSetup, Stage,
    StepReport,
};
use zero_core::optim::{FunctionalOptimizer, Hyperparams};
use zero_core::partition::{ParamInfo, ShardPiece};
use zero_core::{Communicator, Error, ReduceOp, Result};

/// Device memory of the parameters a framework holds (f32, contiguous, one
/// buffer per parameter, in the engine's parameter order).
///
/// The engine asks for one parameter at a time and only queues work on the
/// compute stream while it holds it.
pub trait DeviceParams {
    /// Calls `f` with parameter `param`'s device memory.
    fn with_param(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(&dyn DevicePtr<f32>) -> Result<()>,
    ) -> Result<()>;

    /// Calls `f` with parameter `param`'s device memory, writable.
    fn with_param_mut(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(&mut dyn DevicePtrMut<f32>) -> Result<()>,
    ) -> Result<()>;
}

impl DeviceParams for Vec<CudaSlice<f32>> {
    fn with_param(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(&dyn DevicePtr<f32>) -> Result<()>,
    ) -> Result<()> {
        f(&self[param])
    }

    fn with_param_mut(
        &mut self,
        param: usize,
        f: &mut dyn FnMut(&mut dyn DevicePtrMut<f32>) -> Result<()>,
    ) -> Result<()> {
        f(&mut self[param])
    }
}

fn cuda(e: DriverError) -> Error {
    Error::from(crate::Error::from(e))
}

fn nccl(e: crate::Error) -> Error {
    Error::from(e)
}

/// Copies `len` elements from `src[src_at..]` to `dst[dst_at..]` on `stream`
/// (asynchronously, device to device).
fn copy_range(
    stream: &Arc<CudaStream>,
    src: &dyn DevicePtr<f32>,
    src_at: usize,
    dst: &mut dyn DevicePtrMut<f32>,
    dst_at: usize,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    for (what, at, have) in [
        ("source", src_at, src.len()),
        ("destination", dst_at, dst.len()),
    ] {
        if at + len > have {
            return Err(nccl(crate::Error::BufferSize {
                op: "device copy",
                what,
                got: have,
                expected: at + len,
            }));
        }
    }
    let size = std::mem::size_of::<f32>();
    let (s, _gs) = src.device_ptr(stream);
    let (d, _gd) = dst.device_ptr_mut(stream);
    // SAFETY: both ranges lie inside live device buffers of f32 (checked
    // above) whose guards are held until the copy is queued; they belong to
    // different buffers or disjoint ranges (the engine never copies a buffer
    // onto itself).
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(
            d + (dst_at * size) as u64,
            s + (src_at * size) as u64,
            len * size,
            stream.cu_stream(),
        )
    }
    .map_err(cuda)
}

/// ZeRO stages 0-2 for one rank, on one GPU, over NCCL (f32 parameters).
///
/// Built like the host [`zero_core::Engine`]: parameters in collective
/// order, an [`EngineConfig`], and a built-in optimizer of `zero-core`
/// (SGD, Adam, AdamW, Adagrad or RMSprop) that describes the update.
/// [`DeviceEngine::step`] takes the gradients as device buffers (one slot
/// per parameter, `None` for none) and updates the parameters through
/// [`DeviceParams`].
pub struct DeviceEngine {
    comm: NcclComm,
    kernels: FusedKernels,
    config: EngineConfig,
    params: Vec<ParamInfo>,
    setup: ShardSetup,
    optimizer: Box<dyn FunctionalOptimizer<f32>>,
    device_optimizer: DeviceOptimizer,
    /// Whether the host optimizer's hyperparameters changed since the
    /// device optimizer read them.
    hyper_stale: bool,
    /// Steps taken by each owned piece (the bias corrections are per piece).
    piece_steps: Vec<u64>,
    param_shard: CudaSlice<f32>,
    grad_shard: Option<CudaSlice<f32>>,
    full_grads: Option<CudaSlice<f32>>,
    bucket_buf: Option<CudaSlice<f32>>,
    norm: NormAccumulator,
    micro_steps: usize,
    present: Vec<bool>,
    trainable: Vec<bool>,
    active: Vec<bool>,
    bucket_active: Vec<bool>,
    steps: u64,
}

impl DeviceEngine {
    /// Builds the engine on `comm`'s GPU (a collective: every rank calls it
    /// alike). Compiles the fused kernels (once per engine, a few hundred
    /// milliseconds).
    pub fn new(
        comm: NcclComm,
        params: Vec<ParamInfo>,
        mut optimizer: Box<dyn FunctionalOptimizer<f32>>,
        config: EngineConfig,
    ) -> Result<Self> {
        check_rank_consistency(&comm, &params, &config, optimizer.as_ref())?;
        let setup = ShardSetup::new(
            &params,
            &config,
            optimizer.as_mut(),
            comm.world_size(),
            comm.rank(),
        )?;
        let kernels = FusedKernels::new(comm.context()).map_err(nccl)?;
        let stream = comm.compute_stream().clone();
        let shard_numel = setup.plan.shard_numel;
        let ranges: Vec<(Range<usize>, usize)> = setup
            .owned
            .iter()
            .map(|p| {
                let at = setup.shard_offset(p);
                (at..at + p.len(), setup.group_of[p.param])
            })
            .collect();
        let mut device_optimizer =
            DeviceOptimizer::new(optimizer.as_ref(), &stream, shard_numel, &ranges)?;
        device_optimizer.refresh(optimizer.as_ref())?;
        let zeros = |n: usize| stream.alloc_zeros::<f32>(n).map_err(cuda);
        let grad_shard = match config.stage {
            Stage::Ddp => None,
            _ => Some(zeros(shard_numel)?),
        };
        let full_grads = match config.stage {
            Stage::Gradients => None,
            _ => Some(zeros(setup.plan.flat_numel())?),
        };
        let trainable: Vec<bool> = params.iter().map(|p| p.trainable).collect();
        let mut engine = Self {
            param_shard: zeros(shard_numel)?,
            grad_shard,
            full_grads,
            bucket_buf: None,
            norm: NormAccumulator::new(&stream).map_err(nccl)?,
            piece_steps: vec![0; setup.owned.len()],
            micro_steps: 0,
            present: vec![false; params.len()],
            active: trainable.clone(),
            bucket_active: Vec::new(),
            trainable,
            steps: 0,
            hyper_stale: false,
            device_optimizer,
            optimizer,
            kernels,
            comm,
            config,
            params,
            setup,
        };
        engine.rebuild_buckets();
        Ok(engine)
    }

    /// The communicator.
    pub fn comm(&self) -> &NcclComm {
        &self.comm
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The parameters, in collective order.
    pub fn params(&self) -> &[ParamInfo] {
        &self.params
    }

    /// The plan, layout and owned pieces.
    pub fn setup(&self) -> &ShardSetup {
        &self.setup
    }

    /// Optimizer steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The host optimizer that describes the update (hyperparameters).
    pub fn optimizer(&self) -> &dyn FunctionalOptimizer<f32> {
        self.optimizer.as_ref()
    }

    /// The learning rate of group 0.
    pub fn learning_rate(&self) -> f64 {
        self.optimizer.learning_rate(0)
    }

    /// Sets the learning rate of every group.
    pub fn set_learning_rate(&mut self, lr: f64) {
        for group in 0..self.optimizer.num_groups() {
            self.optimizer.set_learning_rate(group, lr);
        }
        self.hyper_stale = true;
    }

    /// Changes the hyperparameters of `group` (validated by the host
    /// optimizer).
    pub fn set_hyperparams(&mut self, group: usize, hyper: &Hyperparams) -> Result<()> {
        self.optimizer.set_hyperparams(group, hyper)?;
        self.hyper_stale = true;
        Ok(())
    }

    /// Freezes (`false`) or unfreezes a parameter; see
    /// [`zero_core::Engine::set_trainable`].
    pub fn set_trainable(&mut self, name: &str, trainable: bool) -> Result<()> {
        let Some(&i) = self.setup.index.get(name) else {
            return Err(Error::Config(format!(
                "set_trainable: {name:?} is not a parameter of the model"
            )));
        };
        if trainable && !self.params[i].trainable {
            return Err(Error::Config(format!(
                "parameter {name:?} was frozen when the optimizer was built and owns no shard; \
                 rebuild the optimizer with it trainable"
            )));
        }
        self.trainable[i] = trainable;
        Ok(())
    }

    /// The trainable mask in effect.
    pub fn active_mask(&self) -> &[bool] {
        &self.active
    }

    /// Device bytes this rank holds, per category (`params` counts the
    /// framework's replica and the engine's shard copy).
    pub fn memory_report(&self) -> MemoryReport {
        let size = std::mem::size_of::<f32>();
        let len = |b: &Option<CudaSlice<f32>>| b.as_ref().map_or(0, CudaSlice::len);
        let replica: usize = self
            .params
            .iter()
            .map(|p| p.numel() * p.dtype.size_in_bytes())
            .sum();
        MemoryReport {
            params: replica + self.param_shard.len() * size,
            grads: len(&self.full_grads) * size,
            grad_shard: len(&self.grad_shard) * size,
            optimizer_state: self.device_optimizer.state_bytes(),
            comm_buffers: len(&self.bucket_buf) * size,
        }
    }

    fn stream(&self) -> Arc<CudaStream> {
        self.comm.compute_stream().clone()
    }

    fn check_grads(&self, grads: &[Option<&dyn DevicePtr<f32>>]) -> Result<()> {
        if grads.len() != self.params.len() {
            return Err(Error::Config(format!(
                "got {} gradient slots for {} parameters; pass one per parameter (None for none)",
                grads.len(),
                self.params.len()
            )));
        }
        for (p, g) in self.params.iter().zip(grads) {
            if let Some(g) = g {
                if g.len() != p.numel() {
                    return Err(Error::Config(format!(
                        "gradient of {:?} has {} elements, the parameter {}; pass each \
                         parameter's whole, contiguous gradient in parameter order",
                        p.name,
                        g.len(),
                        p.numel()
                    )));
                }
            }
        }
        Ok(())
    }

    /// The bucket's pieces of the gradients present, as flatten entries
    /// (position in the bucket, gradient, element range).
    fn bucket_pieces<'g>(
        layout: &Layout,
        k: usize,
        grads: &[Option<&'g dyn DevicePtr<f32>>],
    ) -> Vec<(usize, &'g dyn DevicePtr<f32>, Range<usize>)> {
        let start = layout.bucket_range(k).start;
        layout
            .runs_of(k)
            .iter()
            .filter_map(|run| {
                grads[run.param].map(|g| (run.pos - start, g, run.param_range.clone()))
            })
            .collect()
    }

    /// Adds one micro-step's gradients without communicating.
    pub fn accumulate(&mut self, grads: &[Option<&dyn DevicePtr<f32>>]) -> Result<()> {
        self.check_grads(grads)?;
        let stream = self.stream();
        if self.full_grads.is_none() {
            let n = self.setup.plan.flat_numel();
            self.full_grads = Some(stream.alloc_zeros(n).map_err(cuda)?);
        }
        let Some(full) = self.full_grads.as_mut() else {
            unreachable!("allocated above");
        };
        if self.micro_steps == 0 {
            stream.memset_zeros(full).map_err(cuda)?;
        }
        for k in 0..self.setup.layout.buckets.len() {
            let pieces = Self::bucket_pieces(&self.setup.layout, k, grads);
            let mut bucket = full.slice_mut(self.setup.layout.bucket_range(k));
            self.kernels
                .flatten_ranges(&stream, &pieces, &mut bucket, true)
                .map_err(nccl)?;
        }
        for (present, g) in self.present.iter_mut().zip(grads) {
            *present |= g.is_some();
        }
        self.micro_steps += 1;
        Ok(())
    }

    /// One micro-step: on the last of `grad_accum_steps` it reduces, steps
    /// and updates `params` (returning `Some`); before that it accumulates.
    pub fn step(
        &mut self,
        grads: &[Option<&dyn DevicePtr<f32>>],
        params: &mut dyn DeviceParams,
    ) -> Result<Option<StepReport>> {
        if self.micro_steps + 1 < self.config.grad_accum_steps {
            self.accumulate(grads)?;
            return Ok(None);
        }
        self.check_grads(grads)?;
        self.reduce_and_update(Some(grads), params).map(Some)
    }

    /// Finishes an optimizer step from the micro-steps accumulated so far.
    pub fn step_accumulated(&mut self, params: &mut dyn DeviceParams) -> Result<StepReport> {
        if self.micro_steps == 0 {
            return Err(Error::State(
                "step_accumulated called with no accumulated micro-step; call accumulate first"
                    .into(),
            ));
        }
        self.reduce_and_update(None, params)
    }

    fn reduce_and_update(
        &mut self,
        last: Option<&[Option<&dyn DevicePtr<f32>>]>,
        params: &mut dyn DeviceParams,
    ) -> Result<StepReport> {
        let micro_steps = self.micro_steps + usize::from(last.is_some());
        if let Some(grads) = last {
            for (present, g) in self.present.iter_mut().zip(grads) {
                *present |= g.is_some();
            }
        }
        if self.config.check_trainability {
            let local: Vec<bool> = self
                .trainable
                .iter()
                .zip(&self.present)
                .map(|(&t, &p)| t && p)
                .collect();
            let active = self.global_mask(&local)?;
            if active != self.active {
                tracing::debug!("trainable mask changed; rebuilding buckets");
                self.active = active;
                self.rebuild_buckets();
            }
        }
        if self.hyper_stale {
            self.device_optimizer.refresh(self.optimizer.as_ref())?;
            self.hyper_stale = false;
        }

        // The owned pieces' current values (the user may have loaded
        // weights since the last step).
        let stream = self.stream();
        for piece in &self.setup.owned {
            let at = self.setup.shard_offset(piece);
            let shard = &mut self.param_shard;
            params.with_param(piece.param, &mut |src| {
                copy_range(
                    &stream,
                    src,
                    piece.param_range.start,
                    shard,
                    at,
                    piece.len(),
                )
            })?;
        }

        self.reduce_gradients(last, micro_steps)?;
        let grad_norm = self.clip_gradients()?;
        self.run_optimizer()?;
        self.write_back(params)?;

        self.micro_steps = 0;
        self.present.fill(false);
        if self.config.stage == Stage::Gradients {
            self.full_grads = None;
        }
        self.steps += 1;
        Ok(StepReport {
            grad_norm,
            micro_steps,
        })
    }

    fn reduce_gradients(
        &mut self,
        last: Option<&[Option<&dyn DevicePtr<f32>>]>,
        micro_steps: usize,
    ) -> Result<()> {
        let stream = self.stream();
        let layout = &self.setup.layout;
        if self.full_grads.is_none() {
            let longest = (0..layout.buckets.len())
                .map(|k| layout.bucket_range(k).len())
                .max()
                .unwrap_or(0);
            if self.bucket_buf.as_ref().map_or(0, CudaSlice::len) < longest {
                self.bucket_buf = Some(stream.alloc_zeros(longest).map_err(cuda)?);
            }
        }
        for k in 0..layout.buckets.len() {
            if !self.bucket_active[k] {
                continue;
            }
            let range = layout.bucket_range(k);
            let shard_range = layout.buckets[k].clone();
            let pieces = match last {
                Some(grads) => Self::bucket_pieces(layout, k, grads),
                None => Vec::new(),
            };
            let (mut bucket, add) = match self.full_grads.as_mut() {
                Some(full) => (full.slice_mut(range.clone()), self.micro_steps > 0),
                None => match self.bucket_buf.as_mut() {
                    Some(buf) => (buf.slice_mut(0..range.len()), false),
                    None => unreachable!("allocated above"),
                },
            };
            if !add {
                stream.memset_zeros(&mut bucket).map_err(cuda)?;
            }
            self.kernels
                .flatten_ranges(&stream, &pieces, &mut bucket, add)
                .map_err(nccl)?;
            match self.grad_shard.as_mut() {
                None => self
                    .comm
                    .all_reduce_view(&mut bucket, ReduceOp::Avg)
                    .map_err(nccl)?,
                Some(shard) => self
                    .comm
                    .reduce_scatter_view(&bucket, &mut shard.slice_mut(shard_range), ReduceOp::Avg)
                    .map_err(nccl)?,
            }
        }
        if micro_steps > 1 {
            self.scale_grads(1.0 / micro_steps as f64)?;
        }
        Ok(())
    }

    /// The owned pieces that train this step, as shard ranges; neighbours
    /// that both train are merged across the padding between them (zero in
    /// every gradient buffer), so scaling and norms take few launches.
    fn active_ranges(&self) -> Vec<Range<usize>> {
        let mut ranges: Vec<Range<usize>> = Vec::new();
        let mut previous_active = false;
        for piece in &self.setup.owned {
            let active = self.active[piece.param];
            if active {
                let at = self.setup.shard_offset(piece);
                match ranges.last_mut() {
                    Some(last) if previous_active => last.end = at + piece.len(),
                    _ => ranges.push(at..at + piece.len()),
                }
            }
            previous_active = active;
        }
        ranges
    }

    fn scale_grads(&mut self, factor: f64) -> Result<()> {
        let stream = self.stream();
        let ranges = self.active_ranges();
        let source = match (self.grad_shard.as_mut(), self.full_grads.as_mut()) {
            (Some(shard), _) => shard,
            (None, Some(full)) => full,
            (None, None) => return Err(Error::State("no reduced gradients to scale".into())),
        };
        for range in ranges {
            self.kernels
                .scale(&stream, &mut source.slice_mut(range), factor as f32)
                .map_err(nccl)?;
        }
        Ok(())
    }

    fn clip_gradients(&mut self) -> Result<Option<f64>> {
        let norm_type = match (&self.config.clip, self.config.compute_grad_norm) {
            (Some(clip), _) => clip.norm_type,
            (None, true) => NormType::L2,
            (None, false) => return Ok(None),
        };
        let kind = match norm_type {
            NormType::L1 => NormKind::L1,
            NormType::L2 => NormKind::L2,
            NormType::Inf => NormKind::Inf,
        };
        let stream = self.stream();
        self.norm.reset(&stream).map_err(nccl)?;
        let ranges = self.active_ranges();
        let source = match (self.grad_shard.as_ref(), self.full_grads.as_ref()) {
            (Some(g), _) | (None, Some(g)) => g,
            (None, None) => return Err(Error::State("no reduced gradients to measure".into())),
        };
        for range in ranges {
            self.kernels
                .norm_partial(&stream, &source.slice(range), kind, &mut self.norm)
                .map_err(nccl)?;
        }
        // The norm is needed on the host (the clipping coefficient, the
        // report): one synchronization, as with any clipping.
        let local = self.norm.read(&stream, kind).map_err(nccl)?;
        let total = if self.config.stage == Stage::Ddp {
            local
        } else {
            let op = match norm_type {
                NormType::Inf => ReduceOp::Max,
                _ => ReduceOp::Sum,
            };
            self.host_all_reduce(&[local], op)?[0]
        };
        let norm = match norm_type {
            NormType::L2 => total.sqrt(),
            _ => total,
        };
        if let Some(clip) = self.config.clip {
            let coef = clip.max_norm / (norm + 1e-6);
            if coef < 1.0 {
                self.scale_grads(coef)?;
            }
        }
        Ok(Some(norm))
    }

    fn run_optimizer(&mut self) -> Result<()> {
        let slots: Vec<PieceSlot> = self
            .setup
            .owned
            .iter()
            .zip(&self.piece_steps)
            .map(|(p, &steps)| {
                let at = self.setup.shard_offset(p);
                PieceSlot {
                    range: at..at + p.len(),
                    group: self.setup.group_of[p.param],
                    step: steps + 1,
                    active: self.active[p.param],
                }
            })
            .collect();
        let segments = plan_segments(&self.setup.layout.buckets, &self.bucket_active, &slots);
        let stream = self.stream();
        // The reduced gradients: the shard in stages 1 and 2, the full
        // buffer in stage 0 (a plan over one rank: shard offsets are flat).
        let grads = match (self.grad_shard.as_ref(), self.full_grads.as_ref()) {
            (Some(g), _) | (None, Some(g)) => g,
            (None, None) => return Err(Error::State("no reduced gradients to step".into())),
        };
        self.device_optimizer.step(
            &self.kernels,
            &stream,
            &mut self.param_shard,
            grads,
            &segments,
        )?;
        for (steps, slot) in self.piece_steps.iter_mut().zip(&slots) {
            if slot.active {
                *steps += 1;
            }
        }
        Ok(())
    }

    fn write_back(&mut self, params: &mut dyn DeviceParams) -> Result<()> {
        let stream = self.stream();
        if self.config.stage == Stage::Ddp {
            let owned: Vec<&ShardPiece> = self
                .setup
                .owned
                .iter()
                .filter(|p| self.active[p.param])
                .collect();
            for piece in owned {
                let at = self.setup.shard_offset(piece);
                let shard = &self.param_shard;
                params.with_param_mut(piece.param, &mut |dst| {
                    copy_range(
                        &stream,
                        shard,
                        at,
                        dst,
                        piece.param_range.start,
                        piece.len(),
                    )
                })?;
            }
            return Ok(());
        }
        let layout = &self.setup.layout;
        for k in 0..layout.buckets.len() {
            if !self.bucket_active[k] {
                continue;
            }
            let range = layout.bucket_range(k);
            let shard_range = layout.buckets[k].clone();
            // The gradients are consumed: gather into the full gradient
            // buffer where one exists (stage 1), else the bucket buffer.
            let mut gathered = match (self.full_grads.as_mut(), self.bucket_buf.as_mut()) {
                (Some(full), _) => full.slice_mut(range.clone()),
                (None, Some(buf)) => buf.slice_mut(0..range.len()),
                (None, None) => return Err(Error::State("no gather buffer".into())),
            };
            self.comm
                .all_gather_view(&self.param_shard.slice(shard_range), &mut gathered)
                .map_err(nccl)?;
            for run in layout.runs_of(k) {
                if self.active[run.param] {
                    let at = run.pos - range.start;
                    params.with_param_mut(run.param, &mut |dst| {
                        copy_range(
                            &stream,
                            &gathered,
                            at,
                            dst,
                            run.param_range.start,
                            run.param_range.len(),
                        )
                    })?;
                }
            }
        }
        Ok(())
    }

    fn rebuild_buckets(&mut self) {
        let layout = &self.setup.layout;
        self.bucket_active = (0..layout.buckets.len())
            .map(|k| layout.runs_of(k).iter().any(|run| self.active[run.param]))
            .collect();
    }

    /// All-reduces a few host values through a device buffer (waits).
    fn host_all_reduce(&self, values: &[f64], op: ReduceOp) -> Result<Vec<f64>> {
        let stream = self.stream();
        let mut buf = stream.clone_htod(values).map_err(cuda)?;
        self.comm.all_reduce_view(&mut buf, op).map_err(nccl)?;
        stream.clone_dtoh(&buf).map_err(cuda)
    }

    fn global_mask(&self, local: &[bool]) -> Result<Vec<bool>> {
        let mask: Vec<f64> = local.iter().map(|&b| f64::from(u8::from(b))).collect();
        let mask = self.host_all_reduce(&mask, ReduceOp::Max)?;
        Ok(mask
            .iter()
            .zip(&self.params)
            .map(|(&m, p)| m > 0.5 && p.trainable)
            .collect())
    }
}
