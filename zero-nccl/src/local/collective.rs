//! What each rank of an in-process collective does, as plain data: the
//! descriptors a rank posts to its peers ([`Posted`], one per collective of
//! a batch: [`encode_posts`]), the check that every rank called the same
//! collectives ([`check_posted`]), and the copies and reductions a rank
//! issues over its peers' buffers ([`steps`]).
//!
//! [`CudaThreadComm`](crate::CudaThreadComm) runs these steps as device
//! copies and reduction kernels; the tests below run them over host buffers
//! and compare with `zero-core`'s thread backend, so the addressing is
//! checked without a GPU.

use zero_core::{DType, Error, ReduceOp, Result};

/// A collective, with what every rank must agree on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// In place over `len` elements.
    AllReduce(ReduceOp),
    /// `world_size * len` elements in, `len` out.
    ReduceScatter(ReduceOp),
    /// `len` elements in, `world_size * len` out.
    AllGather,
    /// In place over `len` elements, from `root`.
    Broadcast { root: usize },
    /// In place over `len` elements, the result on `root` only.
    Reduce { op: ReduceOp, root: usize },
    /// Rank `r`'s `counts[r]` elements land at `sum(counts[..r])` on `root`,
    /// or on every rank when `root` is `None`.
    Gather {
        counts: Vec<usize>,
        root: Option<usize>,
    },
}

/// One rank's call of a collective: the kind, the element type and the
/// length that defines it (see [`Kind`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Call {
    pub kind: Kind,
    pub dtype: DType,
    pub len: usize,
}

impl Call {
    /// A variable-length gather ([`Kind::Gather`]) of `counts` elements of
    /// `dtype`: its length is the total, the same on every rank (each
    /// rank's own count differs, and calls must match).
    pub fn gather(dtype: DType, counts: Vec<usize>, root: Option<usize>) -> Self {
        let len = counts.iter().sum();
        Self {
            kind: Kind::Gather { counts, root },
            dtype,
            len,
        }
    }

    /// A short description for errors: `reduce_scatter(sum) of 256 x f32`.
    pub fn describe(&self) -> String {
        let name = match &self.kind {
            Kind::AllReduce(op) => format!("all_reduce({})", op.as_str()),
            Kind::ReduceScatter(op) => format!("reduce_scatter({})", op.as_str()),
            Kind::AllGather => "all_gather".to_string(),
            Kind::Broadcast { root } => format!("broadcast(root {root})"),
            Kind::Reduce { op, root } => format!("reduce({}, root {root})", op.as_str()),
            Kind::Gather {
                counts,
                root: Some(root),
            } => format!("gather_varlen(root {root}, counts {counts:?})"),
            Kind::Gather { counts, root: None } => {
                format!("all_gather_varlen(counts {counts:?})")
            }
        };
        format!("{name} of {} x {}", self.len, self.dtype)
    }
}

/// What a rank posts to its peers before a collective: its call, the device
/// addresses of its send and receive buffers, and the handle of the event
/// recorded when its inputs are ready. A rank whose own checks failed posts
/// `failed`, so that its peers fail at once instead of at the deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Posted {
    pub call: Call,
    pub send: u64,
    pub recv: u64,
    pub ready: u64,
    pub failed: bool,
}

fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Product => 4,
    }
}

fn op_of(code: u64) -> Option<ReduceOp> {
    Some(match code {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Avg,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        4 => ReduceOp::Product,
        _ => return None,
    })
}

fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
    }
}

fn dtype_of(code: u64) -> Option<DType> {
    Some(match code {
        0 => DType::F32,
        1 => DType::F64,
        2 => DType::BF16,
        3 => DType::F16,
        _ => return None,
    })
}

/// `usize::MAX` on the wire: no root (a gather to every rank).
const NO_ROOT: u64 = u64::MAX;

