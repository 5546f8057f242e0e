//! `MpiComm`'s asynchronous collectives: they return before the collective
//! completes (shown without timing: a rank joins late, and only after the
//! others have seen `test()` say "not done"), give the blocking forms' exact
//! bits, keep call order when interleaved with blocking collectives and
//! with each other across communicators, and a leaked `Work` breaks nothing.
//!
//! Run it under MPI, ranks on one node (scripts/test-mpi.sh does):
//! `mpirun -n 3 --oversubscribe --allow-run-as-root target/debug/deps/mpi_async-*`.
//! The late rank waits for files the others create in a shared temporary
//! directory, a rendezvous outside MPI. Every rank prints its failures; the
//! process exits non-zero on any failure on any rank. Run by plain
//! `cargo test` (no launcher) it prints why it skips and passes.

fn main() {
    #[cfg(not(feature = "mpi"))]
    println!("mpi_async: skipped, zero-mpi-gloo was built without the `mpi` feature");
    #[cfg(feature = "mpi")]
    with_mpi::main();
}

#[cfg(feature = "mpi")]
mod with_mpi {
    use half::bf16;
    use std::path::PathBuf;
    use std::time::{Duration, Instant};
    use zero_core::{Communicator, Element, Error, ReduceOp, Work};
    use zero_mpi_gloo::{launched_by_mpirun, Algorithm, MpiComm};

    /// Small integers in [-2, 2]: sums are exact in every type and order.
    fn exact(rank: usize, i: usize, salt: usize) -> f64 {
        ((rank * 7 + i * 3 + salt * 11) % 5) as f64 - 2.0
    }

    fn exact_data<T: Element>(rank: usize, len: usize, salt: usize) -> Vec<T> {
        (0..len)
            .map(|i| T::from_f64(exact(rank, i, salt)))
            .collect()
    }

    fn exact_sum(world: usize, i: usize, salt: usize) -> f64 {
        (0..world).map(|r| exact(r, i, salt)).sum()
    }

    /// Values whose sums round: only the same algorithm in the same order
    /// gives the same bits.
    fn inexact_data<T: Element>(rank: usize, len: usize, salt: usize) -> Vec<T> {
        (0..len)
            .map(|i| {
                T::from_f64(((rank * 7919 + i * 104_729 + salt * 31) % 1000) as f64 / 997.0 - 0.3)
            })
            .collect()
    }

    fn bits<T: Element>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    struct Checker {
        failures: Vec<String>,
        checks: usize,
    }

    impl Checker {
        fn check(&mut self, what: &str, ok: bool, detail: impl FnOnce() -> String) {
            self.checks += 1;
            if !ok {
                self.failures.push(format!("{what}: {}", detail()));
            }
        }

        /// The value, or the error recorded (and `None`).
        fn ok<V>(&mut self, what: &str, result: zero_core::Result<V>) -> Option<V> {
            self.checks += 1;
            match result {
                Ok(v) => Some(v),
                Err(e) => {
                    self.failures.push(format!("{what}: {e}"));
                    None
                }
            }
        }

        fn sums<T: Element>(&mut self, what: &str, got: &[T], world: usize, salt: usize) {
            let bad = got
                .iter()
                .enumerate()
                .find(|(i, g)| g.to_f64() != exact_sum(world, *i, salt));
            self.check(what, bad.is_none(), || {
                let (i, g) = bad.map(|(i, g)| (i, g.to_f64())).unwrap_or_default();
                format!("element {i} is {g}, expected {}", exact_sum(world, i, salt))
            });
        }

        fn same_bits<T: Element>(&mut self, what: &str, got: &[T], want: &[T]) {
            self.check(what, bits(got) == bits(want), || {
                "the async result differs from the blocking one".into()
            });
        }
    }

