//! What `CudaMemory` can do beyond the engine's core seam: reductions that
//! complete on the stream after they return, gathers of packed 16-bit
//! chunks, and queued transfers to and from page-locked host memory for
//! offload.

use super::{check_range, cuda, gather_widen, short_wire, wire16, CudaMemory};
use crate::kernels::Half;
use crate::DeviceComm;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Arc;
use zero_core::engine::{Deferral, HostPin, HostTransfers, Landing, PackedGathers};
use zero_core::{Error, Result};

impl CudaMemory {
    /// A download's checks (`range` of a buffer of `len`, into `out_len`
    /// elements) and its stream, made to wait on the reductions still
    /// deferred (the deferral goes on); `None` when there is nothing to
    /// copy.
    fn download_stream(
        &mut self,
        len: usize,
        range: &Range<usize>,
        out_len: usize,
    ) -> Result<Option<Arc<CudaStream>>> {
        check_range("download", range, len)?;
        if range.len() != out_len {
            return Err(Error::State(format!(
                "internal: download of {} elements into {out_len}",
                range.len()
            )));
        }
        if range.is_empty() {
            return Ok(None);
        }
        let stream = self.stream()?;
        // Those the stream waits on already (fenced) order it for good: one
        // wait per reduction over a pass, not one per reduction and bucket.
        if let Some(events) = self.deferred.as_ref() {
            for event in &events[self.fenced.min(events.len())..] {
                stream.wait(event).map_err(cuda)?;
            }
            self.fenced = events.len();
        }
        Ok(Some(stream))
    }

    /// The stream a transfer is queued on: the copy stream, made to wait
    /// for what `compute` has queued so far, or `compute` itself. Every
    /// transfer goes on the same one, so each one landed means every one
    /// queued before it did (`pinned::Transfers`).
    fn transfer_stream(&self, compute: &Arc<CudaStream>) -> Result<Arc<CudaStream>> {
        match &self.copy {
            Some(copy) => {
                let ready = compute.record_event(None).map_err(cuda)?;
                copy.wait(&ready).map_err(cuda)?;
                Ok(Arc::clone(copy))
            }
            None => Ok(Arc::clone(compute)),
        }
    }

    /// [`PackedGathers::all_gather_packed`] in `H`: `send`'s memory already
    /// holds the `n` rounded values, gathered from there.
    fn all_gather_packed_as<H: Half + zero_core::Element>(
        &mut self,
        comm: &impl DeviceComm,
        send: &CudaSlice<f32>,
        n: usize,
        recv: &mut CudaSlice<f32>,
        recv_range: Range<usize>,
    ) -> Result<()> {
        check_range(
            "all_gather_packed",
            &(0..zero_core::engine::packed_len::<f32>(n)),
            send.len(),
        )?;
        check_range("all_gather_packed", &recv_range, recv.len())?;
        let stream = self.stream()?;
        let (_, recv16) = wire16(&mut self.wire16, &stream, 0, recv_range.len())?;
        // SAFETY: `send` holds `n` values of the 16-bit plain-data `H`
        // packed from its start (`pack_narrow`'s layout; length checked).
        let packed = unsafe { send.transmute::<H>(n) }.ok_or_else(short_wire)?;
        gather_widen(
            &self.kernels,
            &stream,
            comm,
            &packed,
            recv16,
            (recv, recv_range),
        )
    }
}

impl<C: DeviceComm> Deferral<C> for CudaMemory {
    fn defer_completion(&mut self) {
        self.deferred.get_or_insert_with(Vec::new);
    }

    fn deferred_count(&self) -> usize {
        self.deferred.as_ref().map_or(0, Vec::len)
    }

    /// The compute stream waits on the first `count` deferred collectives'
    /// events; the host does not.
    fn fence_deferred(&mut self, count: usize) -> Result<()> {
        let Some(events) = self.deferred.as_ref() else {
            return Ok(());
        };
        let count = count.min(events.len());
        if count <= self.fenced {
            return Ok(());
        }
        let stream = self.stream()?;
        for event in &events[self.fenced..count] {
            stream.wait(event).map_err(cuda)?;
        }
        self.fenced = count;
        Ok(())
    }

    /// The compute stream (the communicator's, which is this memory's)
    /// waits on every deferred collective; the host does not.
    fn settle(&mut self, _comm: &C) -> Result<()> {
        let Some(events) = self.deferred.take() else {
            return Ok(());
        };
        let fenced = std::mem::take(&mut self.fenced);
        let stream = self.stream()?;
        for event in &events[fenced.min(events.len())..] {
            stream.wait(event).map_err(cuda)?;
        }
        Ok(())
    }
}

