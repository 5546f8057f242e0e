//! Stage 3's parameter gathers: each sharded parameter is all-gathered from
//! the ranks' shards just before a layer uses it, into a pooled buffer that
//! goes back to the pool right after, with the next layers' gathers issued
//! ahead (prefetch) on a thread of their own.
//!
//! A *unit* is what one gather brings: the buckets of the plan that hold a
//! run of consecutive sharded parameters (parameters that share a bucket
//! share a unit, so consecutive small layers travel in one collective per
//! bucket). With the interleaved plan, bucket `k` is one stretch of the
//! parameter sequence split evenly over the ranks, so all-gathering it
//! yields that stretch in order: a parameter's values are one contiguous
//! range of its unit's buffer.
//!
//! A unit above the engine's `gather_bytes` is gathered in *pieces*
//! instead: piece `j` of a bucket all-gathers slice `j` of every rank's
//! chunk, so it brings `N` stretches of the sequence, one per rank. A
//! parameter is then a list of [`Span`]s over several units, which the
//! framework computes with one piece at a time: its whole values never
//! exist on a rank.
//!
//! Every rank must issue the same gathers in the same order (they are
//! collectives on a communicator of their own). Decisions to issue are
//! therefore taken only on the caller's thread, from the upcoming units
//! (the units to prefetch next, in order) and the bytes alive, never from
//! how far a gather has got:
//! - a forward's upcoming units replay the units the previous forward
//!   requested (the trace), a backward's the previous backward's, or before
//!   there is one the order the engine predicts from the graph;
//! - a request for a unit among the upcoming ones further on takes it out
//!   and issues it alone; one not among them is issued alone;
//! - after each request (and after the optimizer step has updated the
//!   shard) upcoming units are issued while at most `prefetch_bytes`
//!   are issued and not yet taken (one unit always may, so that a layer
//!   larger than the budget is still prefetched), and at most
//!   `max_live_bytes` are gathered in all.
//!
//! A rank whose model requests other units than its peers still issues the
//! upcoming gathers, so the collectives stay matched; the engine compares a
//! fingerprint of each forward's requests across ranks when backward
//! begins, and a difference is an error on every rank.

use crate::{Error, Result};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock};
use std::thread::JoinHandle;

/// All-gathers `send` (this rank's chunk of one bucket) into `recv` (the
/// whole bucket, every rank's chunk in rank order).
pub type GatherFn<T> = dyn Fn(&[T], &mut [T]) -> Result<()> + Send + Sync;

/// Where stage 3's gathers run: the parameter shard they read, the buffers
/// they fill, and the collective. The [`Fetcher`]'s decisions (upcoming units,
/// prefetch, budgets, pool) are the same over every memory; this is what
/// differs.
///
/// Host memory ([`HostGathers`]) gathers into vectors and returns when the
/// values are there (on the fetcher's thread, or the caller's). A device
/// memory *queues* each gather on a stream of its own and returns at once;
/// [`GatherMemory::ready`] then orders the caller's work (its compute
/// stream) after the gather, with no host wait, so the caller's thread
/// issues ahead without a thread of its own.
pub trait GatherMemory<T>: Send + Sync + 'static {
    /// This rank's parameter shard (the engine's buffer, lent to the
    /// fetcher between steps).
    type Shard: Send + Sync + 'static;
    /// The buffer one gather fills.
    type Buffer: Send + 'static;

    /// Whether [`GatherMemory::gather`] only queues the gather (see the
    /// trait's documentation).
    fn queues(&self) -> bool {
        false
    }

    /// Elements of `shard`.
    fn shard_len(shard: &Self::Shard) -> usize;

    /// Elements `buffer` holds.
    fn capacity(buffer: &Self::Buffer) -> usize;

    /// A buffer of at least `len` elements: `reuse` (a pooled one) when it
    /// is large enough, else a new one (`reuse` is freed first).
    fn buffer(&self, reuse: Option<Self::Buffer>, len: usize) -> Result<Self::Buffer>;

    /// All-gathers each bucket: `shard[bucket.shard]` of every rank, in
    /// rank order, into `buffer[bucket.at]`. A collective on the fetcher's
    /// own communicator.
    fn gather(
        &self,
        shard: &Self::Shard,
        buckets: &[UnitBucket],
        buffer: &mut Self::Buffer,
    ) -> Result<()>;

    /// [`GatherMemory::gather`] from a parameter shard in host memory (an
    /// offloaded one): each bucket's chunk is brought to this memory first.
    fn gather_from_host(
        &self,
        shard: &[T],
        buckets: &[UnitBucket],
        buffer: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (shard, buckets, buffer);
        Err(Error::Config(
            "stage 3 cannot gather from a parameter shard in host memory on this memory".into(),
        ))
    }

    /// Orders what the caller does next after `buffer`'s gather: its reads
    /// of the buffer, and its writes of the shard (a step). Called whenever
    /// a gathered buffer leaves the fetcher's hands or is let go.
    fn ready(&self, _buffer: &mut Self::Buffer) -> Result<()> {
        Ok(())
    }

    /// Copies `buffer[range]` into `out` (on the host), after its gather.
    fn read(&self, buffer: &Self::Buffer, range: Range<usize>, out: &mut [T]) -> Result<()>;
}

