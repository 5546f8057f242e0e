//! Master weights: an engine whose element type is wider than its
//! parameters' (an `Engine<f32>` over a bf16 or f16 model) keeps its shard
//! of the weights in the wider type, and that shard, not the replica, is
//! the truth.
//!
//! The engine's buffers and optimizer state are all in `T`, so with `T =
//! f32` over a 16-bit model the gradients are reduced in f32, the optimizer
//! state is f32 and the optimizer steps the f32 master shard; the replica
//! (the model's 16-bit variables) receives the updated values rounded to
//! its dtype. The adapter converts at the seam: its [`ParamStore`] reads and
//! writes the 16-bit variables as `T`, and its gradients arrive as `T`.
//!
//! What changes in the engine:
//! - the owned pieces are read from the replica only when the masters are
//!   stale (before the first step, after [`Engine::reload_master_weights`]);
//!   re-reading the rounded replica every step, as an engine without
//!   masters does, would throw the master precision away;
//! - the all-gather of the updated shard sends the parameters' dtype (see
//!   [`EngineConfig::gather_in_param_dtype`]);
//! - checkpoints store the weights in `T`, the trainable ones from the
//!   masters, so a resume loses nothing, and load into any precision.
//!
//! [`ParamStore`]: super::ParamStore
//! [`EngineConfig::gather_in_param_dtype`]: super::EngineConfig::gather_in_param_dtype

use super::sharding::Sharding;
use super::{EngineConfig, ParamStore, ShardMemory, Stage};
use crate::comm::Communicator;
use crate::dtype::convert_slice;
use crate::partition::ParamInfo;
use crate::{DType, Element, Result};
use std::ops::Range;

/// Whether an engine of element type `T` can step a parameter of `dtype`:
/// its own type, or a 16-bit type narrower than `T` (then `T` holds its
/// master weights). Frozen parameters may have any dtype; the ones this
/// rejects are left out of checkpoints.
pub(super) fn engine_steps<T: Element>(dtype: DType) -> bool {
    dtype == T::DTYPE
        || (matches!(dtype, DType::BF16 | DType::F16)
            && T::DTYPE.size_in_bytes() > dtype.size_in_bytes())
}

/// Which copy holds the truth of the trained parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Truth {
    /// The replica: each step reads the owned pieces from it (a user may
    /// have changed them since the last step).
    Replica,
    /// The parameter shard (master weights, stage 3's sharded parameters);
    /// until it is `fresh` (read once, or loaded), the next step reads the
    /// replica.
    Shard { fresh: bool },
}

impl Truth {
    /// Whether the shard holds the truth.
    pub fn in_shard(self) -> bool {
        matches!(self, Self::Shard { .. })
    }

    /// Whether the shard holds the truth, current.
    pub fn fresh(self) -> bool {
        self == Self::Shard { fresh: true }
    }

    /// Marks the shard current or stale (nothing where the replica holds
    /// the truth).
    pub fn set_fresh(&mut self, now: bool) {
        if let Self::Shard { fresh } = self {
            *fresh = now;
        }
    }
}

/// Where an engine keeps its masters and the dtypes its values travel in,
/// decided once at construction from the parameters, the configuration,
/// the world size and the memory.
#[derive(Clone, Copy, Debug)]
pub(super) struct Wire {
    /// Master weights are kept: some trainable parameter has a narrower
    /// dtype than the engine's element type.
    pub masters: bool,
    /// The dtype the updated shard travels in: the parameters' when they
    /// share one narrower than `T` (their replica holds nothing finer, so
    /// rounding before sending is exact), `T` otherwise. A single rank
    /// sends nothing, so it gathers in `T` (rounding there would only add
    /// two conversion passes; the write-back rounds the same).
    pub gather: DType,
    /// Stage 3: the 16-bit dtype its gathers may carry, at any world size:
    /// the parameters', when they share one narrower than `T` and the
    /// configuration gathers in the parameters' dtype. The layers compute
    /// in it anyway, so gathering in it replaces their rounding at every
    /// use with one rounding of each rank's chunk before it is sent.
    pub stage3_gather: Option<DType>,
    /// The dtype gradients travel in: the master dtype unless the
    /// configuration asks for the parameters' (`reduce_in_param_dtype`).
    pub reduce: DType,
    /// With shard groups, the dtype each gradient shard's average across
    /// its replicas travels in: `replica_reduce_dtype`, else `reduce`.
    pub replica: DType,
    /// The 16-bit dtype offload's step thread packs each stepped bucket's
    /// weights in for the write-back: the model's, when it is a 16-bit
    /// model with wider masters, the configuration gathers in the
    /// parameters' dtype (as by default) and the memory gathers packed
    /// chunks. Rounding on the host then widening on the device gives the
    /// model the same values as rounding the masters there; it costs the
    /// host one more pass over the stepped weights and halves the bytes
    /// sent up.
    pub packed_write_back: Option<DType>,
}

