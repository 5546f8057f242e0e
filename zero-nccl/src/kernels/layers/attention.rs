//! Causal self-attention's launches for [`LayerKernels`]: the call's shape
//! and its checks, the two kernel families (tensor cores for bf16 and f16
//! from sm_80, CUDA cores otherwise) and the operands of the packed and the
//! split layouts.

use super::{check_len, int_arg, per_element, Launch, LayerElement, LayerKernels, ELEMENT_NAMES};
use crate::{Error, Result};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// The widest head the attention kernels take.
pub const MAX_HEAD_DIM: usize = 128;

/// The head widths the attention kernels are compiled for: a head of
/// `head_dim` runs the first variant at least as wide.
pub(super) const HEAD_DIM_VARIANTS: [usize; 2] = [64, 128];

/// The storage types of the tensor-core attention, in
/// [`LayerElement::TENSOR_CORE_INDEX`] order.
pub(super) const TENSOR_CORE_NAMES: [&str; 2] = ["bf16", "f16"];

/// The oldest compute capability with the `mma.sync` shapes the tensor-core
/// attention uses (bf16 needs sm_80).
const TENSOR_CORE_MIN_ARCH: u32 = 80;

/// Threads of an attention block (`ATTN_THREADS` in layers.cu).
pub(super) const ATTENTION_THREADS: u32 = 128;
/// Query (forward, dQ) or key (dK/dV) rows per attention block, per head
/// width variant (`ATTN_WARPS * ATTN_R_<DMAX>` in layers.cu).
const ATTENTION_ROWS: [usize; 2] = [32, 16];
/// The same for the tensor-core kernels: query rows per forward block per
/// head width variant (`TC_QROWS(DMAX)` in attention_tc.cu: two m-tiles of
/// 16 a warp at 64, one at 128), rows per dQ and dK/dV block (`TC_ROWS`);
/// their blocks are 128 threads too (`TC_THREADS`).
const TENSOR_CORE_ROWS: BlockRows = BlockRows {
    forward: [128, 64],
    backward: 64,
};

/// The tensor-core family's rows per block: per head width variant for the
/// forward (query rows), and for dQ and dK/dV (query and key rows).
#[derive(Clone, Copy, Debug, PartialEq)]
struct BlockRows {
    forward: [usize; 2],
    backward: usize,
}

/// The shape of one causal self-attention call, over a packed `qkv`
/// `[batch, time, (heads + 2 * kv_heads) * head_dim]` (queries, then keys,
/// then values, each head's `head_dim` columns contiguous) or separate `q`
/// `[batch, time, heads * head_dim]` and `k`, `v` `[batch, time, kv_heads *
/// head_dim]`, with output `[batch, time, heads * head_dim]` and
/// log-sum-exp `[batch, heads, time]` f32. Query head `h` attends with K/V
/// head `h / (heads / kv_heads)`; query `t` to keys `t - window < j <= t`
/// (all keys up to `t` without a window).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub time: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads: `heads` itself, or a divisor of it (grouped-query
    /// attention).
    pub kv_heads: usize,
    /// Width of one head (at most [`MAX_HEAD_DIM`]).
    pub head_dim: usize,
    /// The factor on `q · k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding-window attention: each query attends to at most this many
    /// positions, its own included (at least 1). `None`: every position up
    /// to its own.
    pub window: Option<usize>,
}