impl Posted {
    /// Little-endian u64 words: kind, op, root, dtype, len, send, recv,
    /// ready, failed, the number of counts, the counts.
    pub fn encode(&self) -> Vec<u8> {
        let (kind, op, root, counts): (u64, u64, u64, &[usize]) = match &self.call.kind {
            Kind::AllReduce(op) => (0, op_code(*op), 0, &[]),
            Kind::ReduceScatter(op) => (1, op_code(*op), 0, &[]),
            Kind::AllGather => (2, 0, 0, &[]),
            Kind::Broadcast { root } => (3, 0, *root as u64, &[]),
            Kind::Reduce { op, root } => (4, op_code(*op), *root as u64, &[]),
            Kind::Gather { counts, root } => (5, 0, root.map_or(NO_ROOT, |r| r as u64), counts),
        };
        let words = [
            kind,
            op,
            root,
            dtype_code(self.call.dtype),
            self.call.len as u64,
            self.send,
            self.recv,
            self.ready,
            u64::from(self.failed),
            counts.len() as u64,
        ];
        words
            .into_iter()
            .chain(counts.iter().map(|&c| c as u64))
            .flat_map(u64::to_le_bytes)
            .collect()
    }

    /// The inverse of [`Posted::encode`]; `None` for bytes it did not write.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() % 8 != 0 {
            return None;
        }
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
        let [kind, op, root, dtype, len, send, recv, ready, failed, n_counts, counts @ ..] =
            words.as_slice()
        else {
            return None;
        };
        if counts.len() as u64 != *n_counts || *failed > 1 {
            return None;
        }
        let to_usize = |w: u64| usize::try_from(w).ok();
        let kind = match kind {
            0 => Kind::AllReduce(op_of(*op)?),
            1 => Kind::ReduceScatter(op_of(*op)?),
            2 => Kind::AllGather,
            3 => Kind::Broadcast {
                root: to_usize(*root)?,
            },
            4 => Kind::Reduce {
                op: op_of(*op)?,
                root: to_usize(*root)?,
            },
            5 => Kind::Gather {
                counts: counts.iter().map(|&c| to_usize(c)).collect::<Option<_>>()?,
                root: if *root == NO_ROOT {
                    None
                } else {
                    Some(to_usize(*root)?)
                },
            },
            _ => return None,
        };
        Some(Self {
            call: Call {
                kind,
                dtype: dtype_of(*dtype)?,
                len: to_usize(*len)?,
            },
            send: *send,
            recv: *recv,
            ready: *ready,
            failed: *failed == 1,
        })
    }
}

/// A rank's posts of one protocol pass (a batch of collectives that share
/// its ready event), as it sends them: little-endian u64 words, the number
/// of posts, then each post's word count and [`Posted::encode`].
pub(crate) fn encode_posts(posts: &[Posted]) -> Vec<u8> {
    let mut bytes = (posts.len() as u64).to_le_bytes().to_vec();
    for post in posts {
        let words = post.encode();
        bytes.extend(((words.len() / 8) as u64).to_le_bytes());
        bytes.extend(words);
    }
    bytes
}

/// The inverse of [`encode_posts`]; `None` for bytes it did not write.
fn decode_posts(bytes: &[u8]) -> Option<Vec<Posted>> {
    let word = |at: usize| -> Option<usize> {
        let word = bytes.get(at..at + 8)?;
        usize::try_from(u64::from_le_bytes(word.try_into().ok()?)).ok()
    };
    let count = word(0)?;
    let mut at = 8;
    let mut posts = Vec::new();
    for _ in 0..count {
        let end = word(at)?.checked_mul(8)?.checked_add(at + 8)?;
        posts.push(Posted::decode(bytes.get(at + 8..end)?)?);
        at = end;
    }
    (at == bytes.len()).then_some(posts)
}

/// A batch's calls, for errors.
fn describe(posts: &[Posted]) -> String {
    match posts {
        [one] => one.call.describe(),
        _ => {
            let calls: Vec<String> = posts.iter().map(|post| post.call.describe()).collect();
            format!("{} collectives at once ({})", calls.len(), calls.join(", "))
        }
    }
}