impl<C: DeviceComm> PackedGathers<C, CudaSlice<f32>> for CudaMemory {
    fn all_gather_packed(
        &mut self,
        comm: &C,
        send: &CudaSlice<f32>,
        n: usize,
        recv: &mut CudaSlice<f32>,
        recv_range: Range<usize>,
        wire: zero_core::DType,
    ) -> Result<()> {
        use zero_core::DType;
        match wire {
            DType::BF16 => self.all_gather_packed_as::<bf16>(comm, send, n, recv, recv_range),
            DType::F16 => self.all_gather_packed_as::<f16>(comm, send, n, recv, recv_range),
            other => Err(Error::State(format!(
                "internal: a packed gather in {other:?}, not a 16-bit dtype"
            ))),
        }
    }
}

impl<C: DeviceComm> HostTransfers<f32, C> for CudaMemory {
    /// Offload's device-to-host transfer: the compute stream first waits on
    /// the reductions still deferred (the deferral goes on), the host waits
    /// for the stream within the communicator's deadline (a reduction a
    /// dead peer never joins is an error, not a hang), then the copy runs.
    fn download(
        &mut self,
        buffer: &CudaSlice<f32>,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let Some(stream) = self.download_stream(buffer.len(), &range, out.len())? else {
            return Ok(());
        };
        self.drain_within("offload: copying to host memory")?;
        stream.memcpy_dtoh(&buffer.slice(range), out).map_err(cuda)
    }

    /// [`HostTransfers::download`] without the host's wait: the compute
    /// stream waits on the deferred reductions, the copy into page-locked
    /// `out` is queued after them, and the source stays held until it has
    /// landed (see `pinned::Transfers`).
    unsafe fn download_queued(
        &mut self,
        buffer: CudaSlice<f32>,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let Some(compute) = self.download_stream(buffer.len(), &range, out.len())? else {
            return Ok(());
        };
        let stream = self.transfer_stream(&compute)?;
        {
            let source = buffer.slice(range);
            let (src, _record) = source.device_ptr(&stream);
            // SAFETY: `src` holds `out.len()` elements, kept alive by
            // `transfers` until the copy lands; `out` is page-locked and
            // stays in place, untouched, until then (the caller's contract).
            unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src, stream.cu_stream()) }
                .map_err(cuda)?;
        }
        let done = stream.record_event(None).map_err(cuda)?;
        self.transfers.queued(done, Some(buffer), self.timeout)
    }

    /// A new buffer holding `values`, its copy from page-locked memory
    /// queued (no drain first: it cannot block the host) and waited for by
    /// `land`. The buffer is allocated on the compute stream, which uses
    /// and frees it; on a copy stream, the copy waits for the allocation
    /// and the compute stream for the copy.
    unsafe fn upload_queued(&mut self, values: &[f32]) -> Result<CudaSlice<f32>> {
        let compute = self.stream()?;
        if values.is_empty() {
            // As `alloc_zeroed`: one spare element no range reaches.
            return compute.alloc_zeros(1).map_err(cuda);
        }
        // SAFETY: the copy below, the first use of the buffer, writes
        // every element.
        let mut staged = unsafe { compute.alloc::<f32>(values.len()) }.map_err(cuda)?;
        let stream = self.transfer_stream(&compute)?;
        {
            let (dst, _record) = staged.device_ptr_mut(&stream);
            // SAFETY: `dst` holds `values.len()` elements; `values` is
            // page-locked and stays in place, unwritten, until the copy
            // lands (the caller's contract).
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, values, stream.cu_stream()) }
                .map_err(cuda)?;
        }
        let done = stream.record_event(None).map_err(cuda)?;
        if self.copy.is_some() {
            compute.wait(&done).map_err(cuda)?;
        }
        self.transfers.queued(done, None, self.timeout)?;
        Ok(staged)
    }

    fn landing(&mut self) -> Result<Option<Landing>> {
        Ok(self.transfers.landing(self.timeout))
    }

    fn land(&mut self) -> Result<()> {
        self.transfers.land(self.timeout)
    }

    /// Registers the offloaded shard with the driver (see `pinned`).
    fn pin_host(&mut self, values: &mut [f32]) -> Result<Option<HostPin>> {
        let stream = self.stream()?;
        super::super::pinned::pin(stream.context(), values, &self.transfers, self.timeout)
    }

    /// Offload's transfers on a stream of their own (see `transfer_stream`).
    fn copy_stream(&mut self) -> Result<()> {
        if self.copy.is_none() {
            let stream = self.stream()?;
            self.copy = Some(stream.context().new_stream().map_err(cuda)?);
        }
        Ok(())
    }
}
