//! How [`NcclComm`] issues collectives on its comm stream: the four ring
//! collectives through one NCCL call site, the variable-length gathers as
//! grouped sends and receives, and the checks on their buffers.

use super::NcclComm;
use crate::device_comm::{bucket_gathers, event_work, ring_bytes};
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use zero_core::comm::{check_counts, check_len, check_root};
use zero_core::engine::UnitBucket;
use zero_core::{DType, Element, ReduceOp, Work};

/// The NCCL type of an element type.
pub(super) fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

pub(super) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Product => sys::ncclRedOp_t::ncclProd,
    }
}

/// A ring collective that [`NcclComm::collective_event`] issues.
#[derive(Clone, Copy, Debug)]
enum Collective {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    /// From the rank `root` (checked against the world size).
    Broadcast {
        root: i32,
    },
}

impl Collective {
    /// The NCCL function's name, for errors and the deadline's messages.
    fn call(self) -> &'static str {
        match self {
            Self::AllReduce(_) => "ncclAllReduce",
            Self::ReduceScatter(_) => "ncclReduceScatter",
            Self::AllGather => "ncclAllGather",
            Self::Broadcast { .. } => "ncclBroadcast",
        }
    }
}

/// What a ring collective of `count` elements of `T` per rank from `src`
/// into `dst` does at world size 1, where each is the identity: nothing in
/// place (`None`), else a copy of this many bytes. `NcclComm` does that
/// instead of launching NCCL's one-rank kernel.
fn one_rank_copy<T>(src: u64, dst: u64, count: usize) -> Option<usize> {
    (src != dst && count > 0).then(|| count * std::mem::size_of::<T>())
}

/// Queues on `stream` what a ring collective does at world size 1
/// ([`one_rank_copy`]).
///
/// # Safety
///
/// `src` and `dst` address live device buffers of at least `count`
/// elements of `T`.
unsafe fn one_rank<T>(src: u64, dst: u64, count: usize, stream: sys::cudaStream_t) -> Result<()> {
    match one_rank_copy::<T>(src, dst, count) {
        None => Ok(()),
        // SAFETY: both ranges are live device memory (the contract).
        Some(bytes) => {
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, stream.cast()) }
                .map_err(Error::from)
        }
    }
}

/// Address of element `offset` of a buffer of `T` at `ptr`.
fn offset_ptr<T>(ptr: u64, offset: usize) -> u64 {
    ptr + (offset * std::mem::size_of::<T>()) as u64
}

/// What a collective waits for before it starts on the comm stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum After {
    /// The work queued on the compute stream so far: the collective reads
    /// or writes buffers that kernels fill or read.
    Compute,
    /// Only the comm stream's own earlier work: the collective's buffers
    /// were just staged from the host on the comm stream, so it need not
    /// wait for the compute stream to drain (nor the host that waits on it).
    CommStream,
}

/// Who receives a variable-length gather.
#[derive(Clone, Copy)]
pub(super) enum Receivers {
    All,
    Root(usize),
}

impl NcclComm {
    fn cu_stream(&self) -> sys::cudaStream_t {
        self.comm_stream.cu_stream() as sys::cudaStream_t
    }

    /// Orders the comm stream after the compute stream, runs `call` under the
    /// communicator lock and returns the event recorded after it.
    pub(super) fn issue(
        &self,
        op: &'static str,
        bytes: u64,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<()>,
    ) -> Result<CudaEvent> {
        self.issue_after(After::Compute, op, bytes, call)
    }

    /// [`issue`](Self::issue), the comm stream ordered after the compute
    /// stream only when `after` says so.
    pub(super) fn issue_after(
        &self,
        after: After,
        op: &'static str,
        bytes: u64,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> Result<()>,
    ) -> Result<CudaEvent> {
        self.owner.check("NcclComm")?;
        self.ctx.bind_to_thread()?;
        if after == After::Compute {
            let ready = self.compute.record_event(None)?;
            self.comm_stream.wait(&ready)?;
        }
        {
            let comm = self.lock(op)?;
            call(comm.0, self.cu_stream())?;
        }
        self.seq.fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
        Ok(self.comm_stream.record_event(None)?)
    }

    /// The handle of a collective that completes at `done`.
    pub(super) fn work<'a>(&self, done: CudaEvent) -> Work<'a> {
        event_work(self.compute.clone(), self.owner, done)
    }

    pub(super) fn check_root(&self, op: &'static str, root: usize) -> Result<i32> {
        check_root(op, root, self.world_size)?;
        Ok(root as i32)
    }

