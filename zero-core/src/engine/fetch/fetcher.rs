//! The [`Fetcher`]: what the framework's layers and the engine ask of
//! stage 3's gathers (lend, give back, seed, mark the passes, lend the shard).

use super::board::{Board, FetchStats, Phase, State};
use super::memory::{GatherMemory, HostGathers};
use super::units::{pieces_and_members, spans_by_piece, PieceSpans, Span, Unit};
use super::worker::{gather_unit, QueuedGather, Worker};
use crate::{Error, Result};
use std::collections::VecDeque;
use std::hash::Hasher;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;

/// One piece of a sharded parameter's values, gathered (all of them when
/// the parameter is gathered whole): give it back with
/// [`Fetcher::release`] when the layer is done with it. `B` is the
/// memory's buffer ([`GatherMemory::Buffer`]; a vector on the host).
pub struct Gathered<T, B = Vec<T>> {
    buffer: B,
    unit: usize,
    /// (elements of the buffer, their places in the parameter), in order.
    spans: PieceSpans,
    numel: usize,
    values: PhantomData<fn() -> T>,
}

impl<T, B> std::fmt::Debug for Gathered<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gathered")
            .field("unit", &self.unit)
            .field("spans", &self.spans)
            .field("numel", &self.numel)
            .finish_non_exhaustive()
    }
}

impl<T, B> Gathered<T, B> {
    /// Where the whole parameter lies in [`Gathered::buffer`], when this
    /// piece holds all of it (a parameter gathered whole).
    pub fn whole(&self) -> Option<Range<usize>> {
        match &*self.spans {
            [(at, values)] if values.start == 0 && values.len() == self.numel => Some(at.clone()),
            _ => None,
        }
    }

    /// The stretches of the parameter this piece brings: (elements of
    /// [`Gathered::buffer`], their places in the row-major parameter).
    pub fn spans(&self) -> &[(Range<usize>, Range<usize>)] {
        &self.spans
    }

    /// The gathered unit's buffer (the parameter's values lie in it at
    /// [`Gathered::spans`]).
    pub fn buffer(&self) -> &B {
        &self.buffer
    }

