//! [`RotaryDims`], the shape a rotary-embedding call works on, and
//! [`Turn`], which way it rotates: the CPU op and the CUDA entry points
//! both take them.

use candle_core::{bail, Result, Shape, Tensor};

const OP: &str = "rotary_embedding";

/// The shape a rotary embedding works on: `x` `[batch, time, heads,
/// head_dim]`, the tables `[time, head_dim / 2]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RotaryDims {
    pub(crate) batch: usize,
    pub(crate) time: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
}

impl RotaryDims {
    pub(super) fn of(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Self> {
        let Ok((batch, time, heads, head_dim)) = x.dims4() else {
            bail!(
                "zero-candle {OP}: x has shape {:?}; pass [batch, time, heads, head_dim]",
                x.dims()
            )
        };
        if head_dim % 2 != 0 {
            bail!("zero-candle {OP}: head_dim {head_dim} is odd; rotary embeddings rotate pairs")
        }
        for (what, table) in [("cos", cos), ("sin", sin)] {
            if table.dims() != [time, head_dim / 2] {
                bail!(
                    "zero-candle {OP}: {what} has shape {:?}, expected [{time}, {}] (time, \
                     head_dim / 2) for x of shape {:?}",
                    table.dims(),
                    head_dim / 2,
                    x.dims()
                )
            }
            if table.dtype() != x.dtype() {
                bail!(
                    "zero-candle {OP}: {what} is {:?} but x is {:?}; convert the table with \
                     .to_dtype()",
                    table.dtype(),
                    x.dtype()
                )
            }
        }
        Ok(Self {
            batch,
            time,
            heads,
            head_dim,
        })
    }

    pub(super) fn shape(&self) -> Shape {
        Shape::from((self.batch, self.time, self.heads, self.head_dim))
    }
}

/// Which way [`rotate`] turns: by the tables' angles (the forward), or by
/// their opposites (the backward: a rotation's transpose is its inverse).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    Forward,
    Backward,
}