impl Wire {
    /// For an engine of element type `T` over `params` on `world_size`
    /// ranks, with a memory that gathers packed 16-bit chunks or not.
    pub fn new<T: Element>(
        params: &[ParamInfo],
        config: &EngineConfig,
        world_size: usize,
        gathers_packed: bool,
    ) -> Self {
        // The trainable parameters' dtype when they share one, else `T`'s.
        let mut trainable = params.iter().filter(|p| p.trainable);
        let param_dtype = match trainable.next() {
            Some(first) if trainable.all(|p| p.dtype == first.dtype) => first.dtype,
            _ => T::DTYPE,
        };
        let narrow =
            matches!(param_dtype, DType::BF16 | DType::F16) && T::DTYPE.size_in_bytes() > 2;
        let reduce = if config.reduce_in_param_dtype {
            param_dtype
        } else {
            T::DTYPE
        };
        Self {
            masters: params.iter().any(|p| p.trainable && p.dtype != T::DTYPE),
            gather: if config.gather_in_param_dtype && world_size > 1 {
                param_dtype
            } else {
                T::DTYPE
            },
            stage3_gather: (narrow && config.gather_in_param_dtype).then_some(param_dtype),
            reduce,
            replica: config.replica_reduce_dtype.unwrap_or(reduce),
            packed_write_back: (narrow && config.gather_in_param_dtype && gathers_packed)
                .then_some(param_dtype),
        }
    }
}

/// The master weights (the parameter shard, when the engine keeps them)
/// with what reads and writes them: the memory, the partition, and the
/// communicator the owners send their pieces over.
pub(super) struct Masters<'a, T: Element, C: Communicator, M: ShardMemory<T, C>> {
    pub comm: &'a C,
    pub memory: &'a mut M,
    pub shard: &'a mut M::Buffer,
    pub sharding: &'a Sharding,
    /// Stage 0: every rank holds every master (nothing is sent).
    pub replicated: bool,
}

impl<'a, T: Element, C: Communicator, M: ShardMemory<T, C>> Masters<'a, T, C, M> {
    /// The master weights in `shard` (laid out by `sharding`) at `stage`.
    pub fn new(
        (comm, memory): (&'a C, &'a mut M),
        shard: &'a mut M::Buffer,
        sharding: &'a Sharding,
        stage: Stage,
    ) -> Self {
        Self {
            comm,
            memory,
            shard,
            sharding,
            replicated: stage == Stage::Ddp,
        }
    }

    /// Streams parameter `param`'s master weights to rank `root`, one piece
    /// at a time in element order: `sink(param_range, values)` runs on
    /// `root` for each piece of the plan (together they cover a trainable
    /// parameter), so that no rank holds more than one piece. Saves the
    /// model without a whole-model buffer.
    ///
    /// A collective in stages 1 to 3: one gather per piece, from its owner
    /// (none for the pieces `root` owns), every rank calling it for the same
    /// parameters in the same order. In stage 0 `root` holds everything and
    /// nothing is sent. The sink cannot fail: a sink that meets an error
    /// must keep it and let the pieces go by, since the other ranks are
    /// sending them.
    pub fn stream(
        &mut self,
        param: usize,
        root: usize,
        sink: &mut dyn FnMut(Range<usize>, &[T]),
    ) -> Result<()> {
        self.land(param, root, Landing::Sink(sink))
    }

    /// [`Masters::stream`] straight into `out` on `root`, the whole
    /// parameter (what the plan leaves out of it is zeroed; a background
    /// save's snapshot); the other ranks pass an empty `out`.
    pub fn gather(&mut self, param: usize, root: usize, out: &mut [T]) -> Result<()> {
        self.land(param, root, Landing::Whole { out, next: 0 })
    }

