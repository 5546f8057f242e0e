//! # zero-mpi-gloo
//!
//! The CPU path of zero-rs across processes and machines (feature `mpi`): an
//! MPI communicator over host buffers. Being written.
#![warn(missing_docs)]
