//! Property and scenario tests for the `Flat` and `Greedy` partitioners.

use proptest::prelude::*;
use zero_core::partition::{PartitionKind, PartitionPlan, ShardPiece};
use zero_core::{DType, Error, Flat, Greedy, ParamInfo, Partitioner};

/// Checks every invariant a plan promises, for either partitioner.
fn check_plan(plan: &PartitionPlan, params: &[ParamInfo], world_size: usize, alignment: usize) {
    assert_eq!(plan.world_size, world_size);
    assert_eq!(plan.params, params);
    assert_eq!(plan.shards.len(), world_size);
    assert_eq!(plan.flat_offsets.len(), params.len());
    assert_eq!(plan.shard_numel % alignment, 0, "shard_numel not aligned");

    // Every element of every trainable parameter is owned exactly once;
    // frozen parameters not at all.
    let mut owned: Vec<Vec<u32>> = params.iter().map(|p| vec![0; p.numel()]).collect();
    for (rank, shard) in plan.shards.iter().enumerate() {
        let range = plan.shard_range(rank);
        let mut last_end = range.start;
        for piece in shard {
            assert!(!piece.is_empty(), "empty piece {piece:?}");
            assert!(params[piece.param].trainable, "frozen param owns {piece:?}");
            let offset = plan.flat_offsets[piece.param].expect("trainable has offset");
            assert_eq!(piece.flat_range.start, offset + piece.param_range.start);
            assert_eq!(piece.flat_range.len(), piece.param_range.len());
            assert!(piece.param_range.end <= params[piece.param].numel());
            assert!(
                piece.flat_range.start >= last_end,
                "pieces unsorted or overlapping"
            );
            assert!(
                piece.flat_range.end <= range.end,
                "piece outside rank {rank}'s shard"
            );
            last_end = piece.flat_range.end;
            for e in piece.param_range.clone() {
                owned[piece.param][e] += 1;
            }
        }
    }
    for (i, p) in params.iter().enumerate() {
        if p.trainable {
            assert!(
                owned[i].iter().all(|&c| c == 1),
                "param {i} not owned exactly once"
            );
            let offset = plan.flat_offsets[i].expect("trainable has offset");
            assert!(offset + p.numel() <= plan.flat_numel());
        } else {
            assert_eq!(plan.flat_offsets[i], None, "frozen param {i} has an offset");
        }
    }

    // Buckets cover 0..shard_numel contiguously, aligned except the last.
    let mut next = 0;
    for (k, b) in plan.buckets.iter().enumerate() {
        assert_eq!(b.start, next);
        assert!(b.end > b.start, "empty bucket {k}");
        if k + 1 < plan.buckets.len() {
            assert_eq!(b.len() % alignment, 0);
        }
        next = b.end;
    }
    assert_eq!(next, plan.shard_numel);

    // The bucket pieces of a rank, merged back where a bucket boundary cut
    // a piece, are exactly its pieces.
    for rank in 0..world_size {
        let mut merged: Vec<ShardPiece> = Vec::new();
        for k in 0..plan.buckets.len() {
            let lo = plan.shard_range(rank).start + plan.buckets[k].start;
            let hi = plan.shard_range(rank).start + plan.buckets[k].end;
            for piece in plan.bucket_pieces(rank, k) {
                assert!(piece.flat_range.start >= lo && piece.flat_range.end <= hi);
                match merged.last_mut() {
                    Some(last)
                        if last.param == piece.param
                            && last.flat_range.end == piece.flat_range.start =>
                    {
                        last.flat_range.end = piece.flat_range.end;
                        last.param_range.end = piece.param_range.end;
                    }
                    _ => merged.push(piece),
                }
            }
        }
        assert_eq!(merged, plan.shards[rank], "bucket pieces of rank {rank}");
    }
}

fn params_strategy() -> impl Strategy<Value = Vec<ParamInfo>> {
    prop::collection::vec((0usize..200, any::<bool>(), 0u8..3), 0..30).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (n, trainable, shape_kind))| {
                let shape = match shape_kind {
                    0 => vec![n],
                    1 => vec![n, 1],
                    _ => vec![1, n, 1],
                };
                ParamInfo::new(format!("p{i:02}"), shape, DType::F32).with_trainable(trainable)
            })
            .collect()
    })
}