impl AttentionShape {
    /// Elements of a packed `qkv` (and of its gradient).
    pub fn qkv_len(&self) -> usize {
        self.batch * self.time * (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Elements of a separate `q` (and of its gradient).
    pub fn q_len(&self) -> usize {
        self.out_len()
    }

    /// Elements of a separate `k` or `v` (and of their gradients).
    pub fn kv_len(&self) -> usize {
        self.batch * self.time * self.kv_heads * self.head_dim
    }

    /// Elements of the output (and of its gradient).
    pub fn out_len(&self) -> usize {
        self.batch * self.time * self.heads * self.head_dim
    }

    /// Elements of the log-sum-exp.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.time
    }

    /// Fails unless separate `q`, `k`, `v` (or their gradients, `names`)
    /// have `lens` elements.
    fn check_split_lens(
        &self,
        op: &'static str,
        names: [&'static str; 3],
        lens: [usize; 3],
    ) -> Result<()> {
        let expected = [self.q_len(), self.kv_len(), self.kv_len()];
        for ((what, got), expected) in names.into_iter().zip(lens).zip(expected) {
            check_len(op, what, got, expected)?;
        }
        Ok(())
    }
}

/// `XY` of NVRTC's `compute_XY` (0 when it has no number).
fn arch_number(arch: &str) -> u32 {
    arch.trim_start_matches("compute_")
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .unwrap_or(0)
}

/// The per-type kernels of one attention head-width variant.
#[derive(Debug)]
struct AttentionFunctions {
    forward: CudaFunction,
    backward_dq: CudaFunction,
    backward_dkdv: CudaFunction,
}

impl AttentionFunctions {
    /// `attention_{family}_d{dmax}_{ty}` for the three kernels, `family`
    /// being `""` or `"tc_"`.
    fn load(module: &Arc<CudaModule>, family: &str, dmax: usize, ty: &str) -> Result<Self> {
        let load = |kernel: &str| {
            module.load_function(&format!("attention_{family}{kernel}_d{dmax}_{ty}"))
        };
        Ok(Self {
            forward: load("forward")?,
            backward_dq: load("backward_dq")?,
            backward_dkdv: load("backward_dkdv")?,
        })
    }
}

/// The attention kernels of both families, every storage type and head
/// width, and which family this device runs.
#[derive(Debug)]
pub(super) struct AttentionKernels {
    /// The CUDA-core family: per [`LayerElement::INDEX`], then per
    /// [`HEAD_DIM_VARIANTS`].
    cuda_core: [[AttentionFunctions; 2]; 3],
    /// The tensor-core family: per [`LayerElement::TENSOR_CORE_INDEX`], then
    /// per [`HEAD_DIM_VARIANTS`].
    tensor_core: [[AttentionFunctions; 2]; 2],
    /// Whether the device runs the tensor-core family (sm_80 or newer).
    tensor_cores: bool,
    /// The backward's row dots `dO · O`, per [`LayerElement::INDEX`] (both
    /// families use them).
    delta: [CudaFunction; 3],
}

impl AttentionKernels {
    /// Loads them from `module`, which NVRTC compiled for `arch`.
    pub(super) fn load(module: &Arc<CudaModule>, arch: &str) -> Result<Self> {
        let [[a0, a1], [b0, b1], [c0, c1]] = ELEMENT_NAMES
            .map(|ty| HEAD_DIM_VARIANTS.map(|dmax| AttentionFunctions::load(module, "", dmax, ty)));
        let [[d0, d1], [e0, e1]] = TENSOR_CORE_NAMES.map(|ty| {
            HEAD_DIM_VARIANTS.map(|dmax| AttentionFunctions::load(module, "tc_", dmax, ty))
        });
        Ok(Self {
            cuda_core: [[a0?, a1?], [b0?, b1?], [c0?, c1?]],
            tensor_core: [[d0?, d1?], [e0?, e1?]],
            tensor_cores: arch_number(arch) >= TENSOR_CORE_MIN_ARCH,
            delta: per_element(module, "attention_backward_delta")?,
        })
    }

    /// The kernels of head-width `variant` that run attention in `E` on this
    /// device, and their rows per block, `[forward, backward]` (the
    /// backward's dQ and dK/dV blocks alike): the tensor-core family for
    /// bf16 and f16 from sm_80, else the CUDA-core one.
    fn for_element<E: LayerElement>(&self, variant: usize) -> (&AttentionFunctions, [usize; 2]) {
        match E::TENSOR_CORE_INDEX {
            Some(index) if self.tensor_cores => (
                &self.tensor_core[index][variant],
                [TENSOR_CORE_ROWS.forward[variant], TENSOR_CORE_ROWS.backward],
            ),
            _ => {
                let rows = ATTENTION_ROWS[variant];
                (&self.cuda_core[E::INDEX][variant], [rows, rows])
            }
        }
    }
}

/// An attention call's checked shape: the head-width variant, the kernels'
/// `int` arguments and scale, and the row strides `[q, k and v]` of the
/// packed and the split layouts.
#[derive(Clone, Copy, Debug)]
struct CheckedAttention {
    variant: usize,
    time: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    /// The window the kernels take: at most `time` (which is no window).
    window: i32,
    scale: f32,
    packed_strides: [i32; 2],
    split_strides: [i32; 2],
}

impl CheckedAttention {
    /// Checks an attention call's shape and derives the kernels' arguments.
    fn new(op: &'static str, shape: &AttentionShape) -> Result<Self> {
        let d = shape.head_dim;
        let Some(variant) = HEAD_DIM_VARIANTS.iter().position(|&dmax| d <= dmax) else {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "head_dim {d} is wider than the fused attention's {MAX_HEAD_DIM}; use more \
                     heads of at most {MAX_HEAD_DIM} columns, or composed ops"
                ),
            }));
        };
        if d == 0 || shape.heads == 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "heads = {} and head_dim = {d}: both must be at least 1",
                    shape.heads
                ),
            }));
        }
        if shape.kv_heads == 0 || shape.heads % shape.kv_heads != 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: format!(
                    "{} query heads cannot share {} K/V heads evenly; kv_heads must divide heads",
                    shape.heads, shape.kv_heads
                ),
            }));
        }
        if shape.window == Some(0) {
            return Err(Error::from(zero_core::Error::Unsupported {
                op,
                detail: "a sliding window of 0 positions: a query sees at least itself; use a \
                         window of at least 1"
                    .into(),
            }));
        }
        // Kernels index a row with int: the packed row must fit.
        let packed = int_arg(
            op,
            "(heads + 2 * kv_heads) * head_dim",
            (shape.heads + 2 * shape.kv_heads) * d,
        )?;
        Ok(Self {
            variant,
            time: int_arg(op, "time", shape.time)?,
            heads: int_arg(op, "heads", shape.heads)?,
            kv_heads: int_arg(op, "kv_heads", shape.kv_heads)?,
            head_dim: int_arg(op, "head_dim", d)?,
            window: int_arg(
                op,
                "window",
                shape.window.unwrap_or(shape.time).min(shape.time),
            )?,
            scale: shape.scale,
            packed_strides: [packed, packed],
            split_strides: [
                int_arg(op, "heads * head_dim", shape.heads * d)?,
                int_arg(op, "kv_heads * head_dim", shape.kv_heads * d)?,
            ],
        })
    }

    /// Queues `kernel`, one of `ATTN_FORWARD_PARAMS`, `ATTN_DQ_PARAMS` or
    /// `ATTN_DKDV_PARAMS` (the same in both families): they all take
    /// `q, k, v` first and the strides and this shape last, and differ only
    /// in the device pointers between, `pointers`.
    ///
    /// # Safety
    /// `pointers` are the ones `kernel` takes there, in its order; every
    /// buffer holds what the kernel indexes for this shape with `input`'s
    /// strides; `cfg`'s blocks are the kernel's 128 threads.
    unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        kernel: &CudaFunction,
        cfg: LaunchConfig,
        input: &AttentionOperands,
        pointers: &[u64],
    ) -> Result<()> {
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&input.q).arg(&input.k).arg(&input.v);
        for pointer in pointers {
            launch.arg(pointer);
        }
        launch
            .arg(&input.q_stride)
            .arg(&input.kv_stride)
            .arg(&self.time)
            .arg(&self.heads)
            .arg(&self.kv_heads)
            .arg(&self.head_dim)
            .arg(&self.window)
            .arg(&self.scale);
        // SAFETY: the arguments are the kernel's and the buffers fit the
        // shape, as the caller promises.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

