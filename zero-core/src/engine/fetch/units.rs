//! What one gather brings (a [`Unit`] of buckets) and where each
//! parameter's values lie in the gathered buffers (its [`Span`]s).

use std::ops::Range;
use std::sync::Arc;

/// One bucket of a unit: this rank's chunk in the shard, and where the
/// whole bucket goes in the unit's buffer.
#[derive(Clone, Debug)]
pub struct UnitBucket {
    /// This rank's chunk: elements of the parameter shard.
    pub shard: Range<usize>,
    /// Where every rank's chunk goes, in rank order: elements of the
    /// unit's buffer.
    pub at: Range<usize>,
}

/// Where a stretch of a parameter's values lies in a unit's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(in crate::engine) struct Span {
    pub unit: usize,
    /// Elements of the unit's buffer.
    pub at: Range<usize>,
    /// The same elements' places in the parameter (row-major).
    pub values: Range<usize>,
}

/// What one gather brings.
#[derive(Clone, Debug)]
pub(in crate::engine) struct Unit {
    pub buckets: Vec<UnitBucket>,
    /// Elements of the unit's buffer.
    pub len: usize,
}

/// (elements of a gathered buffer, their places in the parameter), in
/// order: one piece's stretches of one parameter.
pub(super) type PieceSpans = Arc<[(Range<usize>, Range<usize>)]>;

/// Per parameter, the units that hold its pieces, in order; per unit, the
/// parameters it holds pieces of.
pub(super) fn pieces_and_members(
    units: usize,
    place: &[Vec<Span>],
) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); units];
    let mut pieces: Vec<Vec<usize>> = vec![Vec::new(); place.len()];
    for (p, spans) in place.iter().enumerate() {
        for span in spans {
            if pieces[p].last() != Some(&span.unit) {
                pieces[p].push(span.unit);
                members[span.unit].push(p);
            }
        }
    }
    (pieces, members)
}

/// Per parameter and piece, the piece's stretches in its unit's buffer.
pub(super) fn spans_by_piece(pieces: &[Vec<usize>], place: &[Vec<Span>]) -> Vec<Vec<PieceSpans>> {
    pieces
        .iter()
        .zip(place)
        .map(|(units, spans)| {
            units
                .iter()
                .map(|&unit| {
                    spans
                        .iter()
                        .filter(|s| s.unit == unit)
                        .map(|s| (s.at.clone(), s.values.clone()))
                        .collect()
                })
                .collect()
        })
        .collect()
}
