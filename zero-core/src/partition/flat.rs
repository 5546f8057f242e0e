//! The flat partitioner. (stub, being written)

use super::{ParamInfo, PartitionPlan, Partitioner};

/// Placeholder.
#[derive(Clone, Debug, Default)]
pub struct Flat;

impl Partitioner for Flat {
    fn partition(&self, _: &[ParamInfo], _: usize, _: usize) -> crate::Result<PartitionPlan> {
        Err(crate::Error::Config("not yet".into()))
    }
}
