//! The steps of one in-process collective, over any [`Lane`]: the device's
//! streams in [`CudaThreadComm`](crate::CudaThreadComm), host memory in the
//! tests below, which run the whole protocol (rendezvous, checks, failures,
//! how long events live and when queued work has run) without a GPU.
//!
//! 1. This rank records an event on its compute stream (its inputs are
//!    ready) and posts it with its call and buffer addresses; the posts are
//!    gathered through the ranks' [`ThreadComm`] and checked
//!    ([`check_posted`]).
//! 2. Its comm stream waits on every rank's ready event and issues its part
//!    of the collective ([`steps`]): copies and reductions over the peers'
//!    buffers.
//! 3. It records an event when its part is issued and posts it (or that it
//!    failed); its comm stream waits on every rank's, so no rank's buffers
//!    are reused while a peer still reads or writes them. The event
//!    recorded after that is the collective's completion.
//!
//! A batch of collectives (a stage-3 layer's all-gathers) runs as one: one
//! ready event, its calls posted together and checked call by call, every
//! call's steps issued in step 2, one completion.
//!
//! A failure in step 1 (a refused argument, mismatched calls) fails every
//! rank there, before any work is queued. Once the posts check, every rank
//! goes on to step 3's rendezvous whatever fails: it posts its failure with
//! its event, or, when it cannot record one, drains its comm stream first.
//! A rank that then returns an error (its own or a peer's) first waits on
//! the host for every posted event, since its caller may free its buffers
//! at once and no completion event orders that after the peers' work. So a
//! failure reaches every rank as an error, and no rank returns while work
//! it knows of is queued over its buffers. A rendezvous that fails in
//! itself (a peer panicked or missed the deadline) returns at once: the
//! peers' events are then unknown.
//!
//! Every event a stream waits on was recorded before the wait was queued,
//! so a stream never waits on work that a dead peer will not queue. A rank
//! keeps its events, its ready one from the moment the posts check, until
//! every peer has posted its next collective (by then no peer will wait on
//! them, on a stream or on the host), and a communicator that is dropped
//! leaves its last ones to its group.

use super::collective::{check_posted, encode_posts, At, Call, Posted, Step};
use zero_core::{Communicator, DType, Error, ReduceOp, Result, ThreadComm};

/// Where a collective's work is queued: a rank's compute and comm streams.
pub(crate) trait Lane {
    /// A recorded point of a stream.
    type Event;

    /// Records an event on the compute stream.
    fn record_compute(&self) -> Result<Self::Event>;

    /// Records an event on the comm stream.
    fn record_comm(&self) -> Result<Self::Event>;

    /// The handle peers wait on.
    fn handle(event: &Self::Event) -> u64;

    /// Makes the comm stream wait on an event of this lane or a peer's.
    ///
    /// # Safety
    ///
    /// `handle` is the handle of a live event of the group.
    unsafe fn wait(&self, handle: u64) -> Result<()>;