/// Each rank's load in elements, frozen parameters included.
fn greedy_loads(params: &[ParamInfo], world_size: usize) -> Vec<usize> {
    let ranks = Greedy::assign(params, world_size).unwrap();
    let mut loads = vec![0; world_size];
    for (p, r) in params.iter().zip(ranks) {
        loads[r] += p.numel();
    }
    loads
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn flat_plans_are_valid(
        params in params_strategy(),
        world_size in 1usize..=16,
        alignment in prop::sample::select(vec![1usize, 4, 32]),
        bucket_bytes in prop::sample::select(vec![1usize, 4, 100, 1000, usize::MAX]),
    ) {
        let plan = Flat::new(alignment).partition(&params, world_size, bucket_bytes).unwrap();
        prop_assert_eq!(plan.kind, PartitionKind::Flat);
        check_plan(&plan, &params, world_size, alignment);

        // Trainable parameters are concatenated in order.
        let mut next = 0;
        for (p, off) in params.iter().zip(&plan.flat_offsets) {
            if p.trainable {
                prop_assert_eq!(*off, Some(next));
                next += p.numel();
            }
        }
        // Minimal padding, and full ranks first: a rank owns shard_numel
        // until the data runs out.
        let total = next;
        prop_assert_eq!(plan.shard_numel, total.div_ceil(world_size).div_ceil(alignment) * alignment);
        for rank in 0..world_size {
            let expected = total.saturating_sub(rank * plan.shard_numel).min(plan.shard_numel);
            prop_assert_eq!(plan.owned_numel(rank), expected);
        }

        let again = Flat::new(alignment).partition(&params, world_size, bucket_bytes).unwrap();
        prop_assert_eq!(again, plan);
    }

    #[test]
    fn greedy_plans_are_valid(
        params in params_strategy(),
        world_size in 1usize..=16,
        alignment in prop::sample::select(vec![1usize, 4, 32]),
        bucket_bytes in prop::sample::select(vec![1usize, 4, 100, 1000, usize::MAX]),
    ) {
        let plan = Greedy::new(alignment).partition(&params, world_size, bucket_bytes).unwrap();
        prop_assert_eq!(plan.kind, PartitionKind::Greedy);
        check_plan(&plan, &params, world_size, alignment);

        // Whole parameters: no trainable parameter straddles ranks.
        for shard in &plan.shards {
            for piece in shard {
                prop_assert_eq!(piece.param_range.clone(), 0..params[piece.param].numel());
            }
        }
        // Balance, counting frozen parameters.
        let loads = greedy_loads(&params, world_size);
        let largest = params.iter().map(ParamInfo::numel).max().unwrap_or(0);
        let (min, max) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        prop_assert!(max <= min + largest, "loads {:?}, largest {}", loads, largest);
        // shard_numel is the largest trainable segment, aligned.
        let largest_segment = (0..world_size).map(|r| plan.owned_numel(r)).max().unwrap_or(0);
        prop_assert_eq!(plan.shard_numel, largest_segment.div_ceil(alignment) * alignment);

        let again = Greedy::new(alignment).partition(&params, world_size, bucket_bytes).unwrap();
        prop_assert_eq!(again, plan);
    }
}

fn reference_params(world_size: usize) -> Vec<ParamInfo> {
    (0..4 * world_size)
        .map(|i| ParamInfo::new(format!("p{i:02}"), [[9, 7, 5, 3][i % 4], 1], DType::F32))
        .collect()
}

#[test]
fn greedy_reference_scenario_gives_24_elements_per_rank() {
    let params = reference_params(4);
    for alignment in [1, 32] {
        let plan = Greedy::new(alignment)
            .partition(&params, 4, usize::MAX)
            .unwrap();
        for rank in 0..4 {
            assert_eq!(plan.owned_numel(rank), 24, "rank {rank}");
        }
        assert_eq!(plan.shard_numel, 24usize.div_ceil(alignment) * alignment);
    }
}

