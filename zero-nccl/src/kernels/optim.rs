//! The built-in optimizers' steps over a flat f32 shard on the GPU, one
//! launch per call, following `torch.optim`'s documented algorithms.
//!
//! Each optimizer has hyperparameters (`*Hyper`, PyTorch's defaults) and a
//! device state (`*State`) that exports to and imports from
//! `zero_core::optim::ParamState` under PyTorch's state names, for
//! checkpoints. The step count lives in the state, as in PyTorch.
//!
//! Scalars that torch derives from Python floats (`1 - beta2`, `1 - alpha`,
//! `1 - dampening`, AdamW's `1 - lr * weight_decay`, the bias corrections)
//! are derived here in f64 and rounded to f32 once, where they meet the f32
//! tensors, as zero-core's host optimizers do; the kernels never compute
//! them in f32 (`1.0f - 0.999f` is 1.3e-5 away from `0.001f`).

use super::FusedKernels;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, SyncOnDrop};
use std::ops::Range;
use std::sync::Arc;
use zero_core::comm::check_len;
use zero_core::optim::ParamState;

/// SGD hyperparameters (`torch.optim.SGD`).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdHyper {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0: none).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
}

impl Default for SgdHyper {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

/// Adam / AdamW hyperparameters (`torch.optim.Adam`, `torch.optim.AdamW`).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Term added to the denominator.
    pub eps: f64,
    /// Weight decay: an L2 penalty for Adam, decoupled for AdamW.
    pub weight_decay: f64,
    /// Use the AMSGrad variant.
    pub amsgrad: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
    /// AdamW: decay the weights directly (`p *= 1 - lr * weight_decay`).
    pub decoupled_weight_decay: bool,
}

impl Default for AdamHyper {
    /// `torch.optim.Adam`'s defaults.
    fn default() -> Self {
        Self {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
            maximize: false,
            decoupled_weight_decay: false,
        }
    }
}

impl AdamHyper {
    /// `torch.optim.AdamW`'s defaults (weight decay 0.01, decoupled).
    pub fn adamw() -> Self {
        Self {
            weight_decay: 1e-2,
            decoupled_weight_decay: true,
            ..Self::default()
        }
    }
}

/// Adagrad hyperparameters (`torch.optim.Adagrad`).
#[derive(Clone, Debug, PartialEq)]
pub struct AdagradHyper {
    /// Learning rate.
    pub lr: f64,
    /// Learning-rate decay.
    pub lr_decay: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Starting value of the sum of squares.
    pub initial_accumulator_value: f64,
    /// Term added to the denominator.
    pub eps: f64,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
}

impl Default for AdagradHyper {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            lr_decay: 0.0,
            weight_decay: 0.0,
            initial_accumulator_value: 0.0,
            eps: 1e-10,
            maximize: false,
        }
    }
}

/// RMSprop hyperparameters (`torch.optim.RMSprop`).
#[derive(Clone, Debug, PartialEq)]
pub struct RmspropHyper {
    /// Learning rate.
    pub lr: f64,
    /// Smoothing constant.
    pub alpha: f64,
    /// Term added to the denominator.
    pub eps: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Momentum factor (0: none).
    pub momentum: f64,
    /// Normalize by an estimate of the gradient's variance.
    pub centered: bool,
    /// Maximize the objective instead of minimizing it.
    pub maximize: bool,
}

impl Default for RmspropHyper {
    fn default() -> Self {
        Self {
            lr: 1e-2,
            alpha: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            centered: false,
            maximize: false,
        }
    }
}

/// A device optimizer state that round-trips through host memory for checkpoints.
pub trait DeviceState: Sized {
    /// Copies the state to the host, under PyTorch's names (blocks the host).
    fn export(&self, stream: &Arc<CudaStream>) -> Result<ParamState<f32>>;

    /// Uploads a state of `len` elements exported by [`DeviceState::export`]
    /// (or by the host optimizers of `zero-core`).
    fn import(stream: &Arc<CudaStream>, state: &ParamState<f32>, len: usize) -> Result<Self>;
}