    /// Sends `param`'s pieces to `root`, landing there as `landing` says.
    fn land(&mut self, param: usize, root: usize, mut landing: Landing<'_, T>) -> Result<()> {
        let rank = self.comm.rank();
        let world = self.comm.world_size();
        let shard_numel = self.sharding.partition.shard_numel;
        // (owner, range in the parameter, position in the owner's shard)
        let mut pieces: Vec<(usize, Range<usize>, usize)> = self
            .sharding
            .partition
            .shards
            .iter()
            .enumerate()
            .flat_map(|(owner, shard)| {
                shard
                    .iter()
                    .filter(|piece| piece.param == param)
                    .map(move |piece| {
                        let at = piece.flat_range.start - owner * shard_numel;
                        (owner, piece.param_range.clone(), at)
                    })
            })
            .collect();
        pieces.sort_by_key(|(_, range, _)| range.start);
        let (mut send, mut recv): (Vec<T>, Vec<T>) = (Vec::new(), Vec::new());
        for (owner, range, at) in pieces {
            let here = at..at + range.len();
            // Stage 0, or a piece `root` owns: nothing to send.
            if self.replicated || owner == root {
                if rank == root {
                    let into = landing.place(range.clone(), &mut recv);
                    self.memory
                        .buffer_to_host(self.comm, self.shard, here, into)?;
                    landing.landed(range, &recv);
                }
                continue;
            }
            let sent = if owner == rank {
                let send = scratch(&mut send, range.len());
                self.memory
                    .buffer_to_host(self.comm, self.shard, here, send)?;
                &send[..]
            } else {
                &[][..]
            };
            let mut counts = vec![0; world];
            counts[owner] = range.len();
            let into = if rank == root {
                Some(landing.place(range.clone(), &mut recv))
            } else {
                None
            };
            self.memory
                .gather_varlen_host(self.comm, sent, &counts, into, root)?;
            if rank == root {
                landing.landed(range, &recv);
            }
        }
        if rank == root {
            landing.finish();
        }
        Ok(())
    }

    /// Sets the owned pieces of parameter `param`'s master weights from its
    /// whole `values` (a checkpoint load).
    pub fn set(&mut self, param: usize, values: &[T]) -> Result<()> {
        self.set_range(param, 0..values.len(), values)
    }

    /// Sets what this rank owns of `param[range]` in the master weights from
    /// `values`, the values of that range: a stage-3 load reads just its
    /// own pieces of a parameter. Owned pieces outside `range` are left as
    /// they are.
    pub fn set_range(&mut self, param: usize, range: Range<usize>, values: &[T]) -> Result<()> {
        if values.len() != range.len() {
            return Err(crate::Error::BufferSize {
                op: "set_masters_range",
                what: "values",
                got: values.len(),
                expected: range.len(),
            });
        }
        for copy in self
            .sharding
            .owned_copies
            .iter()
            .filter(|c| c.param == param)
        {
            let lo = copy.param_range.start.max(range.start);
            let hi = copy.param_range.end.min(range.end);
            if lo >= hi {
                continue;
            }
            self.memory.buffer_from_host(
                self.shard,
                copy.at + (lo - copy.param_range.start),
                &values[lo - range.start..hi - range.start],
            )?;
        }
        Ok(())
    }
}

/// A host replica of 16-bit (or any) parameters read and written as another
/// element type: the [`ParamStore`] of an `Engine<f32>` with master weights
/// over a model kept as `Vec<Vec<bf16>>` (tests, and adapters with host
/// replicas).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CastParams<S>(pub Vec<Vec<S>>);

impl<S: Element, T: Element> ParamStore<T> for CastParams<S> {
    fn read(&mut self, param: usize, range: Range<usize>, out: &mut [T]) -> Result<()> {
        convert_slice(&self.0[param][range], out);
        Ok(())
    }

    fn write(&mut self, param: usize, range: Range<usize>, values: &[T]) -> Result<()> {
        convert_slice(values, &mut self.0[param][range]);
        Ok(())
    }
}

/// Where [`Masters`]' pieces land on the root.
enum Landing<'s, T> {
    /// Handed to a sink one at a time, from a scratch buffer.
    Sink(&'s mut dyn FnMut(Range<usize>, &[T])),
    /// In place in the whole parameter; `next` is where the last piece
    /// ended (the gap before a piece is zeroed).
    Whole { out: &'s mut [T], next: usize },
}

impl<T: Element> Landing<'_, T> {
    /// Where the piece `range` goes: its place in the parameter, or the
    /// first `range.len()` elements of `scratch`.
    fn place<'a>(&'a mut self, range: Range<usize>, scratch: &'a mut Vec<T>) -> &'a mut [T] {
        match self {
            Landing::Sink(_) => self::scratch(scratch, range.len()),
            Landing::Whole { out, next } => {
                out[*next..range.start].fill(T::default());
                *next = range.end;
                &mut out[range]
            }
        }
    }

    /// The piece `range` arrived (into `scratch` for a sink).
    fn landed(&mut self, range: Range<usize>, scratch: &[T]) {
        if let Landing::Sink(sink) = self {
            let len = range.len();
            sink(range, &scratch[..len]);
        }
    }

    /// Zeroes what follows the last piece.
    fn finish(self) {
        if let Landing::Whole { out, next } = self {
            out[next..].fill(T::default());
        }
    }
}

/// The first `len` elements of `buf`, grown (never shrunk, never cleared)
/// to hold them: a scratch buffer reused piece after piece.
fn scratch<T: Element>(buf: &mut Vec<T>, len: usize) -> &mut [T] {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
    &mut buf[..len]
}