    /// Blocks the host until an event of this lane or a peer's has
    /// completed, or the deadline of collective `seq` (`op`) passes.
    ///
    /// # Safety
    ///
    /// `handle` is the handle of a live event of the group.
    unsafe fn wait_on_host(&self, handle: u64, at: (&'static str, u64)) -> Result<()>;

    /// Blocks the host until everything queued on the comm stream has run.
    fn sync_comm(&self) -> Result<()>;

    /// Copies `bytes` from `src` to `dst` on the comm stream.
    ///
    /// # Safety
    ///
    /// Both ranges are live memory of the group's ranks, not overlapping.
    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;

    /// Combines `len` elements of `dtype` from each source in order
    /// ([`Step::Reduce`]) into every destination, on the comm stream.
    ///
    /// # Safety
    ///
    /// Every range is live memory of the group's ranks; a source overlaps a
    /// destination only where both are the same memory.
    unsafe fn reduce(
        &self,
        dtype: DType,
        srcs: &[u64],
        dsts: &[u64],
        len: usize,
        op: ReduceOp,
    ) -> Result<()>;
}

/// One collective, or a batch of them in one pass, as the module's
/// documentation describes. `check` is this rank's own validation of its
/// arguments (posted, so that a refusal fails the peers at once); each call
/// comes with the addresses of this rank's `send` and `recv` buffers (the
/// same in place, or for an all-gather in place `send` is this rank's slot
/// of `recv`; 0 for a buffer it does not have). A batch shares one ready
/// event and the two rendezvous, and completes at one event. `previous`
/// holds this rank's events of its previous pass and receives this one's.
/// Returns the completion event.
pub(crate) fn collective<L: Lane>(
    host: &ThreadComm,
    lane: &L,
    previous: &mut Vec<L::Event>,
    (op, seq): (&'static str, u64),
    calls: &[(Call, (u64, u64))],
    check: Result<()>,
) -> Result<L::Event> {
    let rank = host.rank();
    if calls.is_empty() {
        return Err(Error::State(format!(
            "internal: {op} #{seq} is a batch of no collectives"
        )));
    }
    let ready = lane.record_compute()?;
    let posts: Vec<Posted> = calls
        .iter()
        .map(|(call, (send, recv))| Posted {
            call: call.clone(),
            send: *send,
            recv: *recv,
            ready: L::handle(&ready),
            failed: check.is_err(),
        })
        .collect();
    let gathered = host.all_gather_bytes(&encode_posts(&posts))?;
    check?;
    let posted = check_posted(op, seq, rank, &gathered)?;
    // Every peer has posted this collective, so none waits on the previous
    // one's events any more; from here on peers may wait on `ready`.
    previous.clear();
    previous.push(ready);
    let issued = issue(lane, rank, host.world_size(), &posted);
    let (read, issued) = match lane.record_comm() {
        Ok(read) => {
            let handle = L::handle(&read);
            previous.push(read);
            (Some(handle), issued)
        }
        // With no event to cover this rank's work, it is done before the
        // peers learn of the failure. The first error is the one reported:
        // a drain that fails as well leaves nothing more to do.
        Err(error) => {
            let _ = lane.sync_comm();
            (None, Err(issued.err().unwrap_or(error)))
        }
    };
    let mut mine = vec![u8::from(issued.is_err())];
    if let Some(handle) = read {
        mine.extend(handle.to_le_bytes());
    }
    let gathered = host.all_gather_bytes(&mine)?;
    let mut failed = Vec::new();
    let mut reads = Vec::new();
    for (peer, bytes) in gathered.iter().enumerate() {
        let (flag, event) = bytes.split_first().unwrap_or((&1, &[]));
        let event = <[u8; 8]>::try_from(event).ok().map(u64::from_le_bytes);
        reads.extend(event.map(|handle| (peer, handle)));
        if peer != rank && (*flag != 0 || event.is_none()) {
            failed.push(peer);
        }
    }
    let finished = issued.and_then(|()| {
        if !failed.is_empty() {
            return Err(Error::PeerFailed {
                op,
                seq,
                failed,
                reason: "it could not issue its part of the collective".into(),
            });
        }
        for &(_, handle) in reads.iter().filter(|(peer, _)| *peer != rank) {
            // SAFETY: the peer keeps this event until every rank has
            // posted its next collective, which this one has not.
            unsafe { lane.wait(handle) }?;
        }
        lane.record_comm()
    });
    finished.inspect_err(|_| {
        // The caller may free this rank's buffers as soon as it returns,
        // with no completion event to order that after the work queued over
        // them, so that work must have run. A host wait that fails (a
        // broken device) leaves the first error to report.
        for &(_, handle) in &reads {
            // SAFETY: as above; this rank's own event is in `previous`.
            if unsafe { lane.wait_on_host(handle, (op, seq)) }.is_err() {
                break;
            }
        }
    })
}

/// Waits on every rank's ready event and issues this rank's steps of each
/// collective of the batch (`posted`: by collective, then by rank).
fn issue<L: Lane>(lane: &L, rank: usize, n: usize, posted: &[Vec<Posted>]) -> Result<()> {
    for post in posted.first().into_iter().flatten() {
        // SAFETY: each rank keeps its ready event (one per batch) until
        // every rank has posted its next collective.
        unsafe { lane.wait(post.ready) }?;
    }
    for posted in posted {
        issue_steps(lane, rank, n, posted)?;
    }
    Ok(())
}

/// Issues this rank's steps of one collective (`posted`: every rank's).
fn issue_steps<L: Lane>(lane: &L, rank: usize, n: usize, posted: &[Posted]) -> Result<()> {
    let call = &posted[rank].call;
    let elem = call.dtype.size_in_bytes();
    let addrs = |at: &[At]| -> Vec<u64> { at.iter().map(|a| a.address(posted, elem)).collect() };
    for step in super::collective::steps(&call.kind, call.len, n, rank) {
        match step {
            Step::Copy { from, to, len } => {
                let (dst, src) = (to.address(posted, elem), from.address(posted, elem));
                // In place (an all-gather whose send is this rank's slot of
                // its receive buffer) the values are where they belong; a
                // copy onto itself would overlap, and write what the peers
                // read at the same time.
                if dst != src {
                    // SAFETY: the calls matched, so every range lies inside
                    // the ranks' posted buffers, live until the work queued
                    // over them has run: a rank that returns its completion
                    // event orders its caller after it, one that fails
                    // waits for it on the host. Distinct slots of one
                    // gather do not overlap.
                    unsafe { lane.copy(dst, src, len * elem) }?;
                }
            }
            // SAFETY: as above; each destination range is written by this
            // step only, and a source that is a destination is the same
            // memory (in place).
            Step::Reduce {
                srcs,
                dsts,
                len,
                op,
            } => unsafe { lane.reduce(call.dtype, &addrs(&srcs), &addrs(&dsts), len, op) }?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::collective::Kind;
    use super::*;
    use std::collections::HashMap;
    use std::ops::Range;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
    use std::time::{Duration, Instant};
    use zero_core::ThreadGroup;

    /// A point of a rank's comm stream: the rank, and how many of the
    /// stream's entries precede it.
    type Point = (usize, usize);

    /// The group's device as the host lane models it: work runs when it is
    /// issued (so results are right at once) but counts as queued, its
    /// memory still in use, until a host wait on an event recorded after
    /// it (or after a wait that depends on it). A wait on an event that is
    /// gone fails the test.
    #[derive(Default)]
    struct Device {
        state: Mutex<DeviceState>,
        next: AtomicU64,
    }

    #[derive(Default)]
    struct DeviceState {
        /// Live events by handle, with the point each marks (`None` for a
        /// compute stream's, complete at once: no work is queued there).
        events: HashMap<u64, Option<Point>>,
        /// Each rank's comm stream.
        streams: HashMap<usize, Stream>,
    }

    #[derive(Default)]
    struct Stream {
        entries: Vec<Entry>,
        /// How many entries have run.
        done: usize,
    }

    enum Entry {
        /// A copy or reduction over these byte ranges.
        Work(Vec<Range<u64>>),
        /// A wait on the point an event marks.
        Wait(Option<Point>),
    }

    impl Device {
        fn state(&self) -> MutexGuard<'_, DeviceState> {
            // A rank that panicked holding the lock leaves the model intact.
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        }

        fn live_events(&self) -> usize {
            self.state().events.len()
        }

        /// How many queued copies and reductions touch any of `ranges`.
        fn queued_over(&self, ranges: &[Range<u64>]) -> usize {
            let overlaps =
                |a: &Range<u64>| ranges.iter().any(|b| a.start < b.end && b.start < a.end);
            let state = self.state();
            let queued = state.streams.values().flat_map(|s| &s.entries[s.done..]);
            queued
                .filter(|e| matches!(e, Entry::Work(w) if w.iter().any(overlaps)))
                .count()
        }
    }

    impl DeviceState {
        /// Runs a comm stream up to `point`, and first what its waits
        /// before that point wait on.
        fn complete(&mut self, (rank, upto): Point) {
            let stream = self.streams.entry(rank).or_default();
            if upto <= stream.done {
                return;
            }
            let from = std::mem::replace(&mut stream.done, upto);
            let waited: Vec<Point> = stream.entries[from..upto]
                .iter()
                .filter_map(|e| match e {
                    Entry::Wait(point) => *point,
                    Entry::Work(_) => None,
                })
                .collect();
            for point in waited {
                self.complete(point);
            }
        }

        fn point_of(&self, handle: u64, rank: usize) -> Option<Point> {
            match self.events.get(&handle) {
                Some(point) => *point,
                None => panic!("rank {rank} waits on event {handle}, which its owner has dropped"),
            }
        }
    }

    struct HostEvent {
        handle: u64,
        device: Arc<Device>,
    }

    impl Drop for HostEvent {
        fn drop(&mut self) {
            self.device.state().events.remove(&self.handle);
        }
    }

    /// How a rank's host lane behaves.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Behaviour {
        Sound,
        /// Fails every copy and reduction it is to issue.
        FailsIssue,
        /// Fails to record any event on its comm stream.
        FailsRecordComm,
        /// Falls behind: pauses 50 ms before queuing each wait.
        SlowWaits,
    }

    /// Host memory standing in for the device ([`Device`]), after a short
    /// pause before each wait that varies the ranks' interleavings; f32
    /// only.
    struct HostLane {
        device: Arc<Device>,
        rank: usize,
        behaviour: Behaviour,
    }

    impl HostLane {
        fn event(&self, point: Option<Point>) -> HostEvent {
            let handle = self.device.next.fetch_add(1, Ordering::Relaxed) + 1;
            self.device.state().events.insert(handle, point);
            HostEvent {
                handle,
                device: self.device.clone(),
            }
        }

        fn pause(&self, salt: u64) {
            let micros = (self.rank as u64 * 37 + salt * 11) % 200;
            std::thread::sleep(Duration::from_micros(micros));
            if self.behaviour == Behaviour::SlowWaits {
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        /// Queues work over `ranges`, or fails as the lane is told to.
        fn queue(&self, ranges: Vec<Range<u64>>) -> Result<()> {
            if self.behaviour == Behaviour::FailsIssue {
                return Err(Error::State("injected issue failure".into()));
            }
            let mut state = self.device.state();
            let stream = state.streams.entry(self.rank).or_default();
            stream.entries.push(Entry::Work(ranges));
            Ok(())
        }
    }

    impl Lane for HostLane {
        type Event = HostEvent;

        fn record_compute(&self) -> Result<HostEvent> {
            Ok(self.event(None))
        }

        fn record_comm(&self) -> Result<HostEvent> {
            if self.behaviour == Behaviour::FailsRecordComm {
                return Err(Error::State("injected record failure".into()));
            }
            let at = self
                .device
                .state()
                .streams
                .entry(self.rank)
                .or_default()
                .entries
                .len();
            Ok(self.event(Some((self.rank, at))))
        }

        fn handle(event: &HostEvent) -> u64 {
            event.handle
        }

        unsafe fn wait(&self, handle: u64) -> Result<()> {
            self.pause(handle);
            let mut state = self.device.state();
            let point = state.point_of(handle, self.rank);
            let stream = state.streams.entry(self.rank).or_default();
            stream.entries.push(Entry::Wait(point));
            Ok(())
        }

        unsafe fn wait_on_host(&self, handle: u64, _: (&'static str, u64)) -> Result<()> {
            let mut state = self.device.state();
            if let Some(point) = state.point_of(handle, self.rank) {
                state.complete(point);
            }
            Ok(())
        }

        fn sync_comm(&self) -> Result<()> {
            let mut state = self.device.state();
            let end = state.streams.entry(self.rank).or_default().entries.len();
            state.complete((self.rank, end));
            Ok(())
        }

        unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
            let span = |a: u64| a..a + bytes as u64;
            assert!(
                dst + bytes as u64 <= src || src + bytes as u64 <= dst,
                "rank {}: a copy over overlapping ranges {:?} and {:?}",
                self.rank,
                span(dst),
                span(src)
            );
            self.queue(vec![span(dst), span(src)])?;
            // SAFETY: as the trait requires.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
            Ok(())
        }

        unsafe fn reduce(
            &self,
            dtype: DType,
            srcs: &[u64],
            dsts: &[u64],
            len: usize,
            op: ReduceOp,
        ) -> Result<()> {
            assert_eq!(dtype, DType::F32, "the host lane reduces f32 only");
            let bytes = (len * 4) as u64;
            self.queue(srcs.iter().chain(dsts).map(|&a| a..a + bytes).collect())?;
            for i in 0..len {
                // SAFETY: as the trait requires; element i of every source
                // is read before element i of any destination is written.
                let read = |a: u64| unsafe { *(a as *const f32).add(i) };
                let acc = super::super::collective::combine_f32(op, srcs.iter().map(|&s| read(s)));
                for &d in dsts {
                    // SAFETY: as above.
                    unsafe { *(d as *mut f32).add(i) = acc };
                }
            }
            Ok(())
        }
    }

    /// The bytes of `buf`, as the device model tracks them.
    fn span(buf: &[f32]) -> Range<u64> {
        let start = buf.as_ptr() as u64;
        start..start + std::mem::size_of_val(buf) as u64
    }

    /// One rank: its host communicator, its lane and its previous events.
    struct Rank {
        host: ThreadComm,
        lane: HostLane,
        previous: Vec<HostEvent>,
        seq: u64,
    }

    impl Rank {
        fn new(host: ThreadComm, device: &Arc<Device>, behaviour: Behaviour) -> Self {
            let rank = host.rank();
            Self {
                host,
                lane: HostLane {
                    device: device.clone(),
                    rank,
                    behaviour,
                },
                previous: Vec::new(),
                seq: 0,
            }
        }

        /// One pass of the protocol over `calls`.
        fn pass(
            &mut self,
            op: &'static str,
            calls: &[(Call, (u64, u64))],
            check: Result<()>,
        ) -> Result<()> {
            self.seq += 1;
            collective(
                &self.host,
                &self.lane,
                &mut self.previous,
                (op, self.seq),
                calls,
                check,
            )
            .map(drop)
        }

        fn run(
            &mut self,
            op: &'static str,
            kind: Kind,
            len: usize,
            send: &[f32],
            recv: &mut [f32],
            check: Result<()>,
        ) -> Result<()> {
            let call = f32_call(kind, len);
            let addrs = (send.as_ptr() as u64, recv.as_mut_ptr() as u64);
            self.pass(op, &[(call, addrs)], check)
        }

        /// Any call, from `send` into `recv`.
        fn run_call(
            &mut self,
            op: &'static str,
            call: &Call,
            send: &[f32],
            recv: &mut [f32],
        ) -> Result<()> {
            let addrs = (send.as_ptr() as u64, recv.as_mut_ptr() as u64);
            self.pass(op, &[(call.clone(), addrs)], Ok(()))
        }

        /// An in-place collective over `buf`.
        fn in_place(&mut self, op: &'static str, kind: Kind, buf: &mut [f32]) -> Result<()> {
            let ptr = buf.as_mut_ptr() as u64;
            self.pass(op, &[(f32_call(kind, buf.len()), (ptr, ptr))], Ok(()))
        }

        /// All-gathers in place of the pieces `at` of `buf`, in one pass:
        /// this rank's slot of each piece is what it sends (stage 3's
        /// gathers of a layer's buckets from a host shard).
        fn all_gather_in_place(&mut self, buf: &mut [f32], at: &[Range<usize>]) -> Result<()> {
            let (rank, n) = (self.host.rank(), self.host.world_size());
            let base = buf.as_mut_ptr() as u64;
            let address = |i: usize| base + (i * std::mem::size_of::<f32>()) as u64;
            let calls: Vec<(Call, (u64, u64))> = at
                .iter()
                .map(|at| {
                    let len = at.len() / n;
                    let send = address(at.start + rank * len);
                    (f32_call(Kind::AllGather, len), (send, address(at.start)))
                })
                .collect();
            self.pass("all_gather", &calls, Ok(()))
        }
    }

    fn f32_call(kind: Kind, len: usize) -> Call {
        Call {
            kind,
            dtype: DType::F32,
            len,
        }
    }

    impl Drop for Rank {
        /// As a dropped `CudaThreadComm` leaves its last events to its
        /// group (freed with the group), they stay live here.
        fn drop(&mut self) {
            for event in self.previous.drain(..) {
                std::mem::forget(event);
            }
        }
    }

    fn values(rank: usize, len: usize, salt: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * 7919 + i * 104_729 + salt * 31) % 1013) as f32 * 0.01 - 5.03)
            .collect()
    }

    fn flatten<R>(results: Vec<Result<Result<R>>>) -> Vec<Result<R>> {
        results.into_iter().map(|r| r.and_then(|r| r)).collect()
    }

    /// Every rank but `failed` reports `failed` as the failed peer.
    fn assert_peers_name<R: std::fmt::Debug>(results: &[Result<R>], failed: usize) {
        for (r, result) in results.iter().enumerate().filter(|(r, _)| *r != failed) {
            match result {
                Err(Error::PeerFailed { failed: named, .. }) => assert_eq!(named, &vec![failed]),
                other => panic!("rank {r}: expected rank {failed}'s failure, got {other:?}"),
            }
        }
    }

    /// The lengths per rank of the all-gather pieces after the first.
    const PIECES: [usize; 3] = [7, 0, 20];

    #[test]
    fn collectives_through_the_protocol_give_the_thread_backend_s_results() {
        for n in 1..=4 {
            let device = Arc::new(Device::default());
            let len = 97;
            let ours = ThreadGroup::new(n).run(|host| {
                let r = host.rank();
                let mut rank = Rank::new(host, &device, Behaviour::Sound);
                let mut out = Vec::new();
                for (k, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
                    .into_iter()
                    .enumerate()
                {
                    let mut all = values(r, len, k);
                    rank.in_place("all_reduce", Kind::AllReduce(op), &mut all)?;
                    let mut part = vec![0.0; len];
                    let big = values(r, n * len, k);
                    rank.run(
                        "reduce_scatter",
                        Kind::ReduceScatter(op),
                        len,
                        &big,
                        &mut part,
                        Ok(()),
                    )?;
                    out.push(all);
                    out.push(part);
                }
                let mut gathered = vec![0.0; n * len];
                rank.run(
                    "all_gather",
                    Kind::AllGather,
                    len,
                    &values(r, len, 9),
                    &mut gathered,
                    Ok(()),
                )?;
                // In place, a layer's buckets in one pass: each rank's slot
                // of each piece holds what it sends, the others stale values
                // the gather overwrites.
                let mut in_place = vec![f32::NAN; n * (len + PIECES.iter().sum::<usize>())];
                let mut at = Vec::new();
                for (k, &piece) in [len].iter().chain(&PIECES).enumerate() {
                    let start = at.last().map_or(0, |last: &Range<usize>| last.end);
                    let slot = start + r * piece..start + (r + 1) * piece;
                    in_place[slot].copy_from_slice(&values(r, piece, 9 + k));
                    at.push(start..start + n * piece);
                }
                let before = rank.host.next_seq();
                rank.all_gather_in_place(&mut in_place, &at)?;
                // One pass: two host rendezvous, not two per piece.
                assert_eq!(rank.host.next_seq() - before, 2);
                out.push(gathered);
                out.push(in_place);
                let mut cast = values(r, len, 10);
                rank.in_place("broadcast", Kind::Broadcast { root: n - 1 }, &mut cast)?;
                out.push(cast);
                Ok(out)
            });
            let theirs = ThreadGroup::new(n).run(|c| {
                let r = c.rank();
                let mut out = Vec::new();
                for (k, op) in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
                    .into_iter()
                    .enumerate()
                {
                    let mut all = values(r, len, k);
                    c.all_reduce(&mut all, op)?;
                    let mut part = vec![0.0; len];
                    c.reduce_scatter(&values(r, n * len, k), &mut part, op)?;
                    out.push(all);
                    out.push(part);
                }
                let mut gathered = vec![0.0; n * len];
                c.all_gather(&values(r, len, 9), &mut gathered)?;
                out.push(gathered.clone());
                let mut pieces = gathered;
                for (k, &piece) in PIECES.iter().enumerate() {
                    let mut gathered = vec![0.0; n * piece];
                    c.all_gather(&values(r, piece, 10 + k), &mut gathered)?;
                    pieces.extend(gathered);
                }
                out.push(pieces);
                let mut cast = values(r, len, 10);
                c.broadcast(&mut cast, n - 1)?;
                out.push(cast);
                Ok(out)
            });
            let ours: Vec<_> = flatten(ours).into_iter().map(Result::unwrap).collect();
            let theirs: Vec<_> = flatten(theirs).into_iter().map(Result::unwrap).collect();
            assert_eq!(ours, theirs, "n={n}");
            // Each rank freed every event but its last collective's two.
            assert_eq!(device.live_events(), 2 * n, "n={n}");
        }
    }

    #[test]
    fn variable_length_gathers_with_different_counts_per_rank() {
        let counts = vec![3, 1, 0, 5];
        let total: usize = counts.iter().sum();
        let n = counts.len();
        let device = Arc::new(Device::default());
        let counts = &counts;
        let ours = flatten(ThreadGroup::new(n).run(|host| {
            let r = host.rank();
            let mut rank = Rank::new(host, &device, Behaviour::Sound);
            let send = values(r, counts[r], 12);
            let mut all = vec![0.0; total];
            // As `CudaThreadComm` describes the call.
            let call = |root| Call::gather(DType::F32, counts.clone(), root);
            rank.run_call("all_gather_varlen", &call(None), &send, &mut all)?;
            let mut to_root = vec![0.0; total];
            rank.run_call("gather_varlen", &call(Some(n - 1)), &send, &mut to_root)?;
            Ok((all, to_root))
        }));
        let theirs = flatten(ThreadGroup::new(n).run(|c| {
            let r = c.rank();
            let send = values(r, counts[r], 12);
            let mut all = vec![0.0; total];
            c.all_gather_varlen(&send, counts, &mut all)?;
            let mut to_root = vec![0.0; total];
            let root = n - 1;
            c.gather_varlen(&send, counts, (r == root).then_some(&mut to_root[..]), root)?;
            Ok((all, to_root))
        }));
        for (r, (ours, theirs)) in ours.into_iter().zip(theirs).enumerate() {
            let (ours, theirs) = (ours.unwrap(), theirs.unwrap());
            assert_eq!(ours.0, theirs.0, "all_gather_varlen rank {r}");
            if r == n - 1 {
                assert_eq!(ours.1, theirs.1, "gather_varlen");
            }
        }
    }

    #[test]
    fn a_refused_argument_fails_the_peers_at_once_naming_the_rank() {
        let device = Arc::new(Device::default());
        let start = Instant::now();
        let results = flatten(
            ThreadGroup::new(3)
                .with_timeout(Duration::from_secs(30))
                .run(|host| {
                    let r = host.rank();
                    let mut rank = Rank::new(host, &device, Behaviour::Sound);
                    let send = vec![1.0; 12];
                    let mut recv = vec![0.0; 4];
                    let check = if r == 1 {
                        Err(Error::BufferSize {
                            op: "reduce_scatter",
                            what: "send",
                            got: 11,
                            expected: 12,
                        })
                    } else {
                        Ok(())
                    };
                    rank.run(
                        "reduce_scatter",
                        Kind::ReduceScatter(ReduceOp::Sum),
                        4,
                        &send,
                        &mut recv,
                        check,
                    )
                }),
        );
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(
            matches!(results[1], Err(Error::BufferSize { .. })),
            "{:?}",
            results[1]
        );
        assert_peers_name(&results, 1);
    }

    #[test]
    fn mismatched_calls_fail_every_rank() {
        let device = Arc::new(Device::default());
        let results = flatten(ThreadGroup::new(3).run(|host| {
            let r = host.rank();
            let mut rank = Rank::new(host, &device, Behaviour::Sound);
            let mut buf = vec![1.0; if r == 2 { 5 } else { 4 }];
            rank.in_place("all_reduce", Kind::AllReduce(ReduceOp::Sum), &mut buf)
        }));
        for (r, result) in results.iter().enumerate() {
            assert!(
                matches!(result, Err(Error::CollectiveMismatch { .. })),
                "rank {r}: {result:?}"
            );
        }
    }

    #[test]
    fn a_rank_that_cannot_issue_its_part_fails_its_peers_after_the_collective() {
        let device = Arc::new(Device::default());
        let results = flatten(ThreadGroup::new(3).run(|host| {
            let behaviour = if host.rank() == 2 {
                Behaviour::FailsIssue
            } else {
                Behaviour::Sound
            };
            let n = host.world_size();
            let mut rank = Rank::new(host, &device, behaviour);
            let mut gathered = vec![0.0; n * 4];
            rank.run(
                "all_gather",
                Kind::AllGather,
                4,
                &[1.0; 4],
                &mut gathered,
                Ok(()),
            )
        }));
        assert!(matches!(&results[2], Err(Error::State(m)) if m.contains("injected")));
        assert_peers_name(&results, 2);
    }

    #[test]
    fn a_rank_that_panics_between_collectives_fails_its_peers() {
        let device = Arc::new(Device::default());
        let start = Instant::now();
        let results = flatten(
            ThreadGroup::new(3)
                .with_timeout(Duration::from_secs(30))
                .run(|host| {
                    let r = host.rank();
                    let mut rank = Rank::new(host, &device, Behaviour::Sound);
                    let mut buf = vec![1.0; 8];
                    rank.in_place("all_reduce", Kind::AllReduce(ReduceOp::Sum), &mut buf)?;
                    if r == 1 {
                        panic!("rank 1 dies between collectives");
                    }
                    rank.in_place("all_reduce", Kind::AllReduce(ReduceOp::Sum), &mut buf)
                }),
        );
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(matches!(
            results[1],
            Err(Error::RankPanicked { rank: 1, .. })
        ));
        assert_peers_name(&results, 1);
    }

    #[test]
    fn events_outlive_every_peer_s_wait_on_them() {
        // Many small collectives with ranks running at different paces: a
        // rank dropping an event a peer still waits on fails `HostLane::wait`.
        for n in [2, 3, 4] {
            let device = Arc::new(Device::default());
            let results = flatten(ThreadGroup::new(n).run(|host| {
                let r = host.rank();
                let mut rank = Rank::new(host, &device, Behaviour::Sound);
                let mut buf = vec![r as f32; 16];
                for i in 0..50 {
                    if (i + r) % 7 == 0 {
                        std::thread::sleep(Duration::from_micros(300));
                    }
                    rank.in_place("all_reduce", Kind::AllReduce(ReduceOp::Max), &mut buf)?;
                }
                Ok(buf)
            }));
            for (r, result) in results.into_iter().enumerate() {
                let buf = result.unwrap_or_else(|e| panic!("n={n} rank {r}: {e}"));
                assert!(buf.iter().all(|&x| x == (n - 1) as f32), "n={n} rank {r}");
            }
        }
    }

    /// What a rank's collective returned, and how many copies and
    /// reductions over its buffers were queued when it did.
    type Returned = (Result<()>, usize);

    /// Each rank's result, checking that it returned with no copy or
    /// reduction over its buffers still queued: its caller frees them then.
    fn returned_with_nothing_queued(results: Vec<Result<Result<Returned>>>) -> Vec<Result<()>> {
        let outcomes: Vec<_> = flatten(results)
            .into_iter()
            .enumerate()
            .map(|(r, out)| out.unwrap_or_else(|e| panic!("rank {r}: {e}")))
            .collect();
        outcomes
            .into_iter()
            .enumerate()
            .map(|(r, (result, queued))| {
                assert_eq!(
                    queued, 0,
                    "rank {r} returned {result:?} with work over its buffers queued"
                );
                result
            })
            .collect()
    }

    #[test]
    fn a_failing_rank_returns_only_once_the_work_over_its_buffers_has_run() {
        // Rank 1 cannot issue its part; by the time the ranks learn that,
        // its peers have issued theirs, which read and write its buffers
        // (and the peers' own).
        for kind in [Kind::AllGather, Kind::AllReduce(ReduceOp::Sum)] {
            let device = Arc::new(Device::default());
            let results = ThreadGroup::new(3).run(|host| {
                let behaviour = if host.rank() == 1 {
                    Behaviour::FailsIssue
                } else {
                    Behaviour::Sound
                };
                let mut rank = Rank::new(host, &device, behaviour);
                let send = vec![1.0; 4];
                let mut recv = vec![0.0; 12];
                let result = match kind {
                    Kind::AllGather => {
                        rank.run("all_gather", kind.clone(), 4, &send, &mut recv, Ok(()))
                    }
                    _ => rank.in_place("all_reduce", kind.clone(), &mut recv),
                };
                Ok((result, device.queued_over(&[span(&send), span(&recv)])))
            });
            let results = returned_with_nothing_queued(results);
            assert!(
                matches!(&results[1], Err(Error::State(m)) if m.contains("injected issue")),
                "{kind:?}: {:?}",
                results[1]
            );
            assert_peers_name(&results, 1);
        }
    }

    #[test]
    fn a_rank_that_cannot_record_its_comm_event_keeps_its_ready_event_for_its_peers() {
        // Rank 0 fails as soon as it has issued its part; its peers fall
        // behind and wait on its ready event later. A wait on an event that
        // was dropped fails `HostLane::wait`.
        let device = Arc::new(Device::default());
        let start = Instant::now();
        let results = ThreadGroup::new(3)
            .with_timeout(Duration::from_secs(30))
            .run(|host| {
                let behaviour = if host.rank() == 0 {
                    Behaviour::FailsRecordComm
                } else {
                    Behaviour::SlowWaits
                };
                let mut rank = Rank::new(host, &device, behaviour);
                let mut buf = vec![1.0; 6];
                let result = rank.in_place("all_reduce", Kind::AllReduce(ReduceOp::Sum), &mut buf);
                Ok((result, device.queued_over(&[span(&buf)])))
            });
        assert!(start.elapsed() < Duration::from_secs(10));
        let results = returned_with_nothing_queued(results);
        assert!(
            matches!(&results[0], Err(Error::State(m)) if m.contains("injected record")),
            "{:?}",
            results[0]
        );
        assert_peers_name(&results, 0);
    }
}
