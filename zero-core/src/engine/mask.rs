//! Which parameters train: the flags the user sets, the mask in effect
//! across ranks, and the buckets that hold an active parameter.

use super::window::AccumulationWindow;
use super::{Layout, ShardMemory};
use crate::comm::{Communicator, ReduceOp};
use crate::partition::ParamInfo;
use crate::{Element, Error, Result};

pub(super) struct Trainability {
    /// Per parameter, the user's flag (`Engine::set_trainable`).
    pub trainable: Vec<bool>,
    /// The mask in effect, the same on every rank: what the buckets were
    /// built for (what is reduced and gathered).
    pub active: Vec<bool>,
    /// Per bucket, whether it holds an active parameter; the others are
    /// neither reduced nor gathered.
    pub bucket_active: Vec<bool>,
}

impl Trainability {
    pub fn new(trainable: Vec<bool>) -> Self {
        Self {
            active: trainable.clone(),
            bucket_active: Vec::new(),
            trainable,
        }
    }

    /// Puts in effect the OR across the ranks of `comm` of the `local`
    /// flags (one all-reduce), and rebuilds the buckets of `layout` if the
    /// mask changed.
    pub fn agree<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        &mut self,
        memory: &mut M,
        comm: &C,
        (params, layout): (&[ParamInfo], &Layout),
        local: &[bool],
    ) -> Result<()> {
        let active = mask_over(memory, comm, params, local)?;
        if active != self.active {
            tracing::debug!("trainable mask changed; rebuilding buckets");
            self.active = active;
            self.rebuild_buckets(layout);
        }
        Ok(())
    }

    /// Which parameters train in the step that closes `window`. Checked: the same answer on every rank, from one
    /// all-reduce (a gradient on any rank counts: the reduced gradient
    /// holds it), and the buckets rebuilt if the mask changed. Unchecked:
    /// the flags decide what is reduced and gathered (the same collectives
    /// on every rank), and a parameter with no gradient is still left
    /// untouched, which is exact when every rank leaves out the same
    /// parameters (as the same model on every rank does).
    pub fn for_step<T: Element, C: Communicator, M: ShardMemory<T, C>>(
        &mut self,
        checked: bool,
        window: &AccumulationWindow,
        (memory, comm): (&mut M, &C),
        model: (&[ParamInfo], &Layout),
    ) -> Result<Vec<bool>> {
        if !checked {
            return Ok(window.with_gradient(&self.active));
        }
        self.agree(memory, comm, model, &window.with_gradient(&self.trainable))?;
        Ok(self.active.clone())
    }

    /// Per parameter, whether it trains in a step that runs beside backward
    /// (the interleaved schedule), before that step's mask is agreed:
    /// checked (`checked`), the user's flags, which the step then agrees
    /// on; unchecked, the mask in effect.
    pub fn beside_backward(&self, checked: bool) -> &[bool] {
        if checked {
            &self.trainable
        } else {
            &self.active
        }
    }

    /// Marks the buckets of `layout` that hold at least one active
    /// parameter.
    pub fn rebuild_buckets(&mut self, layout: &Layout) {
        self.bucket_active = (0..layout.buckets.len())
            .map(|k| layout.runs_of(k).iter().any(|run| self.active[run.param]))
            .collect();
    }
}

/// Checks that every rank marks the same parameters (one all-reduce of
/// the mask and its negation).
pub(super) fn check_same_mask<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
    comm: &C,
    params: &[ParamInfo],
    mask: &[bool],
) -> Result<()> {
    let n = mask.len();
    let mut agreed: Vec<f32> = mask.iter().map(|&m| f32::from(u8::from(m))).collect();
    agreed.extend(mask.iter().map(|&m| -f32::from(u8::from(m))));
    memory.all_reduce_host(comm, &mut agreed[..], ReduceOp::Max)?;
    let differs = (0..n).find(|&i| agreed[i] != -agreed[n + i]);
    match differs {
        None => Ok(()),
        Some(i) => Err(Error::Config(format!(
            "stage 3: the ranks disagree on whether {:?} is sharded (gathered on use by a \
             ZeRO-aware layer on some ranks only); every rank must build the same model",
            params[i].name
        ))),
    }
}

/// ORs a per-parameter mask across the ranks of `comm` (one `f32` per
/// parameter); a frozen parameter stays out.
pub(super) fn mask_over<T: Element, C: Communicator, M: ShardMemory<T, C>>(
    memory: &mut M,
    comm: &C,
    params: &[ParamInfo],
    local: &[bool],
) -> Result<Vec<bool>> {
    let mut mask: Vec<f32> = local.iter().map(|&b| f32::from(u8::from(b))).collect();
    memory.all_reduce_host(comm, &mut mask[..], ReduceOp::Max)?;
    Ok(mask
        .iter()
        .zip(params)
        .map(|(&m, p)| m > 0.5 && p.trainable)
        .collect())
}
