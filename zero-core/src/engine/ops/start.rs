//! One starting model on every rank: at construction an adapter whose
//! ranks built their own values (Candle's random initializers draw anew on
//! each rank) makes them rank 0's, as PyTorch's DDP broadcasts its module
//! at construction, or checks that they already are
//! ([`EngineConfig::starting_model`]).

use crate::comm::{Communicator, ReduceOp};
use crate::engine::{Engine, ParamCopy, ShardMemory, StartingModel};
use crate::partition::ParamInfo;
use crate::{Element, Error, Result};
use fnv::FnvHasher;
use std::hash::Hasher;

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Makes every rank's parameters (all of them, frozen ones included)
    /// rank 0's values, or checks that they are, as
    /// [`EngineConfig::starting_model`] says. Call it once, right after
    /// construction and before the first step, on parameters each rank
    /// built itself. A collective: every rank calls it.
    ///
    /// [`EngineConfig::starting_model`]: crate::engine::EngineConfig::starting_model
    pub fn sync_starting_model(&mut self, params: &mut M::Params<'_>) -> Result<()> {
        // Every rank of the world, whichever shard group it is in.
        let comm = crate::engine::groups::world(&self.comm, &self.groups);
        if comm.world_size() == 1 {
            return Ok(());
        }
        let memory = &mut self.memory;
        match self.config.starting_model {
            StartingModel::Broadcast => {
                let chunk = (self.config.bucket_bytes / std::mem::size_of::<T>()).max(1);
                broadcast_params(comm, memory, &self.params, chunk, params)
            }
            StartingModel::Verify => verify_params(comm, memory, &self.params, params),
        }
    }
}

/// Rank 0's parameters onto every rank, `chunk` elements at a time.
///
/// The memories have no broadcast, so it is an all-reduce (sum) in which
/// every other rank contributes `-0.0`: `x + (-0.0)` is `x`, bit for bit
/// (signed zeros and NaNs included), in any order of addition.
fn broadcast_params<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    comm: &C,
    memory: &mut M,
    infos: &[ParamInfo],
    chunk: usize,
    params: &mut M::Params<'_>,
) -> Result<()> {
    let sizes: Vec<usize> = infos.iter().map(ParamInfo::numel).collect();
    let chunks = copy_chunks(&sizes, chunk);
    let Some(longest) = chunks.iter().map(|c| copied_len(c)).max() else {
        return Ok(());
    };
    let root = comm.rank() == 0;
    let mut buffer = memory.alloc_zeroed(longest)?;
    for copies in &chunks {
        let range = 0..copied_len(copies);
        if root {
            memory.read_params(params, copies, &mut buffer)?;
        } else {
            memory.zero(&mut buffer, range.clone())?;
            memory.scale(&mut buffer, std::slice::from_ref(&range), -1.0)?;
        }
        memory.all_reduce(comm, &mut buffer, range, ReduceOp::Sum)?;
        if !root {
            memory.write_params(params, copies, &buffer)?;
        }
    }
    Ok(())
}

/// Hashes each parameter's values on every rank and compares them with
/// rank 0's; an error names the first parameter that differs.
fn verify_params<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    comm: &C,
    memory: &mut M,
    infos: &[ParamInfo],
    params: &mut M::Params<'_>,
) -> Result<()> {
    let mut hashes = Vec::with_capacity(infos.len() * 8);
    let mut values = Vec::new();
    for (i, info) in infos.iter().enumerate() {
        values.clear();
        values.resize(info.numel(), T::default());
        memory.read_param_host(comm, params, i, &mut values)?;
        let bytes: &[u8] = bytemuck::cast_slice(&values);
        let mut hasher = FnvHasher::default();
        hasher.write(bytes);
        hashes.extend_from_slice(&hasher.finish().to_le_bytes());
    }
    let all = comm.all_gather_bytes(&hashes)?;
    let Some(root) = all.first() else {
        return Ok(());
    };
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        let differs = root
            .chunks(8)
            .zip(theirs.chunks(8))
            .position(|(a, b)| a != b);
        if let Some(i) = differs {
            return Err(Error::StartingModelDiffers {
                param: infos[i].name.clone(),
                rank,
            });
        }
    }
    Ok(())
}

/// The parameters (of `sizes` elements, in order) cut into runs of at most
/// `chunk` elements, as copies into a buffer starting at 0; a parameter
/// may straddle two runs.
fn copy_chunks(sizes: &[usize], chunk: usize) -> Vec<Vec<ParamCopy>> {
    let mut chunks = Vec::new();
    let mut current: Vec<ParamCopy> = Vec::new();
    let mut filled = 0;
    for (param, &numel) in sizes.iter().enumerate() {
        let mut start = 0;
        while start < numel {
            let take = (numel - start).min(chunk - filled);
            current.push(ParamCopy {
                param,
                param_range: start..start + take,
                at: filled,
            });
            start += take;
            filled += take;
            if filled == chunk {
                chunks.push(std::mem::take(&mut current));
                filled = 0;
            }
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// The elements a run of copies moves.
fn copied_len(copies: &[ParamCopy]) -> usize {
    copies.iter().map(|c| c.param_range.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of every parameter is copied once, in order, runs
    /// never exceed the chunk, and a parameter longer than a chunk is
    /// split across runs.
    #[test]
    fn chunks_cover_every_element_once_within_the_chunk_size() {
        let sizes = [3, 0, 10, 1, 4];
        for chunk in [1, 2, 4, 7, 18, 100] {
            let chunks = copy_chunks(&sizes, chunk);
            let mut next = vec![0; sizes.len()];
            for copies in &chunks {
                assert!(copied_len(copies) <= chunk && copied_len(copies) > 0);
                let mut at = 0;
                for c in copies {
                    assert_eq!(c.at, at, "contiguous in the buffer");
                    assert_eq!(c.param_range.start, next[c.param], "in order");
                    next[c.param] = c.param_range.end;
                    at += c.param_range.len();
                }
            }
            assert_eq!(next, sizes, "chunk {chunk}");
        }
        assert!(copy_chunks(&[0, 0], 4).is_empty());
    }
}
