//! Stand-ins for the MPI types when the crate is built without its `mpi`
//! feature: the same names, constructors that return
//! [`Error::FeatureDisabled`]. No value of [`MpiComm`] can exist, so code
//! written against it compiles and fails at the first constructor call with
//! a message that says how to enable MPI.

use crate::error::{Error, Result};
use zero_core::{Element, Host, ReduceOp, Result as CoreResult, Work};

/// Which algorithm large collectives use (see the `mpi` feature's docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// The library's collective for small buffers, the ring for large ones.
    #[default]
    Auto,
    /// Always the MPI library's collective.
    Native,
    /// Always the send/receive ring.
    Ring,
}

/// The MPI communicator; this build has no MPI (feature `mpi` is off), so
/// every constructor returns [`Error::FeatureDisabled`].
#[derive(Debug)]
pub struct MpiComm {
    never: std::convert::Infallible,
}

impl MpiComm {
    /// Always [`Error::FeatureDisabled`]: this build has no MPI.
    pub fn init() -> Result<Self> {
        Err(Error::FeatureDisabled {
            op: "MpiComm::init",
        })
    }

    /// This rank's index (unreachable: no value exists without MPI).
    pub fn rank(&self) -> usize {
        match self.never {}
    }

    /// The group's size (unreachable: no value exists without MPI).
    pub fn world_size(&self) -> usize {
        match self.never {}
    }

    /// Would end the job (unreachable: no value exists without MPI).
    pub fn abort(&self, _reason: &str) -> ! {
        match self.never {}
    }

    /// Would return the value or end the job (unreachable without MPI).
    pub fn ok_or_abort<T, E: std::fmt::Display>(&self, _result: Result<T, E>) -> T {
        match self.never {}
    }

    /// Would choose the algorithm of large collectives (unreachable).
    pub fn with_algorithm(self, _algorithm: Algorithm) -> Self {
        match self.never {}
    }

    /// Would set the deadline of every collective (unreachable).
    pub fn with_timeout(self, _timeout: Option<std::time::Duration>) -> Self {
        match self.never {}
    }

    /// Would install the abort-on-panic hook (unreachable without MPI).
    pub fn abort_on_panic(&self) {
        match self.never {}
    }
}

impl zero_core::Communicator for MpiComm {
    type Memory = Host;
    fn rank(&self) -> usize {
        match self.never {}
    }
    fn world_size(&self) -> usize {
        match self.never {}
    }
    fn bytes_sent(&self) -> u64 {
        match self.never {}
    }
    fn barrier(&self) -> CoreResult<()> {
        match self.never {}
    }
    fn all_reduce<T: Element>(&self, _: &mut [T], _: ReduceOp) -> CoreResult<()> {
        match self.never {}
    }
    fn reduce_scatter<T: Element>(&self, _: &[T], _: &mut [T], _: ReduceOp) -> CoreResult<()> {
        match self.never {}
    }
    fn all_gather<T: Element>(&self, _: &[T], _: &mut [T]) -> CoreResult<()> {
        match self.never {}
    }
    fn broadcast<T: Element>(&self, _: &mut [T], _: usize) -> CoreResult<()> {
        match self.never {}
    }
    fn reduce<T: Element>(&self, _: &mut [T], _: ReduceOp, _: usize) -> CoreResult<()> {
        match self.never {}
    }
    fn gather_varlen<T: Element>(
        &self,
        _: &[T],
        _: &[usize],
        _: Option<&mut [T]>,
        _: usize,
    ) -> CoreResult<()> {
        match self.never {}
    }
    fn all_gather_varlen<T: Element>(&self, _: &[T], _: &[usize], _: &mut [T]) -> CoreResult<()> {
        match self.never {}
    }
    fn all_gather_bytes(&self, _: &[u8]) -> CoreResult<Vec<Vec<u8>>> {
        match self.never {}
    }
    fn all_reduce_async<'a, T: Element>(
        &'a self,
        _: &'a mut [T],
        _: ReduceOp,
    ) -> CoreResult<Work<'a>> {
        match self.never {}
    }
    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        _: &'a [T],
        _: &'a mut [T],
        _: ReduceOp,
    ) -> CoreResult<Work<'a>> {
        match self.never {}
    }
    fn all_gather_async<'a, T: Element>(
        &'a self,
        _: &'a [T],
        _: &'a mut [T],
    ) -> CoreResult<Work<'a>> {
        match self.never {}
    }
    fn broadcast_async<'a, T: Element>(&'a self, _: &'a mut [T], _: usize) -> CoreResult<Work<'a>> {
        match self.never {}
    }
    fn split(&self, _: &[usize]) -> CoreResult<Option<Self>> {
        match self.never {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_without_feature_says_how_to_enable_it() {
        let err = MpiComm::init().unwrap_err();
        assert!(err.to_string().contains("`mpi` feature"), "{err}");
    }
}
