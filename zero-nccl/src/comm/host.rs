//! The collectives that wait on the host: byte gathers and host values,
//! staged through device memory on the comm stream, each wait bounded by
//! the deadline. Their buffers come from the host, so they wait for no
//! kernel: the host does not wait for the compute stream to drain (only for
//! the comm stream's earlier collectives).

use super::collectives::{After, Receivers};
use super::NcclComm;
use crate::device_comm::ring_bytes;
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::{result as nccl, sys};
use zero_core::{Element, ReduceOp};

impl NcclComm {
    pub(super) fn host_bytes_all_gather(&self, send: &[u8]) -> Result<Vec<Vec<u8>>> {
        const OP: &str = "all_gather_bytes";
        let n = self.world_size;
        if n == 1 {
            return Ok(vec![send.to_vec()]);
        }
        let stream = &self.comm_stream;
        let len_send = stream.clone_htod(&[send.len() as u64])?;
        let mut len_recv = stream.alloc_zeros::<u64>(n)?;
        let done = self.raw_all_gather(
            OP,
            &len_send,
            &mut len_recv,
            sys::ncclDataType_t::ncclUint64,
        )?;
        self.host_wait(OP, &done)?;
        let lens: Vec<usize> = stream
            .clone_dtoh(&len_recv)?
            .into_iter()
            .map(|l| l as usize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        if max == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let mut padded = send.to_vec();
        padded.resize(max, 0);
        let data_send = stream.clone_htod(&padded)?;
        let mut data_recv = stream.alloc_zeros::<u8>(max * n)?;
        let done = self.raw_all_gather(
            OP,
            &data_send,
            &mut data_recv,
            sys::ncclDataType_t::ncclUint8,
        )?;
        self.host_wait(OP, &done)?;
        let all = stream.clone_dtoh(&data_recv)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &len)| all[r * max..r * max + len].to_vec())
            .collect())
    }

    fn raw_all_gather<U>(
        &self,
        op: &'static str,
        send: &CudaSlice<U>,
        recv: &mut CudaSlice<U>,
        dtype: sys::ncclDataType_t,
    ) -> Result<CudaEvent> {
        let count = send.len();
        let bytes = ring_bytes(recv.num_bytes(), self.world_size);
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        self.issue_after(After::CommStream, op, bytes, |comm, stream| {
            // SAFETY: callers allocate `recv` with world_size * count elements.
            unsafe { nccl::all_gather(src as *const _, dst as *mut _, count, dtype, comm, stream) }
                .map(drop)
                .map_err(|e| Error::nccl("ncclAllGather", e))
        })
    }
}

/// The host-facing collectives of [`DeviceComm`](crate::DeviceComm), in this
/// crate's errors.
impl NcclComm {
    /// [`DeviceComm::wait_compute`](crate::DeviceComm::wait_compute).
    pub(super) fn wait_compute_raw(&self, op: &'static str) -> Result<()> {
        self.owner.check("NcclComm")?;
        self.ctx.bind_to_thread()?;
        let done = self.compute.record_event(None)?;
        self.host_wait(op, &done)
    }

    /// [`DeviceComm::all_reduce_host`](crate::DeviceComm::all_reduce_host),
    /// through device memory on the comm stream. On one rank every
    /// reduction leaves the values as they are: nothing goes to the device.
    /// The engine all-reduces a few host values every step (the graph's
    /// fingerprint, the trainable mask): on neither path does the host wait
    /// for the compute stream to drain.
    pub(super) fn all_reduce_host_raw(&self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        self.owner.check("NcclComm")?;
        if self.world_size == 1 {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        let stream = &self.comm_stream;
        let mut buf = stream.clone_htod(values)?;
        let done = self.all_reduce_event_after(After::CommStream, &mut buf, op)?;
        self.host_wait("all_reduce (host values)", &done)?;
        stream.memcpy_dtoh(&buf, values)?;
        Ok(())
    }

    /// [`DeviceComm::gather_varlen_host`](crate::DeviceComm::gather_varlen_host),
    /// staged through device memory on the comm stream.
    pub(super) fn gather_varlen_host_raw<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.owner.check("NcclComm")?;
        self.ctx.bind_to_thread()?;
        self.check_root("gather_varlen", root)?;
        let stream = &self.comm_stream;
        // cudarc cannot allocate zero bytes: stage through one spare element.
        let mut send_dev = stream.alloc_zeros::<T>(send.len().max(1))?;
        let mut recv_dev = stream.alloc_zeros::<T>(recv.as_ref().map_or(1, |r| r.len().max(1)))?;
        if !send.is_empty() {
            stream.memcpy_htod(send, &mut send_dev.slice_mut(0..send.len()))?;
        }
        let recv_len = recv.as_ref().map(|r| r.len());
        let done = {
            let mut recv_view = recv_len.map(|len| recv_dev.slice_mut(0..len));
            self.varlen_event(
                "gather_varlen",
                &send_dev.slice(0..send.len()),
                counts,
                recv_view.as_mut(),
                Receivers::Root(root),
                After::CommStream,
            )?
        };
        self.host_wait("gather_varlen", &done)?;
        if let Some(out) = recv {
            let len = out.len();
            stream.memcpy_dtoh(&recv_dev.slice(0..len), out)?;
        }
        Ok(())
    }
}