/// Stage 3's gathers in host memory: vectors, gathered by `all_gather`
/// (a collective on the fetcher's own communicator).
pub struct HostGathers<T> {
    all_gather: Arc<GatherFn<T>>,
}

impl<T> HostGathers<T> {
    /// Gathers with `all_gather`, one call per bucket.
    pub fn new(all_gather: Arc<GatherFn<T>>) -> Self {
        Self { all_gather }
    }
}

impl<T: crate::Element> GatherMemory<T> for HostGathers<T> {
    type Shard = Vec<T>;
    type Buffer = Vec<T>;

    fn shard_len(shard: &Vec<T>) -> usize {
        shard.len()
    }

    fn capacity(buffer: &Vec<T>) -> usize {
        buffer.capacity()
    }

    fn buffer(&self, reuse: Option<Vec<T>>, len: usize) -> Result<Vec<T>> {
        let mut buffer = reuse.unwrap_or_default();
        if buffer.capacity() < len {
            // Freed before the larger one is made.
            drop(std::mem::take(&mut buffer));
            buffer = Vec::with_capacity(len);
        }
        buffer.resize(len, T::default());
        Ok(buffer)
    }

    fn gather(&self, shard: &Vec<T>, buckets: &[UnitBucket], buffer: &mut Vec<T>) -> Result<()> {
        self.gather_from_host(shard, buckets, buffer)
    }

    fn gather_from_host(
        &self,
        shard: &[T],
        buckets: &[UnitBucket],
        buffer: &mut Vec<T>,
    ) -> Result<()> {
        for bucket in buckets {
            (self.all_gather)(&shard[bucket.shard.clone()], &mut buffer[bucket.at.clone()])?;
        }
        Ok(())
    }

    fn read(&self, buffer: &Vec<T>, range: Range<usize>, out: &mut [T]) -> Result<()> {
        out.copy_from_slice(&buffer[range]);
        Ok(())
    }
}

/// A queued gather: its ticket, its unit, the buffer to gather into.
type QueuedGather<B> = (u64, usize, B);

/// One bucket of a unit: this rank's chunk in the shard, and where the
/// whole bucket goes in the unit's buffer.
#[derive(Clone, Debug)]
pub struct UnitBucket {
    /// This rank's chunk: elements of the parameter shard.
    pub shard: Range<usize>,
    /// Where every rank's chunk goes, in rank order: elements of the
    /// unit's buffer.
    pub at: Range<usize>,
}

/// Where a stretch of a parameter's values lies in a unit's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Span {
    pub unit: usize,
    /// Elements of the unit's buffer.
    pub at: Range<usize>,
    /// The same elements' places in the parameter (row-major).
    pub values: Range<usize>,
}

/// What one gather brings.
#[derive(Clone, Debug)]
pub(super) struct Unit {
    pub buckets: Vec<UnitBucket>,
    /// Elements of the unit's buffer.
    pub len: usize,
}

/// (elements of a gathered buffer, their places in the parameter), in
/// order: one piece's stretches of one parameter.
type PieceSpans = Arc<[(Range<usize>, Range<usize>)]>;

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

/// Counters of the gathers of one [`Fetcher`], since it was built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Per parameter, how many times a gather that brings it was issued.
    pub gathers: Vec<u64>,
    /// Requests whose gather had been issued before the request (prefetched).
    pub hits: u64,
    /// Requests that had to issue their own gather.
    pub misses: u64,
    /// The most gathered bytes alive at once (issued or in use).
    pub peak_live_bytes: usize,
    /// Times a forward or backward pass requested another sequence than
    /// the one recorded, and the new one replaced it.
    pub retraces: u64,
    /// Gathers of a backward issued while its forward was finishing.
    pub early: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Forward,
    Backward,
}

/// A gather issued and not yet taken by a request.
struct Issued<B> {
    unit: usize,
    /// `None` until the gather completes (or, on a memory that queues
    /// gathers, is queued).
    result: Option<Result<B>>,
    ticket: u64,
}