/// Decodes every rank's posts (as gathered, in rank order) and checks that
/// they all called what `rank` called: a rank that failed its own checks
/// fails every peer ([`Error::PeerFailed`] naming it), different calls are
/// an [`Error::CollectiveMismatch`] naming both. Returns the posts by
/// collective of the batch, then by rank.
pub(crate) fn check_posted(
    op: &'static str,
    seq: u64,
    rank: usize,
    gathered: &[Vec<u8>],
) -> Result<Vec<Vec<Posted>>> {
    let posted: Vec<Vec<Posted>> = gathered
        .iter()
        .enumerate()
        .map(|(peer, bytes)| {
            decode_posts(bytes)
                .filter(|posts| !posts.is_empty())
                .ok_or_else(|| {
                    Error::State(format!(
                        "{op} #{seq}: rank {peer} posted {} bytes that are not a collective's \
                     descriptor (a communicator of another version?)",
                        bytes.len()
                    ))
                })
        })
        .collect::<Result<_>>()?;
    let failed: Vec<usize> = (0..posted.len())
        .filter(|&p| p != rank && posted[p].iter().any(|post| post.failed))
        .collect();
    if !failed.is_empty() {
        return Err(Error::PeerFailed {
            op,
            seq,
            failed,
            reason: "its arguments were refused (see that rank's error)".into(),
        });
    }
    let this = &posted[rank];
    let same = |other: &[Posted]| {
        other.len() == this.len() && other.iter().zip(this).all(|(o, t)| o.call == t.call)
    };
    if let Some((other_rank, other)) = posted
        .iter()
        .enumerate()
        .find(|(p, posts)| *p != rank && !posts.iter().any(|post| post.failed) && !same(posts))
    {
        return Err(Error::CollectiveMismatch {
            seq,
            rank,
            this: describe(this),
            other_rank,
            other: describe(other),
        });
    }
    let mut by_call = vec![Vec::with_capacity(posted.len()); this.len()];
    for posts in posted {
        for (i, post) in posts.into_iter().enumerate() {
            by_call[i].push(post);
        }
    }
    Ok(by_call)
}

/// Which of a rank's two buffers an address names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Send,
    Recv,
}

/// Element `offset` of rank `rank`'s `side` buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct At {
    pub rank: usize,
    pub side: Side,
    pub offset: usize,
}

impl At {
    fn new(rank: usize, side: Side, offset: usize) -> Self {
        Self { rank, side, offset }
    }

    /// The device address of this element, given every rank's post.
    pub fn address(&self, posted: &[Posted], elem_bytes: usize) -> u64 {
        let base = match self.side {
            Side::Send => posted[self.rank].send,
            Side::Recv => posted[self.rank].recv,
        };
        base + (self.offset * elem_bytes) as u64
    }
}

/// One operation a rank issues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// `len` elements from every source, combined with `op` in the order
    /// given (rank order) in a wide accumulator, written to every destination.
    Reduce {
        srcs: Vec<At>,
        dsts: Vec<At>,
        len: usize,
        op: ReduceOp,
    },
    /// `len` elements copied.
    Copy { from: At, to: At, len: usize },
}

/// Elements `[lo, hi)` of `len` that rank `rank` of `n` reduces in an
/// all-reduce (the thread backend's split).
fn chunk(len: usize, n: usize, rank: usize) -> (usize, usize) {
    (len * rank / n, len * (rank + 1) / n)
}