/// Where an attention call's `q`, `k`, `v` (or their gradients) start and
/// how far apart their rows are: a packed `qkv` is three column offsets of
/// one buffer, separate tensors three buffers.
#[derive(Clone, Copy, Debug)]
struct AttentionOperands {
    q: u64,
    k: u64,
    v: u64,
    q_stride: i32,
    kv_stride: i32,
}

impl AttentionOperands {
    /// The operands within a packed `qkv` at device address `qkv`.
    fn packed<E>(qkv: u64, shape: &AttentionShape, strides: [i32; 2]) -> Self {
        let column = |c: usize| qkv + (c * std::mem::size_of::<E>()) as u64;
        Self {
            q: qkv,
            k: column(shape.heads * shape.head_dim),
            v: column((shape.heads + shape.kv_heads) * shape.head_dim),
            q_stride: strides[0],
            kv_stride: strides[1],
        }
    }

    /// The operands of separate `q`, `k`, `v` at device addresses `[q, k, v]`.
    fn split([q, k, v]: [u64; 3], [q_stride, kv_stride]: [i32; 2]) -> Self {
        Self {
            q,
            k,
            v,
            q_stride,
            kv_stride,
        }
    }
}

impl LayerKernels {
    /// Causal self-attention forward over a packed `qkv`: `y = softmax(scale
    /// q k^T + mask) v` per sequence and head, and the rows' log-sum-exp
    /// `lse` (what [`LayerKernels::attention_backward`] needs), in one
    /// launch.
    pub fn attention_forward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        qkv: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
        lse: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "attention_forward";
        let checked = CheckedAttention::new(OP, shape)?;
        check_len(OP, "qkv", qkv.len(), shape.qkv_len())?;
        let (qkv, _g0) = qkv.device_ptr(stream);
        let operands = AttentionOperands::packed::<E>(qkv, shape, checked.packed_strides);
        self.launch_attention_forward::<E>(OP, stream, shape, &checked, operands, y, lse)
    }

    /// [`LayerKernels::attention_forward`] over separate `q` `[batch, time,
    /// heads * head_dim]`, `k` and `v` `[batch, time, kv_heads * head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_forward_split<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        q: &impl DevicePtr<E>,
        k: &impl DevicePtr<E>,
        v: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
        lse: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const OP: &str = "attention_forward_split";
        let checked = CheckedAttention::new(OP, shape)?;
        shape.check_split_lens(OP, ["q", "k", "v"], [q.len(), k.len(), v.len()])?;
        let (q, _g0) = q.device_ptr(stream);
        let (k, _g1) = k.device_ptr(stream);
        let (v, _g2) = v.device_ptr(stream);
        let operands = AttentionOperands::split([q, k, v], checked.split_strides);
        self.launch_attention_forward::<E>(OP, stream, shape, &checked, operands, y, lse)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_attention_forward<E: LayerElement>(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        checked: &CheckedAttention,
        input: AttentionOperands,
        y: &mut impl DevicePtrMut<E>,
        lse: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check_len(op, "y", y.len(), shape.out_len())?;
        check_len(op, "lse", lse.len(), shape.lse_len())?;
        let (kernels, [rows, _]) = self.attention.for_element::<E>(checked.variant);
        let Some(cfg) = self.attention_config(op, shape.time, rows, shape.heads, shape.batch)?
        else {
            return Ok(());
        };
        let (y, _g1) = y.device_ptr_mut(stream);
        let (lse, _g2) = lse.device_ptr_mut(stream);
        // SAFETY: the buffers hold the shape's element counts of `E` (checked
        // by the callers and above), which with the strides bound every index
        // the kernel forms; `y, lse` are what `ATTN_FORWARD_PARAMS` of both
        // families takes between `q, k, v` and the strides; `cfg` has their
        // 128 threads.
        unsafe { checked.launch(stream, &kernels.forward, cfg, &input, &[y, lse]) }
    }

    /// Causal self-attention backward over a packed `qkv`: `dqkv` (shaped
    /// as `qkv`) from `qkv`, the forward's output `out` and `lse`, and the
    /// output's gradient `grad_out`. Three launches (row dots `dO · O`,
    /// then dK/dV and dQ), with a `[batch, heads, time]` f32 scratch
    /// allocated on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        qkv: &impl DevicePtr<E>,
        out: &impl DevicePtr<E>,
        lse: &impl DevicePtr<f32>,
        grad_out: &impl DevicePtr<E>,
        dqkv: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "attention_backward";
        let checked = CheckedAttention::new(OP, shape)?;
        check_len(OP, "qkv", qkv.len(), shape.qkv_len())?;
        check_len(OP, "dqkv", dqkv.len(), shape.qkv_len())?;
        let (qkv, _g0) = qkv.device_ptr(stream);
        let (dqkv, _g1) = dqkv.device_ptr_mut(stream);
        let input = AttentionOperands::packed::<E>(qkv, shape, checked.packed_strides);
        let grads = AttentionOperands::packed::<E>(dqkv, shape, checked.packed_strides);
        self.launch_attention_backward::<E>(
            OP, stream, shape, &checked, input, out, lse, grad_out, grads,
        )
    }

    /// [`LayerKernels::attention_backward`] over separate `q`, `k`, `v`
    /// (see [`LayerKernels::attention_forward_split`]): `dq`, `dk`, `dv`
    /// shaped as those. A K/V head's gradient sums over its group of query
    /// heads, in order.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward_split<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        [q, k, v]: [&dyn DevicePtr<E>; 3],
        out: &impl DevicePtr<E>,
        lse: &impl DevicePtr<f32>,
        grad_out: &impl DevicePtr<E>,
        [dq, dk, dv]: [&mut dyn DevicePtrMut<E>; 3],
    ) -> Result<()> {
        const OP: &str = "attention_backward_split";
        let checked = CheckedAttention::new(OP, shape)?;
        shape.check_split_lens(OP, ["q", "k", "v"], [q.len(), k.len(), v.len()])?;
        shape.check_split_lens(OP, ["dq", "dk", "dv"], [dq.len(), dk.len(), dv.len()])?;
        let (q, _g0) = q.device_ptr(stream);
        let (k, _g1) = k.device_ptr(stream);
        let (v, _g2) = v.device_ptr(stream);
        let (dq, _g3) = dq.device_ptr_mut(stream);
        let (dk, _g4) = dk.device_ptr_mut(stream);
        let (dv, _g5) = dv.device_ptr_mut(stream);
        // The gradients have their inputs' strides.
        let input = AttentionOperands::split([q, k, v], checked.split_strides);
        let grads = AttentionOperands::split([dq, dk, dv], checked.split_strides);
        self.launch_attention_backward::<E>(
            OP, stream, shape, &checked, input, out, lse, grad_out, grads,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_attention_backward<E: LayerElement>(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        checked: &CheckedAttention,
        input: AttentionOperands,
        out: &impl DevicePtr<E>,
        lse: &impl DevicePtr<f32>,
        grad_out: &impl DevicePtr<E>,
        grads: AttentionOperands,
    ) -> Result<()> {
        check_len(op, "out", out.len(), shape.out_len())?;
        check_len(op, "lse", lse.len(), shape.lse_len())?;
        check_len(op, "grad_out", grad_out.len(), shape.out_len())?;
        let (kernels, [_, rows]) = self.attention.for_element::<E>(checked.variant);
        let (time, batch) = (shape.time, shape.batch);
        let Some(dq_cfg) = self.attention_config(op, time, rows, shape.heads, batch)? else {
            return Ok(());
        };
        let Some(dkdv_cfg) = self.attention_config(op, time, rows, shape.kv_heads, batch)? else {
            return Ok(());
        };
        let Some(delta_cfg) = self.config(op, Launch::WarpPerRow(shape.lse_len()))? else {
            return Ok(());
        };
        let batch = int_arg(op, "batch", batch)?;
        // SAFETY: the delta kernel writes every element (one per query row)
        // before the other two read it, in stream order.
        let mut delta = unsafe { stream.alloc::<f32>(shape.lse_len()) }?;
        let (out, _g1) = out.device_ptr(stream);
        let (lse, _g2) = lse.device_ptr(stream);
        let (grad_out, _g3) = grad_out.device_ptr(stream);
        {
            let (delta, _g5) = delta.device_ptr_mut(stream);
            let mut launch = stream.launch_builder(&self.attention.delta[E::INDEX]);
            launch
                .arg(&out)
                .arg(&grad_out)
                .arg(&delta)
                .arg(&batch)
                .arg(&checked.time)
                .arg(&checked.heads)
                .arg(&checked.head_dim);
            // SAFETY: out and grad_out hold batch * time * heads * head_dim
            // `E`, delta batch * heads * time f32; the arguments match
            // `attention_backward_delta_*`.
            unsafe { launch.launch(delta_cfg) }?;
        }
        let (delta, _g5) = delta.device_ptr(stream);
        let dkdv = [grad_out, lse, delta, grads.k, grads.v];
        // SAFETY: every buffer holds the shape's element count (checked by
        // the callers and above); the gradients have their inputs' strides;
        // `dkdv` is what `ATTN_DKDV_PARAMS` takes between `q, k, v` and the
        // strides; the blocks are 128 threads, one per K/V head and key tile.
        unsafe { checked.launch(stream, &kernels.backward_dkdv, dkdv_cfg, &input, &dkdv) }?;
        let dq = [grad_out, lse, delta, grads.q];
        // SAFETY: as above; dQ writes the columns of dq only (in a packed
        // dqkv disjoint from dK/dV's); `dq` is what `ATTN_DQ_PARAMS` takes.
        unsafe { checked.launch(stream, &kernels.backward_dq, dq_cfg, &input, &dq) }
    }

    /// Blocks of `rows` rows per `time` tile, per head and sequence.
    fn attention_config(
        &self,
        op: &'static str,
        time: usize,
        rows: usize,
        heads: usize,
        batch: usize,
    ) -> Result<Option<LaunchConfig>> {
        self.config(
            op,
            Launch::Attention {
                time,
                rows,
                heads,
                batch,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::layers::LAYER_SOURCE;

    #[test]
    fn attention_rows_match_the_source() {
        // ATTENTION_ROWS = ATTN_WARPS * ATTN_R_<DMAX>.
        assert!(LAYER_SOURCE.contains("#define ATTN_WARPS 4"));
        assert!(LAYER_SOURCE.contains("#define ATTN_R_64 8"));
        assert!(LAYER_SOURCE.contains("#define ATTN_R_128 4"));
        assert_eq!(ATTENTION_ROWS, [4 * 8, 4 * 4]);
        assert!(LAYER_SOURCE.contains("#define ATTN_THREADS (ATTN_WARPS * 32)"));
        assert_eq!(ATTENTION_THREADS, 4 * 32);
        assert!(LAYER_SOURCE.contains("#define TC_ROWS 64"));
        assert!(LAYER_SOURCE.contains("#define TC_THREADS (TC_WARPS * 32)"));
        assert!(LAYER_SOURCE.contains("#define TC_WARPS 4"));
        // TC_QROWS(DMAX) = TC_WARPS * 16 * TC_MT(DMAX).
        assert!(LAYER_SOURCE.contains("#define TC_MT(DMAX) ((DMAX) <= 64 ? 2 : 1)"));
        assert!(LAYER_SOURCE.contains("#define TC_QROWS(DMAX) (TC_WARPS * 16 * TC_MT(DMAX))"));
        assert_eq!(HEAD_DIM_VARIANTS, [64, 128]);
        assert_eq!(
            TENSOR_CORE_ROWS,
            BlockRows {
                forward: [4 * 16 * 2, 4 * 16],
                backward: 64
            }
        );
    }

    /// Every attention kernel's parameters end with the strides and the
    /// shape in the order [`CheckedAttention::launch`] passes them.
    #[test]
    fn kernel_parameters_end_in_the_launch_s_order() {
        for name in ["ATTN_FORWARD_PARAMS", "ATTN_DQ_PARAMS", "ATTN_DKDV_PARAMS"] {
            let at = LAYER_SOURCE
                .find(&format!("#define {name}(T)"))
                .unwrap_or_else(|| panic!("{name} is defined"));
            let mut params = String::new();
            for line in LAYER_SOURCE[at..].lines().skip(1) {
                params.push_str(line.trim_end_matches('\\'));
                if !line.ends_with('\\') {
                    break;
                }
            }
            let params = params.split_whitespace().collect::<Vec<_>>().join(" ");
            let tail =
                "int q_stride, int kv_stride, int T_, int H, int KVH, int D, int W, float scale";
            assert!(params.ends_with(tail), "{name}: {params}");
        }
    }

    #[test]
    fn tensor_cores_start_at_sm_80() {
        assert_eq!(arch_number("compute_90"), 90);
        assert_eq!(arch_number("compute_90a"), 90);
        assert_eq!(arch_number("compute_75"), 75);
        assert!(arch_number("compute_80") >= TENSOR_CORE_MIN_ARCH);
        assert!(arch_number("compute_86") >= TENSOR_CORE_MIN_ARCH);
        assert!(arch_number("compute_75") < TENSOR_CORE_MIN_ARCH);
        // The kernels trap below sm_80, where LayerKernels never runs them.
        assert!(LAYER_SOURCE.contains("#elif __CUDA_ARCH__ >= 800"));
    }

    #[test]
    fn grouped_heads_must_divide_and_strides_follow_the_layout() {
        let shape = AttentionShape {
            batch: 1,
            time: 3,
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            scale: 0.125,
            window: None,
        };
        let checked = CheckedAttention::new("t", &shape).unwrap();
        assert_eq!(checked.packed_strides, [12 * 64, 12 * 64]);
        assert_eq!(checked.split_strides, [8 * 64, 2 * 64]);
        assert_eq!(checked.variant, 0);
        let operands = AttentionOperands::packed::<half::bf16>(1 << 20, &shape, [768, 768]);
        assert_eq!(operands.k, (1 << 20) + 2 * 8 * 64);
        assert_eq!(operands.v, (1 << 20) + 2 * 10 * 64);
        for kv_heads in [0, 3] {
            let err = CheckedAttention::new("t", &AttentionShape { kv_heads, ..shape })
                .unwrap_err()
                .to_string();
            assert!(err.contains("kv_heads must divide heads"), "{err}");
        }
    }

    #[test]
    fn split_lengths_are_checked_by_name() {
        let shape = AttentionShape {
            batch: 1,
            time: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            scale: 0.5,
            window: None,
        };
        let lens = [shape.q_len(), shape.kv_len(), shape.kv_len()];
        shape.check_split_lens("t", ["q", "k", "v"], lens).unwrap();
        let err = shape
            .check_split_lens("t", ["dq", "dk", "dv"], [lens[0], lens[1], lens[0]])
            .unwrap_err()
            .to_string();
        assert!(err.contains("dv"), "{err}");
    }

    /// The kernels take the window as at most `time` (no window is `time`),
    /// and refuse an empty one.
    #[test]
    fn windows_pass_as_at_most_time_and_are_never_empty() {
        let shape = AttentionShape {
            batch: 1,
            time: 100,
            heads: 2,
            kv_heads: 2,
            head_dim: 8,
            scale: 0.5,
            window: None,
        };
        let window = |window| CheckedAttention::new("t", &AttentionShape { window, ..shape });
        assert_eq!(window(None).unwrap().window, 100);
        assert_eq!(window(Some(1)).unwrap().window, 1);
        assert_eq!(window(Some(64)).unwrap().window, 64);
        assert_eq!(window(Some(1 << 40)).unwrap().window, 100);
        let err = window(Some(0)).unwrap_err().to_string();
        assert!(err.contains("window of at least 1"), "{err}");
    }

    #[test]
    fn head_widths_pick_the_narrowest_variant() {
        let pick = |d: usize| HEAD_DIM_VARIANTS.iter().position(|&dmax| d <= dmax);
        assert_eq!(pick(1), Some(0));
        assert_eq!(pick(32), Some(0));
        assert_eq!(pick(64), Some(0));
        assert_eq!(pick(65), Some(1));
        assert_eq!(pick(128), Some(1));
        assert_eq!(pick(129), None);
    }

    #[test]
    fn shapes_count_their_elements() {
        let shape = AttentionShape {
            batch: 2,
            time: 5,
            heads: 3,
            kv_heads: 3,
            head_dim: 4,
            scale: 0.5,
            window: None,
        };
        assert_eq!(shape.qkv_len(), 2 * 5 * 36);
        assert_eq!(shape.out_len(), 2 * 5 * 12);
        assert_eq!(shape.lse_len(), 2 * 3 * 5);
        let grouped = AttentionShape {
            heads: 4,
            kv_heads: 2,
            ..shape
        };
        assert_eq!(grouped.qkv_len(), 2 * 5 * 8 * 4);
        assert_eq!(grouped.q_len(), 2 * 5 * 16);
        assert_eq!(grouped.kv_len(), 2 * 5 * 8);
    }
}