    /// The gather unit the buffer belongs to (for
    /// [`Fetcher::release_buffer`]).
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The whole buffer of the gather (other parameters of the unit
    /// around the range), taken out to be lent on: a framework may move it
    /// into a tensor storage for the length of one computation and give it
    /// back with [`Fetcher::release_buffer`] and [`Gathered::unit`].
    pub fn into_buffer(self) -> B {
        self.buffer
    }
}

/// Stage 3's gathers for one rank (see the module documentation).
///
/// Shared between the engine (which refreshes the shard after each step
/// and marks the passes) and the framework's layers (which
/// [`acquire`](Fetcher::acquire) and [`release`](Fetcher::release) the
/// full values of the parameters they compute with). `G` is where the
/// gathers run (host vectors unless said).
pub struct Fetcher<T, G: GatherMemory<T> = HostGathers<T>> {
    pub(super) units: Vec<Unit>,
    /// Per parameter: where its values lie, in unit order (empty: not
    /// sharded).
    place: Vec<Vec<Span>>,
    /// Per parameter: its units (pieces), in order.
    pieces: Vec<Vec<usize>>,
    /// Per parameter and piece: where its values lie in the piece's
    /// buffer (worked out once: a request allocates nothing).
    piece_spans: Vec<Vec<PieceSpans>>,
    /// Per parameter: its elements.
    numel: Vec<usize>,
    /// Per unit, the parameters it brings.
    pub(super) members: Vec<Vec<usize>>,
    pub(super) elem_bytes: usize,
    pub(super) prefetch_bytes: usize,
    pub(super) max_live_bytes: usize,
    /// This rank's parameter shard, the gathers' source: lent by the
    /// engine between steps (the only copy; `None` while the engine has it).
    pub(super) shard: Arc<RwLock<Option<G::Shard>>>,
    /// The upcoming units and the gathers issued, shared with the gather thread.
    pub(super) board: Arc<Board<G::Buffer>>,
    /// The gather thread's queue (`None`: gathers run on the caller's
    /// thread: queued on a device stream, or, for communicators that must
    /// not run two collectives at once, blocking).
    pub(super) jobs: Option<Mutex<Sender<QueuedGather<G::Buffer>>>>,
    pub(super) gathers: Arc<G>,
    values: PhantomData<fn() -> T>,
    /// The gather thread, joined when the fetcher goes (it holds the
    /// shard and a gather's buffer until it has stopped).
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl<T, G: GatherMemory<T>> Drop for Fetcher<T, G> {
    fn drop(&mut self) {
        // Closing the queue stops the thread after the gather under way.
        // The thread holds no handle on the fetcher, so this runs on
        // another thread, and the communicator in `gathers` is let go here
        // after the thread's (MPI wants `MPI_Finalize`, which the last
        // communicator's drop may call, on the thread that initialized it).
        self.jobs = None;
        let worker = self
            .worker
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(worker) = worker {
            let _ = worker.join();
        }
        // Gathers issued ahead and never taken are ordered before the shard
        // goes (the fields drop after this, the shard first): on a memory
        // that queues them, one left queued would read a freed shard. Those
        // the thread never got to were never issued.
        let issued = std::mem::take(&mut self.board.lock().issued);
        for issued in issued {
            if let Some(Ok(mut buffer)) = issued.result {
                let _ = self.gathers.ready(&mut buffer);
            }
        }
    }
}

impl<T: crate::Element, G: GatherMemory<T>> Fetcher<T, G> {
    /// A fetcher for `units`; `place[p]` locates parameter `p`. With
    /// `threaded`, gathers that block (host memory) run on a thread of
    /// their own (a prefetch then overlaps the caller's compute); gathers
    /// that `gathers` queues are issued from the caller's thread.
    pub(in crate::engine) fn new(
        units: Vec<Unit>,
        place: Vec<Vec<Span>>,
        shard: G::Shard,
        gathers: G,
        budgets: (usize, usize),
        threaded: bool,
    ) -> Result<Arc<Self>> {
        let (prefetch_bytes, max_live_bytes) = budgets;
        let elem_bytes = gathers.element_bytes();
        let (pieces, members) = pieces_and_members(units.len(), &place);
        if let Some(u) = units.iter().find(|u| u.len * elem_bytes > max_live_bytes) {
            return Err(Error::Config(format!(
                "stage 3: a layer's gathered parameters take {} bytes, more than max_live_bytes \
                 ({max_live_bytes}); raise max_live_bytes above the largest layer",
                u.len * elem_bytes
            )));
        }
        let piece_spans = spans_by_piece(&pieces, &place);
        let numel = place
            .iter()
            .map(|spans| spans.iter().map(|s| s.values.len()).sum())
            .collect();
        let (jobs, receiver) = if threaded && !gathers.queues() {
            let (tx, rx) = mpsc::channel();
            (Some(Mutex::new(tx)), Some(rx))
        } else {
            (None, None)
        };
        let counts = vec![0; place.len()];
        let fetcher = Arc::new(Self {
            units,
            place,
            piece_spans,
            numel,
            pieces,
            members,
            elem_bytes,
            prefetch_bytes,
            max_live_bytes,
            shard: Arc::new(RwLock::new(Some(shard))),
            board: Arc::new(Board {
                state: Mutex::new(State::new(counts)),
                done: Condvar::new(),
            }),
            jobs,
            gathers: Arc::new(gathers),
            values: PhantomData,
            worker: Mutex::new(None),
        });
        if let Some(receiver) = receiver {
            let worker = Worker {
                units: fetcher.units.clone(),
                shard: fetcher.shard.clone(),
                gathers: fetcher.gathers.clone(),
                board: Arc::clone(&fetcher.board),
            };
            let handle = std::thread::Builder::new()
                .name("zero-gather".into())
                .spawn(move || worker.run(receiver))
                .map_err(|e| Error::State(format!("cannot start the gather thread: {e}")))?;
            *fetcher
                .worker
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(handle);
        }
        Ok(fetcher)
    }

