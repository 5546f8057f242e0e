//! Rotary embeddings' launches for [`LayerKernels`] (`rotary_*` in
//! layers.cu): the call's shape, its checks, and the turn (forward, or the
//! backward's opposite angles).

use super::{check_len, int_arg, Launch, LayerElement, LayerKernels};
use crate::{Error, Result};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use std::sync::Arc;

/// The shape of one rotary-embedding call in `rotate_half`'s convention:
/// `x` and `y` `[batch, time, heads, head_dim]`, the tables `cos` and `sin`
/// `[time, head_dim / 2]`. The pair `(d, d + head_dim / 2)` of each head
/// at position `t` turns by the angle of the tables' `(t, d)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RotaryShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence (the tables' rows).
    pub time: usize,
    /// Heads per position.
    pub heads: usize,
    /// Width of one head; even.
    pub head_dim: usize,
}

impl RotaryShape {
    /// Elements of `x` and of `y`.
    pub fn x_len(&self) -> usize {
        self.batch * self.time * self.heads * self.head_dim
    }

    /// Elements of each table.
    pub fn table_len(&self) -> usize {
        self.time * self.head_dim / 2
    }
}

/// Which way [`LayerKernels::rotary_embedding`] turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RotaryTurn {
    /// By the tables' angles: `y = x cos + rotate_half(x) sin` (the
    /// forward).
    Forward,
    /// By their opposites: the forward's transpose, which maps the output
    /// gradient to the input's (the backward).
    Backward,
}

impl RotaryTurn {
    /// The factor on the sines (the kernel's `sign`).
    fn sign(self) -> f32 {
        match self {
            RotaryTurn::Forward => 1.0,
            RotaryTurn::Backward => -1.0,
        }
    }
}

impl LayerKernels {
    /// `y = x` rotated by the angles of `cos` and `sin` (or, with
    /// [`RotaryTurn::Backward`], by their opposites), for the layout of
    /// [`RotaryShape`]: `[x1 c - x2 s, x2 c + x1 s]` per head, with `x1`,
    /// `x2` its halves. One thread per pair.
    #[allow(clippy::too_many_arguments)]
    pub fn rotary_embedding<E: LayerElement>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &RotaryShape,
        turn: RotaryTurn,
        x: &impl DevicePtr<E>,
        cos: &impl DevicePtr<E>,
        sin: &impl DevicePtr<E>,
        y: &mut impl DevicePtrMut<E>,
    ) -> Result<()> {
        const OP: &str = "rotary_embedding";
        if shape.head_dim % 2 != 0 {
            return Err(Error::from(zero_core::Error::Unsupported {
                op: OP,
                detail: format!(
                    "head_dim {} is odd; rotary embeddings rotate pairs",
                    shape.head_dim
                ),
            }));
        }
        check_len(OP, "x", x.len(), shape.x_len())?;
        check_len(OP, "y", y.len(), shape.x_len())?;
        check_len(OP, "cos", cos.len(), shape.table_len())?;
        check_len(OP, "sin", sin.len(), shape.table_len())?;
        let pairs = shape.x_len() / 2;
        let Some(cfg) = self.config(OP, Launch::Elements(pairs))? else {
            return Ok(());
        };
        let pairs = pairs as i64;
        let half = int_arg(OP, "head_dim / 2", shape.head_dim / 2)?;
        let heads = int_arg(OP, "heads", shape.heads)?;
        let time = int_arg(OP, "time", shape.time)?;
        let sign = turn.sign();
        let (x, _g0) = x.device_ptr(stream);
        let (cos, _g1) = cos.device_ptr(stream);
        let (sin, _g2) = sin.device_ptr(stream);
        let (y, _g3) = y.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&self.rotary[E::INDEX]);
        launch
            .arg(&x)
            .arg(&cos)
            .arg(&sin)
            .arg(&y)
            .arg(&pairs)
            .arg(&half)
            .arg(&heads)
            .arg(&time)
            .arg(&sign);
        // SAFETY: x and y hold 2 * pairs `E` (checked against the shape),
        // cos and sin time * half; the kernel reads row t of the tables for
        // t < time only; the arguments match `rotary_*`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_follow_the_shape() {
        let shape = RotaryShape {
            batch: 2,
            time: 3,
            heads: 5,
            head_dim: 8,
        };
        assert_eq!(shape.x_len(), 240);
        assert_eq!(shape.table_len(), 12);
        assert_eq!(RotaryTurn::Forward.sign(), 1.0);
        assert_eq!(RotaryTurn::Backward.sign(), -1.0);
    }
}
