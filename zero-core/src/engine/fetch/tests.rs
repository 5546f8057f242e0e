//! The fetcher's tests: prefetch, budgets and passes over host memory and
//! over a memory that queues its gathers as a device does.

use super::*;
use crate::Result;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};

/// `count` units of `len` elements over one rank: unit `u`'s bucket is
/// shard range `u*len..(u+1)*len`, one parameter per unit.
fn build<G: GatherMemory<f32>>(
    count: usize,
    len: usize,
    budgets: (usize, usize),
    threaded: bool,
    memory: (G::Shard, G),
) -> Arc<Fetcher<f32, G>> {
    build_lens(&vec![len; count], budgets, threaded, memory)
}

/// Units of `lens` elements over one rank, one after the other in the
/// shard, one parameter per unit.
fn build_lens<G: GatherMemory<f32>>(
    lens: &[usize],
    budgets: (usize, usize),
    threaded: bool,
    (shard, gathers): (G::Shard, G),
) -> Arc<Fetcher<f32, G>> {
    let mut start = 0;
    let units = lens
        .iter()
        .map(|&len| {
            start += len;
            Unit {
                buckets: vec![UnitBucket {
                    shard: start - len..start,
                    at: 0..len,
                }],
                len,
            }
        })
        .collect();
    let place = lens
        .iter()
        .enumerate()
        .map(|(u, &len)| {
            vec![Span {
                unit: u,
                at: 0..len,
                values: 0..len,
            }]
        })
        .collect();
    Fetcher::new(units, place, shard, gathers, budgets, threaded).unwrap()
}

fn shard_values(count: usize, len: usize) -> Vec<f32> {
    (0..count * len).map(|i| i as f32).collect()
}

fn fetcher(count: usize, len: usize, budgets: (usize, usize), threaded: bool) -> Arc<Fetcher<f32>> {
    // One rank: the all-gather is a copy.
    let gather: Arc<GatherFn<f32>> = Arc::new(|send: &[f32], recv: &mut [f32]| {
        recv.copy_from_slice(send);
        Ok(())
    });
    let memory = (shard_values(count, len), HostGathers::new(gather));
    build(count, len, budgets, threaded, memory)
}

/// Gathers queued as a device queues them on a stream: `gather` only
/// records the copies, and `ready` (the compute stream waiting on the
/// gather) runs them, reading the shard as it is then. A step that
/// changed the shard before a gather was ordered would show in the
/// gathered values.
#[derive(Default)]
struct Queued {
    pending: AtomicUsize,
}

type SharedShard = Arc<RwLock<Vec<f32>>>;

/// A copy queued from a shard (which it does not keep alive, as a device's
/// queued copy does not keep its source) into a buffer's range.
type QueuedCopy = (Weak<RwLock<Vec<f32>>>, Range<usize>, Range<usize>);

struct QueuedBuffer {
    values: Vec<f32>,
    copies: Vec<QueuedCopy>,
}

impl GatherMemory<f32> for Arc<Queued> {
    type Shard = SharedShard;
    type Buffer = QueuedBuffer;

    fn queues(&self) -> bool {
        true
    }

    fn shard_len(shard: &SharedShard) -> usize {
        shard.read().unwrap().len()
    }

    fn capacity(buffer: &QueuedBuffer) -> usize {
        buffer.values.len()
    }

    fn buffer(&self, reuse: Option<QueuedBuffer>, len: usize) -> Result<QueuedBuffer> {
        Ok(match reuse {
            Some(buffer) if buffer.values.len() >= len => buffer,
            _ => QueuedBuffer {
                values: vec![f32::NAN; len],
                copies: Vec::new(),
            },
        })
    }