    /// A rendezvous outside MPI, for the late-joiner tests: files in a
    /// directory every rank sees (the ranks share a node). A rank that must
    /// join a collective late waits for the others' files; MPI cannot carry
    /// that signal, since every MPI call of a rank is ordered after the
    /// asynchronous collective it is waiting to join.
    struct Signals {
        dir: PathBuf,
    }

    impl Signals {
        fn new(comm: &MpiComm) -> Self {
            let mine = if comm.rank() == 0 {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                let dir = std::env::temp_dir()
                    .join(format!("zero-mpi-async-{}-{nanos}", std::process::id()));
                if let Err(e) = std::fs::create_dir_all(&dir) {
                    comm.abort(&format!("cannot create {}: {e}", dir.display()));
                }
                dir.to_string_lossy().into_owned().into_bytes()
            } else {
                Vec::new()
            };
            let all = comm.ok_or_abort(comm.all_gather_bytes(&mine));
            Self {
                dir: PathBuf::from(String::from_utf8_lossy(&all[0]).into_owned()),
            }
        }

        fn raise(&self, comm: &MpiComm, name: &str) {
            let path = self.dir.join(format!("{name}-{}", comm.rank()));
            if let Err(e) = std::fs::write(&path, b"") {
                comm.abort(&format!("cannot create {}: {e}", path.display()));
            }
        }