    fn lock(&self) -> MutexGuard<'_, State<G::Buffer>> {
        self.board.lock()
    }

    /// Where piece `piece` of sharded parameter `param` lies in its
    /// gathered buffer (as [`Gathered::spans`] will say), or `None` when
    /// there is no such piece.
    pub fn piece_spans(
        &self,
        param: usize,
        piece: usize,
    ) -> Option<&[(Range<usize>, Range<usize>)]> {
        self.piece_spans
            .get(param)?
            .get(piece)
            .map(|spans| &spans[..])
    }

    /// Whether parameter `param` is sharded (gathered on use).
    pub fn is_sharded(&self, param: usize) -> bool {
        self.pieces(param) > 0
    }

    /// How many pieces sharded parameter `param` is gathered in (1: whole;
    /// 0: not sharded).
    pub fn pieces(&self, param: usize) -> usize {
        self.pieces.get(param).map_or(0, Vec::len)
    }

    /// The units of `params`' pieces, in order: the gathers that
    /// requesting them one after another makes. With `shared_once`, a unit
    /// shared by consecutive parameters counts once (a prediction of
    /// parameters, not of requests).
    fn units_of(&self, params: &[usize], shared_once: bool) -> VecDeque<usize> {
        let mut units = VecDeque::new();
        for &p in params {
            for &u in self.pieces.get(p).into_iter().flatten() {
                if !(shared_once && units.back() == Some(&u)) {
                    units.push_back(u);
                }
            }
        }
        units
    }

    /// Whether gathers run on a thread of their own (they do on host
    /// memory unless the communicator cannot run two collectives at once).
    pub fn threaded(&self) -> bool {
        self.jobs.is_some()
    }

    /// Whether gathers run beside the caller's work (on a thread of their
    /// own, or queued on a device stream), so that prefetching pays.
    pub fn overlaps(&self) -> bool {
        self.jobs.is_some() || self.gathers.queues()
    }

    /// The counters so far.
    pub fn stats(&self) -> FetchStats {
        self.lock().stats.clone()
    }

    /// Piece `piece` of sharded parameter `param` (see
    /// [`Fetcher::pieces`]): the prefetched gather when one was issued,
    /// else one issued now. Issues the next upcoming gathers before waiting
    /// for this one.
    pub fn acquire(&self, param: usize, piece: usize) -> Result<Gathered<T, G::Buffer>> {
        let Some(&unit) = self.pieces.get(param).and_then(|p| p.get(piece)) else {
            return Err(Error::Config(format!(
                "stage 3: parameter #{param} has {} gathered pieces, not a piece {piece}; a \
                 parameter that is not sharded has nothing to gather: read it from the model",
                self.pieces(param)
            )));
        };
        let spans = Arc::clone(&self.piece_spans[param][piece]);
        let numel = self.numel[param];
        let mut st = self.note_request(self.lock(), unit)?;
        let prefetched = st.issued.iter().find(|i| i.unit == unit).map(|i| i.ticket);
        let ticket = match prefetched {
            Some(ticket) => {
                st.stats.hits += 1;
                ticket
            }
            None => {
                st.stats.misses += 1;
                if let Some(j) = st.upcoming.iter().position(|&u| u == unit) {
                    st.upcoming.remove(j);
                }
                st = self.make_room(st, unit)?;
                self.issue(&mut st, unit)
            }
        };
        self.top_up(&mut st);
        let buffer = self.take_gathered(st, ticket, unit)?;
        Ok(Gathered {
            buffer,
            unit,
            spans,
            numel,
            values: PhantomData,
        })
    }

