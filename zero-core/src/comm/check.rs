//! The argument checks every backend makes before a collective.

use crate::{Error, Result};

/// `Ok` when `root` is a rank of a group of `world_size`, else
/// [`Error::InvalidRank`]: the root check every backend makes.
pub fn check_root(op: &'static str, root: usize, world_size: usize) -> Result<()> {
    if root < world_size {
        Ok(())
    } else {
        Err(Error::InvalidRank {
            op,
            rank: root,
            world_size,
        })
    }
}

/// `Ok` with the total when `counts` holds one count per rank of a group of
/// `world_size` and rank `rank`'s is `send_len`, else
/// [`Error::BufferSize`]: the check of a variable-length gather.
pub fn check_counts(
    op: &'static str,
    counts: &[usize],
    send_len: usize,
    (rank, world_size): (usize, usize),
) -> Result<usize> {
    check_len(op, "counts", counts.len(), world_size)?;
    check_len(op, "send", send_len, counts[rank])?;
    Ok(counts.iter().sum())
}

/// `Ok` when buffer `what` of collective `op` has the `expected` number of
/// elements, else [`Error::BufferSize`]: the length check every backend
/// makes before a collective.
pub fn check_len(op: &'static str, what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(Error::BufferSize {
            op,
            what,
            got,
            expected,
        })
    }
}
