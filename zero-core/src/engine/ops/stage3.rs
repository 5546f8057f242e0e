//! The engine's stage-3 methods: sharding the parameters, streaming them, and
//! the shard lent out while it is the truth (see the `stage3` module for what
//! stage 3 is).

use crate::comm::{Communicator, ReduceOp};
use crate::engine::buffers::Borrower;
use crate::engine::fetch::{Fetcher, GatherMemory};
use crate::engine::mask::check_same_mask;
use crate::engine::precision::Truth;
use crate::engine::stage3::{gather_units, FetcherOf, ParamPieceSink, ShardedParams};
use crate::engine::{Engine, ShardMemory, Stage, StageState};
use crate::{Element, Error, Result};
use std::sync::Arc;

impl<T, C, M> Engine<T, C, M>
where
    T: Element,
    C: Communicator,
    M: ShardMemory<T, C>,
{
    /// Stage 3: from now on, keeps the parameters `gatherable` marks (those
    /// the framework gathers on use) that are trainable and larger than
    /// `persist_numel` only as shards, and returns the [`Fetcher`] that
    /// gathers them. `params` is the replica, read once more for the
    /// owned pieces if the shard is not current. A collective (every rank
    /// passes the same mask; a difference is an error on every rank). Call
    /// it between steps, once.
    ///
    /// After this the engine never touches the sharded parameters'
    /// replica: the framework may free it, and must get their values from
    /// the fetcher (checkpoints hold them; they are saved from the shards).
    pub fn shard_parameters(
        &mut self,
        gatherable: &[bool],
        params: &mut M::Params<'_>,
    ) -> Result<Arc<FetcherOf<T, C, M>>> {
        self.finish_gathers()?;
        let sharded = self.fetcher().is_some();
        check_shardable(
            self.config.stage,
            sharded,
            (gatherable.len(), self.params.len()),
        )?;
        self.window.refuse_mid("shard_parameters")?;
        // With master weights the shard holds them. A memory that can
        // gathers them rounded to the model's 16-bit dtype (the values the
        // write-back would give); otherwise the gathers carry the masters
        // (in `T`) and the framework rounds what it computes with.
        let persist = self.config.persist_numel;
        let mask: Vec<bool> = (self.params.iter().zip(gatherable))
            .map(|(p, &g)| g && p.trainable && p.numel() > persist)
            .collect();
        check_same_mask(&mut self.memory, &*self.comm, &self.params, &mask)?;
        // The shard must hold the current values before the replica goes
        // (a lean shard, `lean_shard`, exists only from now on). The bucket
        // buffers are let go first, so that the shard and the replica
        // meeting here do not add to what a step holds.
        let numel = self.sharding.partition.shard_numel;
        if self.buffers.param_shard.len::<T, C, M>() < numel {
            self.buffers.pool.clear();
            let shard = crate::engine::shard_memory::alloc_shard(&mut self.memory, numel)?;
            self.buffers.param_shard.put(shard);
        }
        self.refresh_param_shard(params)?;
        let world = self.comm.world_size();
        let every_rank: Vec<usize> = (0..world).collect();
        let gather_comm = self.comm.split(&every_rank)?.ok_or_else(|| {
            Error::State("internal: a split over every rank left this rank out".into())
        })?;
        let threaded = gather_comm.concurrent_groups();
        let mut gathers = self.memory.gathers(gather_comm)?;
        if let Some(dtype) = self.wire.stage3_gather {
            gathers.gather_in(dtype);
        }
        // Unset budgets are the memory's (a device gathers whole layers).
        let budgets = self.config.gather_budgets(gathers.default_budgets());
        let piece_len = budgets.gather_bytes / gathers.element_bytes();
        let (units, place) = gather_units(&self.sharding, &self.params, &mask, piece_len, world)?;
        // The shard moves to the fetcher between steps: one copy.
        let shard = self
            .buffers
            .param_shard
            .lend::<T, C, M>(Borrower::Fetcher)?;
        let fetcher = Fetcher::new(
            units,
            place,
            shard,
            gathers,
            (budgets.prefetch_bytes, budgets.max_live_bytes),
            threaded,
        )?;
        // The shard holds the sharded parameters' only copy, current.
        if mask.contains(&true) {
            self.truth = Truth::Shard { fresh: true };
        }
        // Nothing is deferred from now on (`shard_parameters` finished the
        // gathers above).
        self.stage = StageState::Parameters(ShardedParams {
            sharded: mask,
            fetcher: fetcher.clone(),
        });
        Ok(fetcher)
    }

    /// Stage 3 from the start: before any step, lays the parameters out in
    /// `order` (parameter indices, about the order backward will hand over
    /// their gradients; parameters left out follow by name) and shards as
    /// [`Engine::shard_parameters`] does, reading this rank's owned pieces
    /// from `params` (for a sharded parameter, a source that computes only
    /// what is asked: nothing reads a whole sharded parameter). A
    /// collective: every rank passes the same order and mask (a difference
    /// is an error on every rank).
    ///
    /// The first backward then keeps this layout whatever order its
    /// gradients come in (a different order costs overlap, not
    /// correctness).
    pub fn shard_from_start(
        &mut self,
        order: &[usize],
        gatherable: &[bool],
        params: &mut M::Params<'_>,
    ) -> Result<Arc<FetcherOf<T, C, M>>> {
        if self.steps > 0
            || self.window.micro_steps > 0
            || self.window.in_full_buffer
            || self.pass.is_some()
        {
            return Err(Error::State(
                "shard_from_start must come before the first step or micro-step; after one, \
                 use shard_parameters"
                    .into(),
            ));
        }
        let mut seen = vec![false; self.params.len()];
        for &p in order {
            match seen.get_mut(p) {
                Some(seen) if !*seen => *seen = true,
                Some(_) => {
                    return Err(Error::Config(format!(
                        "shard_from_start: parameter #{p} ({:?}) is listed twice in the order",
                        self.params[p].name
                    )))
                }
                None => {
                    return Err(Error::Config(format!(
                        "shard_from_start: parameter #{p} does not exist (there are {})",
                        self.params.len()
                    )))
                }
            }
        }
        let expected: Vec<(usize, usize)> = order.iter().map(|&p| (p, 1)).collect();
        let mine = crate::engine::consistency::order_fingerprint(&expected);
        let mut agreed = mine;
        self.memory
            .all_reduce_host(&self.comm, &mut agreed[..], ReduceOp::Max)?;
        if agreed != mine {
            return Err(Error::Config(format!(
                "stage 3: rank {} builds its layers in another order than some other rank \
                 (the layout of the shards follows it); every rank must build the same model",
                self.comm.rank()
            )));
        }
        self.plan_in_order(&expected)?;
        self.shard_parameters(gatherable, params)
    }

    /// Streams the values of each parameter of `params` from the shards to
    /// rank `root`, piece by piece in the parameter's element order:
    /// `sink(param, param_range, values)` runs on `root` for each piece
    /// (its owner sends it), so no rank holds more than one piece. Saves a
    /// stage-3 model without gathering any parameter whole. A collective:
    /// every rank passes the same parameters in the same order. A sink
    /// error does not stop the collectives (the other ranks would wait);
    /// the first is returned at the end, on `root` only. With shard groups
    /// `root`'s group streams, and the other groups return at once.
    pub fn stream_params(
        &mut self,
        params: &[usize],
        root: usize,
        sink: &mut ParamPieceSink<'_, T>,
    ) -> Result<()> {
        self.finish_gathers()?;
        self.window.refuse_mid("stream_params")?;
        // With shard groups, `root`'s group streams (each holds every
        // piece); the others have nothing to do.
        let group =
            crate::engine::groups::in_group(&self.comm, &self.groups, root, "stream_params")?;
        if let Some(&p) = params.iter().find(|&&p| p >= self.params.len()) {
            return Err(Error::Config(format!(
                "stream_params: parameter #{p} does not exist (there are {})",
                self.params.len()
            )));
        }
        let Some(root) = group else {
            return Ok(());
        };
        self.with_shard_home(|engine| {
            let mut failure = None;
            for &param in params {
                engine
                    .masters()?
                    .stream(param, root, &mut |range, values| {
                        if failure.is_none() {
                            failure = sink(param, range, values).err();
                        }
                    })?;
            }
            failure.map_or(Ok(()), Err)
        })
    }
}

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Stage 3: the fetcher of the sharded parameters, once
    /// [`Engine::shard_parameters`] made one.
    pub fn fetcher(&self) -> Option<&Arc<FetcherOf<T, C, M>>> {
        self.stage.sharded_params().map(|s| &s.fetcher)
    }

    /// Stage 3: runs `f` with the parameter shard home from the fetcher
    /// (a step, a checkpoint), and lends it back after, whatever `f`
    /// returned: between steps the fetcher holds the only copy.
    pub(in crate::engine) fn with_shard_home<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        let fetcher = match self.stage.sharded_params() {
            Some(sharded) if self.buffers.param_shard.lent_to(Borrower::Fetcher) => {
                sharded.fetcher.clone()
            }
            _ => return f(self),
        };
        // On failure the fetcher keeps the shard; nothing changed here.
        self.buffers.param_shard.put(fetcher.take_shard()?);
        let result = f(self);
        let shard = self.buffers.param_shard.lend::<T, C, M>(Borrower::Fetcher);
        fetcher.put_shard(shard?);
        result
    }
}

/// The errors of a [`Engine::shard_parameters`] call on an engine of
/// `stage`, `sharded` already, given `flags` flags for `params` parameters.
fn check_shardable(stage: Stage, sharded: bool, (flags, params): (usize, usize)) -> Result<()> {
    if stage != Stage::Parameters {
        return Err(Error::Config(format!(
            "shard_parameters needs stage 3; this engine runs stage {}",
            stage.number()
        )));
    }
    if sharded {
        return Err(Error::State(
            "shard_parameters was already called; the parameters are sharded".into(),
        ));
    }
    if flags != params {
        return Err(Error::Config(format!(
            "shard_parameters: got {flags} flags for {params} parameters; pass one per parameter"
        )));
    }
    Ok(())
}