    /// Gives a gathered buffer back to the pool (and lets the prefetch go
    /// on into the bytes it frees).
    pub fn release(&self, gathered: Gathered<T, G::Buffer>) {
        self.release_unit(gathered.unit, gathered.buffer);
    }

    /// Gives back the buffer of a gather of `unit` ([`Gathered::unit`])
    /// taken out of its [`Gathered`] (the framework lent it on as a tensor
    /// storage).
    pub fn release_buffer(&self, unit: usize, buffer: G::Buffer) {
        if unit < self.units.len() {
            self.release_unit(unit, buffer);
        }
    }

    /// Counts a buffer of `unit` lent on and not given back (the framework
    /// could not) as no longer alive.
    pub fn forget_buffer(&self, unit: usize) {
        if unit < self.units.len() {
            let mut st = self.lock();
            st.live_bytes -= self.bytes(unit);
            self.top_up(&mut st);
        }
    }

    fn release_unit(&self, unit: usize, buffer: G::Buffer) {
        let mut st = self.lock();
        st.live_bytes -= self.bytes(unit);
        st.pool.push(buffer);
        self.top_up(&mut st);
    }

    /// Plans the first passes from parameters used before the fetcher
    /// existed (a framework records what its layers used in the step that
    /// ran on whole weights): `forward` and `backward` list parameters in
    /// order of use. Then starts prefetching the next forward.
    pub fn seed(&self, forward: &[usize], backward: &[usize]) {
        let mut st = self.lock();
        st.forward_trace = self.units_of(forward, false).into();
        if !backward.is_empty() {
            st.backward_trace = Some(self.units_of(backward, false).into());
        }
        if st.phase == Phase::Forward && st.log.is_empty() && st.issued.is_empty() {
            st.upcoming = st.forward_trace.iter().copied().collect();
        }
        self.top_up(&mut st);
    }

    /// The full values of sharded parameter `param`, gathered now, outside
    /// the passes' upcoming units (to save or inspect weights). A collective: every
    /// rank calls it for the same parameters in the same order, between
    /// passes.
    pub fn gather_full(&self, param: usize) -> Result<Vec<T>> {
        if !self.is_sharded(param) {
            return Err(Error::Config(format!(
                "stage 3: parameter #{param} is not sharded, so it has nothing to gather"
            )));
        }
        let st = self.lock();
        let mut st = self.drain(st)?;
        let numel = self.place[param].iter().map(|s| s.values.len()).sum();
        let mut values = vec![T::default(); numel];
        let mut buffer = None;
        for &unit in &self.pieces[param] {
            let len = self.units[unit].len;
            let mut gathered = self.gathers.buffer(buffer.take(), len)?;
            gathered = gather_unit(&*self.gathers, &self.units[unit], &self.shard, gathered)?;
            self.gathers.ready(&mut gathered)?;
            for span in self.place[param].iter().filter(|s| s.unit == unit) {
                self.gathers
                    .read(&gathered, span.at.clone(), &mut values[span.values.clone()])?;
            }
            buffer = Some(gathered);
        }
        // The drained prefetches are upcoming again.
        if st.phase == Phase::Forward && st.log.is_empty() {
            st.upcoming = st.forward_trace.iter().copied().collect();
        }
        Ok(values)
    }

