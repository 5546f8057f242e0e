//! [`MpiComm`]: the [`Communicator`](zero_core::Communicator) over MPI.

mod abort;
mod asynchronous;
mod collectives;
mod deadline;
mod progress;
mod ring;

use abort::abort_world;
use deadline::Watch;
use progress::Progress;

use crate::error::{Error, Result};
use mpi::environment::{Threading, Universe};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Under `MPI_THREAD_SERIALIZED`, every MPI call this crate makes holds this
/// lock. MPI is a per-process library; one lock per process is the honest
/// shape of that, not a convenience global. Under `MPI_THREAD_MULTIPLE` a
/// collective holds its communicator's own lock instead ([`Group::calls`]),
/// so that collectives of two communicators run at once (a split is a
/// collective of its parent); initializing, duplicating a program's
/// communicator, freeing and finalizing still hold this one.
static MPI_LOCK: Mutex<()> = Mutex::new(());

/// Which algorithm the large reduce-scatter, all-gather and all-reduce use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Algorithm {
    /// The MPI library's collective below [`Algorithm::RING_MIN_BYTES`],
    /// the send/receive ring at or above it (the default).
    #[default]
    Auto,
    /// Always the MPI library's collective (`MPI_Reduce_scatter_block`,
    /// `MPI_Allgather`, `MPI_Allreduce`).
    Native,
    /// Always the ring of `MPI_Sendrecv` (see the `ring` module).
    Ring,
}

impl Algorithm {
    /// Full-buffer size (bytes) from which [`Algorithm::Auto`] uses the ring.
    ///
    /// Below it the per-step latency of `N-1` send/receives is what counts
    /// and the library's tuned small-message algorithms win; above it
    /// bandwidth counts and the ring, which moves the minimum `(N-1)/N` of the
    /// buffer, measured faster (`bench comm` under `mpirun -n 2` reports the
    /// ratios; Open MPI 4.1 on shared memory).
    pub const RING_MIN_BYTES: usize = 256 * 1024;

    /// Whether a collective over a full buffer of `bytes` uses the ring.
    pub(crate) fn use_ring(self, bytes: usize) -> bool {
        match self {
            Algorithm::Auto => bytes >= Self::RING_MIN_BYTES,
            Algorithm::Native => false,
            Algorithm::Ring => true,
        }
    }
}