struct State<B> {
    phase: Phase,
    /// Units the last complete forward / backward requested, in order.
    forward_trace: Vec<usize>,
    backward_trace: Option<Vec<usize>>,
    /// Units requested in the current pass.
    log: Vec<usize>,
    /// Units to issue ahead, in order.
    upcoming: VecDeque<usize>,
    /// Whether the forward has requested its whole trace and the upcoming
    /// units go on with the backward trace (the backward's first gathers
    /// then run during the end of the forward).
    continued: bool,
    issued: VecDeque<Issued<B>>,
    next_ticket: u64,
    /// Bytes issued and not taken; bytes issued or in use.
    ahead_bytes: usize,
    live_bytes: usize,
    pool: Vec<B>,
    stats: FetchStats,
}

impl<B> State<B> {
    /// Before the first forward; `gathers`: a zero count per parameter.
    fn new(gathers: Vec<u64>) -> Self {
        Self {
            phase: Phase::Forward,
            forward_trace: Vec::new(),
            backward_trace: None,
            log: Vec::new(),
            upcoming: VecDeque::new(),
            continued: false,
            issued: VecDeque::new(),
            next_ticket: 0,
            ahead_bytes: 0,
            live_bytes: 0,
            pool: Vec::new(),
            stats: FetchStats {
                gathers,
                ..FetchStats::default()
            },
        }
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
    units: Vec<Unit>,
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
    members: Vec<Vec<usize>>,
    elem_bytes: usize,
    prefetch_bytes: usize,
    max_live_bytes: usize,
    /// This rank's parameter shard, the gathers' source: lent by the
    /// engine between steps (the only copy; `None` while the engine has it).
    shard: Arc<RwLock<Option<G::Shard>>>,
    /// The upcoming units and the gathers issued, shared with the gather thread.
    board: Arc<Board<G::Buffer>>,
    /// The gather thread's queue (`None`: gathers run on the caller's
    /// thread: queued on a device stream, or, for communicators that must
    /// not run two collectives at once, blocking).
    jobs: Option<Mutex<Sender<QueuedGather<G::Buffer>>>>,
    gathers: Arc<G>,
    values: PhantomData<fn() -> T>,
    /// The gather thread, joined when the fetcher goes (it holds the
    /// shard and a gather's buffer until it has stopped).
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// What the caller's thread and the gather thread share: the state, and
/// the condition a request waits on for its gather.
struct Board<B> {
    state: Mutex<State<B>>,
    done: Condvar,
}

impl<B> Board<B> {
    fn lock(&self) -> MutexGuard<'_, State<B>> {
        // Every change to the state is made after the fallible work, so a
        // panic elsewhere leaves it consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
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
    }
}

/// Per parameter, the units that hold its pieces, in order; per unit, the
/// parameters it holds pieces of.
fn pieces_and_members(units: usize, place: &[Vec<Span>]) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); units];
    let mut pieces: Vec<Vec<usize>> = vec![Vec::new(); place.len()];
    for (p, spans) in place.iter().enumerate() {
        for span in spans {
            if pieces[p].last() != Some(&span.unit) {
                pieces[p].push(span.unit);
                members[span.unit].push(p);
            }
        }
    }
    (pieces, members)
}

/// Per parameter and piece, the piece's stretches in its unit's buffer.
fn spans_by_piece(pieces: &[Vec<usize>], place: &[Vec<Span>]) -> Vec<Vec<PieceSpans>> {
    pieces
        .iter()
        .zip(place)
        .map(|(units, spans)| {
            units
                .iter()
                .map(|&unit| {
                    spans
                        .iter()
                        .filter(|s| s.unit == unit)
                        .map(|s| (s.at.clone(), s.values.clone()))
                        .collect()
                })
                .collect()
        })
        .collect()
}

