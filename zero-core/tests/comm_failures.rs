//! Failure injection on the thread backend: a rank that panics, returns
//! early, never arrives, or calls something else makes every healthy rank
//! fail with the right error, fast, naming the operation, sequence number
//! and ranks. Never a hang, never a panic on the healthy ranks.

use std::time::{Duration, Instant};
use zero_core::prelude::*;

/// Deadline for the fail-fast cases: they must fail far sooner.
const LONG: Duration = Duration::from_secs(60);

fn healthy_error<R: std::fmt::Debug>(r: &Result<Result<R>>) -> &Error {
    match r {
        Ok(Err(e)) => e,
        other => panic!("expected a collective error, got {other:?}"),
    }
}

#[test]
fn a_rank_that_panics_fails_its_peers_fast() {
    let t = Instant::now();
    let results = ThreadGroup::new(4)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            let mut x = vec![1.0f32; 100];
            for step in 0..10 {
                if comm.rank() == 2 && step == 3 {
                    panic!("injected failure at step {step}");
                }
                comm.all_reduce(&mut x, ReduceOp::Sum)?;
            }
            Ok(())
        });
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    for (rank, r) in results.iter().enumerate() {
        if rank == 2 {
            match r {
                Err(Error::RankPanicked { rank: 2, message }) => {
                    assert!(message.contains("injected failure at step 3"))
                }
                other => panic!("rank 2: {other:?}"),
            }
            continue;
        }
        let e = healthy_error(r);
        assert!(
            matches!(e, Error::PeerFailed { op: "all_reduce", seq: 3, failed, .. } if failed == &[2]),
            "rank {rank}: {e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("all_reduce #3") && msg.contains("[2]") && msg.contains("panicked"),
            "{msg}"
        );
    }
}

#[test]
fn later_collectives_fail_too_after_a_peer_left() {
    let results = ThreadGroup::new(3)
        .with_timeout(LONG)
        .run(|comm| -> Result<Vec<String>> {
            if comm.rank() == 0 {
                return Ok(Vec::new()); // returns early: drops its communicator
            }
            let mut errors = Vec::new();
            for _ in 0..3 {
                match comm.barrier() {
                    Ok(()) => errors.push("ok".to_string()),
                    Err(e) => errors.push(e.to_string()),
                }
            }
            Ok(errors)
        });
    for (rank, r) in results.into_iter().enumerate().skip(1) {
        let errors = r.unwrap().unwrap();
        for (seq, e) in errors.iter().enumerate() {
            assert!(
                e.contains(&format!("barrier #{seq}"))
                    && e.contains("[0]")
                    && e.contains("dropped"),
                "rank {rank}: {e}"
            );
        }
    }
}

#[test]
fn a_rank_that_skips_a_collective() {
    let t = Instant::now();
    let results = ThreadGroup::new(4)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            let send = vec![1.0f64; 8];
            let mut recv = vec![0.0f64; 32];
            comm.all_gather(&send, &mut recv)?;
            if comm.rank() == 1 {
                return Ok(()); // skips the next collective and leaves
            }
            comm.all_gather(&send, &mut recv)
        });
    assert!(t.elapsed() < Duration::from_secs(5));
    for (rank, r) in results.iter().enumerate() {
        if rank == 1 {
            assert!(matches!(r, Ok(Ok(()))));
            continue;
        }
        let e = healthy_error(r);
        assert!(
            matches!(e, Error::PeerFailed { op: "all_gather", seq: 1, failed, .. } if failed == &[1]),
            "rank {rank}: {e:?}"
        );
    }
}

#[test]
fn a_rank_that_never_arrives_times_out() {
    // Generous next to the first collective's cost, so a loaded machine
    // cannot time out the healthy all-reduce.
    let deadline = Duration::from_millis(1000);
    let results = ThreadGroup::new(4)
        .with_timeout(deadline)
        .run(|comm| -> Result<Duration> {
            let mut x = vec![comm.rank() as f32; 1 << 16];
            comm.all_reduce(&mut x, ReduceOp::Sum)?;
            if comm.rank() == 3 {
                std::thread::sleep(Duration::from_millis(2500));
            }
            let t = Instant::now();
            // The peers' buffers are freed when they return; the late rank
            // must find the collective aborted and never read them.
            let mut y = vec![comm.rank() as f32; 1 << 16];
            comm.reduce_scatter(&x, &mut y[..1 << 14], ReduceOp::Sum)
                .map(|()| t.elapsed())
        });
    for (rank, r) in results.iter().enumerate() {
        let e = healthy_error(r);
        assert!(
            matches!(e, Error::CollectiveTimeout { op: "reduce_scatter", seq: 1, missing, .. } if missing == &[3]),
            "rank {rank}: {e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("reduce_scatter #1") && msg.contains("[3]"),
            "{msg}"
        );
    }
}

