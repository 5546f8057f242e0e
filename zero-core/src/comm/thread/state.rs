//! The shared state of a thread group: one slot per collective sequence
//! number, the ranks that left, and the spin-then-park wait.

use crate::comm::ReduceOp;
use crate::{DType, Error, Result};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a waiter spins (yielding) before it parks on the condition
/// variable. Short enough to cost little on an oversubscribed machine, long
/// enough that a small all-reduce between two busy ranks never sleeps.
const SPIN: Duration = Duration::from_micros(100);

/// What a rank called: compared between ranks at the same sequence number.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct OpDesc {
    pub op: &'static str,
    pub dtype: Option<(DType, TypeId)>,
    pub reduce: Option<ReduceOp>,
    pub len: Option<usize>,
    pub root: Option<usize>,
    pub list: Option<Vec<usize>>,
}

impl OpDesc {
    pub fn new(op: &'static str) -> Self {
        Self {
            op,
            dtype: None,
            reduce: None,
            len: None,
            root: None,
            list: None,
        }
    }
}

impl std::fmt::Display for OpDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if let Some((dtype, _)) = self.dtype {
            parts.push(dtype.to_string());
        }
        if let Some(op) = self.reduce {
            parts.push(op.as_str().to_string());
        }
        if let Some(len) = self.len {
            parts.push(format!("{len} elements"));
        }
        if let Some(list) = &self.list {
            let name = if self.op == "split" {
                "ranks"
            } else {
                "counts"
            };
            parts.push(format!("{name} {list:?}"));
        }
        if let Some(root) = self.root {
            parts.push(format!("root {root}"));
        }
        write!(f, "{}({})", self.op, parts.join(", "))
    }
}

/// A rank's caller-owned buffers, lent to its peers for the duration of one
/// blocking collective. Lengths are in elements of the collective's type.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawBuf {
    pub send: *const u8,
    pub send_len: usize,
    pub recv: *mut u8,
}

// SAFETY: a `RawBuf` is plain data (addresses and lengths). Peers dereference
// it only between "every rank arrived" and "every rank departed" of one
// blocking collective; during that window the owner is blocked inside the
// same collective, which holds the borrows the pointers were made from, and
// every rank touches disjoint regions (see `ThreadComm`'s collectives). The
// mutex hand-offs at arrival and departure order those accesses.
unsafe impl Send for RawBuf {}

/// What a rank deposited for a collective.
#[derive(Clone)]
pub(super) enum Contribution {
    /// Nothing (barrier, non-root of an asynchronous broadcast, withdrawn).
    Empty,
    /// Zero-copy: the caller's buffers (blocking collectives).
    Borrowed(RawBuf),
    /// An owned copy (asynchronous collectives, split): a `Vec<T>` or a group.
    Owned(Arc<dyn Any + Send + Sync>),
}

/// Why a collective was abandoned. Set only while some rank has not arrived,
/// so no rank ever reads a peer's buffer in an aborted collective.
#[derive(Clone, Debug)]
enum Abort {
    Timeout {
        missing: Vec<usize>,
    },
    PeerFailed {
        failed: Vec<usize>,
        reason: String,
    },
    Mismatch {
        first: (usize, OpDesc),
        second: (usize, OpDesc),
    },
}

impl Abort {
    fn to_error(&self, rank: usize, seq: u64, desc: &OpDesc, waited: Duration) -> Error {
        match self {
            Abort::Timeout { missing } => Error::CollectiveTimeout {
                op: desc.op,
                seq,
                missing: missing.clone(),
                waited_s: waited.as_secs_f64(),
            },
            Abort::PeerFailed { failed, reason } => Error::PeerFailed {
                op: desc.op,
                seq,
                failed: failed.clone(),
                reason: reason.clone(),
            },
            Abort::Mismatch { first, second } => {
                // Name the side this rank is not on.
                let other = if rank == first.0 {
                    second
                } else if rank == second.0 {
                    first
                } else if *desc == first.1 {
                    second
                } else {
                    first
                };
                Error::CollectiveMismatch {
                    seq,
                    rank,
                    this: desc.to_string(),
                    other_rank: other.0,
                    other: other.1.to_string(),
                }
            }
        }
    }
}

struct Slot {
    desc: OpDesc,
    first: usize,
    arrived: Vec<bool>,
    n_arrived: usize,
    n_done: usize,
    contributions: Vec<Contribution>,
    abort: Option<Abort>,
}

impl Slot {
    fn missing(&self) -> Vec<usize> {
        (0..self.arrived.len())
            .filter(|&r| !self.arrived[r])
            .collect()
    }
}