/// A [`Communicator`](zero_core::Communicator) over an MPI communicator, for
/// processes launched by `mpirun` (or `srun`). Buffers are host slices.
///
/// ```no_run
/// use zero_core::{Communicator, ReduceOp};
/// use zero_mpi_gloo::MpiComm;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let comm = MpiComm::init()?;
/// comm.abort_on_panic();
/// let mut grads = vec![1.0f32; 1024];
/// comm.all_reduce(&mut grads[..], ReduceOp::Avg)?;
/// # Ok(()) }
/// ```
///
/// # Failures
/// MPI cannot cancel a collective: a rank that returns early or hangs leaves
/// the others waiting in their next one. Open MPI ends the whole job when one
/// process exits without `MPI_Finalize` (a panic that unwinds out of `main`,
/// a non-zero exit), but a rank that keeps running after an error does not.
/// So a program should (1) call [`MpiComm::abort_on_panic`] once after
/// construction, and (2) end the job with [`MpiComm::abort`] (or
/// [`MpiComm::ok_or_abort`]) when it gives up on an error, instead of
/// returning from a single rank. Both print `rank R failed: <reason>` and
/// call `MPI_Abort`, which makes `mpirun` kill every rank and exit non-zero.
/// As a last resort every collective has a deadline
/// ([`MpiComm::with_timeout`], 300 s by default): a watchdog thread ends the
/// job, naming the collective and its sequence number, when one runs longer.
///
/// # Threads
/// `MpiComm` is `Send + Sync`. [`MpiComm::init`] asks MPI for
/// `MPI_THREAD_MULTIPLE`; where MPI provides it, a collective holds its
/// communicator's lock, so collectives of two communicators (one
/// [`split`](zero_core::Communicator::split) from the other) run at the same
/// time from two threads ([`concurrent_groups`](zero_core::Communicator::concurrent_groups)
/// is then `true`: stage 3 gathers on a thread of its own while gradients
/// are reduced on another). Where MPI provides only
/// `MPI_THREAD_SERIALIZED`, every MPI call of this crate holds one
/// process-wide lock and such collectives run one after the other. With a
/// communicator from a program that initialized MPI at a lower level,
/// collectives called from another thread than the initializing one return
/// an error.
///
/// # Asynchronous forms
/// `all_reduce_async`, `reduce_scatter_async`, `all_gather_async` and
/// `broadcast_async` return while the collective is still running. Each
/// copies its input into buffers it owns and queues the collective on a
/// progress thread, which runs queued collectives one at a time in the order
/// they were started: the communicator's own under `MPI_THREAD_MULTIPLE`,
/// else the process's one (for every communicator of the process); the
/// returned [`Work`](zero_core::Work) copies the result into the caller's
/// buffers when it is waited, or tested and found complete. The cost is one
/// copy in and one copy out.
///
/// Order, and with it the matching of collectives across ranks, stays the
/// call order: a blocking collective first waits for every asynchronous one
/// started before it on the same queue (its communicator's, or under
/// `MPI_THREAD_SERIALIZED` any communicator's of the process), and so does
/// dropping a communicator. The deadline runs from the moment the progress
/// thread issues the collective; errors are returned by the call (bad
/// arguments) or by `wait`/`test`.
///
/// Leaking a `Work` (`mem::forget`) is safe: MPI only ever writes to the
/// staged buffers, which the queued job owns; the collective still runs (the
/// peers issue it too) and its result is dropped. MPI immediate collectives
/// (`MPI_Iallreduce`) on the caller's buffers would keep writing to them
/// after a leaked `Work` let them go.
///
/// Where MPI provides less than `MPI_THREAD_SERIALIZED` (a communicator from
/// [`MpiComm::from_communicator`]), no other thread may call MPI: the
/// asynchronous forms then run to completion before returning.
pub struct MpiComm {
    // Dropped in `Drop` (freeing the MPI communicator) before the universe
    // can finalize MPI.
    group: ManuallyDrop<Group>,
    world_rank: usize,
    threading: Threading,
    bytes_sent: AtomicU64,
    timeout: Option<Duration>,
    seq: AtomicU64,
    watch: Arc<Watch>,
    universe: Option<Arc<Universe>>,
}

/// An MPI communicator this crate owns (a duplicate or a split), shared by
/// an [`MpiComm`] and the asynchronous collectives it has queued. Freed
/// (`MPI_Comm_free`) under the MPI lock when the last holder drops it, which
/// is the `MpiComm`: its `Drop` waits for the queued jobs first.
pub(crate) struct Handle {
    comm: ManuallyDrop<SimpleCommunicator>,
    /// What a collective on this communicator holds under
    /// `MPI_THREAD_MULTIPLE` ([`Group::calls`]).
    calls: Mutex<()>,
    /// Where its asynchronous collectives queue: its own queue under
    /// `MPI_THREAD_MULTIPLE`, the process's otherwise (see `progress`).
    progress: Arc<Progress>,
}

// SAFETY: `SimpleCommunicator` is `!Send + !Sync` only because it holds a raw
// `MPI_Comm` handle (a pointer in Open MPI). Every MPI call this crate makes
// through it holds a lock (`Entered::begin`, `Handle::drop`): `MPI_LOCK`
// where MPI provides `MPI_THREAD_SERIALIZED`, so no two threads are ever
// inside MPI through this crate at once; the communicator's own where it
// provides `MPI_THREAD_MULTIPLE`, so no two threads are ever inside MPI on
// one communicator at once (MPI allows any threads in at once then).
// `Entered::begin` refuses calls from a non-main thread when MPI provides
// less than `MPI_THREAD_SERIALIZED`, and asynchronous collectives only move
// to the progress thread when it provides at least that. The handle itself
// is immutable after construction.
unsafe impl Send for Handle {}
// SAFETY: as for `Send`: shared access only reaches MPI under those locks.
unsafe impl Sync for Handle {}

