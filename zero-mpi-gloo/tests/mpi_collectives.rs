//! Every collective of `MpiComm` against a sequential reference, for every
//! element type and algorithm, sizes including 0 and smaller than the world,
//! and subgroups.
//!
//! Run it under MPI (scripts/test-mpi.sh does):
//! `mpirun -n 3 --oversubscribe --allow-run-as-root target/debug/deps/mpi_collectives-*`.
//! Every rank prints its failures; the process exits non-zero on any failure
//! on any rank. Run by plain `cargo test` (no launcher) it prints why it
//! skips and passes.

fn main() {
    #[cfg(not(feature = "mpi"))]
    println!("mpi_collectives: skipped, zero-mpi-gloo was built without the `mpi` feature");
    #[cfg(feature = "mpi")]
    with_mpi::main();
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use half::{bf16, f16};
    use zero_core::{Communicator, Element, Error, ReduceOp};
    use zero_mpi_gloo::{launched_by_mpirun, Algorithm, MpiComm};

    const OPS: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
    ];

    /// Small integers in [-2, 2]: exact in every type, so sums, maxima and
    /// products are exact whatever the reduction order; only averages round.
    fn value(rank: usize, i: usize, salt: usize) -> f64 {
        ((rank * 7 + i * 3 + salt * 11) % 5) as f64 - 2.0
    }

    fn data<T: Element>(rank: usize, len: usize, salt: usize) -> Vec<T> {
        (0..len)
            .map(|i| T::from_f64(value(rank, i, salt)))
            .collect()
    }

    /// The reduction of element `i` over ranks `0..world`, in f64.
    fn reference(op: ReduceOp, world: usize, i: usize, salt: usize) -> f64 {
        let vals = (0..world).map(|r| value(r, i, salt));
        match op {
            ReduceOp::Sum => vals.sum(),
            ReduceOp::Avg => vals.sum::<f64>() / world as f64,
            ReduceOp::Max => vals.fold(f64::MIN, f64::max),
            ReduceOp::Min => vals.fold(f64::MAX, f64::min),
            ReduceOp::Product => vals.product(),
        }
    }

    /// Half a unit in the last place of the type: averages round once.
    fn tolerance<T: Element>(op: ReduceOp) -> f64 {
        if op != ReduceOp::Avg {
            return 0.0;
        }
        match T::DTYPE {
            zero_core::DType::F32 => 1e-6,
            zero_core::DType::F64 => 1e-14,
            zero_core::DType::BF16 => 8e-3,
            zero_core::DType::F16 => 1e-3,
        }
    }

    struct Checker {
        failures: Vec<String>,
        checks: usize,
    }

    impl Checker {
        fn close<T: Element>(
            &mut self,
            what: &str,
            got: &[T],
            expected: impl Fn(usize) -> f64,
            tol: f64,
        ) {
            self.checks += 1;
            for (i, g) in got.iter().enumerate() {
                let e = expected(i);
                let g = g.to_f64();
                if (g - e).abs() > tol * e.abs().max(1.0) {
                    self.failures
                        .push(format!("{what}: element {i} is {g}, expected {e}"));
                    return;
                }
            }
        }

        fn ok(&mut self, what: &str, result: zero_core::Result<()>) -> bool {
            self.checks += 1;
            match result {
                Ok(()) => true,
                Err(e) => {
                    self.failures.push(format!("{what}: {e}"));
                    false
                }
            }
        }

        fn fails(&mut self, what: &str, result: zero_core::Result<()>, want: fn(&Error) -> bool) {
            self.checks += 1;
            match result {
                Ok(()) => self
                    .failures
                    .push(format!("{what}: succeeded, expected an error")),
                Err(e) if want(&e) => {}
                Err(e) => self.failures.push(format!("{what}: wrong error {e}")),
            }
        }
    }

    fn check_type<T: Element>(c: &mut Checker, comm: &MpiComm, label: &str) {
        let (rank, w) = (comm.rank(), comm.world_size());
        let t = T::DTYPE;
        // The engine's broadcast of the starting model: a sum in which every
        // rank but 0 gives -0.0 returns rank 0's bits, signed zeros, NaN
        // and infinities included, whatever the order of addition.
        let special = [
            0.0,
            -0.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1.0e-3,
        ];
        let root: Vec<T> = (0..1001)
            .map(|i| match special.get(i) {
                Some(&v) => T::from_f64(v),
                None => T::from_f64(((i * 7919) % 1000) as f64 / 997.0 - 0.3),
            })
            .collect();
        let mut buf = match rank {
            0 => root.clone(),
            _ => vec![T::from_f64(-0.0); root.len()],
        };
        let what = format!("{label} all_reduce {t} as a broadcast from rank 0");
        if c.ok(&what, comm.all_reduce(&mut buf[..], ReduceOp::Sum)) {
            c.checks += 1;
            if bytemuck::cast_slice::<T, u8>(&buf) != bytemuck::cast_slice::<T, u8>(&root) {
                c.failures.push(format!("{what}: not rank 0's bits"));
            }
        }
        for (salt, len) in [0, 1, w.saturating_sub(1), 5, 1001, 100_003]
            .into_iter()
            .enumerate()
        {
            for op in OPS {
                let what = format!("{label} all_reduce {t} {} len {len}", op.as_str());
                let mut buf = data::<T>(rank, len, salt);
                if c.ok(&what, comm.all_reduce(&mut buf[..], op)) {
                    c.close(
                        &what,
                        &buf,
                        |i| reference(op, w, i, salt),
                        tolerance::<T>(op),
                    );
                }
                let what = format!("{label} all_reduce_async {t} {} len {len}", op.as_str());
                let mut buf = data::<T>(rank, len, salt);
                let result = comm
                    .all_reduce_async(&mut buf[..], op)
                    .and_then(|work| work.wait());
                if c.ok(&what, result) {
                    c.close(
                        &what,
                        &buf,
                        |i| reference(op, w, i, salt),
                        tolerance::<T>(op),
                    );
                }
            }
            // reduce to every root: the root gets the result, others keep theirs.
            for root in 0..w {
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                    let what = format!("{label} reduce {t} {} len {len} root {root}", op.as_str());
                    let mut buf = data::<T>(rank, len, salt);
                    if c.ok(&what, comm.reduce(&mut buf[..], op, root)) {
                        if rank == root {
                            c.close(
                                &what,
                                &buf,
                                |i| reference(op, w, i, salt),
                                tolerance::<T>(op),
                            );
                        } else {
                            c.close(&what, &buf, |i| value(rank, i, salt), 0.0);
                        }
                    }
                }
                let what = format!("{label} broadcast {t} len {len} root {root}");
                let mut buf = data::<T>(rank, len, salt);
                if c.ok(&what, comm.broadcast(&mut buf[..], root)) {
                    c.close(&what, &buf, |i| value(root, i, salt), 0.0);
                }
                let what = format!("{label} broadcast_async {t} len {len} root {root}");
                let mut buf = data::<T>(rank, len, salt);
                let result = comm
                    .broadcast_async(&mut buf[..], root)
                    .and_then(|w| w.wait());
                if c.ok(&what, result) {
                    c.close(&what, &buf, |i| value(root, i, salt), 0.0);
                }
            }
        }
        // reduce-scatter and all-gather: `n` per rank, full buffer `w * n`.
        for (salt, n) in [0usize, 1, 3, 1000, 70_001].into_iter().enumerate() {
            for op in OPS {
                let what = format!("{label} reduce_scatter {t} {} n {n}", op.as_str());
                let send = data::<T>(rank, w * n, salt);
                let mut recv = vec![T::default(); n];
                if c.ok(&what, comm.reduce_scatter(&send[..], &mut recv[..], op)) {
                    c.close(
                        &what,
                        &recv,
                        |i| reference(op, w, rank * n + i, salt),
                        tolerance::<T>(op),
                    );
                }
                let what = format!("{label} reduce_scatter_async {t} {} n {n}", op.as_str());
                let mut recv = vec![T::default(); n];
                let result = comm
                    .reduce_scatter_async(&send[..], &mut recv[..], op)
                    .and_then(|w| w.wait());
                if c.ok(&what, result) {
                    c.close(
                        &what,
                        &recv,
                        |i| reference(op, w, rank * n + i, salt),
                        tolerance::<T>(op),
                    );
                }
            }
            let what = format!("{label} all_gather {t} n {n}");
            let send = data::<T>(rank, n, salt);
            let mut recv = vec![T::default(); w * n];
            if c.ok(&what, comm.all_gather(&send[..], &mut recv[..])) {
                c.close(
                    &what,
                    &recv,
                    |i| value(i / n.max(1), i % n.max(1), salt),
                    0.0,
                );
            }
            let what = format!("{label} all_gather_async {t} n {n}");
            let mut recv = vec![T::default(); w * n];
            let result = comm
                .all_gather_async(&send[..], &mut recv[..])
                .and_then(|w| w.wait());
            if c.ok(&what, result) {
                c.close(
                    &what,
                    &recv,
                    |i| value(i / n.max(1), i % n.max(1), salt),
                    0.0,
                );
            }
        }
        // variable-length gathers: rank r sends counts[r] elements, some zero.
        for pattern in 0..3 {
            let counts: Vec<usize> = (0..w)
                .map(|r| match pattern {
                    0 => r + 1,
                    1 => usize::from(r % 2 == 1) * 700,
                    _ => usize::from(r == w - 1) * 3,
                })
                .collect();
            let offsets: Vec<usize> = counts
                .iter()
                .scan(0, |at, &n| {
                    let o = *at;
                    *at += n;
                    Some(o)
                })
                .collect();
            let total: usize = counts.iter().sum();
            let owner = |i: usize| {
                (0..w)
                    .rev()
                    .find(|&r| offsets[r] <= i && counts[r] > 0)
                    .unwrap_or(0)
            };
            let expected = |i: usize| {
                let r = owner(i);
                value(r, i - offsets[r], pattern)
            };
            let send = data::<T>(rank, counts[rank], pattern);
            let what = format!("{label} all_gather_varlen {t} counts {counts:?}");
            let mut recv = vec![T::default(); total];
            if c.ok(
                &what,
                comm.all_gather_varlen(&send[..], &counts, &mut recv[..]),
            ) {
                c.close(&what, &recv, expected, 0.0);
            }
            for root in 0..w {
                let what = format!("{label} gather_varlen {t} counts {counts:?} root {root}");
                let mut recv = vec![T::default(); total];
                let target = (rank == root).then_some(&mut recv[..]);
                if c.ok(&what, comm.gather_varlen(&send[..], &counts, target, root)) && rank == root
                {
                    c.close(&what, &recv, expected, 0.0);
                }
            }
        }
    }

    fn check_comm(c: &mut Checker, comm: &MpiComm, label: &str) {
        let (rank, w) = (comm.rank(), comm.world_size());
        c.ok(&format!("{label} barrier"), comm.barrier());
        check_type::<f32>(c, comm, label);
        check_type::<f64>(c, comm, label);
        check_type::<bf16>(c, comm, label);
        check_type::<f16>(c, comm, label);

        let what = format!("{label} all_gather_bytes");
        let mine = vec![rank as u8; rank];
        c.checks += 1;
        match comm.all_gather_bytes(&mine) {
            Ok(all) => {
                let expected: Vec<Vec<u8>> = (0..w).map(|r| vec![r as u8; r]).collect();
                if all != expected {
                    c.failures.push(format!("{what}: got {all:?}"));
                }
            }
            Err(e) => c.failures.push(format!("{what}: {e}")),
        }

        // Bad arguments are errors, not hangs (every rank makes the same mistake).
        let mut small = [0f32; 3];
        c.fails(
            &format!("{label} reduce_scatter with a short send buffer"),
            comm.reduce_scatter(&[0f32; 1][..], &mut small[..], ReduceOp::Sum),
            |e| matches!(e, Error::BufferSize { .. }),
        );
        c.fails(
            &format!("{label} broadcast from rank {w}"),
            comm.broadcast(&mut small[..], w),
            |e| matches!(e, Error::InvalidRank { .. }),
        );
    }

    /// Two communicators of the process at once, from two threads, entered
    /// in opposite orders on even and odd ranks. With `MPI_THREAD_MULTIPLE`
    /// each collective holds its own communicator's lock and both complete.
    /// Under one process-wide lock each rank would sit inside one collective
    /// waiting for a peer that waits for that lock (the short deadline
    /// would then end the job naming the collective).
    fn check_concurrent_groups(c: &mut Checker, world: &MpiComm) {
        let (rank, w) = (world.rank(), world.world_size());
        let multiple = world.threading() == mpi::environment::Threading::Multiple;
        c.checks += 1;
        if world.concurrent_groups() != multiple {
            c.failures.push(format!(
                "concurrent_groups() is {} at thread level {:?}",
                world.concurrent_groups(),
                world.threading()
            ));
        }
        if !multiple || w == 1 {
            if rank == 0 {
                println!(
                    "mpi_collectives: concurrent communicators not run (thread level {:?})",
                    world.threading()
                );
            }
            return;
        }
        let all: Vec<usize> = (0..w).collect();
        let split = || match world.split(&all) {
            Ok(Some(comm)) => comm.with_timeout(Some(std::time::Duration::from_secs(20))),
            other => world.abort(&format!("split over every rank gave {other:?}")),
        };
        let (first, second) = (split(), split());
        const LEN: usize = 1000;
        let late = std::time::Duration::from_millis(200);
        let (reduced, gathered) = std::thread::scope(|s| {
            let reduce = s.spawn(|| {
                if rank % 2 == 1 {
                    std::thread::sleep(late);
                }
                let mut buf = data::<f32>(rank, LEN, 1);
                first.all_reduce(&mut buf[..], ReduceOp::Sum).map(|()| buf)
            });
            let gather = s.spawn(|| {
                if rank % 2 == 0 {
                    std::thread::sleep(late);
                }
                let mut recv = vec![0f32; LEN * w];
                second
                    .all_gather(&data::<f32>(rank, LEN, 2)[..], &mut recv[..])
                    .map(|()| recv)
            });
            (reduce.join(), gather.join())
        });
        match reduced.expect("the all-reduce thread panicked") {
            Ok(buf) => c.close(
                "concurrent all_reduce",
                &buf,
                |i| reference(ReduceOp::Sum, w, i, 1),
                0.0,
            ),
            Err(e) => c.failures.push(format!("concurrent all_reduce: {e}")),
        }
        match gathered.expect("the all-gather thread panicked") {
            Ok(recv) => c.close(
                "concurrent all_gather",
                &recv,
                |i| value(i / LEN, i % LEN, 2),
                0.0,
            ),
            Err(e) => c.failures.push(format!("concurrent all_gather: {e}")),
        }
    }

    pub fn main() {
        if !launched_by_mpirun() {
            println!(
                "mpi_collectives: skipped, not launched by mpirun (no OMPI_COMM_WORLD_SIZE / PMI_SIZE); \
                 run scripts/test-mpi.sh"
            );
            return;
        }
        let world = match MpiComm::init() {
            Ok(comm) => comm,
            Err(e) => {
                eprintln!("mpi_collectives: cannot initialize MPI: {e}");
                std::process::exit(1);
            }
        };
        world.abort_on_panic();
        let (rank, w) = (world.rank(), world.world_size());
        let mut c = Checker {
            failures: Vec::new(),
            checks: 0,
        };
        let before = world.bytes_sent();

        for algorithm in [Algorithm::Auto, Algorithm::Native, Algorithm::Ring] {
            let all: Vec<usize> = (0..w).collect();
            let comm = match world.split(&all) {
                Ok(Some(comm)) => comm.with_algorithm(algorithm),
                other => world.abort(&format!("split over every rank gave {other:?}")),
            };
            check_comm(&mut c, &comm, &format!("{algorithm:?}"));
        }

        // Subgroups: the even ranks, and (with 3+ ranks) ranks {0, 2} as in
        // the reference scenarios; non-members get None.
        let groups: Vec<Vec<usize>> = vec![(0..w).step_by(2).collect(), vec![w - 1], vec![0, 2]];
        for ranks in groups.into_iter().filter(|g| g.iter().all(|&r| r < w)) {
            match world.split(&ranks) {
                Ok(Some(sub)) => {
                    let expected_rank = ranks.iter().position(|&r| r == rank);
                    c.checks += 1;
                    if Some(sub.rank()) != expected_rank || sub.world_size() != ranks.len() {
                        c.failures.push(format!(
                            "split {ranks:?}: rank {} of {}, expected {expected_rank:?} of {}",
                            sub.rank(),
                            sub.world_size(),
                            ranks.len()
                        ));
                    }
                    let sub = sub.with_algorithm(Algorithm::Ring);
                    check_comm(&mut c, &sub, &format!("subgroup {ranks:?}"));
                }
                Ok(None) => {
                    c.checks += 1;
                    if ranks.contains(&rank) {
                        c.failures.push(format!("split {ranks:?}: member got None"));
                    }
                }
                Err(e) => c.failures.push(format!("split {ranks:?}: {e}")),
            }
        }

        // Ranks that disagree on a split all get an error naming the mismatch.
        if w > 1 {
            let ranks: Vec<usize> = if rank == 0 { vec![0] } else { vec![0, 1] };
            c.checks += 1;
            match world.split(&ranks) {
                Err(Error::CollectiveMismatch { .. }) => {}
                other => c.failures.push(format!(
                    "mismatched split: expected an error, got {:?}",
                    other.map(|s| s.is_some())
                )),
            }
        }

        check_concurrent_groups(&mut c, &world);

        c.checks += 1;
        if w > 1 && world.bytes_sent() == before {
            c.failures.push("bytes_sent did not grow".into());
        }

        for f in &c.failures {
            eprintln!("rank {rank}: FAIL {f}");
        }
        let mut failed = [c.failures.len() as f64];
        if let Err(e) = world.all_reduce(&mut failed[..], ReduceOp::Sum) {
            world.abort(&format!("cannot sum the failures: {e}"));
        }
        if rank == 0 {
            println!(
                "mpi_collectives: {} ranks, {} checks per rank, {} failures in all",
                w, c.checks, failed[0]
            );
        }
        // Finalize MPI (drop the communicator) before choosing the exit code.
        drop(world);
        if failed[0] > 0.0 {
            std::process::exit(1);
        }
    }
}
