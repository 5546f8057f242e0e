//! The built-in optimizers' steps over a flat f32 shard on the GPU, one
//! launch per call, following `torch.optim`'s documented algorithms.
//!
//! Each optimizer has hyperparameters (`*Hyper`, PyTorch's defaults) and a
//! device state (`*State`) that exports to and imports from
//! `zero_core::optim::ParamState` under PyTorch's state names, for
//! checkpoints. The step count lives in the state, as in PyTorch.

use super::FusedKernels;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg, SyncOnDrop};
use std::sync::Arc;
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
#[derive(Debug)]
pub struct SgdState {
    /// `momentum_buffer`, once a step with momentum has run.
    pub momentum_buffer: Option<CudaSlice<f32>>,
    /// Steps taken.
    pub step: u64,
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
        }
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

fn check_len(op: &'static str, what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(Error::BufferSize {
            op,
            what,
            got,
            expected,
        });
    }
    Ok(())
}

fn flag(b: bool) -> i32 {
    i32::from(b)
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
        return Err(Error::BufferSize {
            op,
            what,
            got: buf.len(),
            expected: at + n,
        });
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
    /// `at..at + n` of a state covering `state_len` elements; `step` is the
    /// step being taken (1 for the first). The step count is the caller's.
    #[allow(clippy::too_many_arguments)]
    pub fn sgd_step_at(
        &self,
        stream: &Arc<CudaStream>,
        params: &mut dyn DevicePtrMut<f32>,
        grads: &dyn DevicePtr<f32>,
        state: &mut SgdState,
        at: usize,
        state_len: usize,
        step: u64,
        hyper: &SgdHyper,
    ) -> Result<()> {
        const OP: &str = "sgd_step";
        // torch keeps the buffer None until the first step with momentum,
        // which copies the gradient into it.
        let allocated = ensure_buffer(
            stream,
            &mut state.momentum_buffer,
            hyper.momentum != 0.0,
            state_len,
        )?;
        let first_step = step == 1 || allocated;
        let (n, [(p, _gp), (g, _gg)]) = param_grad_ptrs(OP, stream, params, grads)?;
        let (buf, _gb) = opt_state_ptr(
            OP,
            "momentum_buffer",
            &mut state.momentum_buffer,
            stream,
            at,
            n,
        )?;
        let n64 = n as u64;
        let (lr, momentum, dampening, wd) = (
            hyper.lr as f32,
            hyper.momentum as f32,
            hyper.dampening as f32,
            hyper.weight_decay as f32,
        );
        let (nesterov, maximize, first) =
            (flag(hyper.nesterov), flag(hyper.maximize), flag(first_step));
        let mut launch = stream.launch_builder(&self.sgd);
        launch
            .arg(&p)
            .arg(&g)
            .arg(&buf)
            .arg(&n64)
            .arg(&lr)
            .arg(&momentum)
            .arg(&dampening)
            .arg(&wd)
            .arg(&nesterov)
            .arg(&maximize)
            .arg(&first);
        // SAFETY: p, g and buf (when momentum != 0) address n f32 each (checked
        // above), and the argument list matches `sgd_f32`'s signature.
        unsafe { launch.launch(self.config(n)) }?;
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
        let state_len = state.exp_avg.len();
        ensure_buffer(stream, &mut state.max_exp_avg_sq, hyper.amsgrad, state_len)?;
        let (beta1, beta2) = hyper.betas;
        let bias_correction1 = 1.0 - beta1.powf(step as f64);
        let bias_correction2 = 1.0 - beta2.powf(step as f64);
        let step_size = (hyper.lr / bias_correction1) as f32;
        let bc2_sqrt = bias_correction2.sqrt() as f32;
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
        let (lr, b1, b2, eps, wd) = (
            hyper.lr as f32,
            beta1 as f32,
            beta2 as f32,
            hyper.eps as f32,
            hyper.weight_decay as f32,
        );
        let (decoupled, amsgrad, maximize) = (
            flag(hyper.decoupled_weight_decay),
            flag(hyper.amsgrad),
            flag(hyper.maximize),
        );
        let mut launch = stream.launch_builder(&self.adam);
        launch
            .arg(&p)
            .arg(&g)
            .arg(&m)
            .arg(&v)
            .arg(&vmax)
            .arg(&n64)
            .arg(&lr)
            .arg(&b1)
            .arg(&b2)
            .arg(&eps)
            .arg(&wd)
            .arg(&step_size)
            .arg(&bc2_sqrt)
            .arg(&decoupled)
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
        let (lr, alpha, eps, wd, momentum) = (
            hyper.lr as f32,
            hyper.alpha as f32,
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
    upload(stream, state, name, len)?.ok_or_else(|| Error::Unsupported {
        op: "import_state",
        detail: format!("the state has no `{name}` tensor"),
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
        Ok(Self {
            momentum_buffer: upload(stream, state, "momentum_buffer", len)?,
            step: step_of(state),
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
