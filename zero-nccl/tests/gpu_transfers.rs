//! Offload's queued transfers between page-locked host memory and the GPU
//! (`CudaMemory::download_queued`, `upload_queued`, `land`): the order the
//! engine relies on, whichever streams the copies run on. A download reads
//! what the compute stream wrote before it was queued; the compute
//! stream's work queued after an upload reads the uploaded values; a host
//! buffer can be reused once landed.
//!
//! Needs a GPU: `#[ignore]`d, run with `-- --ignored` on a GPU machine.

#![cfg(feature = "nccl")]

mod common;

use zero_core::engine::{HostBuffer, HostTransfers, ShardMemory};
use zero_nccl::cudarc::driver::CudaSlice;
use zero_nccl::{CudaMemory, DeviceComm, NcclComm};

/// `CudaMemory` as the engine's memory for one communicator type.
trait Memory: HostTransfers<f32, NcclComm, Buffer = CudaSlice<f32>> {}
impl Memory for CudaMemory {}

/// Large enough (256 MB) that a copy takes milliseconds: a copy that did
/// not wait, or was not waited for, would be caught part-way.
const LEN: usize = 64 << 20;

/// The memory for `comm` (its transfers on a stream of their own with
/// `copy_stream`) and a page-locked host buffer of [`LEN`].
fn memory_and_host(comm: &NcclComm, copy_stream: bool) -> (impl Memory, HostBuffer<f32>) {
    let mut memory = CudaMemory::new(comm).unwrap();
    if copy_stream {
        HostTransfers::<f32, NcclComm>::copy_stream(&mut memory).unwrap();
    }
    let host = HostBuffer::pinned(LEN, |values| {
        HostTransfers::<f32, NcclComm>::pin_host(&mut memory, values)
    })
    .unwrap();
    assert!(host.is_pinned(), "the GPU page-locks offloaded memory");
    (memory, host)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_queued_download_reads_what_the_compute_stream_wrote_before_it() {
    let comm = common::nccl_comm();
    for copy_stream in [false, true] {
        download_after_compute(&comm, copy_stream);
    }
}

fn download_after_compute(comm: &NcclComm, copy_stream: bool) {
    let (mut memory, mut host) = memory_and_host(comm, copy_stream);
    let ones = vec![1.0f32; LEN];
    for round in 0..3 {
        let mut device = memory.alloc_zeroed(LEN).unwrap();
        memory.buffer_from_host(&mut device, 0, &ones).unwrap();
        // Queued on the compute stream and still running when the copy is
        // queued: ten doublings, the last half of the buffer twice more.
        for _ in 0..10 {
            memory
                .scale(&mut device, std::slice::from_ref(&(0..LEN)), 2.0)
                .unwrap();
        }
        memory
            .scale(&mut device, std::slice::from_ref(&(LEN / 2..LEN)), 4.0)
            .unwrap();
        // SAFETY: `host` is locked by this memory and untouched until landed.
        unsafe { memory.download_queued(device, 0..LEN, &mut host) }.unwrap();
        memory.land().unwrap();
        let (low, high) = host.split_at(LEN / 2);
        assert!(
            low.iter().all(|&x| x == 1024.0),
            "copy stream {copy_stream}, round {round}"
        );
        assert!(
            high.iter().all(|&x| x == 4096.0),
            "copy stream {copy_stream}, round {round}"
        );
        // The landed buffer is the host's again: the next round rewrites it.
        host.fill(-1.0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_compute_stream_reads_an_upload_only_once_it_landed() {
    let comm = common::nccl_comm();
    for copy_stream in [false, true] {
        compute_after_upload(&comm, copy_stream);
    }
}

fn compute_after_upload(comm: &NcclComm, copy_stream: bool) {
    let (mut memory, mut host) = memory_and_host(comm, copy_stream);
    for round in 0..3u8 {
        let base = f32::from(round) + 1.0;
        for (i, x) in host.iter_mut().enumerate() {
            *x = base + (i % 1000) as f32;
        }
        // SAFETY: `host` is locked by this memory and unwritten until landed.
        let mut device = unsafe { memory.upload_queued(&host[..]) }.unwrap();
        assert_eq!(device.len(), LEN);
        // Queued on the compute stream right behind the upload (on it or
        // on the copy stream): it must scale the uploaded values, not what
        // the buffer held before.
        memory
            .scale(&mut device, std::slice::from_ref(&(0..LEN)), 0.5)
            .unwrap();
        memory.land().unwrap();
        let mut back = vec![0.0f32; LEN];
        memory.download(&device, 0..LEN, &mut back).unwrap();
        let wrong = back
            .iter()
            .enumerate()
            .filter(|&(i, &x)| x != (base + (i % 1000) as f32) * 0.5)
            .count();
        assert_eq!(
            wrong, 0,
            "copy stream {copy_stream}, round {round}: elements not scaled after the upload"
        );
    }
    // An empty upload is a buffer no range reaches, as `alloc_zeroed(0)`.
    // SAFETY: nothing is read.
    let empty = unsafe { memory.upload_queued(&[]) }.unwrap();
    assert_eq!(empty.len(), memory.alloc_zeroed(0).unwrap().len());
    comm.wait_compute("test").unwrap();
}
