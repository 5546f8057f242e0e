//! Element-wise launches for [`LayerKernels`] (`activation_*`,
//! `bias_activation_forward_*`, `gated_*` in layers.cu): one thread per
//! element, the activation chosen by [`ActivationKind`] (or none: the bias
//! add alone).

use super::{check_len, int_arg, ActivationKind, Launch, LayerElement, LayerKernels};
use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use std::sync::Arc;

impl LayerKernels {
    /// `y = act(x)`, element-wise.
    pub fn activation_forward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        x: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "activation_forward";
        check_len(OP, "y", y.len(), x.len())?;
        let Some(cfg) = self.config(OP, Launch::Elements(x.len()))? else {
            return Ok(());
        };
        let n = x.len() as i64;
        let kind = kind as i32;
        let (x, _g0) = x.device_ptr(stream);
        let (y, _g1) = y.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.activation_forward[E::INDEX]);
        launch.arg(&x).arg(&y).arg(&n).arg(&kind);
        // SAFETY: x and y hold n `E`; the arguments match `activation_forward_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// `dx = grad * act'(x)`, element-wise.
    pub fn activation_backward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        x: &impl DevicePtr<E>,
        grad: &impl DevicePtr<E>,
        dx: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "activation_backward";
        check_len(OP, "grad", grad.len(), x.len())?;
        check_len(OP, "dx", dx.len(), x.len())?;
        let (x_ptr, _g0) = x.device_ptr(stream);
        let (g, _g1) = grad.device_ptr(stream);
        let (dx, _g2) = dx.device_ptr_mut(stream);
        // SAFETY: x, grad and dx hold x.len() `E`, the kernel's x, g and dx.
        unsafe {
            self.activation_pass(
                OP,
                &self.activation_backward[E::INDEX],
                stream,
                kind,
                x.len(),
                [x_ptr, g, dx],
            )
        }
    }

    /// A layer's backward with `act` on its input `x` (which the forward
    /// kept alone), one pass over `x`: `y = act(x)`, recomputed for the
    /// weight's gradient, and `grad *= act'(x)` in place, the gradient of
    /// `x` from that of `act(x)`. The values of
    /// [`activation_forward`](Self::activation_forward) and
    /// [`activation_backward`](Self::activation_backward), bit for bit.
    pub fn activation_recompute_backward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        x: &impl DevicePtr<E>,
        grad: &mut impl DevicePtrMut<E>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "activation_recompute_backward";
        check_len(OP, "grad", grad.len(), x.len())?;
        check_len(OP, "y", y.len(), x.len())?;
        let (x_ptr, _g0) = x.device_ptr(stream);
        let (g, _g1) = grad.device_ptr_mut(stream);
        let (y, _g2) = y.device_ptr_mut(stream);
        let function = &self.activation_recompute_backward[E::INDEX];
        // SAFETY: x, grad and y hold x.len() `E`, the kernel's x, g (read
        // by each thread before it writes it) and y.
        unsafe { self.activation_pass(OP, function, stream, kind, x.len(), [x_ptr, g, y]) }
    }

    /// Launches `function`, an activation pass of `(a, b, c, n, kind)` over
    /// `n` elements.
    ///
    /// # Safety
    /// The three pointers hold `n` elements each of the kernel's type, in
    /// the roles `function`'s arguments give them, and stay alive until it
    /// has run (stream order).
    unsafe fn activation_pass(
        &self,
        op: &'static str,
        function: &CudaFunction,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        n: usize,
        [a, b, c]: [u64; 3],
    ) -> Result<()> {
        let Some(cfg) = self.config(op, Launch::Elements(n))? else {
            return Ok(());
        };
        let (n, kind) = (n as i64, kind as i32);
        let mut launch = stream.launch_builder(function);
        launch.arg(&a).arg(&b).arg(&c).arg(&n).arg(&kind);
        // SAFETY: the caller's promise; the arguments match the kernel's.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// A Linear layer's epilogue after a plain GEMM, one pass over its
    /// row-major `[rows, width]` output `pre`: `pre += bias` (per column,
    /// in place: it stays as the pre-activation for the backward) and
    /// `y = act(pre)`.
    pub fn bias_activation_forward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        pre: &mut impl DevicePtrMut<E>,
        bias: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "bias_activation_forward";
        check_len(OP, "y", y.len(), pre.len())?;
        let (y, _g) = y.device_ptr_mut(stream);
        self.bias_epilogue(OP, stream, kind as i32, pre, bias, Some(y))
    }

    /// `pre += bias` in place over a row-major `[rows, width]` `pre`, per
    /// column (a Linear layer's bias after a plain GEMM, no activation).
    pub fn bias_add<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        pre: &mut impl DevicePtrMut<E>,
        bias: &impl DevicePtr<E>,
    ) -> Result<()> {
        self.bias_epilogue("bias_add", stream, -1, pre, bias, None)
    }

    /// Launches `bias_activation_forward_*` with activation `kind` (`-1`:
    /// none, `y` unused) and output `y`, a device pointer of `pre.len()`
    /// elements.
    fn bias_epilogue<E: LayerElement>(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        kind: i32,
        pre: &mut impl DevicePtrMut<E>,
        bias: &impl DevicePtr<E>,
        y: Option<u64>,
    ) -> Result<()> {
        let width = bias.len();
        if width == 0 || pre.len() % width != 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "the output has {} elements, not a whole number of rows of the bias's {width}; \
                     the bias must have the size of the output's last dimension",
                    pre.len()
                ),
            }));
        }
        let Some(cfg) = self.config(op, Launch::Elements(pre.len()))? else {
            return Ok(());
        };
        let n = pre.len() as i64;
        let width = int_arg(op, "the bias's length", width)?;
        let (pre, _g0) = pre.device_ptr_mut(stream);
        let (bias, _g1) = bias.device_ptr(stream);
        // Without an activation the kernel never writes y: pass pre's.
        let y = y.unwrap_or(pre);
        let mut launch = stream.launch_builder(&self.bias_activation_forward[E::INDEX]);
        launch
            .arg(&pre)
            .arg(&bias)
            .arg(&y)
            .arg(&n)
            .arg(&width)
            .arg(&kind);
        // SAFETY: pre and y hold n `E`, bias `width` (n a multiple of it);
        // the arguments match `bias_activation_forward_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// `y = act(gate) * up`, element-wise: SwiGLU's gate with
    /// [`ActivationKind::Silu`], GeGLU's with [`ActivationKind::Gelu`].
    pub fn gated_forward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        gate: &impl DevicePtr<E>,
        up: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "gated_forward";
        check_len(OP, "up", up.len(), gate.len())?;
        check_len(OP, "y", y.len(), gate.len())?;
        let Some(cfg) = self.config(OP, Launch::Elements(gate.len()))? else {
            return Ok(());
        };
        let n = gate.len() as i64;
        let kind = kind as i32;
        let (gate, _g0) = gate.device_ptr(stream);
        let (up, _g1) = up.device_ptr(stream);
        let (y, _g2) = y.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.gated_forward[E::INDEX]);
        launch.arg(&gate).arg(&up).arg(&y).arg(&n).arg(&kind);
        // SAFETY: gate, up and y hold n `E`; the arguments match
        // `gated_forward_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Both gradients of [`LayerKernels::gated_forward`] in one pass:
    /// `dgate = grad * up * act'(gate)`, `dup = grad * act(gate)`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_backward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        kind: ActivationKind,
        gate: &impl DevicePtr<E>,
        up: &impl DevicePtr<E>,
        grad: &impl DevicePtr<E>,
        dgate: &mut impl DevicePtrMut<E>,
        dup: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "gated_backward";
        let n = gate.len();
        check_len(OP, "up", up.len(), n)?;
        check_len(OP, "grad", grad.len(), n)?;
        check_len(OP, "dgate", dgate.len(), n)?;
        check_len(OP, "dup", dup.len(), n)?;
        let Some(cfg) = self.config(OP, Launch::Elements(n))? else {
            return Ok(());
        };
        let n = n as i64;
        let kind = kind as i32;
        let (gate, _g0) = gate.device_ptr(stream);
        let (up, _g1) = up.device_ptr(stream);
        let (g, _g2) = grad.device_ptr(stream);
        let (dgate, _g3) = dgate.device_ptr_mut(stream);
        let (dup, _g4) = dup.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.gated_backward[E::INDEX]);
        launch
            .arg(&gate)
            .arg(&up)
            .arg(&g)
            .arg(&dgate)
            .arg(&dup)
            .arg(&n)
            .arg(&kind);
        // SAFETY: every buffer holds n `E`; the arguments match
        // `gated_backward_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