impl Handle {
    /// Takes ownership of `comm`, a communicator this crate created, used
    /// at thread level `threading`.
    pub(crate) fn new(comm: SimpleCommunicator, threading: Threading) -> Self {
        let progress = if threading == Threading::Multiple {
            Progress::own()
        } else {
            Progress::process()
        };
        Self {
            comm: ManuallyDrop::new(comm),
            calls: Mutex::new(()),
            progress,
        }
    }
}

impl Deref for Handle {
    type Target = SimpleCommunicator;

    fn deref(&self) -> &SimpleCommunicator {
        &self.comm
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // Every job holds the handle: none is left. A queue of this
        // communicator's own ends its thread.
        if !Arc::ptr_eq(&self.progress, &Progress::process()) {
            self.progress.close();
        }
        let _guard = lock();
        // SAFETY: the communicator is dropped exactly once, here, and not
        // used after.
        unsafe { ManuallyDrop::drop(&mut self.comm) };
    }
}

/// What a collective needs of its communicator; a clone travels with each
/// asynchronous collective to the progress thread.
#[derive(Clone)]
pub(crate) struct Group {
    pub(crate) comm: Arc<Handle>,
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    pub(crate) algorithm: Algorithm,
}

impl Group {
    /// The lock a collective on this communicator holds: its own where MPI
    /// provides `MPI_THREAD_MULTIPLE`, the process's otherwise.
    pub(crate) fn calls(&self, threading: Threading) -> &Mutex<()> {
        if threading == Threading::Multiple {
            &self.comm.calls
        } else {
            &MPI_LOCK
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Queued collectives hold the communicator: once every job queued
        // before now has run and been dropped, this is its last holder.
        self.group.comm.progress.wait_idle();
        debug_assert_eq!(Arc::strong_count(&self.group.comm), 1);
        // SAFETY: `group` is dropped exactly once, here, and not used after.
        // Dropping the last `Handle` frees the communicator (under the lock).
        unsafe { ManuallyDrop::drop(&mut self.group) };
        // Finalizing MPI (when this holds the last reference to the
        // universe) is an MPI call too: make it under the lock, like every
        // other.
        let _guard = lock();
        // MPI_Finalize, run when the last reference to the universe goes,
        // waits for every process of the job (Open MPI fences): a peer that
        // hangs at exit would hang this rank too. Watch it like a collective.
        let finalizes = self
            .universe
            .as_ref()
            .is_some_and(|u| Arc::strong_count(u) == 1);
        if finalizes {
            let seq = self.seq.fetch_add(1, Ordering::Relaxed);
            self.watch.start("MPI_Finalize", seq, self.timeout);
        }
        self.universe.take();
        self.watch.finish();
    }
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.group.rank)
            .field("world_size", &self.group.world_size)
            .field("world_rank", &self.world_rank)
            .field("threading", &self.threading)
            .field("algorithm", &self.group.algorithm)
            .field("bytes_sent", &self.bytes_sent.load(Ordering::Relaxed))
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl MpiComm {
    /// Initializes MPI (asking for `MPI_THREAD_MULTIPLE`, working with
    /// `MPI_THREAD_SERIALIZED`; see "Threads" above) and returns a
    /// communicator over all processes of the job (a duplicate of
    /// `MPI_COMM_WORLD`). MPI is finalized when this communicator and every
    /// communicator split from it have been dropped.
    ///
    /// Errors with [`Error::AlreadyInitialized`] if MPI was initialized before
    /// (use [`MpiComm::from_communicator`] then). Run without `mpirun`, MPI
    /// starts a singleton job of one rank.
    pub fn init() -> Result<Self> {
        let _guard = lock();
        if mpi::environment::is_initialized() {
            return Err(Error::AlreadyInitialized);
        }
        let (universe, threading) =
            mpi::initialize_with_threading(Threading::Multiple).ok_or(Error::AlreadyInitialized)?;
        let world = universe.world();
        Ok(Self::build(&world, threading, Some(Arc::new(universe))))
    }

    /// Wraps an existing communicator of a program that initialized MPI
    /// itself. The communicator is duplicated (`MPI_Comm_dup`, a collective
    /// over `comm`), so the backend's messages never mix with the program's.
    /// The program keeps MPI initialized for as long as this value lives.
    pub fn from_communicator(comm: &SimpleCommunicator) -> Result<Self> {
        // The duplicate is a collective: issue it after any queued one.
        Progress::process().wait_idle();
        let _guard = lock();
        if !mpi::environment::is_initialized() || mpi::environment::is_finalized() {
            return Err(Error::NotInitialized {
                op: "MpiComm::from_communicator",
            });
        }
        let threading = mpi::environment::threading_support();
        Ok(Self::build(comm, threading, None))
    }

    /// The caller holds `MPI_LOCK`.
    fn build(
        comm: &SimpleCommunicator,
        threading: Threading,
        universe: Option<Arc<Universe>>,
    ) -> Self {
        let comm = Handle::new(comm.duplicate(), threading);
        let world_rank = SimpleCommunicator::world().rank() as usize;
        Self::wrap(comm, world_rank, threading, universe)
    }

    /// Wraps a communicator this crate owns (a duplicate or a split). The
    /// caller holds `MPI_LOCK`.
    pub(crate) fn wrap(
        comm: Handle,
        world_rank: usize,
        threading: Threading,
        universe: Option<Arc<Universe>>,
    ) -> Self {
        let rank = comm.rank() as usize;
        let world_size = comm.size() as usize;
        Self {
            group: ManuallyDrop::new(Group {
                comm: Arc::new(comm),
                rank,
                world_size,
                algorithm: Algorithm::Auto,
            }),
            world_rank,
            threading,
            bytes_sent: AtomicU64::new(0),
            timeout: Some(zero_core::comm::DEFAULT_TIMEOUT),
            seq: AtomicU64::new(0),
            watch: Watch::register(world_rank, rank, world_size),
            universe,
        }
    }

    /// Chooses the algorithm of large collectives (default
    /// [`Algorithm::Auto`]). Every rank must choose the same.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.group.algorithm = algorithm;
        self
    }

