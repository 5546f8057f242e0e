//! Re-partitioning in the order backward produces gradients.

use crate::comm::Communicator;
use crate::engine::{Engine, ShardMemory, Stage};
use crate::partition::Interleaved;
use crate::{Element, Result};

impl<T: Element, C: Communicator, M: ShardMemory<T, C>> Engine<T, C, M> {
    /// Re-partitions in the order of `expected` (then the other parameters,
    /// by name) if nothing depends on the current partition yet: no step
    /// taken, no state, nothing accumulated. Later changes of the order keep
    /// the partition (overlap may suffer; results do not).
    pub(in crate::engine) fn plan_in_order(&mut self, expected: &[(usize, usize)]) -> Result<()> {
        let mut order = Vec::with_capacity(self.params.len());
        let mut placed = vec![false; self.params.len()];
        // Stage 3: the parameters that may be sharded first, the persistent
        // ones after a break, so that no bucket holds both kinds.
        let persist = self.config.persist_numel;
        let small =
            |p: usize| self.config.stage == Stage::Parameters && self.params[p].numel() <= persist;
        for pass_small in [false, true] {
            for &(param, _) in expected {
                if !placed[param] && small(param) == pass_small {
                    placed[param] = true;
                    order.push(param);
                }
            }
        }
        let large = order.iter().filter(|&&p| !small(p)).count();
        order.extend((0..self.params.len()).filter(|&p| !placed[p]));
        if self.sharding.order.as_deref() == Some(&order[..]) {
            return Ok(());
        }
        let fresh = self.steps == 0
            && self.window.micro_steps == 0
            && !self.window.in_full_buffer
            && self.memory.state_bytes(self.optimizer.home()?) == 0
            // Master weights loaded from a checkpoint live in this plan's
            // shard, and stage 3's fetcher gathers by it.
            && !self.truth.fresh()
            && self.fetcher().is_none();
        if !fresh || self.config.partitioner != crate::engine::PartitionerKind::Flat {
            if self.sharding.order.is_some() {
                tracing::debug!("gradient-ready order changed; keeping the partition");
            }
            self.sharding.order = Some(order);
            return Ok(());
        }
        let world = match self.config.stage {
            Stage::Ddp => 1,
            _ => self.comm.world_size(),
        };
        // The parameters no gradient was predicted for start a bucket of
        // their own: a bucket launched on its predicted gradients then never
        // waits for, or misses, one of them.
        let predicted = placed.iter().filter(|&&p| p).count();
        let mut breaks = vec![large, predicted];
        if self.config.stage == Stage::Parameters {
            breaks.extend(crate::engine::setup::stage3_breaks::<T>(
                &self.params,
                &order[..large],
                &self.config,
            ));
        }
        let plan = Interleaved::default().partition_in_order(
            &self.params,
            &order,
            world,
            // Buckets hold `T`, not the parameters' dtype.
            crate::engine::setup::partition_bucket_bytes::<T>(
                &self.params,
                self.config.bucket_bytes,
                world,
            ),
            &breaks,
        )?;
        self.install_plan(plan, Some(order))
    }
}
