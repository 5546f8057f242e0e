//! Stages 1 and 2: a step's all-gathers deferred into the next forward
//! ([`EngineConfig::defer_gathers`](super::EngineConfig::defer_gathers)).
//!
//! An overlapped step reduces during backward, but its all-gathers can
//! only start once the shard is stepped, and the serial step waits for
//! them: nothing else runs then. With deferral the step stops after the
//! optimizer: each bucket's updated chunk goes to the engine's
//! communication thread, which all-gathers the buckets in forward order
//! (the last bucket in gradient order holds the first layer) and writes
//! each into the replica.
//! Layers wait for their own parameters ([`Refresh::wait`]), so the first
//! layers compute while the later buckets are still on the wire (FSDP
//! gathers the same way, on use).
//!
//! Every other collective of the engine, and every read of the replica or
//! the shard, first waits for the thread (`Engine::finish_gathers`): two
//! threads of one rank must never issue collectives at once, since the
//! ranks would pair them differently.

use super::worker::Ticket;
use super::{ParamCopy, ShardMemory};
use crate::comm::Communicator;
use crate::{DType, Element, Error, Result};
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// The framework's parameters as the deferred all-gathers reach them: a
/// framework lends its parameters to each engine call only, so deferral
/// needs its own way in.
pub trait ParamAccess<T: Element, C: Communicator, M: ShardMemory<T, C>>: Send {
    /// [`ShardMemory::read_params`] on the framework's parameters.
    fn read(&mut self, memory: &mut M, copies: &[ParamCopy], values: &mut M::Buffer) -> Result<()>;
    /// [`ShardMemory::write_params`] on the framework's parameters.
    fn write(&mut self, memory: &mut M, copies: &[ParamCopy], values: &M::Buffer) -> Result<()>;
}

/// Which parameters are current while a step's deferred all-gathers run:
/// shared with the layers, which wait on it before reading their
/// parameters.
#[derive(Debug, Default)]
pub struct Refresh {
    state: Mutex<RefreshState>,
    changed: Condvar,
}

#[derive(Debug)]
struct RefreshState {
    /// Buckets written so far, in the order they are gathered.
    written: usize,
    /// Per parameter, how many buckets must be written before it is
    /// current (0: it is).
    needed: Vec<usize>,
    /// The thread is done (every bucket written, or `failure`).
    ended: bool,
    failure: Option<String>,
}

impl Default for RefreshState {
    /// Before any step deferred its gathers: nothing to wait for.
    fn default() -> Self {
        Self {
            written: 0,
            needed: Vec::new(),
            ended: true,
            failure: None,
        }
    }
}