    /// Sets the deadline of every collective (default
    /// [`DEFAULT_TIMEOUT`](zero_core::comm::DEFAULT_TIMEOUT), 300 s; `None`:
    /// wait forever). A collective still running after it ends the job with
    /// `MPI_Abort` and `rank R failed: <op> #<seq> did not complete within ...`:
    /// MPI cannot cancel a collective, so an error return is not possible.
    /// Communicators split from this one inherit it.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// The deadline of every collective.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// The algorithm of large collectives.
    pub fn algorithm(&self) -> Algorithm {
        self.group.algorithm
    }

    /// This process's rank in `MPI_COMM_WORLD` (the rank failure messages
    /// name).
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// The thread support MPI provides.
    pub fn threading(&self) -> Threading {
        self.threading
    }

    /// The underlying MPI communicator, for calls this crate does not wrap.
    ///
    /// Calls made through it do not hold this crate's lock: make them from
    /// one thread, never while another thread runs a collective of this crate
    /// (unless MPI provides `MPI_THREAD_MULTIPLE`), and never while an
    /// asynchronous collective of this crate is in flight (wait its `Work`
    /// first): the progress thread runs it.
    pub fn raw(&self) -> &SimpleCommunicator {
        &self.group.comm
    }

    /// Installs a panic hook that, after the default report, prints
    /// `rank R failed: <panic message>` and calls `MPI_Abort` on
    /// `MPI_COMM_WORLD`, so that `mpirun` ends every rank and exits non-zero
    /// instead of the surviving ranks waiting forever in a collective.
    /// Call it once, right after construction.
    pub fn abort_on_panic(&self) {
        let world_rank = self.world_rank;
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            let message = if let Some(s) = info.payload().downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = info.payload().downcast_ref::<String>() {
                s.clone()
            } else {
                "panic with a non-string payload".to_string()
            };
            let location = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            abort_world(world_rank, &format!("{message}{location}"));
        }));
    }

    /// Ends the whole MPI job: prints `rank R failed: <reason>` on stderr and
    /// calls `MPI_Abort` on `MPI_COMM_WORLD` (exit code 1). Use it when a rank
    /// gives up on an error, so that the other ranks do not wait for it.
    pub fn abort(&self, reason: &str) -> ! {
        abort_world(self.world_rank, reason)
    }

    /// Returns the value, or ends the job with [`MpiComm::abort`] naming the
    /// error: `let step = comm.ok_or_abort(engine.step())`.
    pub fn ok_or_abort<T, E: std::fmt::Display>(&self, result: Result<T, E>) -> T {
        match result {
            Ok(v) => v,
            Err(e) => self.abort(&e.to_string()),
        }
    }

    /// Enters MPI for one blocking collective `op`: waits for the
    /// asynchronous collectives started before it, then takes the MPI lock.
    fn enter(&self, op: &'static str) -> Result<Entered<'_>> {
        self.group.comm.progress.wait_idle();
        Entered::begin(
            self.group.calls(self.threading),
            self.threading,
            &self.watch,
            op,
            self.next_seq(),
            self.timeout,
        )
    }

    /// The sequence number of the next collective (failure messages name it).
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Adds to the bytes-sent counter.
    fn count_sent(&self, bytes: usize) {
        self.bytes_sent.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// A collective in progress: holds its lock ([`Group::calls`]) and is
/// watched for its deadline until dropped.
struct Entered<'a> {
    _lock: MutexGuard<'a, ()>,
    watch: &'a Watch,
}

impl<'a> Entered<'a> {
    /// Takes `calls` (the lock [`Group::calls`] names) for collective `op`
    /// #`seq` and starts its deadline; refuses a call from a thread MPI does
    /// not allow at the provided thread level.
    fn begin(
        calls: &'a Mutex<()>,
        threading: Threading,
        watch: &'a Watch,
        op: &'static str,
        seq: u64,
        timeout: Option<Duration>,
    ) -> Result<Self> {
        let guard = hold(calls);
        if !other_threads_allowed(threading) {
            let mut flag: std::os::raw::c_int = 0;
            // SAFETY: MPI is initialized (checked at construction, and it stays
            // so while a communicator lives); `flag` is a valid out-pointer.
            unsafe {
                mpi::ffi::MPI_Is_thread_main(&mut flag);
            }
            if flag == 0 {
                return Err(Error::ThreadLevel {
                    op,
                    provided: format!("{threading:?}"),
                });
            }
        }
        watch.start(op, seq, timeout);
        Ok(Entered {
            _lock: guard,
            watch,
        })
    }
}

/// Whether MPI may be called from another thread than the main one (one at
/// a time): `MPI_THREAD_SERIALIZED` or more.
fn other_threads_allowed(threading: Threading) -> bool {
    !matches!(threading, Threading::Single | Threading::Funneled)
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.watch.finish();
    }
}

fn lock() -> MutexGuard<'static, ()> {
    hold(&MPI_LOCK)
}

fn hold(calls: &Mutex<()>) -> MutexGuard<'_, ()> {
    // A panic while holding the lock leaves no broken state behind (the lock
    // guards MPI calls, not data), so a poisoned lock is still usable.
    calls
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