#[test]
fn greedy_matches_pytorch_placement() {
    // torch.distributed.optim.ZeroRedundancyOptimizer._partition_parameters
    // on sizes [9, 7, 5, 3] * 4 over 4 ranks: sorted stably by size, the four
    // 9s (inputs 0, 4, 8, 12) go to ranks 0..3, then the 7s, 5s and 3s.
    let params = reference_params(4);
    let ranks = Greedy::assign(&params, 4).unwrap();
    assert_eq!(ranks, vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
}

#[test]
fn frozen_parameters_count_in_greedy_placement() {
    // Without the frozen 10, the two trainable 6s go to ranks 0 and 1.
    let trainable = vec![
        ParamInfo::new("a", [6], DType::F32),
        ParamInfo::new("b", [6], DType::F32),
    ];
    let plan = Greedy::new(1).partition(&trainable, 2, usize::MAX).unwrap();
    assert_eq!((plan.owned_numel(0), plan.owned_numel(1)), (6, 6));

    // With it, rank 0 holds 10 frozen elements, so both 6s go to rank 1.
    let mut with_frozen = vec![ParamInfo::new("frozen", [10], DType::F32).with_trainable(false)];
    with_frozen.extend(trainable);
    let plan = Greedy::new(1)
        .partition(&with_frozen, 2, usize::MAX)
        .unwrap();
    assert_eq!(Greedy::assign(&with_frozen, 2).unwrap(), vec![0, 1, 1]);
    assert_eq!((plan.owned_numel(0), plan.owned_numel(1)), (0, 12));
    assert_eq!(plan.flat_offsets, vec![None, Some(12), Some(18)]);
    assert_eq!(plan.shard_numel, 12);
}

#[test]
fn flat_straddles_ranks() {
    let params = vec![
        ParamInfo::new("a", [5], DType::F32),
        ParamInfo::new("b", [6], DType::F32),
    ];
    let plan = Flat::new(2).partition(&params, 3, usize::MAX).unwrap();
    assert_eq!(plan.shard_numel, 4);
    assert_eq!(plan.shards[0].len(), 1);
    assert_eq!(plan.shards[1][0].param_range, 4..5);
    assert_eq!(plan.shards[1][1].param_range, 0..3);
    assert_eq!(plan.shards[2][0].param_range, 3..6);
    assert_eq!(plan.owned_numel(2), 3);
}

#[test]
fn empty_models_have_no_buckets() {
    let cases = [
        vec![],
        vec![ParamInfo::new("empty", [0, 3], DType::F32)],
        vec![ParamInfo::new("frozen", [7], DType::F32).with_trainable(false)],
    ];
    for params in cases {
        for plan in [
            Flat::default().partition(&params, 4, 1024).unwrap(),
            Greedy::default().partition(&params, 4, 1024).unwrap(),
        ] {
            assert_eq!(plan.shard_numel, 0);
            assert!(plan.buckets.is_empty());
            assert!(plan.shards.iter().all(Vec::is_empty));
        }
    }
}

#[test]
fn two_params_on_four_ranks_leave_ranks_empty() {
    let params = vec![
        ParamInfo::new("w", [3, 2], DType::F32),
        ParamInfo::new("b", [3], DType::F32),
    ];
    let plan = Greedy::new(1).partition(&params, 4, usize::MAX).unwrap();
    assert_eq!(plan.shard_numel, 6);
    assert_eq!(plan.owned_numel(2), 0);
    assert_eq!(plan.owned_numel(3), 0);
    assert_eq!(plan.buckets, vec![0..6]);
}

#[test]
fn bucket_sizes_follow_bytes_and_dtype() {
    let params = vec![ParamInfo::new("w", [1000], DType::BF16)];
    // 256 bytes of bf16 = 128 elements, a multiple of the alignment 32.
    let plan = Flat::default().partition(&params, 2, 256).unwrap();
    assert_eq!(plan.shard_numel, 512);
    assert_eq!(plan.buckets, vec![0..128, 128..256, 256..384, 384..512]);
    // 100 bytes of bf16 = 50 elements, rounded down to 32.
    let plan = Flat::default().partition(&params, 2, 100).unwrap();
    assert_eq!(plan.buckets.len(), 16);
    // Smaller than one aligned run: one alignment per bucket.
    let plan = Flat::default().partition(&params, 2, 1).unwrap();
    assert_eq!(plan.buckets[0], 0..32);
    // Larger than the shard: one bucket.
    let plan = Flat::default().partition(&params, 2, usize::MAX).unwrap();
    assert_eq!(plan.buckets, vec![0..512]);
}

#[test]
fn invalid_arguments_are_config_errors() {
    let params = vec![ParamInfo::new("w", [4], DType::F32)];
    let partitioners: [&dyn Partitioner; 4] = [
        &Flat::default(),
        &Greedy::default(),
        &Flat::new(0),
        &Greedy::new(0),
    ];
    for (i, p) in partitioners.iter().enumerate() {
        assert!(matches!(
            p.partition(&params, 0, 1024),
            Err(Error::Config(_))
        ));
        assert!(matches!(p.partition(&params, 2, 0), Err(Error::Config(_))));
        if i >= 2 {
            let err = p.partition(&params, 2, 1024).unwrap_err();
            assert!(err.to_string().contains("alignment"), "{err}");
        }
    }
    let dup = vec![
        ParamInfo::new("w", [4], DType::F32),
        ParamInfo::new("w", [4], DType::F32),
    ];
    let err = Flat::default().partition(&dup, 2, 1024).unwrap_err();
    assert!(err.to_string().contains("\"w\" appears twice"), "{err}");
    let huge = vec![ParamInfo::new("huge", [usize::MAX, 2], DType::F32)];
    assert!(matches!(
        Greedy::default().partition(&huge, 2, 1024),
        Err(Error::Config(_))
    ));
}

#[test]
fn mixed_dtypes_are_an_error_naming_the_parameters() {
    let params = vec![
        ParamInfo::new("w", [4], DType::F32),
        ParamInfo::new("b", [4], DType::BF16),
        ParamInfo::new("frozen", [4], DType::F64).with_trainable(false),
    ];
    for p in [&Flat::default() as &dyn Partitioner, &Greedy::default()] {
        let err = p.partition(&params, 2, 1024).unwrap_err().to_string();
        assert!(err.contains("f32: w") && err.contains("bf16: b"), "{err}");
        assert!(!err.contains("frozen"), "{err}");
    }
    // Frozen parameters of another dtype are fine.
    let ok: Vec<ParamInfo> = vec![params[0].clone(), params[2].clone()];
    assert!(Flat::default().partition(&ok, 2, 1024).is_ok());
}