    /// Ends a forward pass and starts the backward one: `predicted` lists
    /// the parameters in the order backward will use them (the first pass
    /// lists the upcoming units from it; later ones replay the previous backward). Returns a
    /// fingerprint of the units the forward requested, for the engine to
    /// compare across ranks.
    pub(in crate::engine) fn begin_backward(&self, predicted: &[usize]) -> Result<u64> {
        let st = self.lock();
        // Gathers the forward issued ahead for this backward are kept when
        // they and the upcoming units are exactly the backward trace (the same
        // decision on every rank: it depends on what was issued only).
        let kept = st.continued && st.phase == Phase::Forward && {
            let trace = st.backward_trace.as_deref().unwrap_or(&[]);
            let ahead = st.issued.len().min(trace.len());
            st.issued
                .iter()
                .map(|i| i.unit)
                .eq(trace[..ahead].iter().copied())
                && st
                    .upcoming
                    .iter()
                    .copied()
                    .eq(trace[ahead..].iter().copied())
        };
        let mut st = if kept { st } else { self.drain(st)? };
        if kept {
            st.stats.early += st.issued.len() as u64;
        }
        st.continued = false;
        // FNV-1a: the same on every rank (std's hasher is not).
        let mut hasher = fnv::FnvHasher::default();
        for &unit in &st.log {
            hasher.write(&(unit as u64).to_le_bytes());
        }
        let fingerprint = hasher.finish();
        if st.phase == Phase::Forward {
            let log = std::mem::take(&mut st.log);
            if log != st.forward_trace {
                if !st.forward_trace.is_empty() {
                    st.stats.retraces += 1;
                }
                st.forward_trace = log;
            }
        }
        st.log.clear();
        st.phase = Phase::Backward;
        if !kept {
            st.upcoming = match &st.backward_trace {
                Some(trace) => trace.iter().copied().collect(),
                None => self.units_of(predicted, true),
            };
        }
        self.top_up(&mut st);
        Ok(fingerprint)
    }

    /// Ends a pass before the shard changes (the step): waits for the
    /// gathers in flight, records a finished backward's requests, and lists the upcoming units
    /// the next forward from the trace. Nothing is issued until
    /// the shard comes back (`put_shard`) or [`Fetcher::resume`].
    pub(in crate::engine) fn end_pass(&self) -> Result<()> {
        let st = self.lock();
        let mut st = self.drain(st)?;
        st.continued = false;
        if st.phase == Phase::Backward {
            let log = std::mem::take(&mut st.log);
            if st.backward_trace.as_ref() != Some(&log) {
                if st.backward_trace.is_some() {
                    st.stats.retraces += 1;
                }
                st.backward_trace = Some(log);
            }
            st.phase = Phase::Forward;
            st.upcoming = st.forward_trace.iter().copied().collect();
        }
        Ok(())
    }

    /// Takes the parameter shard the gathers read (for a step, a
    /// checkpoint), after the gathers in flight.
    pub(in crate::engine) fn take_shard(&self) -> Result<G::Shard> {
        let st = self.lock();
        let st = self.drain(st)?;
        let shard = self
            .shard
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(st);
        shard.ok_or_else(|| Error::State("internal: the parameter shard was already taken".into()))
    }

    /// Gives the shard back (updated by a step), then starts prefetching
    /// the next forward.
    pub(in crate::engine) fn put_shard(&self, shard: G::Shard) {
        *self.shard.write().unwrap_or_else(PoisonError::into_inner) = Some(shard);
        self.resume();
    }

    /// Bytes the gathers have sent ([`GatherMemory::bytes_sent`]).
    pub fn bytes_sent(&self) -> u64 {
        self.gathers.bytes_sent()
    }

    /// Bytes of the gather buffers: in use, issued, and pooled.
    pub fn buffer_bytes(&self) -> usize {
        let st = self.lock();
        let pooled: usize = st.pool.iter().map(G::capacity).sum();
        st.live_bytes + pooled * self.elem_bytes
    }

    /// Starts prefetching the next forward (after a micro-step that did
    /// not change the shard).
    pub(in crate::engine) fn resume(&self) {
        let mut st = self.lock();
        self.top_up(&mut st);
    }
}

impl<T, G: GatherMemory<T>> std::fmt::Debug for Fetcher<T, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("units", &self.units.len())
            .field("prefetch_bytes", &self.prefetch_bytes)
            .field("max_live_bytes", &self.max_live_bytes)
            .field("threaded", &self.jobs.is_some())
            .finish()
    }
}