/// SGD's state: the momentum buffer (allocated on the first step with momentum).
///
/// torch keeps one buffer per parameter and starts it as a copy of the
/// gradient on that parameter's first step with momentum. Here one flat
/// buffer covers the whole shard, allocated by the first step with momentum
/// of any part of it, so the state also remembers which elements no step
/// with momentum has written yet: those start from the gradient whenever
/// they are first stepped with momentum, whether later in the same step (the
/// engine steps a shard segment by segment), after a step without a gradient,
/// or when their group switches momentum on later.
#[derive(Debug)]
pub struct SgdState {
    /// `momentum_buffer`, once a step with momentum has run.
    pub momentum_buffer: Option<CudaSlice<f32>>,
    /// Steps taken.
    pub step: u64,
    /// Elements of `momentum_buffer` that no step with momentum has written.
    unstarted: UnstartedRanges,
}

/// Adam's and AdamW's state.
#[derive(Debug)]
pub struct AdamState {
    /// `exp_avg`: running average of the gradient.
    pub exp_avg: CudaSlice<f32>,
    /// `exp_avg_sq`: running average of the squared gradient.
    pub exp_avg_sq: CudaSlice<f32>,
    /// `max_exp_avg_sq` (AMSGrad only).
    pub max_exp_avg_sq: Option<CudaSlice<f32>>,
    /// Steps taken (`step`).
    pub step: u64,
}

/// Adagrad's state.
#[derive(Debug)]
pub struct AdagradState {
    /// `sum` of squared gradients.
    pub sum: CudaSlice<f32>,
    /// Steps taken.
    pub step: u64,
}

/// RMSprop's state.
#[derive(Debug)]
pub struct RmspropState {
    /// `square_avg`.
    pub square_avg: CudaSlice<f32>,
    /// `grad_avg` (centered only).
    pub grad_avg: Option<CudaSlice<f32>>,
    /// `momentum_buffer` (momentum > 0 only).
    pub momentum_buffer: Option<CudaSlice<f32>>,
    /// Steps taken.
    pub step: u64,
}

impl SgdState {
    /// A fresh state for a shard (the buffer comes with the first step).
    pub fn new() -> Self {
        Self {
            momentum_buffer: None,
            step: 0,
            unstarted: UnstartedRanges::default(),
        }
    }

    /// The element ranges of `momentum_buffer` that no step with momentum
    /// has written (ascending, disjoint): torch has no `momentum_buffer` for
    /// their parameters yet, so an exporter should leave them out.
    pub fn momentum_unstarted(&self) -> &[Range<usize>] {
        &self.unstarted.0
    }

    /// Marks `range` of the momentum buffer as not started: its next step
    /// with momentum copies the gradient into it. For importers whose
    /// checkpoint has no `momentum_buffer` for some parameters ([`DeviceState::import`]
    /// treats an imported buffer as started everywhere).
    pub fn mark_momentum_unstarted(&mut self, range: Range<usize>) {
        self.unstarted.insert(range);
    }
}

/// Sorted, disjoint, non-empty element ranges: the parts of a lazily
/// allocated buffer that no step has written yet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct UnstartedRanges(Vec<Range<usize>>);

impl UnstartedRanges {
    /// All of a buffer of `len` elements.
    fn all(len: usize) -> Self {
        let mut ranges = Self::default();
        ranges.insert(0..len);
        ranges
    }