    fn check_counts(&self, op: &'static str, counts: &[usize], send_len: usize) -> Result<()> {
        check_counts(op, counts, send_len, (self.rank, self.world_size))?;
        Ok(())
    }

    /// Issues `collective` from the device address `src` into `dst` (the
    /// same address when in place) with `count` elements of `T` per rank
    /// (NCCL's `count`, `recvcount` or `sendcount`), counting `bytes` as
    /// sent, once the comm stream is ordered after what `after` names. The
    /// one place the four ring collectives call NCCL.
    ///
    /// # Safety
    ///
    /// `src` and `dst` address live device buffers of `T` holding what
    /// `collective` reads and writes for `count`: `count` elements each in
    /// place, `world_size * count` in reduce-scatter's source and
    /// all-gather's destination, and `count` in the other side of those two.
    unsafe fn collective_event_after<T: Element>(
        &self,
        after: After,
        collective: Collective,
        src: u64,
        dst: u64,
        count: usize,
        bytes: u64,
    ) -> Result<CudaEvent> {
        let call = collective.call();
        let dtype = nccl_dtype(T::DTYPE);
        self.issue_after(after, call, bytes, |comm, stream| {
            if self.world_size == 1 {
                // SAFETY: as this function's contract requires.
                return unsafe { one_rank::<T>(src, dst, count, stream) };
            }
            let (src, dst) = (src as *const c_void, dst as *mut c_void);
            // SAFETY: the buffers are as this function's contract requires.
            unsafe {
                match collective {
                    Collective::AllReduce(op) => {
                        nccl::all_reduce(src, dst, count, dtype, nccl_op(op), comm, stream)
                    }
                    Collective::ReduceScatter(op) => {
                        nccl::reduce_scatter(src, dst, count, dtype, nccl_op(op), comm, stream)
                    }
                    Collective::AllGather => nccl::all_gather(src, dst, count, dtype, comm, stream),
                    Collective::Broadcast { root } => {
                        nccl::broadcast(src, dst, count, dtype, root, comm, stream)
                    }
                }
            }
            .map(drop)
            .map_err(|e| Error::nccl(call, e))
        })
    }

    /// [`collective_event_after`](Self::collective_event_after) the compute
    /// stream's work so far.
    ///
    /// # Safety
    ///
    /// As for `collective_event_after`.
    unsafe fn collective_event<T: Element>(
        &self,
        collective: Collective,
        src: u64,
        dst: u64,
        count: usize,
        bytes: u64,
    ) -> Result<CudaEvent> {
        // SAFETY: the caller's contract is the callee's.
        unsafe {
            self.collective_event_after::<T>(After::Compute, collective, src, dst, count, bytes)
        }
    }

    /// Fails unless the gathered side of a reduce-scatter or all-gather
    /// (`what`, of `got` elements) holds `world_size * count`.
    fn check_gathered(
        &self,
        op: &'static str,
        what: &'static str,
        got: usize,
        count: usize,
    ) -> Result<()> {
        Ok(check_len(op, what, got, count * self.world_size)?)
    }