    fn gather(
        &self,
        shard: &SharedShard,
        buckets: &[UnitBucket],
        buffer: &mut QueuedBuffer,
    ) -> Result<()> {
        assert!(
            buffer.copies.is_empty(),
            "a buffer refilled before it was ready"
        );
        for bucket in buckets {
            let copy = (
                Arc::downgrade(shard),
                bucket.shard.clone(),
                bucket.at.clone(),
            );
            buffer.copies.push(copy);
        }
        self.pending.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn ready(&self, buffer: &mut QueuedBuffer) -> Result<()> {
        if buffer.copies.is_empty() {
            return Ok(());
        }
        for (shard, from, to) in buffer.copies.drain(..) {
            let shard = shard
                .upgrade()
                .expect("a queued gather ran after its shard was freed");
            buffer.values[to].copy_from_slice(&shard.read().unwrap()[from]);
        }
        self.pending.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }

    fn read(&self, buffer: &QueuedBuffer, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(&buffer.values[range]);
        Ok(())
    }
}

fn queued(
    count: usize,
    len: usize,
    budgets: (usize, usize),
) -> (Arc<Fetcher<f32, Arc<Queued>>>, Arc<Queued>) {
    let memory = Arc::new(Queued::default());
    let shard = Arc::new(RwLock::new(shard_values(count, len)));
    let f = build(count, len, budgets, true, (shard, memory.clone()));
    (f, memory)
}

#[test]
fn queued_gathers_prefetch_from_the_caller_s_thread_and_are_ready_before_use() {
    let (f, memory) = queued(6, 10, (80, 120));
    assert!(
        !f.threaded() && f.overlaps(),
        "no thread, and gathers run ahead"
    );
    let order = [0, 1, 2, 3, 4, 5];
    f.seed(&order, &[]);
    for &u in &order {
        let g = f.acquire(u, 0).unwrap();
        let want: Vec<f32> = (u * 10..(u + 1) * 10).map(|i| i as f32).collect();
        assert_eq!(&g.buffer().values[..10], &want[..], "unit {u}");
        f.release(g);
    }
    let stats = f.stats();
    assert_eq!((stats.hits, stats.misses), (6, 0), "{stats:?}");
    assert!(stats.peak_live_bytes <= 120, "{stats:?}");
    assert_eq!(
        f.gather_full(3).unwrap(),
        (30..40).map(|i| i as f32).collect::<Vec<_>>()
    );
    f.end_pass().unwrap();
    assert_eq!(memory.pending.load(Ordering::SeqCst), 0);
}

/// A queued fetcher whose first unit was used and whose upcoming units
/// were issued ahead and are still queued.
fn queued_ahead() -> (Arc<Fetcher<f32, Arc<Queued>>>, Arc<Queued>) {
    let (f, memory) = queued(6, 10, (80, 1000));
    f.seed(&[0, 1, 2, 3, 4, 5], &[]);
    let g = f.acquire(0, 0).unwrap();
    f.release(g);
    assert!(
        memory.pending.load(Ordering::SeqCst) > 0,
        "the upcoming units ran ahead"
    );
    (f, memory)
}

/// Gathers issued ahead and never taken are ordered before the shard
/// goes to a step: one still queued would read the stepped shard.
#[test]
fn queued_gathers_no_pass_took_are_ready_before_the_shard_is_taken() {
    let (f, memory) = queued_ahead();
    f.end_pass().unwrap();
    let shard = f.take_shard().unwrap();
    assert_eq!(memory.pending.load(Ordering::SeqCst), 0);
    // The step changes the shard; the next pass gathers the new values.
    shard.write().unwrap().iter_mut().for_each(|v| *v += 1000.0);
    f.put_shard(shard);
    let g = f.acquire(1, 0).unwrap();
    assert_eq!(g.buffer().values[0], 1010.0);
    f.release(g);
}

/// A fetcher dropped with gathers queued ahead (an optimizer dropped right
/// after a step, a rank failing mid-forward) orders them before its shard
/// goes: a device would otherwise copy from freed memory.
#[test]
fn dropping_the_fetcher_orders_its_queued_gathers_before_the_shard_goes() {
    let (f, memory) = queued_ahead();
    // The fetcher holds the only handle on the shard.
    drop(f);
    assert_eq!(memory.pending.load(Ordering::SeqCst), 0);
}

fn use_units(f: &Fetcher<f32>, order: &[usize], len: usize) {
    for &u in order {
        let g = f.acquire(u, 0).unwrap();
        let want: Vec<f32> = (u * len..(u + 1) * len).map(|i| i as f32).collect();
        let at = g.whole().expect("one piece");
        assert_eq!(&g.buffer().as_wide().unwrap()[at], &want[..], "unit {u}");
        f.release(g);
    }
}

#[test]
fn a_replayed_pass_is_all_hits_within_the_budgets() {
    // 40-byte units; two may be ahead, three alive.
    let f = fetcher(6, 10, (80, 120), true);
    let order = [0, 1, 2, 3, 4, 5];
    f.seed(&order, &[]);
    use_units(&f, &order, 10);
    let stats = f.stats();
    assert_eq!((stats.hits, stats.misses), (6, 0), "{stats:?}");
    assert!(stats.peak_live_bytes <= 120, "{stats:?}");
    assert!(stats.peak_live_bytes >= 80, "prefetch ran ahead: {stats:?}");
    assert_eq!(stats.gathers, vec![1; 6]);
}

#[test]
fn the_backward_s_first_gathers_run_during_the_end_of_the_forward() {
    // Two units may be ahead. Once the forward has requested its whole
    // trace, the backward's first two go ahead and are kept.
    let f = fetcher(4, 10, (80, 1000), true);
    f.seed(&[0, 1, 2, 3], &[3, 2, 1, 0]);
    for _ in 0..2 {
        use_units(&f, &[0, 1, 2, 3], 10);
        f.begin_backward(&[]).unwrap();
        use_units(&f, &[3, 2, 1, 0], 10);
        f.end_pass().unwrap();
        f.resume();
    }
    let stats = f.stats();
    assert_eq!(stats.early, 2 * 2, "{stats:?}");
    assert_eq!((stats.hits, stats.misses), (16, 0), "{stats:?}");
    assert_eq!(stats.retraces, 0, "{stats:?}");
    // An evaluation forward after a complete one restarts the upcoming units
    // (the backward's early gathers are let go) and is all hits but
    // its first unit.
    use_units(&f, &[0, 1, 2, 3], 10);
    use_units(&f, &[0, 1, 2, 3], 10);
    f.begin_backward(&[]).unwrap();
    use_units(&f, &[3, 2, 1, 0], 10);
    let stats = f.stats();
    assert_eq!(stats.misses, 1, "{stats:?}");
    assert_eq!(stats.early, 2 * 2 + 2, "{stats:?}");
    assert_eq!(stats.retraces, 0, "{stats:?}");
}

#[test]
fn without_a_gather_thread_each_use_gathers_when_asked() {
    let f = fetcher(6, 10, (80, 120), false);
    let order = [0, 1, 2, 3, 4, 5];
    f.seed(&order, &[]);
    use_units(&f, &order, 10);
    let stats = f.stats();
    assert_eq!((stats.hits, stats.misses), (0, 6), "{stats:?}");
    assert_eq!(stats.peak_live_bytes, 40, "one layer at a time");
}

#[test]
fn off_plan_requests_are_gathered_alone_and_a_new_pass_replays() {
    let f = fetcher(4, 10, (40, 80), true);
    f.seed(&[0, 1, 2, 3], &[]);
    // Unit 3 before its turn: a miss, gathered alone; the rest follow.
    use_units(&f, &[3, 0, 1, 2], 10);
    assert_eq!(f.stats().misses, 1);
    // The trace's first unit again without a backward: a new forward
    // (evaluation passes). The first replays the pass just recorded
    // (3, 0, 1, 2: misses); the next ones the order they used, where
    // only each pass's first unit, not prefetched across passes, misses.
    use_units(&f, &[0, 1, 2, 3], 10);
    let before = f.stats().misses;
    for _ in 0..3 {
        use_units(&f, &[0, 1, 2, 3], 10);
    }
    let stats = f.stats();
    assert_eq!(stats.misses - before, 3, "{stats:?}");
    assert!(stats.retraces >= 2, "{stats:?}");
    assert!(stats.peak_live_bytes <= 80, "{stats:?}");
}

/// Lending a piece builds no list of spans: every lend of a piece
/// shares the one worked out when the fetcher was made.
#[test]
fn lent_pieces_share_their_spans() {
    let f = fetcher(3, 10, (80, 120), false);
    let first = f.acquire(1, 0).unwrap();
    assert_eq!(first.spans(), &[(0..10, 0..10)]);
    assert_eq!(f.piece_spans(1, 0), Some(first.spans()));
    assert_eq!(f.piece_spans(1, 1), None);
    let spans = first.spans().as_ptr();
    f.release(first);
    let again = f.acquire(1, 0).unwrap();
    assert_eq!(again.spans().as_ptr(), spans);
    f.release(again);
}

/// A buffer lent on and lost (the framework could not give it back)
/// no longer counts as alive: the budget is free for the next gathers.
#[test]
fn a_lost_buffer_frees_its_bytes_of_the_budget() {
    // Room for one 40-byte unit at a time.
    let f = fetcher(3, 10, (40, 40), false);
    for u in 0..3 {
        let g = f.acquire(u, 0).unwrap();
        let unit = g.unit();
        assert_eq!(f.buffer_bytes(), 40, "unit {u} alive");
        drop(g.into_buffer());
        f.forget_buffer(unit);
        assert_eq!(f.buffer_bytes(), 0, "unit {u} forgotten");
    }
    // Without forgetting, the next gather would exceed the budget.
    let g = f.acquire(0, 0).unwrap();
    drop(g.into_buffer());
    let e = f.acquire(1, 0).unwrap_err();
    assert!(e.to_string().contains("max_live_bytes"), "{e}");
}

#[test]
fn a_layer_above_max_live_bytes_is_a_configuration_error() {
    let units = vec![Unit {
        buckets: vec![],
        len: 100,
    }];
    let gather: Arc<GatherFn<f32>> = Arc::new(|_: &[f32], _: &mut [f32]| Ok(()));
    let e = Fetcher::<f32>::new(
        units,
        vec![vec![Span {
            unit: 0,
            at: 0..100,
            values: 0..100,
        }]],
        vec![],
        HostGathers::new(gather),
        (0, 200),
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("max_live_bytes"), "{e}");
}

/// The device's default budgets keep stage 3's gathers within the goal for
/// the bench's GPT (12 x 768 in f32 on four ranks: at most 5 bytes per
/// parameter and rank, the shard's 4 and 1 for what is gathered): a
/// replayed pass over its large weights is all prefetched, with at most a
/// byte per parameter gathered at once. Its 12 x 4 weights are the units;
/// the gathers move nothing (the figure is the fetcher's bookkeeping).
#[test]
fn the_device_budgets_prefetch_a_gpt_pass_within_a_byte_per_parameter() {
    let d = 768;
    let lens: Vec<usize> = (0..12)
        .flat_map(|_| [d * 3 * d, d * d, d * 4 * d, 4 * d * d])
        .collect();
    let params: usize = lens.iter().sum();
    let gather: Arc<GatherFn<f32>> = Arc::new(|_: &[f32], _: &mut [f32]| Ok(()));
    let budgets = crate::engine::GatherBudgets::DEVICE;
    let f = build_lens(
        &lens,
        (budgets.prefetch_bytes, budgets.max_live_bytes),
        true,
        (vec![0.0; params], HostGathers::new(gather)),
    );
    let order: Vec<usize> = (0..lens.len()).collect();
    f.seed(&order, &[]);
    for &u in &order {
        let g = f.acquire(u, 0).unwrap();
        f.release(g);
    }
    let stats = f.stats();
    assert_eq!(
        (stats.hits, stats.misses),
        (lens.len() as u64, 0),
        "{stats:?}"
    );
    assert!(
        stats.peak_live_bytes <= params,
        "{} gathered bytes for {params} parameters",
        stats.peak_live_bytes
    );
}