    /// Adds `range`, merging it with its neighbours.
    fn insert(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        self.0.push(range);
        self.0.sort_unstable_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::with_capacity(self.0.len());
        for r in self.0.drain(..) {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        self.0 = merged;
    }

    /// Cuts `range` into consecutive non-empty pieces, each wholly unstarted
    /// (`true`) or wholly started (`false`), and marks all of it started.
    fn take(&mut self, range: Range<usize>) -> Vec<(Range<usize>, bool)> {
        let mut pieces = Vec::new();
        let mut cursor = range.start;
        let mut kept = Vec::with_capacity(self.0.len() + 1);
        for r in self.0.drain(..) {
            let (start, end) = (r.start.max(range.start), r.end.min(range.end));
            if start >= end {
                kept.push(r);
                continue;
            }
            if cursor < start {
                pieces.push((cursor..start, false));
            }
            pieces.push((start..end, true));
            cursor = end;
            if r.start < start {
                kept.push(r.start..start);
            }
            if end < r.end {
                kept.push(end..r.end);
            }
        }
        if cursor < range.end {
            pieces.push((cursor..range.end, false));
        }
        self.0 = kept;
        pieces
    }
}

impl Default for SgdState {
    fn default() -> Self {
        Self::new()
    }
}

impl AdamState {
    /// A zeroed state for a shard of `len` elements.
    pub fn new(stream: &Arc<CudaStream>, len: usize, hyper: &AdamHyper) -> Result<Self> {
        Ok(Self {
            exp_avg: stream.alloc_zeros(len)?,
            exp_avg_sq: stream.alloc_zeros(len)?,
            max_exp_avg_sq: if hyper.amsgrad {
                Some(stream.alloc_zeros(len)?)
            } else {
                None
            },
            step: 0,
        })
    }
}

impl AdagradState {
    /// A state for `len` elements, the sums set to `initial_accumulator_value`.
    pub fn new(stream: &Arc<CudaStream>, len: usize, hyper: &AdagradHyper) -> Result<Self> {
        let init = vec![hyper.initial_accumulator_value as f32; len];
        Ok(Self {
            sum: stream.clone_htod(&init)?,
            step: 0,
        })
    }
}

impl RmspropState {
    /// A zeroed state for a shard of `len` elements.
    pub fn new(stream: &Arc<CudaStream>, len: usize, hyper: &RmspropHyper) -> Result<Self> {
        Ok(Self {
            square_avg: stream.alloc_zeros(len)?,
            grad_avg: if hyper.centered {
                Some(stream.alloc_zeros(len)?)
            } else {
                None
            },
            momentum_buffer: if hyper.momentum > 0.0 {
                Some(stream.alloc_zeros(len)?)
            } else {
                None
            },
            step: 0,
        })
    }
}

fn flag(b: bool) -> i32 {
    i32::from(b)
}

/// `1 - x` as torch computes it from a Python float: in f64, then rounded to
/// f32 once where it meets the f32 tensors.
fn complement(x: f64) -> f32 {
    (1.0 - x) as f32
}

/// The scalars of one Adam step as `adam_f32` takes them, in the order
/// torch's `_single_tensor_adam` derives them.
#[derive(Clone, Copy, Debug, PartialEq)]
struct AdamScalars {
    /// The L2 penalty added to the gradient (Adam); 0 for AdamW.
    weight_decay: f32,
    /// AdamW's `1 - lr * weight_decay`; exactly 1 otherwise.
    param_decay: f32,
    /// The weight of `exp_avg.lerp_(grad, 1 - beta1)`.
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    /// `-lr / (1 - beta1^t)`.
    neg_step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    bias_correction2_sqrt: f32,
}

impl AdamScalars {
    fn new(hyper: &AdamHyper, step: u64) -> Self {
        let (beta1, beta2) = hyper.betas;
        let step = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(step);
        let bias_correction2 = 1.0 - beta2.powf(step);
        let step_size = hyper.lr / bias_correction1;
        let decoupled = hyper.decoupled_weight_decay;
        Self {
            weight_decay: if decoupled {
                0.0
            } else {
                hyper.weight_decay as f32
            },
            param_decay: if decoupled && hyper.weight_decay != 0.0 {
                complement(hyper.lr * hyper.weight_decay)
            } else {
                1.0
            },
            one_minus_beta1: complement(beta1),
            beta2: beta2 as f32,
            one_minus_beta2: complement(beta2),
            eps: hyper.eps as f32,
            neg_step_size: (-step_size) as f32,
            bias_correction2_sqrt: bias_correction2.sqrt() as f32,
        }
    }
}

/// The address of element `at` of a state buffer of at least `at + n`
/// elements, with its event guard.
fn state_ptr<'a>(
    op: &'static str,
    what: &'static str,
    buf: &'a mut CudaSlice<f32>,
    stream: &'a CudaStream,
    at: usize,
    n: usize,
) -> Result<(u64, SyncOnDrop<'a>)> {
    if at + n > buf.len() {
        return Err(Error::from(zero_core::Error::BufferSize {
            op,
            what,
            got: buf.len(),
            expected: at + n,
        }));
    }
    let (ptr, guard) = buf.device_ptr_mut(stream);
    Ok((ptr + (at * std::mem::size_of::<f32>()) as u64, guard))
}