    pub(super) fn all_reduce_event_raw<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        self.all_reduce_event_after(After::Compute, buf, op)
    }

    /// [`all_reduce_event_raw`](Self::all_reduce_event_raw) ordered after
    /// what `after` names.
    pub(super) fn all_reduce_event_after<T: Element>(
        &self,
        after: After,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        let count = buf.len();
        let bytes = 2 * ring_bytes(buf.num_bytes(), self.world_size);
        let (ptr, _record) = buf.device_ptr_mut(&self.comm_stream);
        // SAFETY: in place over `count` elements of a live device buffer of
        // `T`; the buffer stays borrowed until the returned event's Work is
        // waited.
        unsafe {
            self.collective_event_after::<T>(
                after,
                Collective::AllReduce(op),
                ptr,
                ptr,
                count,
                bytes,
            )
        }
    }

    pub(super) fn reduce_scatter_event_raw<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
        op: ReduceOp,
    ) -> Result<CudaEvent> {
        let count = recv.len();
        self.check_gathered("reduce_scatter", "send", send.len(), count)?;
        let bytes = ring_bytes(send.num_bytes(), self.world_size);
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        // SAFETY: `send` holds world_size * count and `recv` count elements
        // of `T` (checked above); both are live device buffers.
        unsafe { self.collective_event::<T>(Collective::ReduceScatter(op), src, dst, count, bytes) }
    }

    pub(super) fn all_gather_event_raw<T: Element>(
        &self,
        send: &(impl DevicePtr<T> + ?Sized),
        recv: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent> {
        let count = send.len();
        self.check_gathered("all_gather", "recv", recv.len(), count)?;
        let bytes = ring_bytes(recv.num_bytes(), self.world_size);
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let (dst, _record_dst) = recv.device_ptr_mut(&self.comm_stream);
        // SAFETY: `send` holds count and `recv` world_size * count elements
        // of `T` (checked above); both are live device buffers.
        unsafe { self.collective_event::<T>(Collective::AllGather, src, dst, count, bytes) }
    }

    /// [`DeviceComm::all_gather_in_place_event`](crate::DeviceComm::all_gather_in_place_event).
    pub(super) fn all_gather_in_place_event_raw<T: Element>(
        &self,
        buf: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<CudaEvent> {
        let count = crate::device_comm::in_place_slot(buf.len(), self.world_size)?;
        let bytes = ring_bytes(buf.num_bytes(), self.world_size);
        let (dst, _record) = buf.device_ptr_mut(&self.comm_stream);
        let src = offset_ptr::<T>(dst, self.rank * count);
        // SAFETY: `buf` is a live device buffer of world_size * count
        // elements of `T` (checked above), and `src` its slot `rank`: NCCL's
        // in-place all-gather.
        unsafe { self.collective_event::<T>(Collective::AllGather, src, dst, count, bytes) }
    }

    /// [`DeviceComm::all_gather_buckets_event`](crate::DeviceComm::all_gather_buckets_event)
    /// and its in-place form (`shard` `None`): the buckets' all-gathers in
    /// one NCCL group.
    pub(super) fn all_gather_buckets_event_raw<T: Element>(
        &self,
        shard: Option<&CudaSlice<T>>,
        buffer: &mut CudaSlice<T>,
        buckets: &[UnitBucket],
    ) -> Result<CudaEvent> {
        let len = buffer.len();
        let shard = shard.map(|shard| (shard.len(), shard.device_ptr(&self.comm_stream)));
        let (dst, _record_dst) = buffer.device_ptr_mut(&self.comm_stream);
        let (gathers, bytes) = bucket_gathers::<T>(
            shard.as_ref().map(|(len, (src, _))| (*src, *len)),
            (dst, len),
            buckets,
            (self.rank, self.world_size),
        )?;
        let dtype = nccl_dtype(T::DTYPE);
        self.issue("ncclAllGather", bytes, |comm, stream| {
            if self.world_size == 1 {
                for gather in &gathers {
                    // SAFETY: checked by bucket_gathers as below.
                    unsafe { one_rank::<T>(gather.send, gather.recv, gather.count, stream) }?;
                }
                return Ok(());
            }
            let nccl_err = |call| move |e| Error::nccl(call, e);
            nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
            // Queue every gather before checking errors, so that a failure
            // never leaves the group open.
            let mut queued = Ok(());
            for gather in &gathers {
                if queued.is_err() {
                    break;
                }
                let (src, dst) = (gather.send as *const c_void, gather.recv as *mut c_void);
                // SAFETY: bucket_gathers checked each chunk within the shard
                // (or this rank's slot of its place: NCCL's in-place form)
                // and each place, world_size chunks, within the buffer;
                // both are live device buffers of `T`.
                queued = unsafe { nccl::all_gather(src, dst, gather.count, dtype, comm, stream) }
                    .map(drop)
                    .map_err(nccl_err("ncclAllGather"));
            }
            let ended = nccl::group_end()
                .map(drop)
                .map_err(nccl_err("ncclGroupEnd"));
            queued.and(ended)
        })
    }

    pub(super) fn broadcast_event<T: Element>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<CudaEvent> {
        let root = self.check_root("broadcast", root)?;
        let count = buf.len();
        let bytes = ring_bytes(buf.num_bytes(), self.world_size);
        let (ptr, _record) = buf.device_ptr_mut(&self.comm_stream);
        // SAFETY: in place over `count` elements of a live device buffer.
        unsafe {
            self.collective_event::<T>(Collective::Broadcast { root }, ptr, ptr, count, bytes)
        }
    }

    /// Gathers the ranks' contributions with grouped point-to-point calls:
    /// rank `r`'s `counts[r]` elements land at offset `sum(counts[..r])` of
    /// `recv` on every rank in `receivers`.
    pub(super) fn varlen_event<T: Element, R: DevicePtrMut<T> + ?Sized>(
        &self,
        op: &'static str,
        send: &(impl DevicePtr<T> + ?Sized),
        counts: &[usize],
        recv: Option<&mut R>,
        receivers: Receivers,
        after: After,
    ) -> Result<CudaEvent> {
        self.check_counts(op, counts, send.len())?;
        let total: usize = counts.iter().sum();
        let offsets: Vec<usize> = counts
            .iter()
            .scan(0, |acc, &c| {
                let o = *acc;
                *acc += c;
                Some(o)
            })
            .collect();
        let receives = match receivers {
            Receivers::All => true,
            Receivers::Root(root) => root == self.rank,
        };
        let targets: Vec<usize> = match receivers {
            Receivers::All => (0..self.world_size).filter(|&p| p != self.rank).collect(),
            Receivers::Root(root) if root != self.rank => vec![root],
            Receivers::Root(_) => Vec::new(),
        };
        let recv = match (receives, recv) {
            (true, Some(recv)) if recv.len() == total => Some(recv),
            (true, Some(recv)) => {
                return Err(Error::from(zero_core::Error::BufferSize {
                    op,
                    what: "recv",
                    got: recv.len(),
                    expected: total,
                }))
            }
            (true, None) => {
                return Err(Error::from(zero_core::Error::Unsupported {
                    op,
                    detail: "the root must pass a receive buffer".into(),
                }))
            }
            (false, _) => None,
        };
        let dtype = nccl_dtype(T::DTYPE);
        let elem = std::mem::size_of::<T>();
        let bytes = (counts[self.rank] * elem * targets.len()) as u64;
        let (src, _record_src) = send.device_ptr(&self.comm_stream);
        let mut dst_guard = recv.map(|r| r.device_ptr_mut(&self.comm_stream));
        let dst = dst_guard.as_mut().map(|(ptr, _)| *ptr);
        let (rank, world_size) = (self.rank, self.world_size);
        let cu_stream = self.comm_stream.cu_stream();
        self.issue_after(after, op, bytes, |comm, stream| {
            if let Some(dst) = dst {
                if counts[rank] > 0 {
                    // SAFETY: both ranges lie inside live device buffers of
                    // `T` (lengths checked above); the copy is stream-ordered.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            offset_ptr::<T>(dst, offsets[rank]),
                            src,
                            counts[rank] * elem,
                            cu_stream,
                        )
                    }?;
                }
            }
            let nccl_err = |call| move |e| Error::nccl(call, e);
            nccl::group_start().map_err(nccl_err("ncclGroupStart"))?;
            // Queue every send and receive before checking errors, so that a
            // failure never leaves the group open.
            let mut queued = Ok(());
            for peer in (0..world_size).filter(|&p| p != rank) {
                if counts[rank] > 0 && targets.contains(&peer) && queued.is_ok() {
                    // SAFETY: `send` holds counts[rank] elements of `T`.
                    queued = unsafe {
                        nccl::send(
                            src as *const _,
                            counts[rank],
                            dtype,
                            peer as i32,
                            comm,
                            stream,
                        )
                    }
                    .map(drop)
                    .map_err(nccl_err("ncclSend"));
                }
                if let Some(dst) = dst {
                    if counts[peer] > 0 && queued.is_ok() {
                        // SAFETY: offsets[peer] + counts[peer] <= total = recv.len().
                        queued = unsafe {
                            nccl::recv(
                                offset_ptr::<T>(dst, offsets[peer]) as *mut _,
                                counts[peer],
                                dtype,
                                peer as i32,
                                comm,
                                stream,
                            )
                        }
                        .map(drop)
                        .map_err(nccl_err("ncclRecv"));
                    }
                }
            }
            let ended = nccl::group_end()
                .map(drop)
                .map_err(nccl_err("ncclGroupEnd"));
            queued.and(ended)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::one_rank_copy;

    #[test]
    fn one_rank_collectives_copy_only_between_buffers() {
        // In place (an all-reduce, or a gather into its own slot): nothing.
        assert_eq!(one_rank_copy::<f32>(0x1000, 0x1000, 256), None);
        // Into another buffer: every element, in the element's bytes.
        assert_eq!(one_rank_copy::<f32>(0x1000, 0x9000, 256), Some(1024));
        assert_eq!(one_rank_copy::<half::bf16>(0x1000, 0x9000, 256), Some(512));
        assert_eq!(one_rank_copy::<f64>(0x1000, 0x9000, 0), None);
    }
}