#[test]
fn timeout_is_reported_within_the_deadline() {
    let deadline = Duration::from_millis(200);
    let results = ThreadGroup::new(2)
        .with_timeout(deadline)
        .run(|comm| -> Result<Duration> {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(2000));
                return Ok(Duration::ZERO);
            }
            let t = Instant::now();
            let e = comm.barrier().unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::CollectiveTimeout {
                        op: "barrier",
                        seq: 0,
                        ..
                    }
                ),
                "{e}"
            );
            Ok(t.elapsed())
        });
    let waited = results[0].as_ref().unwrap().as_ref().unwrap();
    // The variant already proves it fired before rank 1 left (at 2 s,
    // which would be `PeerFailed`); the bound only guards against a hang.
    assert!(
        *waited >= deadline && *waited < Duration::from_millis(1900),
        "{waited:?}"
    );
}

#[test]
fn mismatched_sizes() {
    let results = ThreadGroup::new(3)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            let len = if comm.rank() == 1 { 10 } else { 12 };
            let mut x = vec![0.0f32; len];
            comm.all_reduce(&mut x, ReduceOp::Sum)
        });
    for (rank, r) in results.iter().enumerate() {
        let e = healthy_error(r);
        let Error::CollectiveMismatch {
            seq: 0,
            rank: me,
            this,
            other_rank,
            other,
        } = e
        else {
            panic!("rank {rank}: {e:?}");
        };
        assert_eq!(*me, rank);
        let (mine, theirs) = if rank == 1 {
            ("10", "12")
        } else {
            ("12", "10")
        };
        assert!(
            this.contains(&format!("all_reduce(f32, sum, {mine} elements)")),
            "{this}"
        );
        assert!(other.contains(&format!("{theirs} elements")), "{other}");
        assert_eq!(*other_rank == 1, rank != 1);
    }
}

#[test]
fn mismatched_operations_and_dtypes() {
    let results = ThreadGroup::new(2)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            if comm.rank() == 0 {
                let mut recv = vec![0.0f32; 8];
                comm.all_gather(&[1.0f32; 4], &mut recv)
            } else {
                let mut x = vec![0.0f32; 4];
                comm.all_reduce(&mut x, ReduceOp::Max)
            }
        });
    for (rank, r) in results.iter().enumerate() {
        let msg = healthy_error(r).to_string();
        assert!(
            msg.contains("#0")
                && msg.contains("all_gather(f32, 4 elements)")
                && msg.contains("all_reduce(f32, max, 4 elements)"),
            "rank {rank}: {msg}"
        );
    }
    let results = ThreadGroup::new(2)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            if comm.rank() == 0 {
                comm.broadcast(&mut [0.0f64; 4], 0)
            } else {
                comm.broadcast(&mut [0.0f32; 4], 0)
            }
        });
    for r in &results {
        let msg = healthy_error(r).to_string();
        assert!(
            msg.contains("broadcast(f64") && msg.contains("broadcast(f32"),
            "{msg}"
        );
    }
}

#[test]
fn invalid_arguments_on_one_rank_fail_its_peers_fast() {
    let t = Instant::now();
    let results = ThreadGroup::new(3)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            let root = if comm.rank() == 2 { 7 } else { 0 };
            comm.broadcast(&mut [0.0f32; 4], root)
        });
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(matches!(
        healthy_error(&results[2]),
        Error::InvalidRank { rank: 7, .. }
    ));
    for r in &results[..2] {
        let e = healthy_error(r);
        assert!(
            matches!(e, Error::PeerFailed { op: "broadcast", seq: 0, failed, .. } if failed == &[2]),
            "{e:?}"
        );
    }
}

#[test]
fn a_pending_async_collective_fails_when_a_peer_panics() {
    let t = Instant::now();
    let results = ThreadGroup::new(3)
        .with_timeout(LONG)
        .run(|comm| -> Result<()> {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                panic!("injected");
            }
            let mut x = vec![1.0f32; 1000];
            let mut work = comm.all_reduce_async(&mut x, ReduceOp::Sum)?;
            assert!(!work.test()?, "rank 1 has not arrived yet");
            work.wait()
        });
    assert!(t.elapsed() < Duration::from_secs(5));
    for r in [&results[0], &results[2]] {
        let e = healthy_error(r);
        assert!(
            matches!(e, Error::PeerFailed { op: "all_reduce_async", seq: 0, failed, .. } if failed == &[1]),
            "{e:?}"
        );
    }
}
