//! [`NcclComm`] as a [`Communicator`] and a [`DeviceComm`]: the trait
//! methods over the collectives of the sibling modules, and `split`.

use super::collectives::{nccl_dtype, nccl_op, After, Receivers};
use super::handle::RawComm;
use super::NcclComm;
use crate::device_comm::{ring_bytes, Cuda, DeviceComm};
use crate::probe::guarded;
use crate::Error;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nccl::{result as nccl, sys};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use zero_core::comm::Buf;
use zero_core::engine::UnitBucket;
use zero_core::{Communicator, Element, ReduceOp, Work};

/// `NCCL_SPLIT_NOCOLOR` from `nccl.h`: the rank takes no part in the new communicator.
const NCCL_SPLIT_NOCOLOR: i32 = -1;

impl Communicator for NcclComm {
    type Memory = Cuda;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    fn barrier(&self) -> zero_core::Result<()> {
        let mut token = self
            .comm_stream
            .alloc_zeros::<f32>(1)
            .map_err(Error::from)?;
        let done = self.all_reduce_event_raw(&mut token, ReduceOp::Sum)?;
        self.host_wait("barrier", &done)?;
        Ok(())
    }

    fn all_reduce<T: Element>(
        &self,
        buf: &mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<()> {
        self.all_reduce_async(buf, op)?.wait()
    }

    fn reduce_scatter<T: Element>(
        &self,
        send: &Buf<Self, T>,
        recv: &mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<()> {
        self.reduce_scatter_async(send, recv, op)?.wait()
    }

    fn all_gather<T: Element>(
        &self,
        send: &Buf<Self, T>,
        recv: &mut Buf<Self, T>,
    ) -> zero_core::Result<()> {
        self.all_gather_async(send, recv)?.wait()
    }

    fn broadcast<T: Element>(&self, buf: &mut Buf<Self, T>, root: usize) -> zero_core::Result<()> {
        self.broadcast_async(buf, root)?.wait()
    }

    fn reduce<T: Element>(
        &self,
        buf: &mut Buf<Self, T>,
        op: ReduceOp,
        root: usize,
    ) -> zero_core::Result<()> {
        let root = self.check_root("reduce", root)?;
        let count = buf.len();
        let bytes = ring_bytes(buf.num_bytes(), self.world_size);
        let (ptr, record) = buf.device_ptr_mut(&self.comm_stream);
        let done = self.issue("ncclReduce", bytes, |comm, stream| {
            // SAFETY: in place over `count` elements of a live device buffer;
            // NCCL writes the result only on `root`.
            unsafe {
                nccl::reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    count,
                    nccl_dtype(T::DTYPE),
                    nccl_op(op),
                    root,
                    comm,
                    stream,
                )
            }
            .map(drop)
            .map_err(|e| Error::nccl("ncclReduce", e))
        })?;
        drop(record);
        self.work(done).wait()
    }

    fn gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: Option<&mut Buf<Self, T>>,
        root: usize,
    ) -> zero_core::Result<()> {
        self.check_root("gather_varlen", root)?;
        let done = self.varlen_event(
            "gather_varlen",
            send,
            counts,
            recv,
            Receivers::Root(root),
            After::Compute,
        )?;
        self.work(done).wait()
    }

    fn all_gather_varlen<T: Element>(
        &self,
        send: &Buf<Self, T>,
        counts: &[usize],
        recv: &mut Buf<Self, T>,
    ) -> zero_core::Result<()> {
        let done = self.varlen_event(
            "all_gather_varlen",
            send,
            counts,
            Some(recv),
            Receivers::All,
            After::Compute,
        )?;
        self.work(done).wait()
    }

    fn all_gather_bytes(&self, send: &[u8]) -> zero_core::Result<Vec<Vec<u8>>> {
        Ok(self.host_bytes_all_gather(send)?)
    }