        /// Waits until every rank but this one has raised `name`. The others
        /// are inside a collective that waits for this rank: giving up must
        /// end the job.
        fn wait_for_others(&self, comm: &MpiComm, name: &str) {
            let start = Instant::now();
            for r in (0..comm.world_size()).filter(|&r| r != comm.rank()) {
                let path = self.dir.join(format!("{name}-{r}"));
                while !path.exists() {
                    if start.elapsed() > Duration::from_secs(60) {
                        comm.abort(&format!(
                            "waited 60 s for {}; do all ranks share a node (and its temporary \
                             directory)?",
                            path.display()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            }
        }

        fn remove(&self, comm: &MpiComm) {
            if comm.rank() == 0 {
                let _ = std::fs::remove_dir_all(&self.dir);
            }
        }
    }

    /// Waits by polling `test()`, the path a caller overlapping work takes.
    fn test_until_done(work: &mut Work<'_>) -> zero_core::Result<()> {
        while !work.test()? {
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Each asynchronous collective returns while a late rank has not joined
    /// it: the others' `test()` says "not done" (no collective can complete
    /// without the late rank's data, and it joins only after their files
    /// exist); then it completes with the right result.
    fn returns_before_completion(c: &mut Checker, comm: &MpiComm, signals: &Signals) {
        let (rank, w) = (comm.rank(), comm.world_size());
        let n = 1000;
        for (k, name) in ["all_reduce", "reduce_scatter", "all_gather", "broadcast"]
            .into_iter()
            .enumerate()
        {
            let late = (k + 1) % w;
            let what = format!("{name}_async with rank {late} late");
            if rank == late {
                signals.wait_for_others(comm, name);
            }
            let send = exact_data::<f32>(rank, w * n, k);
            let mut buf = exact_data::<f32>(rank, n, k);
            let mut recv = vec![0f32; w * n];
            let started = match name {
                "all_reduce" => comm.all_reduce_async(&mut buf[..], ReduceOp::Sum),
                "reduce_scatter" => {
                    comm.reduce_scatter_async(&send[..], &mut buf[..], ReduceOp::Sum)
                }
                "all_gather" => comm.all_gather_async(&send[..n], &mut recv[..]),
                _ => comm.broadcast_async(&mut buf[..], late),
            };
            let Some(mut work) = c.ok(&what, started) else {
                comm.abort(&format!(
                    "{what} did not start; the late rank would wait forever"
                ));
            };
            if rank != late {
                let done = c.ok(&format!("{what}: test"), work.test());
                c.check(&what, done == Some(false), || {
                    format!("test() said {done:?} before rank {late} joined; expected not done")
                });
                signals.raise(comm, name);
            }
            c.ok(
                &format!("{what}: test until done"),
                test_until_done(&mut work),
            );
            drop(work);
            match name {
                "all_reduce" => c.sums(&what, &buf, w, k),
                "reduce_scatter" => {
                    let want: Vec<f64> = (0..n).map(|i| exact_sum(w, rank * n + i, k)).collect();
                    let got: Vec<f64> = buf.iter().map(|v| v.to_f64()).collect();
                    c.check(&what, got == want, || "wrong chunk".into());
                }
                "all_gather" => {
                    let ok = (0..w * n).all(|i| recv[i].to_f64() == exact(i / n, i % n, k));
                    c.check(&what, ok, || "wrong gather".into());
                }
                _ => {
                    let ok = (0..n).all(|i| buf[i].to_f64() == exact(late, i, k));
                    c.check(&what, ok, || format!("not rank {late}'s values"));
                }
            }
        }
    }

    /// The asynchronous forms give the blocking forms' bits, for each
    /// algorithm, element type and size (ring and native paths included).
    fn equal_blocking<T: Element>(c: &mut Checker, comm: &MpiComm, label: &str) {
        let (rank, w) = (comm.rank(), comm.world_size());
        let t = T::DTYPE;
        for (salt, len) in [0usize, 1, 7, 1001, 100_003].into_iter().enumerate() {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let what = format!("{label} all_reduce_async {t} {} len {len}", op.as_str());
                let mut blocking = inexact_data::<T>(rank, len, salt);
                let mut asynchronous = blocking.clone();
                c.ok(&what, comm.all_reduce(&mut blocking[..], op));
                let result = comm
                    .all_reduce_async(&mut asynchronous[..], op)
                    .and_then(Work::wait);
                if c.ok(&what, result).is_some() {
                    c.same_bits(&what, &asynchronous, &blocking);
                }

                let what = format!("{label} reduce_scatter_async {t} {} n {len}", op.as_str());
                let send = inexact_data::<T>(rank, w * len, salt);
                let mut blocking = vec![T::default(); len];
                let mut asynchronous = vec![T::default(); len];
                c.ok(&what, comm.reduce_scatter(&send[..], &mut blocking[..], op));
                let result = comm
                    .reduce_scatter_async(&send[..], &mut asynchronous[..], op)
                    .and_then(Work::wait);
                if c.ok(&what, result).is_some() {
                    c.same_bits(&what, &asynchronous, &blocking);
                }
            }
            let what = format!("{label} all_gather_async {t} n {len}");
            let send = inexact_data::<T>(rank, len, salt);
            let mut blocking = vec![T::default(); w * len];
            let mut asynchronous = vec![T::default(); w * len];
            c.ok(&what, comm.all_gather(&send[..], &mut blocking[..]));
            let result = comm
                .all_gather_async(&send[..], &mut asynchronous[..])
                .and_then(Work::wait);
            if c.ok(&what, result).is_some() {
                c.same_bits(&what, &asynchronous, &blocking);
            }
            let root = salt % w;
            let what = format!("{label} broadcast_async {t} len {len} root {root}");
            let mut blocking = inexact_data::<T>(rank, len, salt);
            let mut asynchronous = blocking.clone();
            c.ok(&what, comm.broadcast(&mut blocking[..], root));
            let result = comm
                .broadcast_async(&mut asynchronous[..], root)
                .and_then(Work::wait);
            if c.ok(&what, result).is_some() {
                c.same_bits(&what, &asynchronous, &blocking);
            }
        }
    }

    /// Several asynchronous collectives on two communicators, a blocking one
    /// in the middle, each rank pausing for a different time between calls,
    /// waited in reverse order: every result is right, so every rank issued
    /// them in the same (call) order. Then twenty in flight at once, each
    /// with its own data.
    fn interleaved_keep_order(c: &mut Checker, world: &MpiComm, other: &MpiComm) {
        let (rank, w) = (world.rank(), world.world_size());
        let n = 3001;
        let pause = || std::thread::sleep(Duration::from_millis(3 * rank as u64));
        let mut a = exact_data::<f32>(rank, n, 1);
        let b_send = exact_data::<f64>(rank, n, 2);
        let mut b = vec![0f64; w * n];
        let mut c_blocking = exact_data::<f32>(rank, n, 3);
        let d_send = exact_data::<bf16>(rank, w * n, 4);
        let mut d = vec![bf16::ZERO; n];
        let mut e = exact_data::<f32>(rank, n, 5);
        let root = w - 1;
        {
            let work_a = world.all_reduce_async(&mut a[..], ReduceOp::Sum);
            pause();
            let work_b = other.all_gather_async(&b_send[..], &mut b[..]);
            pause();
            c.ok(
                "interleaved: blocking all_reduce between async ones",
                world.all_reduce(&mut c_blocking[..], ReduceOp::Sum),
            );
            let work_d = other.reduce_scatter_async(&d_send[..], &mut d[..], ReduceOp::Sum);
            pause();
            let work_e = world.broadcast_async(&mut e[..], root);
            for (what, work) in [
                ("interleaved: broadcast_async", work_e),
                ("interleaved: reduce_scatter_async", work_d),
                ("interleaved: all_gather_async", work_b),
                ("interleaved: all_reduce_async", work_a),
            ] {
                c.ok(what, work.and_then(Work::wait));
            }
        }
        c.sums("interleaved: all_reduce_async", &a, w, 1);
        let gathered = (0..w * n).all(|i| b[i] == exact(i / n, i % n, 2));
        c.check("interleaved: all_gather_async", gathered, || {
            "wrong gather".into()
        });
        c.sums("interleaved: blocking all_reduce", &c_blocking, w, 3);
        let scattered = (0..n).all(|i| d[i].to_f64() == exact_sum(w, rank * n + i, 4));
        c.check("interleaved: reduce_scatter_async", scattered, || {
            "wrong chunk".into()
        });
        let broadcast = (0..n).all(|i| e[i] == exact(root, i, 5) as f32);
        c.check("interleaved: broadcast_async", broadcast, || {
            "wrong values".into()
        });

        let mut bufs: Vec<Vec<f32>> = (0..20).map(|k| exact_data(rank, 100 + k, 10 + k)).collect();
        let mut works = Vec::new();
        for (k, buf) in bufs.iter_mut().enumerate() {
            let comm = if k % 2 == 0 { world } else { other };
            works.push(comm.all_reduce_async(&mut buf[..], ReduceOp::Sum));
            if k % 7 == rank % 7 {
                pause();
            }
        }
        for work in works.into_iter().rev() {
            c.ok("twenty in flight", work.and_then(Work::wait));
        }
        for (k, buf) in bufs.iter().enumerate() {
            c.sums(&format!("twenty in flight, #{k}"), buf, w, 10 + k);
        }
    }

    /// Under `MPI_THREAD_MULTIPLE` each communicator queues its
    /// asynchronous collectives on its own: two threads starting them on
    /// two communicators, in opposite orders on even and odd ranks, both
    /// complete. With one queue for the process, each rank's progress
    /// thread would sit in the collective it got first, waiting for a peer
    /// whose matching one is queued behind the other (the short deadline
    /// would then end the job naming it).
    fn async_on_two_communicators_from_two_threads(c: &mut Checker, world: &MpiComm) {
        let (rank, w) = (world.rank(), world.world_size());
        if world.threading() != mpi::environment::Threading::Multiple || w == 1 {
            if rank == 0 {
                println!(
                    "mpi_async: two threads' queues not run (thread level {:?})",
                    world.threading()
                );
            }
            return;
        }
        let all: Vec<usize> = (0..w).collect();
        let split = || match world.split(&all) {
            Ok(Some(comm)) => comm.with_timeout(Some(Duration::from_secs(20))),
            other => world.abort(&format!("split over every rank gave {other:?}")),
        };
        let (first, second) = (split(), split());
        let n = 1000;
        let late = Duration::from_millis(200);
        let (reduced, gathered) = std::thread::scope(|s| {
            let reduce = s.spawn(|| {
                if rank % 2 == 1 {
                    std::thread::sleep(late);
                }
                let mut buf = exact_data::<f32>(rank, n, 6);
                let work = first.all_reduce_async(&mut buf[..], ReduceOp::Sum);
                work.and_then(Work::wait).map(|()| buf)
            });
            let gather = s.spawn(|| {
                if rank % 2 == 0 {
                    std::thread::sleep(late);
                }
                let send = exact_data::<f32>(rank, n, 7);
                let mut recv = vec![0f32; w * n];
                let work = second.all_gather_async(&send[..], &mut recv[..]);
                work.and_then(Work::wait).map(|()| recv)
            });
            (reduce.join(), gather.join())
        });
        if let Some(buf) = c.ok(
            "two threads: all_reduce_async",
            reduced.expect("the all-reduce thread panicked"),
        ) {
            c.sums("two threads: all_reduce_async", &buf, w, 6);
        }
        if let Some(recv) = c.ok(
            "two threads: all_gather_async",
            gathered.expect("the all-gather thread panicked"),
        ) {
            let right = (0..w * n).all(|i| recv[i] == exact(i / n, i % n, 7) as f32);
            c.check("two threads: all_gather_async", right, || {
                "wrong gather".into()
            });
        }
    }

    /// A leaked `Work` (`mem::forget`), whose buffer is then freed and its
    /// memory reused while the collective is still waiting for a late rank,
    /// breaks nothing: later collectives give right results, a communicator
    /// with a leaked collective queued can be dropped, and a `Work` dropped
    /// unwaited still delivers.
    fn leaked_work(c: &mut Checker, world: &MpiComm, signals: &Signals) {
        let (rank, w) = (world.rank(), world.world_size());
        let late = w - 1;
        let n = 50_000;
        if rank == late {
            signals.wait_for_others(world, "leaked");
        }
        let mut doomed = exact_data::<f32>(rank, n, 20);
        match world.all_reduce_async(&mut doomed[..], ReduceOp::Sum) {
            Ok(work) => std::mem::forget(work),
            Err(e) => world.abort(&format!("leaked: all_reduce_async did not start: {e}")),
        }
        drop(doomed);
        // Likely the freed memory: anything MPI wrote to it would show here.
        let reused = vec![7f32; n];
        if rank != late {
            signals.raise(world, "leaked");
        }

        let mut after = exact_data::<f32>(rank, n, 21);
        c.ok(
            "leaked: blocking all_reduce after",
            world.all_reduce(&mut after[..], ReduceOp::Sum),
        );
        c.sums("leaked: blocking all_reduce after", &after, w, 21);
        c.check(
            "leaked: reused memory",
            reused.iter().all(|&v| v == 7.0),
            || "MPI wrote into memory freed after a leaked Work".into(),
        );

        let all: Vec<usize> = (0..w).collect();
        match world.split(&all) {
            Ok(Some(sub)) => {
                let mut buf = exact_data::<f32>(rank, 100, 22);
                match sub.all_reduce_async(&mut buf[..], ReduceOp::Sum) {
                    Ok(work) => std::mem::forget(work),
                    Err(e) => c.failures.push(format!("leaked on a subgroup: {e}")),
                }
                drop(buf);
                drop(sub);
            }
            other => c.failures.push(format!(
                "leaked: split over every rank gave {:?}",
                other.map(|s| s.is_some())
            )),
        }

        let mut dropped = exact_data::<f32>(rank, 100, 23);
        let work = world.all_reduce_async(&mut dropped[..], ReduceOp::Sum);
        c.ok("leaked: dropped unwaited", work.map(drop));
        c.sums("leaked: dropped unwaited", &dropped, w, 23);

        let mut last = exact_data::<f32>(rank, 100, 24);
        let result = world
            .all_reduce_async(&mut last[..], ReduceOp::Sum)
            .and_then(Work::wait);
        c.ok("leaked: async after", result);
        c.sums("leaked: async after", &last, w, 24);
    }

    /// Bad arguments are errors at the call, before anything is queued.
    fn bad_arguments(c: &mut Checker, comm: &MpiComm) {
        let w = comm.world_size();
        let mut small = [0f32; 3];
        let short = comm.reduce_scatter_async(&[0f32; 1][..], &mut small[..], ReduceOp::Sum);
        let ok = matches!(short, Err(Error::BufferSize { .. }));
        c.check("reduce_scatter_async with a short send buffer", ok, || {
            format!("{:?}", short.map(|_| ()))
        });
        let mut gathered = [0f32; 1];
        let wrong = comm.all_gather_async(&[0f32; 2][..], &mut gathered[..]);
        let ok = matches!(wrong, Err(Error::BufferSize { .. }));
        c.check("all_gather_async with a short receive buffer", ok, || {
            format!("{:?}", wrong.map(|_| ()))
        });
        let bad_root = comm.broadcast_async(&mut small[..], w);
        let ok = matches!(bad_root, Err(Error::InvalidRank { .. }));
        c.check(&format!("broadcast_async from rank {w}"), ok, || {
            format!("{:?}", bad_root.map(|_| ()))
        });
    }

    pub fn main() {
        if !launched_by_mpirun() {
            println!(
                "mpi_async: skipped, not launched by mpirun (no OMPI_COMM_WORLD_SIZE / PMI_SIZE); \
                 run scripts/test-mpi.sh"
            );
            return;
        }
        let world = match MpiComm::init() {
            Ok(comm) => comm,
            Err(e) => {
                eprintln!("mpi_async: cannot initialize MPI: {e}");
                std::process::exit(1);
            }
        };
        // A collective that never completes is a failure of this test: end
        // the job well before the launcher's timeout.
        let world = world.with_timeout(Some(Duration::from_secs(120)));
        world.abort_on_panic();
        let (rank, w) = (world.rank(), world.world_size());
        let mut c = Checker {
            failures: Vec::new(),
            checks: 0,
        };
        let signals = Signals::new(&world);
        let all: Vec<usize> = (0..w).collect();

        if w > 1 {
            returns_before_completion(&mut c, &world, &signals);
        }
        for algorithm in [Algorithm::Auto, Algorithm::Native, Algorithm::Ring] {
            let comm = match world.split(&all) {
                Ok(Some(comm)) => comm.with_algorithm(algorithm),
                other => world.abort(&format!("split over every rank gave {other:?}")),
            };
            let label = format!("{algorithm:?}");
            equal_blocking::<f32>(&mut c, &comm, &label);
            equal_blocking::<bf16>(&mut c, &comm, &label);
        }
        let other = match world.split(&all) {
            Ok(Some(comm)) => comm.with_algorithm(Algorithm::Ring),
            other => world.abort(&format!("split over every rank gave {other:?}")),
        };
        interleaved_keep_order(&mut c, &world, &other);
        drop(other);
        async_on_two_communicators_from_two_threads(&mut c, &world);
        if w > 1 {
            leaked_work(&mut c, &world, &signals);
        }
        bad_arguments(&mut c, &world);

        for f in &c.failures {
            eprintln!("rank {rank}: FAIL {f}");
        }
        let mut failed = [c.failures.len() as f64];
        if let Err(e) = world.all_reduce(&mut failed[..], ReduceOp::Sum) {
            world.abort(&format!("cannot sum the failures: {e}"));
        }
        signals.remove(&world);
        if rank == 0 {
            println!(
                "mpi_async: {} ranks, {} checks per rank, {} failures in all",
                w, c.checks, failed[0]
            );
        }
        drop(world);
        if failed[0] > 0.0 {
            std::process::exit(1);
        }
    }
}