struct State {
    slots: HashMap<u64, Slot>,
    /// Why each rank left the group, once it has.
    left: Vec<Option<String>>,
    /// Threads parked on the condition variable.
    sleepers: usize,
}

/// The state one group's ranks share.
pub(super) struct Shared {
    pub world_size: usize,
    pub timeout: Duration,
    state: Mutex<State>,
    cond: Condvar,
    /// Bumped on every change a waiter may wait for; spinners watch it.
    epoch: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("world_size", &self.world_size)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub fn new(world_size: usize, timeout: Duration) -> Self {
        Self {
            world_size,
            timeout,
            state: Mutex::new(State {
                slots: HashMap::new(),
                left: vec![None; world_size],
                sleepers: 0,
            }),
            cond: Condvar::new(),
            epoch: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock; if something ever did, the
        // state is still consistent (every mutation is a single step).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes waiters; call with the lock held after a change.
    fn changed(&self, st: &State) {
        self.epoch.fetch_add(1, Ordering::Release);
        if st.sleepers > 0 {
            self.cond.notify_all();
        }
    }

    /// Waits until `check` returns `Some`, spinning briefly then parking.
    /// At `deadline`, returns `on_timeout` (with the lock held, after a last
    /// `check`).
    fn wait<T>(
        &self,
        deadline: Option<Instant>,
        mut check: impl FnMut(&Self, &mut State) -> Option<T>,
        on_timeout: impl FnOnce(&Self, &mut State) -> T,
    ) -> T {
        let spin_start = Instant::now();
        let mut st = self.lock();
        loop {
            if let Some(v) = check(self, &mut st) {
                return v;
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return on_timeout(self, &mut st);
            }
            if now.duration_since(spin_start) < SPIN {
                let seen = self.epoch.load(Ordering::Acquire);
                drop(st);
                for i in 0..256 {
                    if self.epoch.load(Ordering::Acquire) != seen {
                        break;
                    }
                    if i < 32 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
                st = self.lock();
                continue;
            }
            let park = deadline.map_or(Duration::from_secs(3600), |d| d - now);
            st.sleepers += 1;
            st = match self.cond.wait_timeout(st, park) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
            st.sleepers -= 1;
        }
    }

    /// Joins collective `seq` with `contribution`. Fails at once if the slot
    /// was aborted, if this rank called something else than the first
    /// arriver, or if a peer already left the group.
    pub fn join(
        &self,
        rank: usize,
        seq: u64,
        desc: &OpDesc,
        contribution: Contribution,
    ) -> Result<()> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let n = self.world_size;
        let slot = match st.slots.get_mut(&seq) {
            Some(slot) => slot,
            None => {
                let failed: Vec<usize> = (0..n)
                    .filter(|&r| r != rank && st.left[r].is_some())
                    .collect();
                if !failed.is_empty() {
                    return Err(Error::PeerFailed {
                        op: desc.op,
                        seq,
                        reason: left_reason(&st.left, &failed),
                        failed,
                    });
                }
                st.slots.entry(seq).or_insert_with(|| Slot {
                    desc: desc.clone(),
                    first: rank,
                    arrived: vec![false; n],
                    n_arrived: 0,
                    n_done: 0,
                    contributions: vec![Contribution::Empty; n],
                    abort: None,
                })
            }
        };
        if let Some(abort) = &slot.abort {
            return Err(abort.to_error(rank, seq, desc, Duration::ZERO));
        }
        if slot.desc != *desc {
            let abort = Abort::Mismatch {
                first: (slot.first, slot.desc.clone()),
                second: (rank, desc.clone()),
            };
            let err = abort.to_error(rank, seq, desc, Duration::ZERO);
            slot.abort = Some(abort);
            self.changed(st);
            return Err(err);
        }
        slot.arrived[rank] = true;
        slot.n_arrived += 1;
        slot.contributions[rank] = contribution;
        if slot.n_arrived == n {
            self.changed(st);
        }
        Ok(())
    }

    /// Marks collective `seq` as failed by `rank` before it joined (invalid
    /// arguments), so its peers fail at once instead of at the deadline.
    pub fn fail(&self, rank: usize, seq: u64, desc: &OpDesc, err: &Error) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let n = self.world_size;
        let slot = st.slots.entry(seq).or_insert_with(|| Slot {
            desc: desc.clone(),
            first: rank,
            arrived: vec![false; n],
            n_arrived: 0,
            n_done: 0,
            contributions: vec![Contribution::Empty; n],
            abort: None,
        });
        if slot.abort.is_none() {
            slot.abort = Some(Abort::PeerFailed {
                failed: vec![rank],
                reason: format!("rank {rank} passed invalid arguments: {err}"),
            });
            self.changed(st);
        }
    }

    /// Checks collective `seq` once: `Some(Ok(contributions))` when every
    /// rank has arrived, `Some(Err)` when it was aborted or a missing rank has
    /// left (which aborts it), `None` while still waiting.
    fn check_arrived(
        &self,
        st: &mut State,
        rank: usize,
        seq: u64,
        desc: &OpDesc,
        start: Instant,
    ) -> Option<Result<Vec<Contribution>>> {
        let Some(slot) = st.slots.get_mut(&seq) else {
            // Unreachable: a slot lives until every rank that joined it has
            // departed, and this rank has not.
            return Some(Err(Error::State(format!(
                "{} #{seq}: internal error: collective state vanished",
                desc.op
            ))));
        };
        if let Some(abort) = &slot.abort {
            return Some(Err(abort.to_error(rank, seq, desc, start.elapsed())));
        }
        if slot.n_arrived == slot.arrived.len() {
            return Some(Ok(slot.contributions.clone()));
        }
        let failed: Vec<usize> = slot
            .missing()
            .into_iter()
            .filter(|&r| st.left[r].is_some())
            .collect();
        if failed.is_empty() {
            return None;
        }
        let abort = Abort::PeerFailed {
            reason: left_reason(&st.left, &failed),
            failed,
        };
        let err = abort.to_error(rank, seq, desc, start.elapsed());
        slot.abort = Some(abort);
        self.changed(st);
        Some(Err(err))
    }

    /// Gives up on collective `seq` at its deadline: aborts it and withdraws
    /// this rank's buffers under the lock, so a late peer never reads them.
    fn time_out(
        &self,
        st: &mut State,
        rank: usize,
        seq: u64,
        desc: &OpDesc,
        start: Instant,
    ) -> Error {
        let Some(slot) = st.slots.get_mut(&seq) else {
            return Error::State(format!(
                "{} #{seq}: internal error: collective state vanished",
                desc.op
            ));
        };
        let abort = Abort::Timeout {
            missing: slot.missing(),
        };
        let err = abort.to_error(rank, seq, desc, start.elapsed());
        slot.abort = Some(abort);
        slot.contributions[rank] = Contribution::Empty;
        self.changed(st);
        err
    }

    /// Blocks until every rank has joined collective `seq` (or it failed),
    /// and returns every rank's contribution.
    pub fn wait_arrived(
        &self,
        rank: usize,
        seq: u64,
        desc: &OpDesc,
        start: Instant,
    ) -> Result<Vec<Contribution>> {
        let deadline = start + self.timeout;
        self.wait(
            Some(deadline),
            |sh, st| sh.check_arrived(st, rank, seq, desc, start),
            |sh, st| Err(sh.time_out(st, rank, seq, desc, start)),
        )
    }

    /// Like [`Shared::wait_arrived`] without blocking: `Ok(None)` while peers
    /// are missing and the deadline has not passed.
    pub fn poll_arrived(
        &self,
        rank: usize,
        seq: u64,
        desc: &OpDesc,
        start: Instant,
    ) -> Result<Option<Vec<Contribution>>> {
        let mut st = self.lock();
        match self.check_arrived(&mut st, rank, seq, desc, start) {
            Some(r) => r.map(Some),
            None if start.elapsed() >= self.timeout => {
                Err(self.time_out(&mut st, rank, seq, desc, start))
            }
            None => Ok(None),
        }
    }

    /// This rank is done with collective `seq` (it no longer touches any
    /// peer's buffer). With `wait`, blocks until every rank is done, so that
    /// the caller may release its own buffers. No deadline applies: every
    /// rank has arrived and is inside code that does not block.
    pub fn depart(&self, seq: u64, wait: bool) {
        {
            let mut st = self.lock();
            let n = self.world_size;
            let done = match st.slots.get_mut(&seq) {
                Some(slot) => {
                    slot.n_done += 1;
                    slot.n_done == n
                }
                None => true,
            };
            if done {
                st.slots.remove(&seq);
                self.changed(&st);
                return;
            }
        }
        if wait {
            self.wait(
                None,
                |_, st| (!st.slots.contains_key(&seq)).then_some(()),
                |_, _| (),
            );
        }
    }

    /// Marks `rank` as gone: its peers' pending and later collectives fail.
    pub fn leave(&self, rank: usize, reason: String) {
        let mut st = self.lock();
        if let Some(slot) = st.left.get_mut(rank) {
            *slot = Some(reason);
        }
        self.changed(&st);
    }
}

fn left_reason(left: &[Option<String>], failed: &[usize]) -> String {
    failed
        .iter()
        .map(|&r| format!("rank {r} {}", left[r].as_deref().unwrap_or("did not join")))
        .collect::<Vec<_>>()
        .join("; ")
}
