//! The flat partitioner: DeepSpeed / FSDP semantics.

use super::layout::{self, round_up};
use super::plan::{ParamInfo, PartitionKind, PartitionPlan, Partitioner, DEFAULT_ALIGNMENT};
use crate::{Error, Result};

/// Concatenates all trainable parameters, in the order given, into one flat
/// buffer and cuts it into `world_size` equal contiguous ranges.
///
/// The buffer is padded at the end so that `shard_numel` is a multiple of
/// [`alignment`](Flat::alignment) elements: every rank's segment then starts
/// on an aligned offset and reduce-scatter / all-gather move equal, exact
/// counts. A parameter may straddle ranks; each rank gets the pieces that
/// fall in its range. Ranks own `shard_numel` elements each except at the
/// end, where the padding sits (the last ranks may own fewer, or nothing).
/// Frozen parameters get no offset and own nothing.
///
/// All trainable parameters must share one dtype (the layout counts
/// elements); an engine with mixed dtypes partitions each dtype separately.
///
/// ```
/// use zero_core::{DType, Flat, ParamInfo, Partitioner};
/// let params = vec![
///     ParamInfo::new("w", [10, 10], DType::F32),
///     ParamInfo::new("b", [10], DType::F32),
/// ];
/// let plan = Flat::new(8).partition(&params, 4, usize::MAX)?;
/// assert_eq!(plan.shard_numel, 32); // 110 / 4 = 27.5, rounded up to 8
/// assert_eq!(plan.owned_numel(0), 32);
/// assert_eq!(plan.owned_numel(3), 110 - 3 * 32);
/// # Ok::<(), zero_core::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Flat {
    /// Alignment of `shard_numel`, in elements (at least 1). The default,
    /// [`DEFAULT_ALIGNMENT`], is 128 bytes of f32.
    pub alignment: usize,
}

impl Default for Flat {
    fn default() -> Self {
        Self {
            alignment: DEFAULT_ALIGNMENT,
        }
    }
}

impl Flat {
    /// A flat partitioner with `alignment` elements (at least 1; 0 is
    /// rejected by [`partition`](Partitioner::partition)).
    pub fn new(alignment: usize) -> Self {
        Self { alignment }
    }

    /// Sets the alignment, in elements.
    pub fn with_alignment(mut self, alignment: usize) -> Self {
        self.alignment = alignment;
        self
    }
}

impl Partitioner for Flat {
    fn partition(
        &self,
        params: &[ParamInfo],
        world_size: usize,
        bucket_bytes: usize,
    ) -> Result<PartitionPlan> {
        let (numels, dtype) =
            layout::validate("Flat", params, world_size, bucket_bytes, self.alignment)?;

        let mut flat_offsets = Vec::with_capacity(params.len());
        let mut total = 0usize;
        for (p, &numel) in params.iter().zip(&numels) {
            if p.trainable {
                flat_offsets.push(Some(total));
                total = total.checked_add(numel).ok_or_else(|| {
                    Error::Config(
                        "Flat: the trainable parameters hold more elements than fit in usize"
                            .into(),
                    )
                })?;
            } else {
                flat_offsets.push(None);
            }
        }

        let shard_numel = round_up("Flat", total.div_ceil(world_size), self.alignment)?;
        if shard_numel.checked_mul(world_size).is_none() {
            return Err(Error::Config(format!(
                "Flat: a flat buffer of {world_size} x {shard_numel} elements overflows usize"
            )));
        }

        Ok(layout::finish(
            PartitionKind::Flat,
            params,
            &numels,
            world_size,
            shard_numel,
            flat_offsets,
            dtype,
            bucket_bytes,
            self.alignment,
        ))
    }
}
