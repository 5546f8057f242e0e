//! Which optimizer launches one step on CUDA memory makes.
//!
//! The fused optimizer kernels step a contiguous shard range with one set of
//! hyperparameters and one step count (Adam's bias corrections). Owned
//! pieces usually share both, so a run of touching buckets stepped together
//! (stage 3's whole shard after backward: a thousand buckets of a 1B model)
//! is one launch; a piece that skips a step (no gradient), sits in another
//! parameter group, or a bucket left out splits it. Pure logic, tested
//! without a GPU.

use std::ops::Range;

/// One owned piece as the planner sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceSlot {
    /// The piece's range in this rank's shard.
    pub range: Range<usize>,
    /// Its parameter group.
    pub group: usize,
    /// The step it is about to take (1 for its first).
    pub step: u64,
    /// Whether it trains this step.
    pub active: bool,
}

/// One optimizer launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The shard range stepped (may include alignment padding between
    /// merged pieces: zero parameters with zero gradients stay zero under
    /// every built-in optimizer).
    pub range: Range<usize>,
    /// The parameter group whose hyperparameters apply.
    pub group: usize,
    /// The step count of every piece in the launch.
    pub step: u64,
}

/// The launches of one step: for each bucket (a shard range) in order, the
/// active pieces cut at the bucket's bounds, merged while neighbours share
/// group and step and no inactive piece lies between them, across the
/// bound of two buckets that touch. Buckets marked inactive in
/// `bucket_active` get no launch and end the segment before them.
pub fn plan_segments(
    buckets: &[Range<usize>],
    bucket_active: &[bool],
    pieces: &[PieceSlot],
) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    // Whether the last segment may still grow: false after an inactive
    // piece or bucket, and where a bucket does not start at the end of the
    // one before (what lies between is not this step's).
    let mut open = false;
    let mut previous_end = None;
    for (bucket, &active) in buckets.iter().zip(bucket_active) {
        open &= active && previous_end == Some(bucket.start);
        previous_end = Some(bucket.end);
        if !active {
            continue;
        }
        for piece in pieces {
            let start = piece.range.start.max(bucket.start);
            let end = piece.range.end.min(bucket.end);
            if start >= end {
                continue;
            }
            if !piece.active {
                open = false;
                continue;
            }
            match out.last_mut() {
                Some(last) if open && last.group == piece.group && last.step == piece.step => {
                    last.range.end = end;
                }
                _ => out.push(Segment {
                    range: start..end,
                    group: piece.group,
                    step: piece.step,
                }),
            }
            open = true;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(range: Range<usize>, group: usize, step: u64, active: bool) -> PieceSlot {
        PieceSlot {
            range,
            group,
            step,
            active,
        }
    }

    fn seg(range: Range<usize>, group: usize, step: u64) -> Segment {
        Segment { range, group, step }
    }

    #[test]
    fn a_bucket_of_alike_pieces_is_one_launch_across_padding() {
        let pieces = [slot(0..10, 0, 3, true), slot(32..50, 0, 3, true)];
        let buckets = std::slice::from_ref(&(0..64));
        let got = plan_segments(buckets, &[true], &pieces);
        assert_eq!(got, vec![seg(0..50, 0, 3)]);
    }

    #[test]
    fn touching_buckets_of_alike_pieces_are_one_launch() {
        let pieces = [slot(0..40, 0, 1, true), slot(40..64, 0, 1, true)];
        let got = plan_segments(&[0..32, 32..64], &[true, true], &pieces);
        assert_eq!(got, vec![seg(0..64, 0, 1)]);
        // A piece of another group or step at the bound still splits.
        let pieces = [slot(0..32, 0, 1, true), slot(32..64, 1, 1, true)];
        let got = plan_segments(&[0..32, 32..64], &[true, true], &pieces);
        assert_eq!(got, vec![seg(0..32, 0, 1), seg(32..64, 1, 1)]);
    }

    #[test]
    fn a_bucket_left_out_or_a_gap_between_buckets_splits_the_launch() {
        let pieces = [slot(0..96, 0, 1, true)];
        let got = plan_segments(&[0..32, 32..64, 64..96], &[true, false, true], &pieces);
        assert_eq!(got, vec![seg(0..32, 0, 1), seg(64..96, 0, 1)]);
        // Buckets that do not touch: what lies between is not stepped.
        let got = plan_segments(&[0..32, 40..96], &[true, true], &pieces);
        assert_eq!(got, vec![seg(0..32, 0, 1), seg(40..96, 0, 1)]);
    }

    #[test]
    fn group_step_or_an_inactive_piece_splits_a_bucket() {
        let pieces = [
            slot(0..8, 0, 2, true),
            slot(8..16, 1, 2, true),
            slot(16..24, 1, 1, true),
            slot(24..32, 1, 1, false),
            slot(32..40, 1, 1, true),
        ];
        let buckets = std::slice::from_ref(&(0..40));
        let got = plan_segments(buckets, &[true], &pieces);
        assert_eq!(
            got,
            vec![
                seg(0..8, 0, 2),
                seg(8..16, 1, 2),
                seg(16..24, 1, 1),
                seg(32..40, 1, 1)
            ]
        );
    }

    #[test]
    fn inactive_buckets_get_no_launch() {
        let pieces = [slot(0..16, 0, 1, true), slot(16..32, 0, 1, true)];
        let got = plan_segments(&[0..16, 16..32], &[false, true], &pieces);
        assert_eq!(got, vec![seg(16..32, 0, 1)]);
    }

    #[test]
    fn segments_cover_exactly_the_active_elements_plus_interior_padding() {
        // A property over many layouts: every element of an active piece in
        // an active bucket is in exactly one segment, no other piece element
        // is in any.
        for seed in 0u64..200 {
            let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let mut next = |m: u64| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) % m
            };
            let mut pieces = Vec::new();
            let mut at = 0usize;
            for _ in 0..(1 + next(8)) {
                at += next(3) as usize; // padding
                let len = 1 + next(20) as usize;
                pieces.push(slot(
                    at..at + len,
                    next(2) as usize,
                    1 + next(2),
                    next(4) != 0,
                ));
                at += len;
            }
            let mut buckets = Vec::new();
            let mut b = 0;
            while b < at {
                let len = 1 + next(30) as usize;
                buckets.push(b..(b + len).min(at));
                b += len;
            }
            // Some buckets left out (stepped early, or frozen).
            let active: Vec<bool> = buckets.iter().map(|_| next(5) != 0).collect();
            let bucket_active =
                |i: usize| active[buckets.iter().position(|b| b.contains(&i)).unwrap()];
            let segments = plan_segments(&buckets, &active, &pieces);
            let mut covered = vec![0u32; at];
            for s in &segments {
                for c in &mut covered[s.range.clone()] {
                    *c += 1;
                }
            }
            for p in &pieces {
                for i in p.range.clone() {
                    let want = u32::from(p.active && bucket_active(i));
                    assert_eq!(covered[i], want, "seed {seed}, element {i} of {p:?}");
                }
                if p.active {
                    for s in segments
                        .iter()
                        .filter(|s| s.range.start < p.range.end && p.range.start < s.range.end)
                    {
                        assert_eq!((s.group, s.step), (p.group, p.step), "seed {seed}");
                    }
                }
            }
        }
    }
}
