//! Checkpoints from the engine's side: consolidating the sharded optimizer
//! state into a [`StateDict`], loading one, and sharded save and load at any
//! world size, stage and partitioner. The engine keeps the entry points and
//! what they refuse; a save borrows what it reads (`Save`, `save.rs`), a
//! load what it writes (`Load`, `load.rs`); the files' pieces and checks
//! are the `state` module's.
//!
//! Every function here is a collective unless it says otherwise. Failures on
//! one rank are shared with the others through one small `all_gather_bytes` of
//! a status, so a rank that fails to write a file makes every rank return an
//! error naming it instead of leaving them waiting.

mod load;
mod save;

use crate::checkpoint::{Manifest, StateDict};
use crate::comm::{Communicator, ReduceOp};
use crate::engine::groups::{self, ShardGroups};
use crate::engine::state::{agree, SaveOptions, SavedCheckpoint};
use crate::engine::{Engine, ShardMemory};
use crate::{Element, Error, Result};
use load::Load;
use save::Save;
use std::path::Path;

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Gathers the full (unsharded) optimizer state on rank `to`, which
    /// gets it (`Some`); the other ranks get `None`. A collective: every
    /// rank calls it.
    ///
    /// It streams shard by shard: for each rank in order, that rank's
    /// pieces go to `to` alone (a `gather_varlen` where only the source
    /// sends), so `to` holds at most one other rank's shard besides the
    /// result. Ranks that own nothing send nothing. The result is a
    /// snapshot: later steps do not update it.
    pub fn consolidate_state_dict(&mut self, to: usize) -> Result<Option<StateDict<T>>> {
        self.finish_gathers()?;
        // With shard groups, `to`'s group gathers (each holds every piece).
        match groups::in_group(&self.comm, &self.groups, to, "consolidate_state_dict")? {
            Some(to) => Save::of(self)?.consolidate(to),
            None => Ok(None),
        }
    }

    /// Writes the full optimizer state into `dir` as one
    /// `optimizer.<tag>.safetensors` (tensors `state.<param>.<state>`, scalars as
    /// f64 tensors of shape `[]`) plus the manifest, streaming shard by
    /// shard to rank `to`, which writes each piece as it arrives (it never
    /// holds more than one shard). Read it back with [`StateDict::load`].
    /// A collective; an error on `to` is returned on every rank.
    pub fn save_consolidated(&mut self, dir: impl AsRef<Path>, to: usize) -> Result<()> {
        self.finish_gathers()?;
        let dir = dir.as_ref();
        // With shard groups, `to`'s group writes it (each holds every
        // piece), and its outcome is every rank's.
        let local = match groups::in_group(&self.comm, &self.groups, to, "save_consolidated")? {
            // (`true`: serialized, `Some(())` would read back as `None`.)
            Some(to) => Save::of(self)?
                .write_consolidated(dir, to)
                .map(|()| Some(true)),
            None => Ok(None),
        };
        if self.groups.is_none() {
            return local.map(|_| ());
        }
        let world = groups::world(&self.comm, &self.groups);
        groups::agree(world, local, dir, "save_consolidated").map(|_: bool| ())
    }

    /// Loads an unsharded optimizer state: each rank slices its pieces out
    /// of the full tensors, and every group takes the dict's
    /// hyperparameters (an optimizer built with another learning rate takes
    /// the saved one). Works at any world size, stage and partitioner. Not
    /// a collective; call it on every rank with the same dict.
    ///
    /// Errors: another optimizer kind, other parameter groups, state for a
    /// name that is not a parameter, or a tensor whose length is not the
    /// parameter's. Parameters without state in the dict keep theirs (a
    /// fresh engine has none). Sets the step counter to the dict's.
    pub fn load_state_dict(&mut self, dict: &StateDict<T>) -> Result<()> {
        self.finish_gathers()?;
        self.window.refuse_mid("load_state_dict")?;
        Load::of(self)?.state_dict(dict)
    }

    /// Saves a sharded checkpoint into `dir` (created if needed). A
    /// collective.
    ///
    /// Each rank that owns a shard writes `optim.<tag>.rank<r>.safetensors`
    /// (its pieces' state, tensors `state.<param>.<offset>.<state>`; in
    /// stage 0 only rank 0, as every rank holds everything); rank 0 writes
    /// `model.<tag>.safetensors` (the weights of the parameters of the
    /// engine's dtype, read from `weights`, under their names: Candle's
    /// `safetensors::load` and Python's `safetensors` read it) and, once
    /// every rank reports success, `manifest.json`, the commit point. The
    /// tag is `step<N>` (with a suffix if the directory's current checkpoint
    /// already uses it), so a save that fails part-way leaves the previous
    /// checkpoint of the directory loadable; files of older checkpoints are
    /// removed once the new manifest is in place.
    ///
    /// Refused inside a gradient-accumulation window (the accumulated
    /// gradients are not part of a checkpoint): finish the step first. A
    /// background save in flight ([`Engine::save_checkpoint_async`]) is
    /// completed first, and its failure returned.
    ///
    /// With shard groups ([`EngineConfig::shard_group`]) the first group
    /// writes it, as a world of one group would (every group holds the same
    /// state), and every rank returns its outcome; background saves alike.
    ///
    /// [`EngineConfig::shard_group`]: crate::engine::EngineConfig::shard_group
    pub fn save_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<Manifest> {
        self.finish_gathers()?;
        self.window.refuse_mid("save_checkpoint")?;
        // One save at a time: a background one in flight completes first.
        self.wait_checkpoint()?;
        let dir = dir.as_ref();
        let mut save = |engine: &mut Self| {
            engine.with_shard_home(|engine| Save::of(engine)?.write_sharded(dir, weights, options))
        };
        // With shard groups every group holds the same state: the first
        // writes it, and every rank returns its outcome.
        let Some(first) = self.groups.as_ref().map(ShardGroups::first) else {
            return save(self);
        };
        let local = if first {
            save(self).map(Some)
        } else {
            Ok(None)
        };
        let world = groups::world(&self.comm, &self.groups);
        groups::agree(world, local, dir, "save_checkpoint")
    }

    /// Saves a sharded checkpoint into `dir` in the background: the files
    /// of [`Engine::save_checkpoint`], bitwise, but this call only
    /// takes a snapshot of what they hold into host memory and returns; a
    /// thread of this rank writes it while training goes on. A collective.
    ///
    /// The snapshot is this rank's optimizer state and, on rank 0, the
    /// model file's data (at stage 3 and with master weights the pieces are
    /// gathered to rank 0 here, as a blocking save gathers them: this call
    /// blocks for the gathers, not for the writes). Rank 0 thus holds the
    /// whole model in host memory until its write is done; a model larger
    /// than rank 0's host memory saves with [`Engine::save_checkpoint`].
    ///
    /// At most one save is in flight: this call first completes the
    /// previous one, as [`Engine::wait_checkpoint`] does, and returns it.
    /// A save completes on the main thread, never on the writer (no
    /// collective runs there): once every rank's writer is done, the ranks
    /// agree and rank 0 writes the manifest, the commit point. Complete a
    /// save sooner with [`Engine::poll_checkpoint`] at step boundaries, and
    /// the last one with [`Engine::wait_checkpoint`] before the engine is
    /// dropped (a drop lets the files finish but writes no manifest: the
    /// save is then incomplete, and loads as nothing).
    ///
    /// Errors: a failure of the previous save's writes on any rank (that
    /// save is then abandoned without a manifest, and this one is not
    /// started: call again to start it); refused inside an accumulation
    /// window. A failure of this save's writes comes back from the call
    /// that completes it.
    pub fn save_checkpoint_async(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
        options: &SaveOptions,
    ) -> Result<Option<SavedCheckpoint>> {
        self.finish_gathers()?;
        self.window.refuse_mid("save_checkpoint_async")?;
        let previous = self.wait_checkpoint()?;
        let dir = dir.as_ref();
        // With shard groups the first group writes; the others wait for it.
        if self.groups.as_ref().is_some_and(|g| !g.first()) {
            self.background.start_elsewhere(dir);
            return Ok(previous);
        }
        self.with_shard_home(|engine| {
            let (save, background) = Save::with_background(engine)?;
            save.start_snapshot(dir, weights, options, background)
        })?;
        Ok(previous)
    }

    /// Completes the background save in flight if every rank's writer is
    /// done, and returns it; `None` if a writer is still busy or no save is
    /// in flight. A collective while a save is in flight (an all-reduce of
    /// one value; nothing otherwise): call it on every rank at the same
    /// point, e.g. once per step. Errors as [`Engine::wait_checkpoint`].
    pub fn poll_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        if !self.background.in_flight() {
            return Ok(None);
        }
        // 1 where this rank's writer is still busy; the max over ranks.
        let mut busy = [f32::from(u8::from(!self.background.written()))];
        self.all_reduce_host(&mut busy[..], ReduceOp::Max)?;
        if busy[0] > 0.0 {
            return Ok(None);
        }
        self.wait_checkpoint()
    }

    /// Waits for the background save in flight on every rank and completes
    /// it (the manifest written, on rank 0); returns it, or `None` if none
    /// was in flight. A collective while a save is in flight.
    ///
    /// Errors, on every rank: a rank's writes failed (the error names the
    /// rank and what failed) or the manifest could not be written. The save
    /// is then abandoned: its directory has no manifest, so it is never
    /// loaded, and the directory's previous checkpoint (or a
    /// [`StepCheckpoints`](crate::checkpoint::StepCheckpoints)' `latest`)
    /// is untouched.
    pub fn wait_checkpoint(&mut self) -> Result<Option<SavedCheckpoint>> {
        let world = self.groups.as_ref().map(|g| &*g.world);
        self.background.complete(&*self.comm, world)
    }

    /// Loads a sharded checkpoint saved at any world size, stage and
    /// partitioner: weights from the model file into `weights`, and this
    /// rank's optimizer state, read from just the rank files whose pieces
    /// overlap its own (each verified against its checksum). Also restores
    /// the hyperparameters of every group and the step counter. Returns the
    /// manifest ([`CheckpointInfo::user`] holds what the save stored). A
    /// collective: a failure on any rank is returned on every rank (the
    /// engine's state is then unspecified; load again).
    ///
    /// [`CheckpointInfo::user`]: crate::checkpoint::CheckpointInfo::user
    ///
    /// Errors ([`Error::Checkpoint`] naming the file): missing, truncated or
    /// corrupted files, an unknown format version, a checkpoint of another
    /// model (parameter names, shapes, dtypes) or optimizer.
    pub fn load_checkpoint(
        &mut self,
        dir: impl AsRef<Path>,
        weights: &mut M::Params<'_>,
    ) -> Result<Manifest> {
        self.window.refuse_mid("load_checkpoint")?;
        self.finish_gathers()?;
        self.wait_checkpoint()?;
        let dir = dir.as_ref();
        let local = self.with_shard_home(|engine| Load::of(engine)?.checkpoint(dir, weights));
        let (status, manifest) = match local {
            Ok(m) => (Ok(Vec::new()), Some(m)),
            Err(e) => (Err(e), None),
        };
        let loaded = agree(&*self.comm, status, dir, "load_checkpoint").and_then(|_| {
            manifest.ok_or_else(|| Error::State("load_checkpoint: internal: no manifest".into()))
        });
        if self.groups.is_none() {
            return loaded;
        }
        // Each group loaded what its ranks hold; every rank agrees.
        let world = groups::world(&self.comm, &self.groups);
        groups::agree(world, loaded.map(Some), dir, "load_checkpoint")
    }
}