/// The steps rank `rank` of `n` issues for `kind` over `len` elements (the
/// calls matched, so every rank's buffers have the sizes the kind implies).
/// Every element of every destination is written by exactly one step of one
/// rank, and each reduction combines the ranks in rank order, as the thread
/// backend does: results are bitwise those of `ThreadComm`.
pub(crate) fn steps(kind: &Kind, len: usize, n: usize, rank: usize) -> Vec<Step> {
    let every = |side, offset| (0..n).map(|p| At::new(p, side, offset)).collect::<Vec<_>>();
    let nonempty = |step: &Step| match step {
        Step::Reduce { len, .. } | Step::Copy { len, .. } => *len > 0,
    };
    let all: Vec<Step> = match kind {
        Kind::AllReduce(op) => {
            let (lo, hi) = chunk(len, n, rank);
            vec![Step::Reduce {
                srcs: every(Side::Send, lo),
                dsts: every(Side::Recv, lo),
                len: hi - lo,
                op: *op,
            }]
        }
        Kind::ReduceScatter(op) => vec![Step::Reduce {
            srcs: every(Side::Send, rank * len),
            dsts: vec![At::new(rank, Side::Recv, 0)],
            len,
            op: *op,
        }],
        Kind::AllGather => (0..n)
            .map(|p| Step::Copy {
                from: At::new(p, Side::Send, 0),
                to: At::new(rank, Side::Recv, p * len),
                len,
            })
            .collect(),
        Kind::Broadcast { root } if *root != rank => vec![Step::Copy {
            from: At::new(*root, Side::Send, 0),
            to: At::new(rank, Side::Recv, 0),
            len,
        }],
        Kind::Broadcast { .. } => Vec::new(),
        Kind::Reduce { op, root } if *root == rank => vec![Step::Reduce {
            srcs: every(Side::Send, 0),
            dsts: vec![At::new(rank, Side::Recv, 0)],
            len,
            op: *op,
        }],
        Kind::Reduce { .. } => Vec::new(),
        Kind::Gather { counts, root } if root.is_none_or(|r| r == rank) => {
            let mut offset = 0;
            counts
                .iter()
                .enumerate()
                .map(|(p, &count)| {
                    let step = Step::Copy {
                        from: At::new(p, Side::Send, 0),
                        to: At::new(rank, Side::Recv, offset),
                        len: count,
                    };
                    offset += count;
                    step
                })
                .collect()
        }
        Kind::Gather { .. } => Vec::new(),
    };
    all.into_iter().filter(nonempty).collect()
}