impl Refresh {
    fn lock(&self) -> MutexGuard<'_, RefreshState> {
        // Plain counters: a panic elsewhere leaves them consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until parameter `param` holds the values of the last step.
    /// An error when the all-gather that carries them failed.
    pub fn wait(&self, param: usize) -> Result<()> {
        let mut state = self.lock();
        loop {
            let needed = state.needed.get(param).copied().unwrap_or(0);
            if state.written >= needed {
                return Ok(());
            }
            if state.ended {
                return Err(failed(&state));
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits until every parameter holds the values of the last step
    /// (nothing to wait for unless that step deferred its all-gathers).
    /// Read the parameters outside hooked layers only after this.
    pub fn wait_all(&self) -> Result<()> {
        let mut state = self.lock();
        while !state.ended {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        match state.failure {
            Some(_) => Err(failed(&state)),
            None => Ok(()),
        }
    }

    /// Whether some parameter is still waiting for its all-gather.
    pub fn pending(&self) -> bool {
        let state = self.lock();
        !state.ended && state.needed.iter().any(|&n| n > state.written)
    }

    /// A new step's gathers: `needed` as in [`RefreshState::needed`].
    pub(super) fn start(&self, needed: Vec<usize>) {
        *self.lock() = RefreshState {
            needed,
            ended: false,
            ..RefreshState::default()
        };
    }

    fn wrote_one(&self) {
        self.lock().written += 1;
        self.changed.notify_all();
    }

    fn end(&self, failure: Option<String>) {
        let mut state = self.lock();
        if !state.ended {
            state.ended = true;
            state.failure = failure;
        }
        drop(state);
        self.changed.notify_all();
    }
}

fn failed(state: &RefreshState) -> Error {
    Error::State(format!(
        "the all-gathers deferred from the last step failed ({}); this rank's parameters were \
         not all updated: restart the run from its last checkpoint",
        state
            .failure
            .as_deref()
            .unwrap_or("the gather thread stopped")
    ))
}

/// Ends a [`Refresh`] however the thread ends (a panic included), so that
/// no layer waits forever.
struct EndOnDrop(Arc<Refresh>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end(Some("the gather thread panicked".into()));
    }
}

/// One bucket to all-gather and write.
pub(super) struct GatherJob {
    /// This rank's updated pieces, already in the parameters (the step
    /// wrote them), at their places in the bucket's chunk.
    pub owned: Vec<ParamCopy>,
    /// Elements of one rank's chunk of the bucket.
    pub chunk: usize,
    /// Elements of the whole bucket.
    pub len: usize,
    /// Where the bucket's active parameters lie in it.
    pub copies: Vec<ParamCopy>,
}

/// What the deferred all-gathers take.
pub(super) struct Payload<T: Element, C: Communicator, M: ShardMemory<T, C>> {
    pub comm: Arc<C>,
    /// The buckets to gather, in order, as they are stepped; the thread
    /// ends when the channel closes.
    pub jobs: Receiver<GatherJob>,
    /// A buffer as long as the longest chunk, to send from.
    pub send: M::Buffer,
    /// A buffer as long as the longest bucket.
    pub recv: M::Buffer,
    pub access: Box<dyn ParamAccess<T, C, M>>,
    pub refresh: Arc<Refresh>,
    /// The dtype on the wire.
    pub dtype: DType,
}

/// What the deferred all-gathers give back.
pub(super) struct Finished<T: Element, C: Communicator, M: ShardMemory<T, C>> {
    pub recv: M::Buffer,
    pub access: Box<dyn ParamAccess<T, C, M>>,
    pub result: Result<()>,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Finished<T, C, M> {
    /// Puts back what the run held (the recv buffer into `pool`, the
    /// parameter access into `gathers`); the run's result.
    pub(super) fn put_back(
        self,
        pool: &mut Vec<M::Buffer>,
        gathers: Option<&mut DeferredGathers<T, C, M>>,
    ) -> Result<()> {
        pool.push(self.recv);
        if let Some(gathers) = gathers {
            gathers.access = Some(self.access);
        }
        self.result
    }
}

/// The last step's all-gathers on the communication thread.
pub(super) type Pending<T, C, M> = Ticket<Finished<T, C, M>>;

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Payload<T, C, M> {
    /// All-gathers and writes every job in order; after a failure, issues
    /// nothing more (the peers' collectives fail within their deadline).
    pub(super) fn run(self, memory: &mut M) -> Finished<T, C, M> {
        let Self {
            comm,
            jobs,
            mut send,
            mut recv,
            mut access,
            refresh,
            dtype,
        } = self;
        let guard = EndOnDrop(Arc::clone(&refresh));
        let mut result = Ok(());
        for job in jobs {
            // Read here, as late as possible: no stepped chunk waits in a
            // buffer of its own.
            result = access
                .read(memory, &job.owned, &mut send)
                .and_then(|()| {
                    memory.all_gather_as(&*comm, &send, 0..job.chunk, &mut recv, 0..job.len, dtype)
                })
                .and_then(|()| access.write(memory, &job.copies, &recv));
            if result.is_err() {
                break;
            }
            refresh.wrote_one();
        }
        refresh.end(result.as_ref().err().map(ToString::to_string));
        drop(guard);
        Finished {
            recv,
            access,
            result,
        }
    }
}

/// Stages 1 and 2: what deferring a step's all-gathers needs.
pub(super) struct DeferredGathers<T: Element, C: Communicator, M: ShardMemory<T, C>> {
    /// How the deferred all-gathers read and write the framework's parameters
    /// (lent to it while it runs); `None`: steps gather before they return.
    pub access: Option<Box<dyn ParamAccess<T, C, M>>>,
    /// The last step's all-gathers, while they may run.
    pub pending: Option<Pending<T, C, M>>,
    /// Steps that deferred their all-gathers.
    pub steps: u64,
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Default for DeferredGathers<T, C, M> {
    fn default() -> Self {
        Self {
            access: None,
            pending: None,
            steps: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_wait_returns_once_its_buckets_are_written_and_fails_if_the_thread_fails() {
        let refresh = Arc::new(Refresh::default());
        // Parameter 0 is in the first bucket, 1 in the second, 2 in none.
        refresh.start(vec![1, 2, 0]);
        assert!(refresh.pending());
        refresh
            .wait(2)
            .expect("a parameter in no bucket is current");
        let waiter = {
            let refresh = refresh.clone();
            std::thread::spawn(move || refresh.wait(1))
        };
        refresh.wrote_one();
        refresh.wait(0).expect("its bucket is written");
        std::thread::sleep(Duration::from_millis(20));
        assert!(
            !waiter.is_finished(),
            "parameter 1 waits for the second bucket"
        );
        refresh.end(Some("peer 1 failed".into()));
        let err = waiter.join().unwrap().expect_err("its bucket never came");
        assert!(err.to_string().contains("peer 1 failed"), "{err}");
        assert!(refresh.wait_all().is_err());
        assert!(!refresh.pending());
    }

    #[test]
    fn a_gather_thread_that_panics_ends_the_waits() {
        let refresh = Arc::new(Refresh::default());
        refresh.start(vec![1]);
        let thread = {
            let refresh = refresh.clone();
            std::thread::spawn(move || {
                let _guard = EndOnDrop(refresh);
                panic!("a write failed hard");
            })
        };
        assert!(thread.join().is_err());
        let err = refresh.wait(0).expect_err("no layer waits forever");
        assert!(err.to_string().contains("panicked"), "{err}");
    }
}