    fn all_reduce_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.all_reduce_event_raw(buf, op)?;
        Ok(self.work(done))
    }

    fn reduce_scatter_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
        op: ReduceOp,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.reduce_scatter_event_raw(send, recv, op)?;
        Ok(self.work(done))
    }

    fn all_gather_async<'a, T: Element>(
        &'a self,
        send: &'a Buf<Self, T>,
        recv: &'a mut Buf<Self, T>,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.all_gather_event_raw(send, recv)?;
        Ok(self.work(done))
    }

    fn broadcast_async<'a, T: Element>(
        &'a self,
        buf: &'a mut Buf<Self, T>,
        root: usize,
    ) -> zero_core::Result<Work<'a>> {
        let done = self.broadcast_event(buf, root)?;
        Ok(self.work(done))
    }

    fn split(&self, ranks: &[usize]) -> zero_core::Result<Option<Self>> {
        const OP: &str = "split";
        if ranks.windows(2).any(|w| w[0] >= w[1]) {
            return Err(zero_core::Error::Config(format!(
                "split: ranks {ranks:?} must be sorted and distinct"
            )));
        }
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(Error::from(zero_core::Error::InvalidRank {
                op: OP,
                rank: bad,
                world_size: self.world_size,
            })
            .into());
        }
        let position = ranks.iter().position(|&r| r == self.rank);
        let (color, key) = match position {
            Some(p) => (0, p as i32),
            None => (NCCL_SPLIT_NOCOLOR, 0),
        };
        let new_comm = guarded("ncclCommSplit", || {
            self.ctx.bind_to_thread()?;
            // Pending work on the old communicator must be queued before the
            // split, which is itself blocking and collective.
            let comm = self.lock(OP)?;
            let mut new_comm: sys::ncclComm_t = std::ptr::null_mut();
            // SAFETY: `comm.0` is live (checked by lock); `new_comm` is a valid
            // out-pointer; a null config inherits the parent's.
            unsafe { sys::ncclCommSplit(comm.0, color, key, &mut new_comm, std::ptr::null_mut()) }
                .result()
                .map_err(|e| Error::nccl("ncclCommSplit", e))?;
            Ok(new_comm)
        })?;
        let Some(position) = position else {
            if !new_comm.is_null() {
                drop(RawComm(new_comm));
            }
            return Ok(None);
        };
        let comm_stream = self.ctx.new_stream().map_err(Error::from)?;
        let mut sub = Self::wrap(
            new_comm,
            self.ctx.clone(),
            self.compute.clone(),
            comm_stream,
            position,
            ranks.len(),
        )
        .with_timeout(self.timeout);
        // The same compute stream, the same thread.
        sub.owner = self.owner;
        Ok(Some(sub))
    }
}

impl DeviceComm for NcclComm {
    fn context(&self) -> &Arc<CudaContext> {
        NcclComm::context(self)
    }

    fn compute_stream(&self) -> &Arc<CudaStream> {
        NcclComm::compute_stream(self)
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn with_compute_stream(self, stream: Arc<CudaStream>) -> zero_core::Result<Self> {
        Ok(NcclComm::with_compute_stream(self, stream)?)
    }

    fn all_reduce_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_reduce_event_raw(buf, op)?)
    }

    fn reduce_scatter_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.reduce_scatter_event_raw(send, recv, op)?)
    }

    fn all_gather_event<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_gather_event_raw(send, recv)?)
    }

    fn all_gather_in_place_event<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_gather_in_place_event_raw(buf)?)
    }

    fn all_gather_buckets_event<T: Element>(
        &self,
        shard: &CudaSlice<T>,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_gather_buckets_event_raw(Some(shard), buffer, buckets)?)
    }

    fn all_gather_buckets_in_place_event<T: Element>(
        &self,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> zero_core::Result<CudaEvent> {
        Ok(self.all_gather_buckets_event_raw(None, buffer, buckets)?)
    }

    fn wait_compute(&self, op: &'static str) -> zero_core::Result<()> {
        Ok(self.wait_compute_raw(op)?)
    }

    fn all_reduce_host(&self, values: &mut [f64], op: ReduceOp) -> zero_core::Result<()> {
        Ok(self.all_reduce_host_raw(values, op)?)
    }

    fn gather_varlen_host<T: Element + DeviceRepr + ValidAsZeroBits>(
        &self,
        send: &[T],
        counts: &[usize],
        recv: Option<&mut [T]>,
        root: usize,
    ) -> zero_core::Result<()> {
        Ok(self.gather_varlen_host_raw(send, counts, recv, root)?)
    }
}