/// [`state_ptr`] for an optional buffer: null when absent (the kernels do
/// not touch it then).
fn opt_state_ptr<'a>(
    op: &'static str,
    what: &'static str,
    buf: &'a mut Option<CudaSlice<f32>>,
    stream: &'a CudaStream,
    at: usize,
    n: usize,
) -> Result<(u64, Option<SyncOnDrop<'a>>)> {
    match buf.as_mut() {
        Some(b) => {
            let (ptr, guard) = state_ptr(op, what, b, stream, at, n)?;
            Ok((ptr, Some(guard)))
        }
        None => Ok((0, None)),
    }
}

/// Allocates a zeroed optional state buffer of `len` elements when `wanted`
/// and absent; returns whether it did.
fn ensure_buffer(
    stream: &Arc<CudaStream>,
    buf: &mut Option<CudaSlice<f32>>,
    wanted: bool,
    len: usize,
) -> Result<bool> {
    if wanted && buf.is_none() {
        *buf = Some(stream.alloc_zeros(len)?);
        return Ok(true);
    }
    Ok(false)
}

/// Parameters and gradients of one launch: `n` elements each.
fn param_grad_ptrs<'a>(
    op: &'static str,
    stream: &'a CudaStream,
    params: &'a mut dyn DevicePtrMut<f32>,
    grads: &'a dyn DevicePtr<f32>,
) -> Result<(usize, [(u64, SyncOnDrop<'a>); 2])> {
    let n = params.len();
    check_len(op, "grads", grads.len(), n)?;
    Ok((n, [params.device_ptr_mut(stream), grads.device_ptr(stream)]))
}

impl FusedKernels {
    /// One SGD step over `params` (a flat shard) with `grads`.
    pub fn sgd_step(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        state: &mut SgdState,
        hyper: &SgdHyper,
    ) -> Result<()> {
        let step = state.step + 1;
        let len = params.len();
        self.sgd_step_at(stream, params, grads, state, 0, len, step, hyper)?;
        state.step = step;
        Ok(())
    }

    /// One SGD step of `params` (`n` elements) with the state elements
    /// `at..at + n` of a state covering `state_len` elements. SGD's update
    /// does not depend on the step count (`_step`, kept so that every
    /// `*_step_at` reads alike): the momentum buffer starts from the
    /// gradient wherever no step with momentum has written it yet (see
    /// [`SgdState`]), which can split the call into a few launches.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd_step_at(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut dyn DevicePtrMut<f32>,
        grads: &dyn DevicePtr<f32>,
        state: &mut SgdState,
        at: usize,
        state_len: usize,
        _step: u64,
        hyper: &SgdHyper,
    ) -> Result<()> {
        const OP: &str = "sgd_step";
        // torch keeps the buffer None until the first step with momentum,
        // and without momentum neither creates nor touches it.
        let momentum = hyper.momentum != 0.0;
        if ensure_buffer(stream, &mut state.momentum_buffer, momentum, state_len)? {
            state.unstarted = UnstartedRanges::all(state_len);
        }
        let (n, [(p, _gp), (g, _gg)]) = param_grad_ptrs(OP, stream, params, grads)?;
        let (buf, _gb) = opt_state_ptr(
            OP,
            "momentum_buffer",
            &mut state.momentum_buffer,
            stream,
            at,
            n,
        )?;
        let pieces = if momentum {
            state.unstarted.take(at..at + n)
        } else {
            vec![(at..at + n, false)]
        };
        let (lr, momentum, one_minus_dampening, wd) = (
            hyper.lr as f32,
            hyper.momentum as f32,
            complement(hyper.dampening),
            hyper.weight_decay as f32,
        );
        let (nesterov, maximize) = (flag(hyper.nesterov), flag(hyper.maximize));
        for (range, unstarted) in pieces {
            let skip = ((range.start - at) * std::mem::size_of::<f32>()) as u64;
            let (p, g) = (p + skip, g + skip);
            let buf = if buf == 0 { 0 } else { buf + skip };
            let len = range.len();
            let (len64, first) = (len as u64, flag(unstarted));
            let mut launch = stream.launch_builder(&self.sgd);
            launch
                .arg(&p)
                .arg(&g)
                .arg(&buf)
                .arg(&len64)
                .arg(&lr)
                .arg(&momentum)
                .arg(&one_minus_dampening)
                .arg(&wd)
                .arg(&nesterov)
                .arg(&maximize)
                .arg(&first);
            // SAFETY: p, g and buf (when momentum != 0) address n f32 each
            // (checked above) and `range` lies within those n, whose guards
            // live until the end of the function; the argument list matches
            // `sgd_f32`'s signature.
            unsafe { launch.launch(self.config(len)) }?;
        }
        Ok(())
    }

    /// One Adam (or AdamW, see [`AdamHyper::decoupled_weight_decay`]) step.
    pub fn adam_step(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        state: &mut AdamState,
        hyper: &AdamHyper,
    ) -> Result<()> {
        let step = state.step + 1;
        self.adam_step_at(stream, params, grads, state, 0, step, hyper)?;
        state.step = step;
        Ok(())
    }

    /// One Adam step of `params` with the state elements `at..at + n`;
    /// `step` is the step being taken (1 for the first; it sets the bias
    /// corrections). The step count is the caller's.
    #[allow(clippy::too_many_arguments)]
    pub fn adam_step_at(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut dyn DevicePtrMut<f32>,
        grads: &dyn DevicePtr<f32>,
        state: &mut AdamState,
        at: usize,
        step: u64,
        hyper: &AdamHyper,
    ) -> Result<()> {
        const OP: &str = "adam_step";
        // AMSGrad switched on mid-run starts its maximum from zeros, as
        // zero-core's host Adam does.
        let state_len = state.exp_avg.len();
        ensure_buffer(stream, &mut state.max_exp_avg_sq, hyper.amsgrad, state_len)?;
        let c = AdamScalars::new(hyper, step);
        let (n, [(p, _gp), (g, _gg)]) = param_grad_ptrs(OP, stream, params, grads)?;
        let (m, _gm) = state_ptr(OP, "exp_avg", &mut state.exp_avg, stream, at, n)?;
        let (v, _gv) = state_ptr(OP, "exp_avg_sq", &mut state.exp_avg_sq, stream, at, n)?;
        let (vmax, _gvm) = opt_state_ptr(
            OP,
            "max_exp_avg_sq",
            &mut state.max_exp_avg_sq,
            stream,
            at,
            n,
        )?;
        let n64 = n as u64;
        let (amsgrad, maximize) = (flag(hyper.amsgrad), flag(hyper.maximize));
        let mut launch = stream.launch_builder(&self.adam);
        launch
            .arg(&p)
            .arg(&g)
            .arg(&m)
            .arg(&v)
            .arg(&vmax)
            .arg(&n64)
            .arg(&c.weight_decay)
            .arg(&c.param_decay)
            .arg(&c.one_minus_beta1)
            .arg(&c.beta2)
            .arg(&c.one_minus_beta2)
            .arg(&c.eps)
            .arg(&c.neg_step_size)
            .arg(&c.bias_correction2_sqrt)
            .arg(&amsgrad)
            .arg(&maximize);
        // SAFETY: every buffer addresses n f32 (checked above; vmax exists when
        // amsgrad), and the argument list matches `adam_f32`'s signature.
        unsafe { launch.launch(self.config(n)) }?;
        Ok(())
    }

    /// One Adagrad step.
    pub fn adagrad_step(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        state: &mut AdagradState,
        hyper: &AdagradHyper,
    ) -> Result<()> {
        let step = state.step + 1;
        self.adagrad_step_at(stream, params, grads, state, 0, step, hyper)?;
        state.step = step;
        Ok(())
    }

    /// One Adagrad step of `params` with the state elements `at..at + n`.
    #[allow(clippy::too_many_arguments)]
    pub fn adagrad_step_at(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut dyn DevicePtrMut<f32>,
        grads: &dyn DevicePtr<f32>,
        state: &mut AdagradState,
        at: usize,
        step: u64,
        hyper: &AdagradHyper,
    ) -> Result<()> {
        const OP: &str = "adagrad_step";
        let clr = (hyper.lr / (1.0 + (step as f64 - 1.0) * hyper.lr_decay)) as f32;
        let (n, [(p, _gp), (g, _gg)]) = param_grad_ptrs(OP, stream, params, grads)?;
        let (s, _gs) = state_ptr(OP, "sum", &mut state.sum, stream, at, n)?;
        let n64 = n as u64;
        let (wd, eps, maximize) = (
            hyper.weight_decay as f32,
            hyper.eps as f32,
            flag(hyper.maximize),
        );
        let mut launch = stream.launch_builder(&self.adagrad);
        launch
            .arg(&p)
            .arg(&g)
            .arg(&s)
            .arg(&n64)
            .arg(&clr)
            .arg(&wd)
            .arg(&eps)
            .arg(&maximize);
        // SAFETY: every buffer addresses n f32 (checked above), and the
        // argument list matches `adagrad_f32`'s signature.
        unsafe { launch.launch(self.config(n)) }?;
        Ok(())
    }

    /// One RMSprop step.
    pub fn rmsprop_step(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        state: &mut RmspropState,
        hyper: &RmspropHyper,
    ) -> Result<()> {
        self.rmsprop_step_at(stream, params, grads, state, 0, hyper)?;
        state.step += 1;
        Ok(())
    }

    /// One RMSprop step of `params` with the state elements `at..at + n`
    /// (RMSprop's update does not depend on the step count).
    pub fn rmsprop_step_at(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut dyn DevicePtrMut<f32>,
        grads: &dyn DevicePtr<f32>,
        state: &mut RmspropState,
        at: usize,
        hyper: &RmspropHyper,
    ) -> Result<()> {
        const OP: &str = "rmsprop_step";
        // torch creates these zeroed with the rest of the state, on the
        // first step; switched on later (where torch raises a KeyError)
        // they start from zeros too, as in zero-core's host RMSprop.
        let state_len = state.square_avg.len();
        ensure_buffer(stream, &mut state.grad_avg, hyper.centered, state_len)?;
        ensure_buffer(
            stream,
            &mut state.momentum_buffer,
            hyper.momentum > 0.0,
            state_len,
        )?;
        let (n, [(p, _gp), (g, _gg)]) = param_grad_ptrs(OP, stream, params, grads)?;
        let (sq, _gsq) = state_ptr(OP, "square_avg", &mut state.square_avg, stream, at, n)?;
        let (ga, _gga) = opt_state_ptr(OP, "grad_avg", &mut state.grad_avg, stream, at, n)?;
        let (buf, _gb) = opt_state_ptr(
            OP,
            "momentum_buffer",
            &mut state.momentum_buffer,
            stream,
            at,
            n,
        )?;
        let n64 = n as u64;
        let (lr, alpha, one_minus_alpha, eps, wd, momentum) = (
            hyper.lr as f32,
            hyper.alpha as f32,
            complement(hyper.alpha),
            hyper.eps as f32,
            hyper.weight_decay as f32,
            hyper.momentum as f32,
        );
        let (centered, maximize) = (flag(hyper.centered), flag(hyper.maximize));
        let mut launch = stream.launch_builder(&self.rmsprop);
        launch
            .arg(&p)
            .arg(&g)
            .arg(&sq)
            .arg(&ga)
            .arg(&buf)
            .arg(&n64)
            .arg(&lr)
            .arg(&alpha)
            .arg(&one_minus_alpha)
            .arg(&eps)
            .arg(&wd)
            .arg(&momentum)
            .arg(&centered)
            .arg(&maximize);
        // SAFETY: every buffer addresses n f32 (checked above; grad_avg and
        // the momentum buffer exist when used), and the argument list
        // matches `rmsprop_f32`'s signature.
        unsafe { launch.launch(self.config(n)) }?;
        Ok(())
    }
}

fn download(
    stream: &Arc<CudaStream>,
    out: &mut ParamState<f32>,
    name: &str,
    buf: Option<&CudaSlice<f32>>,
) -> Result<()> {
    if let Some(buf) = buf {
        out.tensors
            .insert(name.to_string(), stream.clone_dtoh(buf)?);
    }
    Ok(())
}

fn upload(
    stream: &Arc<CudaStream>,
    state: &ParamState<f32>,
    name: &'static str,
    len: usize,
) -> Result<Option<CudaSlice<f32>>> {
    match state.tensors.get(name) {
        None => Ok(None),
        Some(host) => {
            check_len("import_state", name, host.len(), len)?;
            Ok(Some(stream.clone_htod(host)?))
        }
    }
}

fn required(
    stream: &Arc<CudaStream>,
    state: &ParamState<f32>,
    name: &'static str,
    len: usize,
) -> Result<CudaSlice<f32>> {
    upload(stream, state, name, len)?.ok_or_else(|| {
        Error::from(zero_core::Error::Unsupported {
            op: "import_state",
            detail: format!("the state has no `{name}` tensor"),
        })
    })
}

fn step_of(state: &ParamState<f32>) -> u64 {
    state.scalars.get("step").map_or(0, |&s| s.max(0.0) as u64)
}

fn with_step(step: u64) -> ParamState<f32> {
    let mut out = ParamState::default();
    out.scalars.insert("step".to_string(), step as f64);
    out
}

impl DeviceState for SgdState {
    fn export(&self, stream: &Arc<CudaStream>) -> Result<ParamState<f32>> {
        let mut out = with_step(self.step);
        download(
            stream,
            &mut out,
            "momentum_buffer",
            self.momentum_buffer.as_ref(),
        )?;
        Ok(out)
    }

    fn import(stream: &Arc<CudaStream>, state: &ParamState<f32>, len: usize) -> Result<Self> {
        // An imported buffer counts as started everywhere; see
        // `SgdState::mark_momentum_unstarted` for parameters that had none.
        Ok(Self {
            momentum_buffer: upload(stream, state, "momentum_buffer", len)?,
            step: step_of(state),
            unstarted: UnstartedRanges::default(),
        })
    }
}

impl DeviceState for AdamState {
    fn export(&self, stream: &Arc<CudaStream>) -> Result<ParamState<f32>> {
        let mut out = with_step(self.step);
        download(stream, &mut out, "exp_avg", Some(&self.exp_avg))?;
        download(stream, &mut out, "exp_avg_sq", Some(&self.exp_avg_sq))?;
        download(
            stream,
            &mut out,
            "max_exp_avg_sq",
            self.max_exp_avg_sq.as_ref(),
        )?;
        Ok(out)
    }

    fn import(stream: &Arc<CudaStream>, state: &ParamState<f32>, len: usize) -> Result<Self> {
        Ok(Self {
            exp_avg: required(stream, state, "exp_avg", len)?,
            exp_avg_sq: required(stream, state, "exp_avg_sq", len)?,
            max_exp_avg_sq: upload(stream, state, "max_exp_avg_sq", len)?,
            step: step_of(state),
        })
    }
}

impl DeviceState for AdagradState {
    fn export(&self, stream: &Arc<CudaStream>) -> Result<ParamState<f32>> {
        let mut out = with_step(self.step);
        download(stream, &mut out, "sum", Some(&self.sum))?;
        Ok(out)
    }

    fn import(stream: &Arc<CudaStream>, state: &ParamState<f32>, len: usize) -> Result<Self> {
        Ok(Self {
            sum: required(stream, state, "sum", len)?,
            step: step_of(state),
        })
    }
}

impl DeviceState for RmspropState {
    fn export(&self, stream: &Arc<CudaStream>) -> Result<ParamState<f32>> {
        let mut out = with_step(self.step);
        download(stream, &mut out, "square_avg", Some(&self.square_avg))?;
        download(stream, &mut out, "grad_avg", self.grad_avg.as_ref())?;
        download(
            stream,
            &mut out,
            "momentum_buffer",
            self.momentum_buffer.as_ref(),
        )?;
        Ok(out)
    }

    fn import(stream: &Arc<CudaStream>, state: &ParamState<f32>, len: usize) -> Result<Self> {
        Ok(Self {
            square_avg: required(stream, state, "square_avg", len)?,
            grad_avg: upload(stream, state, "grad_avg", len)?,
            momentum_buffer: upload(stream, state, "momentum_buffer", len)?,
            step: step_of(state),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complements_round_once_from_f64() {
        // What torch passes for 1 - beta2 = 1 - 0.999, 1 - alpha = 1 - 0.99, ...
        for x in [0.9, 0.99, 0.999, 0.3, 0.5] {
            assert_eq!(complement(x), (1.0 - x) as f32, "{x}");
        }
        assert_eq!(complement(0.999), 0.001f32);
        // The float complement the kernels used to take is off by 1.3e-5 relative.
        let in_float = 1.0f32 - 0.999f32;
        assert_ne!(in_float, complement(0.999));
        assert!(((in_float - 0.001) / 0.001).abs() > 1e-5);
    }

    #[test]
    fn adam_scalars_follow_torch() {
        let adam = AdamHyper {
            lr: 1e-3,
            betas: (0.9, 0.999),
            weight_decay: 0.01,
            ..AdamHyper::default()
        };
        let c = AdamScalars::new(&adam, 3);
        assert_eq!(c.weight_decay, 0.01f32);
        assert_eq!(c.param_decay, 1.0);
        assert_eq!(c.one_minus_beta1, (1.0f64 - 0.9) as f32);
        assert_eq!(c.beta2, 0.999f32);
        assert_eq!(c.one_minus_beta2, 0.001f32);
        assert_eq!(c.eps, 1e-8f32);
        // step_size = lr / (1 - beta1^t), bias_correction2_sqrt = (1 - beta2^t) ** 0.5
        assert_eq!(c.neg_step_size, (-(1e-3 / (1.0 - 0.9f64.powi(3)))) as f32);
        assert_eq!(
            c.bias_correction2_sqrt,
            (1.0 - 0.999f64.powi(3)).sqrt() as f32
        );

        let adamw = AdamHyper {
            lr: 1e-3,
            ..AdamHyper::adamw()
        };
        let c = AdamScalars::new(&adamw, 1);
        assert_eq!(c.weight_decay, 0.0, "AdamW adds no L2 term");
        assert_eq!(c.param_decay, (1.0 - 1e-3 * 1e-2) as f32);
        let plain = AdamScalars::new(
            &AdamHyper {
                weight_decay: 0.0,
                ..adamw
            },
            1,
        );
        assert_eq!(plain.param_decay, 1.0);
    }

    #[test]
    fn unstarted_ranges_split_and_shrink() {
        let mut r = UnstartedRanges::all(100);
        assert_eq!(r.take(10..20), vec![(10..20, true)]);
        assert_eq!(r.0, vec![0..10, 20..100]);
        assert_eq!(
            r.take(5..30),
            vec![(5..10, true), (10..20, false), (20..30, true)]
        );
        assert_eq!(r.0, vec![0..5, 30..100]);
        assert_eq!(r.take(0..5), vec![(0..5, true)]);
        assert_eq!(r.take(0..5), vec![(0..5, false)]);
        assert_eq!(r.take(40..40), vec![]);
        assert_eq!(r.take(30..100), vec![(30..100, true)]);
        assert!(r.0.is_empty());
        assert_eq!(UnstartedRanges::all(0).0, Vec::<Range<usize>>::new());
    }

    #[test]
    fn unstarted_ranges_merge_on_insert() {
        let mut r = UnstartedRanges::default();
        r.insert(10..20);
        r.insert(30..40);
        r.insert(5..10);
        assert_eq!(r.0, vec![5..20, 30..40]);
        r.insert(15..35);
        assert_eq!(r.0, vec![5..40]);
        r.insert(50..50);
        assert_eq!(r.0, vec![5..40]);
    }

    /// The engine steps a shard segment by segment over one state: the
    /// first segment's call allocates the buffer, and every other segment
    /// of that step must still start from its gradient, as each torch
    /// parameter does on its first step with momentum.
    #[test]
    fn momentum_switched_on_mid_run_starts_every_segment_from_the_gradient() {
        let segments = [0..300, 320..500, 512..600];
        let mut state = SgdState::new();
        // Steps 1-3 without momentum allocate nothing; step 4 allocates.
        state.unstarted = UnstartedRanges::all(600);
        for s in &segments {
            assert_eq!(state.unstarted.take(s.clone()), vec![(s.clone(), true)]);
        }
        // Step 5 continues every segment's buffer.
        for s in &segments {
            assert_eq!(state.unstarted.take(s.clone()), vec![(s.clone(), false)]);
        }
        // Padding between segments was never stepped.
        assert_eq!(state.momentum_unstarted(), &[300..320, 500..512]);
    }

    /// A parameter without a gradient in the step that allocated the buffer
    /// (or in a group whose momentum comes on later) starts from its
    /// gradient when it is first stepped; a segment merging it with a
    /// started neighbour splits in two launches.
    #[test]
    fn a_piece_first_stepped_later_starts_from_its_gradient() {
        let mut state = SgdState::new();
        state.unstarted = UnstartedRanges::all(500);
        assert_eq!(state.unstarted.take(0..300), vec![(0..300, true)]);
        assert_eq!(
            state.unstarted.take(0..500),
            vec![(0..300, false), (300..500, true)]
        );
        state.mark_momentum_unstarted(100..200);
        assert_eq!(
            state.unstarted.take(0..500),
            vec![(0..100, false), (100..200, true), (200..500, false)]
        );
    }
}