impl<T: crate::Element, G: GatherMemory<T>> Fetcher<T, G> {
    /// A fetcher for `units`; `place[p]` locates parameter `p`. With
    /// `threaded`, gathers that block (host memory) run on a thread of
    /// their own (a prefetch then overlaps the caller's compute); gathers
    /// that `gathers` queues are issued from the caller's thread.
    pub(super) fn new(
        units: Vec<Unit>,
        place: Vec<Vec<Span>>,
        shard: G::Shard,
        gathers: G,
        budgets: (usize, usize),
        threaded: bool,
    ) -> Result<Arc<Self>> {
        let (prefetch_bytes, max_live_bytes) = budgets;
        let elem_bytes = std::mem::size_of::<T>();
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

    /// Records a request for `unit` in this pass's log: a new forward when
    /// it starts one again, the backward's gathers allowed ahead when it
    /// ends the forward.
    fn note_request<'s>(
        &'s self,
        mut st: MutexGuard<'s, State<G::Buffer>>,
        unit: usize,
    ) -> Result<MutexGuard<'s, State<G::Buffer>>> {
        // Once the forward went on into the backward's upcoming units,
        // nothing upcoming is for this forward any more.
        let expected = !st.continued
            && (st.upcoming.contains(&unit) || st.issued.iter().any(|i| i.unit == unit));
        let starts_a_pass =
            st.forward_trace.first() == Some(&unit) || st.log.first() == Some(&unit);
        if st.phase == Phase::Forward && !st.log.is_empty() && starts_a_pass && !expected {
            // The first layer of the trace (or of this pass) again, with no
            // backward in between and nothing upcoming for it: a new forward
            // (after an evaluation pass).
            st = self.restart_forward(st)?;
        }
        st.log.push(unit);
        if st.phase == Phase::Forward && !st.continued && st.log == st.forward_trace {
            // The forward's last request: the backward's first gathers may
            // go ahead now (its first layer is usually this one).
            if let Some(trace) = &st.backward_trace {
                let trace = trace.clone();
                st.upcoming.extend(trace);
                st.continued = true;
            }
        }
        Ok(st)
    }

    /// Waits for the gather of `ticket` (of `unit`) and takes its buffer,
    /// ready for the caller's stream.
    fn take_gathered(
        &self,
        st: MutexGuard<'_, State<G::Buffer>>,
        ticket: u64,
        unit: usize,
    ) -> Result<G::Buffer> {
        let mut st = self
            .board
            .done
            .wait_while(st, |st| {
                st.issued
                    .iter()
                    .any(|i| i.ticket == ticket && i.result.is_none())
            })
            .unwrap_or_else(PoisonError::into_inner);
        let j = st
            .issued
            .iter()
            .position(|i| i.ticket == ticket)
            .ok_or_else(|| Error::State("internal: a gather vanished".into()))?;
        let issued = st.issued.remove(j).expect("position found above");
        let bytes = self.bytes(unit);
        st.ahead_bytes -= bytes;
        let ready = match issued.result {
            Some(Ok(mut buffer)) => match self.gathers.ready(&mut buffer) {
                Ok(()) => Ok(buffer),
                Err(e) => {
                    st.pool.push(buffer);
                    Err(e)
                }
            },
            Some(Err(e)) => Err(e),
            None => Err(Error::State("internal: a gather had no result".into())),
        };
        if ready.is_err() {
            st.live_bytes -= bytes;
        }
        ready
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
    pub(super) fn begin_backward(&self, predicted: &[usize]) -> Result<u64> {
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
        let fingerprint = super::consistency::fnv1a(st.log.iter().map(|&u| u as u64));
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
    pub(super) fn end_pass(&self) -> Result<()> {
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
    pub(super) fn take_shard(&self) -> Result<G::Shard> {
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
    pub(super) fn put_shard(&self, shard: G::Shard) {
        *self.shard.write().unwrap_or_else(PoisonError::into_inner) = Some(shard);
        self.resume();
    }

    /// Bytes of the gather buffers: in use, issued, and pooled.
    pub fn buffer_bytes(&self) -> usize {
        let st = self.lock();
        let pooled: usize = st.pool.iter().map(G::capacity).sum();
        st.live_bytes + pooled * self.elem_bytes
    }

    /// Elements of the parameter shard the fetcher holds.
    pub(super) fn shard_len(&self) -> usize {
        self.shard
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, G::shard_len)
    }

    /// Starts prefetching the next forward (after a micro-step that did
    /// not change the shard).
    pub(super) fn resume(&self) {
        let mut st = self.lock();
        self.top_up(&mut st);
    }

    fn bytes(&self, unit: usize) -> usize {
        self.units[unit].len * self.elem_bytes
    }

    /// Issues the gather of `unit` (the caller decided, on every rank alike).
    fn issue(&self, st: &mut State<G::Buffer>, unit: usize) -> u64 {
        let len = self.units[unit].len;
        // The smallest pooled buffer that holds the unit, else the largest
        // one grown (so the pool never holds more buffers than were alive
        // at once), else a new one.
        let fits = st
            .pool
            .iter()
            .enumerate()
            .filter(|(_, b)| G::capacity(b) >= len)
            .min_by_key(|(_, b)| G::capacity(b))
            .map(|(i, _)| i);
        let largest = || {
            st.pool
                .iter()
                .enumerate()
                .max_by_key(|(_, b)| G::capacity(b))
                .map(|(i, _)| i)
        };
        let reuse = fits.or_else(largest).map(|i| st.pool.swap_remove(i));
        let buffer = self.gathers.buffer(reuse, len);
        let bytes = self.bytes(unit);
        st.live_bytes += bytes;
        st.ahead_bytes += bytes;
        st.stats.peak_live_bytes = st.stats.peak_live_bytes.max(st.live_bytes);
        for &p in &self.members[unit] {
            st.stats.gathers[p] += 1;
        }
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let result = match (buffer, &self.jobs) {
            (Err(e), _) => Some(Err(e)),
            (Ok(buffer), Some(jobs)) => {
                let sent = jobs
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .send((ticket, unit, buffer));
                match sent {
                    Ok(()) => None,
                    Err(_) => Some(Err(Error::State(
                        "stage 3: the gather thread is gone (it panicked?)".into(),
                    ))),
                }
            }
            (Ok(buffer), None) => Some(gather_unit(
                &*self.gathers,
                &self.units[unit],
                &self.shard,
                buffer,
            )),
        };
        st.issued.push_back(Issued {
            unit,
            result,
            ticket,
        });
        ticket
    }

    /// Issues upcoming units while the budgets allow (when gathers overlap
    /// the caller's work: a blocking gather ahead on the caller's thread
    /// would only hold memory longer).
    fn top_up(&self, st: &mut State<G::Buffer>) {
        if !self.overlaps() {
            return;
        }
        while let Some(&unit) = st.upcoming.front() {
            let bytes = self.bytes(unit);
            // One unit may always run ahead (when prefetching at all), or
            // a layer larger than the budget would never be prefetched.
            let ahead_full = self.prefetch_bytes == 0
                || (st.ahead_bytes > 0 && st.ahead_bytes + bytes > self.prefetch_bytes);
            if ahead_full || st.live_bytes + bytes > self.max_live_bytes {
                break;
            }
            st.upcoming.pop_front();
            self.issue(st, unit);
        }
    }

    /// Makes room for `unit` under `max_live_bytes` by dropping the most
    /// recently issued prefetches (they go back to the front of the upcoming units).
    fn make_room<'a>(
        &'a self,
        mut st: MutexGuard<'a, State<G::Buffer>>,
        unit: usize,
    ) -> Result<MutexGuard<'a, State<G::Buffer>>> {
        let bytes = self.bytes(unit);
        while st.live_bytes + bytes > self.max_live_bytes {
            let Some(last) = st.issued.back().map(|i| i.ticket) else {
                return Err(Error::Config(format!(
                    "stage 3: {} gathered bytes are in use and the next layer needs {bytes} more, \
                     beyond max_live_bytes ({}); raise max_live_bytes",
                    st.live_bytes, self.max_live_bytes
                )));
            };
            st = self.wait_for(st, last);
            let dropped = st.issued.pop_back().expect("waited for it above");
            let dropped_bytes = self.bytes(dropped.unit);
            st.ahead_bytes -= dropped_bytes;
            st.live_bytes -= dropped_bytes;
            st.upcoming.push_front(dropped.unit);
            match dropped.result {
                Some(Ok(buffer)) => self.pool(&mut st, buffer)?,
                Some(Err(e)) => return Err(e),
                None => {}
            }
        }
        Ok(st)
    }

    fn wait_for<'a>(
        &'a self,
        st: MutexGuard<'a, State<G::Buffer>>,
        ticket: u64,
    ) -> MutexGuard<'a, State<G::Buffer>> {
        self.board
            .done
            .wait_while(st, |st| {
                st.issued
                    .iter()
                    .any(|i| i.ticket == ticket && i.result.is_none())
            })
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts a gathered buffer that no request took back in the pool, once
    /// what follows is ordered after its gather (a step may change the
    /// shard it reads).
    fn pool(&self, st: &mut State<G::Buffer>, mut buffer: G::Buffer) -> Result<()> {
        let ready = self.gathers.ready(&mut buffer);
        st.pool.push(buffer);
        ready
    }

    /// Waits for every issued gather and puts its buffer back in the pool.
    fn drain<'a>(
        &'a self,
        st: MutexGuard<'a, State<G::Buffer>>,
    ) -> Result<MutexGuard<'a, State<G::Buffer>>> {
        let mut st = self
            .board
            .done
            .wait_while(st, |st| st.issued.iter().any(|i| i.result.is_none()))
            .unwrap_or_else(PoisonError::into_inner);
        let mut first_error = None;
        while let Some(issued) = st.issued.pop_front() {
            let bytes = self.bytes(issued.unit);
            st.ahead_bytes -= bytes;
            st.live_bytes -= bytes;
            let pooled = match issued.result {
                Some(Ok(buffer)) => self.pool(&mut st, buffer),
                Some(Err(e)) => Err(e),
                None => Ok(()),
            };
            if let Err(e) = pooled {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(st),
        }
    }

    /// A new forward pass without a backward since the last one.
    fn restart_forward<'a>(
        &'a self,
        st: MutexGuard<'a, State<G::Buffer>>,
    ) -> Result<MutexGuard<'a, State<G::Buffer>>> {
        let mut st = self.drain(st)?;
        st.continued = false;
        let log = std::mem::take(&mut st.log);
        if log != st.forward_trace {
            st.stats.retraces += 1;
            st.forward_trace = log;
        }
        st.upcoming = st.forward_trace.iter().copied().collect();
        Ok(st)
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