/// One element of a [`Step::Reduce`] over f32 values in rank order, as
/// the kernel and the thread backend combine them: the tests' stand-in for
/// the device.
#[cfg(test)]
pub(super) fn combine_f32(op: ReduceOp, values: impl IntoIterator<Item = f32>) -> f32 {
    let mut values = values.into_iter();
    let mut acc = values.next().expect("a reduction has a source");
    let mut n = 1;
    for x in values {
        n += 1;
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc + x,
            ReduceOp::Product => acc * x,
            ReduceOp::Max => acc.max(x),
            ReduceOp::Min => acc.min(x),
        };
    }
    if op == ReduceOp::Avg {
        acc /= n as f32;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use zero_core::{Communicator, ThreadGroup};

    /// Every rank's send and receive buffers, as host memory standing in for
    /// the device; `At::address` indexes them by element.
    struct Ranks {
        send: Vec<Vec<f32>>,
        recv: Vec<Vec<f32>>,
    }

    impl Ranks {
        fn read(&self, at: At, i: usize) -> f32 {
            match at.side {
                Side::Send => self.send[at.rank][at.offset + i],
                Side::Recv => self.recv[at.rank][at.offset + i],
            }
        }

        fn write(&mut self, at: At, i: usize, v: f32) {
            match at.side {
                Side::Send => self.send[at.rank][at.offset + i] = v,
                Side::Recv => self.recv[at.rank][at.offset + i] = v,
            }
        }

        /// Runs every rank's steps, rank by rank (each element is written by
        /// one step only, so the order does not matter), with the reduction
        /// the kernel does: rank order, in f32. In place (`in_place`), the
        /// receive side is the send side.
        fn run(&mut self, kind: &Kind, len: usize, in_place: bool) {
            let n = self.send.len();
            for rank in 0..n {
                for step in steps(kind, len, n, rank) {
                    let fix = |at: At| At {
                        side: if in_place { Side::Send } else { at.side },
                        ..at
                    };
                    match step {
                        Step::Copy { from, to, len } => {
                            for i in 0..len {
                                let v = self.read(fix(from), i);
                                self.write(fix(to), i, v);
                            }
                        }
                        Step::Reduce {
                            srcs,
                            dsts,
                            len,
                            op,
                        } => {
                            for i in 0..len {
                                let acc =
                                    combine_f32(op, srcs.iter().map(|&s| self.read(fix(s), i)));
                                for &d in &dsts {
                                    self.write(fix(d), i, acc);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Values no two ranks share, whose sums round (so the order shows).
    fn values(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((rank * 7919 + i * 104_729) % 1013) as f32 * 0.1f32.powi((i % 3) as i32) - 50.3
            })
            .collect()
    }

    /// What the thread backend gives for the same call, per rank.
    fn thread_backend(
        n: usize,
        f: impl Fn(&zero_core::ThreadComm) -> Vec<f32> + Sync,
    ) -> Vec<Vec<f32>> {
        ThreadGroup::new(n)
            .run(|comm| f(&comm))
            .into_iter()
            .map(|r| r.expect("thread backend"))
            .collect()
    }

    #[test]
    fn every_collective_gives_the_thread_backend_s_result_bitwise() {
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Product,
        ];
        for n in 1..=5 {
            for len in [0, 1, 3, 17, 64] {
                let sends: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
                for op in ops {
                    // all_reduce, in place.
                    let mut ranks = Ranks {
                        send: sends.clone(),
                        recv: vec![Vec::new(); n],
                    };
                    ranks.run(&Kind::AllReduce(op), len, true);
                    let want = thread_backend(n, |c| {
                        let mut b = values(c.rank(), len);
                        c.all_reduce(&mut b, op).unwrap();
                        b
                    });
                    assert_eq!(ranks.send, want, "all_reduce {op:?} n={n} len={len}");

                    // reduce_scatter: n * len in, len out.
                    let big: Vec<Vec<f32>> = (0..n).map(|r| values(r, n * len)).collect();
                    let mut ranks = Ranks {
                        send: big.clone(),
                        recv: vec![vec![0.0; len]; n],
                    };
                    ranks.run(&Kind::ReduceScatter(op), len, false);
                    let want = thread_backend(n, |c| {
                        let mut out = vec![0.0; len];
                        c.reduce_scatter(&values(c.rank(), n * len), &mut out, op)
                            .unwrap();
                        out
                    });
                    assert_eq!(ranks.recv, want, "reduce_scatter {op:?} n={n} len={len}");

                    // reduce to each root, in place.
                    for root in 0..n {
                        let mut ranks = Ranks {
                            send: sends.clone(),
                            recv: vec![Vec::new(); n],
                        };
                        ranks.run(&Kind::Reduce { op, root }, len, true);
                        let want = thread_backend(n, |c| {
                            let mut b = values(c.rank(), len);
                            c.reduce(&mut b, op, root).unwrap();
                            b
                        });
                        assert_eq!(ranks.send[root], want[root], "reduce {op:?} root {root}");
                    }
                }

                // all_gather.
                let mut ranks = Ranks {
                    send: sends.clone(),
                    recv: vec![vec![0.0; n * len]; n],
                };
                ranks.run(&Kind::AllGather, len, false);
                let want = thread_backend(n, |c| {
                    let mut out = vec![0.0; n * len];
                    c.all_gather(&values(c.rank(), len), &mut out).unwrap();
                    out
                });
                assert_eq!(ranks.recv, want, "all_gather n={n} len={len}");

                // broadcast from each root, in place.
                for root in 0..n {
                    let mut ranks = Ranks {
                        send: sends.clone(),
                        recv: vec![Vec::new(); n],
                    };
                    ranks.run(&Kind::Broadcast { root }, len, true);
                    assert!(
                        ranks.send.iter().all(|b| *b == sends[root]),
                        "broadcast {root}"
                    );
                }
            }

            // Variable-length gathers, to one root and to all.
            let counts: Vec<usize> = (0..n).map(|r| (r * 3 + 1) % 4).collect();
            let total: usize = counts.iter().sum();
            let sends: Vec<Vec<f32>> = (0..n).map(|r| values(r, counts[r])).collect();
            for root in (0..n).map(Some).chain([None]) {
                let mut ranks = Ranks {
                    send: sends.clone(),
                    recv: vec![vec![0.0; total]; n],
                };
                let kind = Kind::Gather {
                    counts: counts.clone(),
                    root,
                };
                ranks.run(&kind, counts.len(), false);
                let counts = &counts;
                let want = thread_backend(n, |c| {
                    let mut out = vec![0.0; total];
                    let send = values(c.rank(), counts[c.rank()]);
                    match root {
                        Some(root) => c
                            .gather_varlen(
                                &send,
                                counts,
                                (c.rank() == root).then_some(&mut out[..]),
                                root,
                            )
                            .unwrap(),
                        None => c.all_gather_varlen(&send, counts, &mut out).unwrap(),
                    }
                    out
                });
                for r in (0..n).filter(|&r| root.is_none_or(|root| root == r)) {
                    assert_eq!(ranks.recv[r], want[r], "gather root {root:?} rank {r}");
                }
            }
        }
    }

    #[test]
    fn every_destination_element_is_written_once() {
        for n in 1..=6 {
            for len in [0, 1, 5, 12] {
                // all_reduce's chunks tile each buffer exactly once.
                let mut written = vec![vec![0u32; len]; n];
                for rank in 0..n {
                    for step in steps(&Kind::AllReduce(ReduceOp::Sum), len, n, rank) {
                        let Step::Reduce { dsts, len, .. } = step else {
                            panic!("all_reduce issues reductions only");
                        };
                        assert_eq!(dsts.len(), n);
                        for d in dsts {
                            for count in &mut written[d.rank][d.offset..d.offset + len] {
                                *count += 1;
                            }
                        }
                    }
                }
                assert!(
                    written.iter().flatten().all(|&c| c == 1),
                    "n={n} len={len}: {written:?}"
                );
            }
        }
    }

    #[test]
    fn descriptors_round_trip() {
        let calls = [
            Kind::AllReduce(ReduceOp::Avg),
            Kind::ReduceScatter(ReduceOp::Max),
            Kind::AllGather,
            Kind::Broadcast { root: 3 },
            Kind::Reduce {
                op: ReduceOp::Product,
                root: 1,
            },
            Kind::Gather {
                counts: vec![1, 0, 7],
                root: Some(2),
            },
            Kind::Gather {
                counts: vec![4],
                root: None,
            },
        ];
        for (i, kind) in calls.into_iter().enumerate() {
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let posted = Posted {
                    call: Call {
                        kind: kind.clone(),
                        dtype,
                        len: 1000 + i,
                    },
                    send: 0x7f00_0000_1000,
                    recv: 0x7f00_0000_2000 + i as u64,
                    ready: 0xdead_beef,
                    failed: i % 2 == 1,
                };
                assert_eq!(Posted::decode(&posted.encode()), Some(posted));
            }
        }
        assert_eq!(Posted::decode(&[1, 2, 3]), None);
        assert_eq!(Posted::decode(&[0; 16]), None);
    }

    fn posted(kind: Kind, len: usize, failed: bool) -> Posted {
        Posted {
            call: Call {
                kind,
                dtype: DType::F32,
                len,
            },
            send: 0,
            recv: 0,
            ready: 0,
            failed,
        }
    }

    fn post(kind: Kind, len: usize, failed: bool) -> Vec<u8> {
        encode_posts(&[posted(kind, len, failed)])
    }

    /// A batch of all-gathers of `lens`.
    fn batch(lens: &[usize]) -> Vec<u8> {
        let posts: Vec<Posted> = lens
            .iter()
            .map(|&len| posted(Kind::AllGather, len, false))
            .collect();
        encode_posts(&posts)
    }

    #[test]
    fn batches_round_trip_and_must_match_call_by_call() {
        let posts: Vec<Posted> = [(Kind::AllGather, 3), (Kind::Broadcast { root: 1 }, 9)]
            .into_iter()
            .map(|(kind, len)| posted(kind, len, false))
            .collect();
        assert_eq!(decode_posts(&encode_posts(&posts)), Some(posts.clone()));
        let mut longer = encode_posts(&posts);
        longer.push(0);
        assert_eq!(decode_posts(&longer), None);
        let by_call = check_posted("all_gather", 0, 1, &[batch(&[4, 5]), batch(&[4, 5])]).unwrap();
        assert_eq!(by_call.len(), 2);
        assert!(by_call.iter().all(|ranks| ranks.len() == 2));
        assert_eq!(by_call[1][0].call.len, 5);
        match check_posted("all_gather", 2, 0, &[batch(&[4, 5]), batch(&[4])]) {
            Err(Error::CollectiveMismatch { this, other, .. }) => {
                assert!(this.contains("2 collectives at once"), "{this}");
                assert_eq!(other, "all_gather of 4 x f32");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        let err = check_posted("all_gather", 2, 0, &[batch(&[4, 5]), batch(&[4, 6])]).unwrap_err();
        assert!(err.to_string().contains("of 6 x f32"), "{err}");
        let err = check_posted("all_gather", 2, 0, &[batch(&[4]), batch(&[])]).unwrap_err();
        assert!(err.to_string().contains("rank 1 posted 8 bytes"), "{err}");
    }

    #[test]
    fn different_calls_are_a_mismatch_naming_both_ranks() {
        let gathered = vec![
            post(Kind::AllGather, 8, false),
            post(Kind::AllGather, 8, false),
            post(Kind::AllGather, 9, false),
        ];
        match check_posted("all_gather", 4, 0, &gathered) {
            Err(Error::CollectiveMismatch {
                seq: 4,
                rank: 0,
                other_rank: 2,
                this,
                other,
            }) => {
                assert!(this.contains("all_gather of 8 x f32"), "{this}");
                assert!(other.contains("of 9 x f32"), "{other}");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        let gathered = vec![
            post(Kind::AllReduce(ReduceOp::Sum), 8, false),
            post(Kind::AllReduce(ReduceOp::Avg), 8, false),
        ];
        let err = check_posted("all_reduce", 0, 1, &gathered).unwrap_err();
        assert!(err.to_string().contains("all_reduce(sum)"), "{err}");
        let same = vec![post(Kind::AllGather, 8, false); 3];
        let by_call = check_posted("all_gather", 0, 1, &same).unwrap();
        assert_eq!((by_call.len(), by_call[0].len()), (1, 3));
    }

    #[test]
    fn a_rank_that_refused_its_arguments_fails_its_peers_naming_it() {
        let gathered = vec![
            post(Kind::AllGather, 8, false),
            post(Kind::AllGather, 3, true),
            post(Kind::AllGather, 8, false),
        ];
        for rank in [0, 2] {
            match check_posted("all_gather", 1, rank, &gathered) {
                Err(Error::PeerFailed { failed, .. }) => assert_eq!(failed, vec![1]),
                other => panic!("expected the peer's failure, got {other:?}"),
            }
        }
        let err = check_posted(
            "all_gather",
            1,
            0,
            &[vec![9; 5], post(Kind::AllGather, 8, false)],
        )
        .unwrap_err();
        assert!(err.to_string().contains("rank 0 posted 5 bytes"), "{err}");
        // One refused collective of a batch fails the peers.
        let mut refused = vec![posted(Kind::AllGather, 8, false); 2];
        refused[1].failed = true;
        let gathered = [encode_posts(&refused), batch(&[8, 8])];
        match check_posted("all_gather", 1, 1, &gathered) {
            Err(Error::PeerFailed { failed, .. }) => assert_eq!(failed, vec![0]),
            other => panic!("expected the peer's failure, got {other:?}"),
        }
    }
}
