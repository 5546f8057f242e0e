//! Every rank must run the same model, configuration and graph: the
//! checks that say so at construction and at each backward pass, and the
//! stable hashes they compare.

use super::shard_memory::ShardMemory;
use super::EngineConfig;
use crate::comm::{Communicator, ReduceOp};
use crate::optim::FunctionalOptimizer;
use crate::partition::ParamInfo;
use crate::{Element, Error, Result};
use fnv::FnvHasher;
use std::hash::Hasher;

/// The order hash as exactly representable `f64` pieces, then their
/// negatives: one `Max` all-reduce tells whether every rank agrees.
pub(super) fn order_fingerprint(expected: &[(usize, usize)]) -> [f64; 8] {
    let words = expected
        .iter()
        .flat_map(|&(param, calls)| [param as u64, calls as u64]);
    hash_fingerprint(fnv1a(words))
}

/// FNV-1a of a sequence of words: stable across processes and builds
/// (std's hasher is not), so ranks can compare what they computed.
pub(super) fn fnv1a(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut hasher = FnvHasher::default();
    for word in words {
        hasher.write(&word.to_le_bytes());
    }
    hasher.finish()
}

/// A 64-bit hash as 4 exact 16-bit pieces and their negations: one Max
/// all-reduce then tells whether every rank has the same hash.
fn hash_fingerprint(hash: u64) -> [f64; 8] {
    let mut out = [0.0; 8];
    for i in 0..4 {
        let piece = ((hash >> (16 * i)) & 0xffff) as f64;
        out[i] = piece;
        out[i + 4] = -piece;
    }
    out
}
/// Checks, with one all-reduce, that every rank predicts the same gradient
/// order (`expected`) and, at stage 3, that its forward gathered the same
/// layers (`forward`, the fetcher's hash of them; 0 elsewhere).
pub(super) fn check_same_graph<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
    comm: &C,
    expected: &[(usize, usize)],
    forward: u64,
) -> Result<()> {
    let mut mine = [0.0; 16];
    mine[..8].copy_from_slice(&order_fingerprint(expected));
    mine[8..].copy_from_slice(&hash_fingerprint(forward));
    let mut agreed = mine;
    memory.all_reduce_host(comm, &mut agreed[..], ReduceOp::Max)?;
    let differs =
        |at: usize| (at..at + 4).any(|i| agreed[i] != mine[i] || -agreed[i + 4] != mine[i]);
    if differs(0) {
        return Err(Error::Config(format!(
            "rank {} predicts another gradient order than some other rank ({} hooked \
             gradient(s) here): the ranks' backward graphs differ. Every rank must run the \
             same model on the same kind of input (no rank-dependent branches or layers)",
            comm.rank(),
            expected.len()
        )));
    }
    if differs(8) {
        return Err(Error::Config(format!(
            "rank {}'s forward pass used other sharded layers (or used them in another \
             order) than some other rank's: the ranks' models differ. Every rank must \
             run the same model on the same kind of input (no rank-dependent branches \
             or layers)",
            comm.rank()
        )));
    }
    Ok(())
}

/// All-gathers a description of every rank's parameters, configuration and
/// optimizer and names the first difference with another rank. A
/// collective; engines run it first thing in their constructor.
///
/// `Engine::new` runs it before validating anything locally: every check
/// after it depends only on these inputs, so ranks either all fail alike or
/// all pass. A rank that failed alone would skip this collective and leave
/// its peers waiting until their timeout.
pub fn check_rank_consistency<T: Element, C: Communicator>(
    comm: &C,
    params: &[ParamInfo],
    config: &EngineConfig,
    optimizer: &dyn FunctionalOptimizer<T>,
) -> Result<()> {
    let mine = fingerprint(params, config, optimizer)?;
    let bytes = serde_json::to_vec(&mine)?;
    let all = comm.all_gather_bytes(&bytes)?;
    for (other_rank, other) in all.iter().enumerate() {
        let other: Vec<(String, String)> = serde_json::from_slice(other)?;
        if other == mine {
            continue;
        }
        let at = mine
            .iter()
            .zip(&other)
            .position(|(a, b)| a != b)
            .unwrap_or(mine.len().min(other.len()));
        let describe = |list: &[(String, String)]| match list.get(at) {
            Some((field, value)) => format!("{field} = {value}"),
            None => format!("no entry #{at} (only {} entries)", list.len()),
        };
        return Err(Error::RankMismatch {
            rank: comm.rank(),
            this: describe(&mine),
            other_rank,
            other: describe(&other),
        });
    }
    Ok(())
}

fn fingerprint<T: Element>(
    params: &[ParamInfo],
    config: &EngineConfig,
    optimizer: &dyn FunctionalOptimizer<T>,
) -> Result<Vec<(String, String)>> {
    let mut out = vec![
        ("element type".to_string(), T::DTYPE.to_string()),
        ("parameter count".to_string(), params.len().to_string()),
    ];
    for (i, p) in params.iter().enumerate() {
        out.push((
            format!("parameter #{i}"),
            format!(
                "{} {:?} {}{}",
                p.name,
                p.shape,
                p.dtype,
                if p.trainable { "" } else { " frozen" }
            ),
        ));
    }
    // Every field of the configuration, so that a field added later is
    // checked too (parameter groups below, one entry each).
    let serde_json::Value::Object(fields) = serde_json::to_value(config)? else {
        return Err(Error::State(
            "internal: the engine configuration does not serialize to an object".into(),
        ));
    };
    for (field, value) in fields {
        if field != "param_groups" {
            out.push((field, value.to_string()));
        }
    }
    out.push(("optimizer".into(), optimizer.kind().to_string()));
    for g in 0..optimizer.num_groups() {
        out.push((
            format!("optimizer group {g}"),
            serde_json::Value::Object(optimizer.hyperparams(g)).to_string(),
        ));
    }
    for (k, spec) in config.param_groups.iter().enumerate() {
        out.push((
            format!("parameter group {}", k + 1),
            format!(
                "{:?} {}",
                spec.params,
                serde_json::Value::Object(spec.hyperparams.clone())
            ),
        ));
    }
    Ok(out)
}