/// Runs the gathers of one unit into `buffer`.
fn gather_unit<T, G: GatherMemory<T>>(
    gathers: &G,
    unit: &Unit,
    shard: &RwLock<Option<G::Shard>>,
    mut buffer: G::Buffer,
) -> Result<G::Buffer> {
    let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
    let len = shard.as_ref().map_or(0, G::shard_len);
    let (Some(shard), true) = (&*shard, unit.buckets.iter().all(|b| b.shard.end <= len)) else {
        return Err(Error::State(
            "stage 3: a parameter gather ran while the engine held the shard (during a step); \
             gather between steps"
                .into(),
        ));
    };
    gathers.gather(shard, &unit.buckets, &mut buffer)?;
    Ok(buffer)
}

/// The gather thread: runs the queued gathers in order and hands each
/// result to the fetcher. It holds the fetcher weakly, so dropping the
/// fetcher closes the queue and ends the thread.
struct Worker<T, G: GatherMemory<T>> {
    units: Vec<Unit>,
    shard: Arc<RwLock<Option<G::Shard>>>,
    gathers: Arc<G>,
    board: Arc<Board<G::Buffer>>,
}

impl<T, G: GatherMemory<T>> Worker<T, G> {
    fn run(self, jobs: Receiver<QueuedGather<G::Buffer>>) {
        while let Ok((ticket, unit, buffer)) = jobs.recv() {
            let result = gather_unit(&*self.gathers, &self.units[unit], &self.shard, buffer);
            let mut st = self.board.lock();
            if let Some(issued) = st.issued.iter_mut().find(|i| i.ticket == ticket) {
                issued.result = Some(result);
            }
            drop(st);
            self.board.done.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// `count` units of `len` elements over one rank: unit `u`'s bucket is
    /// shard range `u*len..(u+1)*len`, one parameter per unit.
    fn build<G: GatherMemory<f32>>(
        count: usize,
        len: usize,
        budgets: (usize, usize),
        threaded: bool,
        (shard, gathers): (G::Shard, G),
    ) -> Arc<Fetcher<f32, G>> {
        let units = (0..count)
            .map(|u| Unit {
                buckets: vec![UnitBucket {
                    shard: u * len..(u + 1) * len,
                    at: 0..len,
                }],
                len,
            })
            .collect();
        let place = (0..count)
            .map(|u| {
                vec![Span {
                    unit: u,
                    at: 0..len,
                    values: 0..len,
                }]
            })
            .collect();
        Fetcher::new(units, place, shard, gathers, budgets, threaded).unwrap()
    }

    fn shard_values(count: usize, len: usize) -> Vec<f32> {
        (0..count * len).map(|i| i as f32).collect()
    }

    fn fetcher(
        count: usize,
        len: usize,
        budgets: (usize, usize),
        threaded: bool,
    ) -> Arc<Fetcher<f32>> {
        // One rank: the all-gather is a copy.
        let gather: Arc<GatherFn<f32>> = Arc::new(|send: &[f32], recv: &mut [f32]| {
            recv.copy_from_slice(send);
            Ok(())
        });
        let memory = (shard_values(count, len), HostGathers::new(gather));
        build(count, len, budgets, threaded, memory)
    }

    /// Gathers queued as a device queues them on a stream: `gather` only
    /// records the copies, and `ready` (the compute stream waiting on the
    /// gather) runs them, reading the shard as it is then. A step that
    /// changed the shard before a gather was ordered would show in the
    /// gathered values.
    #[derive(Default)]
    struct Queued {
        pending: AtomicUsize,
    }

    type SharedShard = Arc<RwLock<Vec<f32>>>;

    struct QueuedBuffer {
        values: Vec<f32>,
        copies: Vec<(SharedShard, Range<usize>, Range<usize>)>,
    }

    impl GatherMemory<f32> for Arc<Queued> {
        type Shard = SharedShard;
        type Buffer = QueuedBuffer;

        fn queues(&self) -> bool {
            true
        }

        fn shard_len(shard: &SharedShard) -> usize {
            shard.read().unwrap().len()
        }

        fn capacity(buffer: &QueuedBuffer) -> usize {
            buffer.values.len()
        }

        fn buffer(&self, reuse: Option<QueuedBuffer>, len: usize) -> Result<QueuedBuffer> {
            Ok(match reuse {
                Some(buffer) if buffer.values.len() >= len => buffer,
                _ => QueuedBuffer {
                    values: vec![f32::NAN; len],
                    copies: Vec::new(),
                },
            })
        }

        fn gather(
            &self,
            shard: &SharedShard,
            buckets: &[UnitBucket],
            buffer: &mut QueuedBuffer,
        ) -> Result<()> {
            assert!(
                buffer.copies.is_empty(),
                "a buffer refilled before it was ready"
            );
            for bucket in buckets {
                let copy = (shard.clone(), bucket.shard.clone(), bucket.at.clone());
                buffer.copies.push(copy);
            }
            self.pending.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        fn ready(&self, buffer: &mut QueuedBuffer) -> Result<()> {
            if buffer.copies.is_empty() {
                return Ok(());
            }
            for (shard, from, to) in buffer.copies.drain(..) {
                buffer.values[to].copy_from_slice(&shard.read().unwrap()[from]);
            }
            self.pending.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }

        fn read(&self, buffer: &QueuedBuffer, range: Range<usize>, out: &mut [f32]) -> Result<()> {
            out.copy_from_slice(&buffer.values[range]);
            Ok(())
        }
    }

    fn queued(
        count: usize,
        len: usize,
        budgets: (usize, usize),
    ) -> (Arc<Fetcher<f32, Arc<Queued>>>, Arc<Queued>) {
        let memory = Arc::new(Queued::default());
        let shard = Arc::new(RwLock::new(shard_values(count, len)));
        let f = build(count, len, budgets, true, (shard, memory.clone()));
        (f, memory)
    }

    #[test]
    fn queued_gathers_prefetch_from_the_caller_s_thread_and_are_ready_before_use() {
        let (f, memory) = queued(6, 10, (80, 120));
        assert!(
            !f.threaded() && f.overlaps(),
            "no thread, and gathers run ahead"
        );
        let order = [0, 1, 2, 3, 4, 5];
        f.seed(&order, &[]);
        for &u in &order {
            let g = f.acquire(u, 0).unwrap();
            let want: Vec<f32> = (u * 10..(u + 1) * 10).map(|i| i as f32).collect();
            assert_eq!(&g.buffer().values[..10], &want[..], "unit {u}");
            f.release(g);
        }
        let stats = f.stats();
        assert_eq!((stats.hits, stats.misses), (6, 0), "{stats:?}");
        assert!(stats.peak_live_bytes <= 120, "{stats:?}");
        assert_eq!(
            f.gather_full(3).unwrap(),
            (30..40).map(|i| i as f32).collect::<Vec<_>>()
        );
        f.end_pass().unwrap();
        assert_eq!(memory.pending.load(Ordering::SeqCst), 0);
    }

    /// Gathers issued ahead and never taken are ordered before the shard
    /// goes to a step: one still queued would read the stepped shard.
    #[test]
    fn queued_gathers_no_pass_took_are_ready_before_the_shard_is_taken() {
        let (f, memory) = queued(6, 10, (80, 1000));
        f.seed(&[0, 1, 2, 3, 4, 5], &[]);
        let g = f.acquire(0, 0).unwrap();
        f.release(g);
        assert!(
            memory.pending.load(Ordering::SeqCst) > 0,
            "the upcoming units ran ahead"
        );
        f.end_pass().unwrap();
        let shard = f.take_shard().unwrap();
        assert_eq!(memory.pending.load(Ordering::SeqCst), 0);
        // The step changes the shard; the next pass gathers the new values.
        shard.write().unwrap().iter_mut().for_each(|v| *v += 1000.0);
        f.put_shard(shard);
        let g = f.acquire(1, 0).unwrap();
        assert_eq!(g.buffer().values[0], 1010.0);
        f.release(g);
    }

    fn use_units(f: &Fetcher<f32>, order: &[usize], len: usize) {
        for &u in order {
            let g = f.acquire(u, 0).unwrap();
            let want: Vec<f32> = (u * len..(u + 1) * len).map(|i| i as f32).collect();
            let at = g.whole().expect("one piece");
            assert_eq!(&g.buffer()[at], &want[..], "unit {u}");
            f.release(g);
        }
    }

    #[test]
    fn a_replayed_pass_is_all_hits_within_the_budgets() {
        // 40-byte units; two may be ahead, three alive.
        let f = fetcher(6, 10, (80, 120), true);
        let order = [0, 1, 2, 3, 4, 5];
        f.seed(&order, &[]);
        use_units(&f, &order, 10);
        let stats = f.stats();
        assert_eq!((stats.hits, stats.misses), (6, 0), "{stats:?}");
        assert!(stats.peak_live_bytes <= 120, "{stats:?}");
        assert!(stats.peak_live_bytes >= 80, "prefetch ran ahead: {stats:?}");
        assert_eq!(stats.gathers, vec![1; 6]);
    }

    #[test]
    fn the_backward_s_first_gathers_run_during_the_end_of_the_forward() {
        // Two units may be ahead. Once the forward has requested its whole
        // trace, the backward's first two go ahead and are kept.
        let f = fetcher(4, 10, (80, 1000), true);
        f.seed(&[0, 1, 2, 3], &[3, 2, 1, 0]);
        for _ in 0..2 {
            use_units(&f, &[0, 1, 2, 3], 10);
            f.begin_backward(&[]).unwrap();
            use_units(&f, &[3, 2, 1, 0], 10);
            f.end_pass().unwrap();
            f.resume();
        }
        let stats = f.stats();
        assert_eq!(stats.early, 2 * 2, "{stats:?}");
        assert_eq!((stats.hits, stats.misses), (16, 0), "{stats:?}");
        assert_eq!(stats.retraces, 0, "{stats:?}");
        // An evaluation forward after a complete one restarts the upcoming units
        // (the backward's early gathers are let go) and is all hits but
        // its first unit.
        use_units(&f, &[0, 1, 2, 3], 10);
        use_units(&f, &[0, 1, 2, 3], 10);
        f.begin_backward(&[]).unwrap();
        use_units(&f, &[3, 2, 1, 0], 10);
        let stats = f.stats();
        assert_eq!(stats.misses, 1, "{stats:?}");
        assert_eq!(stats.early, 2 * 2 + 2, "{stats:?}");
        assert_eq!(stats.retraces, 0, "{stats:?}");
    }

    #[test]
    fn without_a_gather_thread_each_use_gathers_when_asked() {
        let f = fetcher(6, 10, (80, 120), false);
        let order = [0, 1, 2, 3, 4, 5];
        f.seed(&order, &[]);
        use_units(&f, &order, 10);
        let stats = f.stats();
        assert_eq!((stats.hits, stats.misses), (0, 6), "{stats:?}");
        assert_eq!(stats.peak_live_bytes, 40, "one layer at a time");
    }

    #[test]
    fn off_plan_requests_are_gathered_alone_and_a_new_pass_replays() {
        let f = fetcher(4, 10, (40, 80), true);
        f.seed(&[0, 1, 2, 3], &[]);
        // Unit 3 before its turn: a miss, gathered alone; the rest follow.
        use_units(&f, &[3, 0, 1, 2], 10);
        assert_eq!(f.stats().misses, 1);
        // The trace's first unit again without a backward: a new forward
        // (evaluation passes). The first replays the pass just recorded
        // (3, 0, 1, 2: misses); the next ones the order they used, where
        // only each pass's first unit, not prefetched across passes, misses.
        use_units(&f, &[0, 1, 2, 3], 10);
        let before = f.stats().misses;
        for _ in 0..3 {
            use_units(&f, &[0, 1, 2, 3], 10);
        }
        let stats = f.stats();
        assert_eq!(stats.misses - before, 3, "{stats:?}");
        assert!(stats.retraces >= 2, "{stats:?}");
        assert!(stats.peak_live_bytes <= 80, "{stats:?}");
    }

    /// Lending a piece builds no list of spans: every lend of a piece
    /// shares the one worked out when the fetcher was made.
    #[test]
    fn lent_pieces_share_their_spans() {
        let f = fetcher(3, 10, (80, 120), false);
        let first = f.acquire(1, 0).unwrap();
        assert_eq!(first.spans(), &[(0..10, 0..10)]);
        assert_eq!(f.piece_spans(1, 0), Some(first.spans()));
        assert_eq!(f.piece_spans(1, 1), None);
        let spans = first.spans().as_ptr();
        f.release(first);
        let again = f.acquire(1, 0).unwrap();
        assert_eq!(again.spans().as_ptr(), spans);
        f.release(again);
    }

    /// A buffer lent on and lost (the framework could not give it back)
    /// no longer counts as alive: the budget is free for the next gathers.
    #[test]
    fn a_lost_buffer_frees_its_bytes_of_the_budget() {
        // Room for one 40-byte unit at a time.
        let f = fetcher(3, 10, (40, 40), false);
        for u in 0..3 {
            let g = f.acquire(u, 0).unwrap();
            let unit = g.unit();
            assert_eq!(f.buffer_bytes(), 40, "unit {u} alive");
            drop(g.into_buffer());
            f.forget_buffer(unit);
            assert_eq!(f.buffer_bytes(), 0, "unit {u} forgotten");
        }
        // Without forgetting, the next gather would exceed the budget.
        let g = f.acquire(0, 0).unwrap();
        drop(g.into_buffer());
        let e = f.acquire(1, 0).unwrap_err();
        assert!(e.to_string().contains("max_live_bytes"), "{e}");
    }

    #[test]
    fn a_layer_above_max_live_bytes_is_a_configuration_error() {
        let units = vec![Unit {
            buckets: vec![],
            len: 100,
        }];
        let gather: Arc<GatherFn<f32>> = Arc::new(|_: &[f32], _: &mut [f32]| Ok(()));
        let e = Fetcher::<f32>::new(
            units,
            vec![vec![Span {
                unit: 0,
                at: 0..100,
                values: 0..100,
            }]],
            vec![],
            HostGathers::new(gather),
            (0, 200),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("max_live_bytes"), "{e}");
    }
}
