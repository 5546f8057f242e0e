//! Background saves (`Engine::save_checkpoint_async`): the files of a
//! blocking save, bitwise, while training goes on; a resume from one; a
//! failed write reported when the save completes, with the previous
//! checkpoint still the latest; a save dropped in flight never loaded.

mod common;

use common::{ckpt_err, engine, listing, make_opt, run, slots, Mlp, Model, Opt, TestMemory};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use zero_core::checkpoint::{Manifest, StepCheckpoints, MANIFEST_FILE};
use zero_core::engine::{
    EngineConfig, Fetcher, GatherMemory, HostMemory, Offload, OffloadMemory, Stage,
};
use zero_core::{Communicator, Engine, Result, SaveOptions, ThreadComm};

fn model() -> Mlp {
    Mlp::new(&[6, 10, 4])
}

fn config(stage: u8) -> EngineConfig {
    EngineConfig::default()
        .with_stage(Stage::from_number(stage).unwrap())
        .with_bucket_bytes(256)
}

/// The values of parameter `p`: gathered through `fetcher` when it is
/// sharded (stage 3), else the replica's.
fn values<G: GatherMemory<f64, Buffer = zero_core::engine::HostGather<f64>>>(
    fetcher: Option<&Arc<Fetcher<f64, G>>>,
    replica: &[Vec<f64>],
    p: usize,
) -> Result<Vec<f64>> {
    let Some(fetcher) = fetcher.filter(|f| f.is_sharded(p)) else {
        return Ok(replica[p].clone());
    };
    let mut out = vec![f64::NAN; replica[p].len()];
    for piece in 0..fetcher.pieces(p) {
        let gathered = fetcher.acquire(p, piece)?;
        for (at, places) in gathered.spans() {
            let buffer = gathered
                .buffer()
                .as_wide()
                .expect("f64 values gathered as such");
            out[places.clone()].copy_from_slice(&buffer[at.clone()]);
        }
        fetcher.release(gathered);
    }
    Ok(out)
}

/// Trains `steps` of the model; at stage 3 the parameters are sharded
/// after step 0.
fn train<M: TestMemory>(
    e: &mut Engine<f64, ThreadComm, M>,
    replica: &mut Vec<Vec<f64>>,
    steps: Range<usize>,
) -> Result<()> {
    let rank = e.comm().rank();
    for s in steps {
        let fetcher = e.fetcher().cloned();
        let weights = (0..replica.len())
            .map(|p| values(fetcher.as_ref(), replica, p))
            .collect::<Result<Vec<_>>>()?;
        let g = model().grads(&weights, rank, s);
        e.step(&slots(&g), replica)?;
        if s == 0 && e.config().stage == Stage::Parameters {
            e.shard_parameters(&vec![true; replica.len()], replica)?;
        }
    }
    Ok(())
}

fn options(step: usize) -> SaveOptions {
    SaveOptions {
        user: serde_json::json!({ "step": step }),
        ..SaveOptions::default()
    }
}

/// Every file of `left` and `right`: the same names, the same bytes.
fn assert_same_files(left: &Path, right: &Path) {
    let names = listing(left);
    assert_eq!(
        names,
        listing(right),
        "{} vs {}",
        left.display(),
        right.display()
    );
    assert!(names.iter().any(|n| n == MANIFEST_FILE), "{names:?}");
    for name in names {
        let (l, r) = (
            std::fs::read(left.join(&name)).unwrap(),
            std::fs::read(right.join(&name)).unwrap(),
        );
        assert!(
            l == r,
            "{name} differs between {} and {}",
            left.display(),
            right.display()
        );
    }
}

/// At steps 3 and 5: a blocking save into `blocking-N`, then a background
/// one into `background-N` while steps go on; both must hold the same
/// files. The second round reuses the first one's buffers.
fn blocking_then_background<M: TestMemory>(
    mut e: Engine<f64, ThreadComm, M>,
    root: &Path,
) -> Result<()> {
    let mut replica = model().init();
    train(&mut e, &mut replica, 0..3)?;
    for (step, next) in [(3, 5), (5, 6)] {
        e.save_checkpoint(
            root.join(format!("blocking-{step}")),
            &mut replica,
            &options(step),
        )?;
        let dir = root.join(format!("background-{step}"));
        assert_eq!(
            e.save_checkpoint_async(&dir, &mut replica, &options(step))?,
            None
        );
        // The state changes while the writer writes the snapshot.
        train(&mut e, &mut replica, step..next)?;
        let saved = e.wait_checkpoint()?.expect("a save was in flight");
        assert_eq!(saved.dir, dir);
        assert_eq!(saved.manifest, Manifest::load(&dir)?);
        assert_eq!(e.wait_checkpoint()?, None, "nothing left in flight");
    }
    Ok(())
}

#[test]
fn background_saves_write_the_files_of_blocking_saves() {
    let model = model();
    for stage in [1, 2, 3] {
        let root = tempfile::tempdir().unwrap();
        run(2, |comm| {
            let e = engine(comm, &model, make_opt(Opt::Adam, false), config(stage))?;
            blocking_then_background(e, root.path())
        });
        for step in [3, 5] {
            assert_same_files(
                &root.path().join(format!("blocking-{step}")),
                &root.path().join(format!("background-{step}")),
            );
        }
    }
    // Offload: the optimizer state lives in host memory apart from the
    // device's (here another host memory) buffers.
    let root = tempfile::tempdir().unwrap();
    run(2, |comm| {
        let e = Engine::with_memory(
            comm,
            OffloadMemory::new(HostMemory),
            model.infos(),
            make_opt(Opt::Adam, false),
            config(2).with_offload(Offload::Optimizer, 1),
        )?;
        blocking_then_background(e, root.path())
    });
    for step in [3, 5] {
        assert_same_files(
            &root.path().join(format!("blocking-{step}")),
            &root.path().join(format!("background-{step}")),
        );
    }
}

#[test]
fn resume_from_a_background_save_is_bitwise_the_uninterrupted_run() {
    let model = model();
    let uninterrupted = run(2, |comm| {
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config(2))?;
        let mut replica = model.init();
        train(&mut e, &mut replica, 0..6)?;
        Ok(replica)
    });
    let dir = tempfile::tempdir().unwrap();
    run(2, |comm| {
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config(2))?;
        let mut replica = model.init();
        train(&mut e, &mut replica, 0..3)?;
        e.save_checkpoint_async(dir.path(), &mut replica, &options(3))?;
        train(&mut e, &mut replica, 3..5)?;
        e.wait_checkpoint()?.expect("a save was in flight");
        Ok(())
    });
    let resumed = run(2, |comm| {
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config(2))?;
        let mut replica: Vec<Vec<f64>> = model.init().iter().map(|p| vec![0.0; p.len()]).collect();
        let manifest = e.load_checkpoint(dir.path(), &mut replica)?;
        assert_eq!(manifest.checkpoint.unwrap().user["step"], 3);
        assert_eq!(e.steps(), 3);
        train(&mut e, &mut replica, 3..6)?;
        Ok(replica)
    });
    for (rank, (got, want)) in resumed.iter().zip(&uninterrupted).enumerate() {
        assert!(got == want, "rank {rank}: the resumed run's weights differ");
    }
}

#[test]
fn a_failed_background_write_is_an_error_when_completed_and_latest_stays() {
    let model = model();
    let root = tempfile::tempdir().unwrap();
    let checkpoints = StepCheckpoints::new(root.path());
    // A file where step 6's directory goes: its writer cannot create it.
    std::fs::write(checkpoints.next_dir(6), b"in the way").unwrap();
    run(2, |comm| {
        let rank = comm.rank();
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config(2))?;
        let mut replica = model.init();
        train(&mut e, &mut replica, 0..2)?;
        e.save_checkpoint_async(checkpoints.next_dir(2), &mut replica, &options(2))?;
        train(&mut e, &mut replica, 2..3)?;
        let saved = e.wait_checkpoint()?.expect("a save was in flight");
        assert_eq!(saved.dir, checkpoints.next_dir(2));
        if rank == 0 {
            assert_eq!(checkpoints.commit_dir(&saved.dir)?, checkpoints.next_dir(2));
            let elsewhere = root.path().join("elsewhere").join("step-000002");
            assert!(checkpoints.commit_dir(&elsewhere).is_err());
        }

        // Rank 1's optimizer file fails after 64 bytes: every rank learns
        // it when the save completes.
        train(&mut e, &mut replica, 3..4)?;
        let failing = SaveOptions {
            fail_after: Some((1, 64)),
            ..options(4)
        };
        e.save_checkpoint_async(checkpoints.next_dir(4), &mut replica, &failing)?;
        train(&mut e, &mut replica, 4..5)?;
        let err = e.wait_checkpoint().expect_err("rank 1's write failed");
        if rank == 0 {
            let (_, detail) = ckpt_err(err);
            assert!(detail.contains("failed on rank 1"), "{detail}");
        } else {
            assert!(err.to_string().contains("injected write failure"), "{err}");
        }
        assert!(!checkpoints.next_dir(4).join(MANIFEST_FILE).exists());

        // The directory cannot be created: the next save says so, and
        // starts nothing; the one after it runs.
        train(&mut e, &mut replica, 5..6)?;
        e.save_checkpoint_async(checkpoints.next_dir(6), &mut replica, &options(6))?;
        train(&mut e, &mut replica, 6..7)?;
        let err = e
            .save_checkpoint_async(checkpoints.next_dir(7), &mut replica, &options(7))
            .expect_err("step 6's directory is a file");
        assert!(err.to_string().contains("step-000006"), "{err}");
        assert_eq!(e.wait_checkpoint()?, None, "step 7's save did not start");
        assert_eq!(checkpoints.latest()?, Some(checkpoints.next_dir(2)));
        e.save_checkpoint_async(checkpoints.next_dir(7), &mut replica, &options(7))?;
        assert!(e.wait_checkpoint()?.is_some());
        Ok(())
    });
    // `latest` was never moved past step 2 (step 7 was not committed).
    assert_eq!(
        StepCheckpoints::resolve(root.path()).unwrap(),
        checkpoints.next_dir(2)
    );
    assert_eq!(
        checkpoints
            .complete()
            .unwrap()
            .into_iter()
            .map(|(step, _)| step)
            .collect::<Vec<_>>(),
        [2, 7],
        "4 and 6 are not complete"
    );
}

#[test]
fn a_poll_completes_a_written_save_and_a_drop_leaves_it_incomplete() {
    let model = model();
    let root = tempfile::tempdir().unwrap();
    let checkpoints = StepCheckpoints::new(root.path());
    run(2, |comm| {
        let mut e = engine(comm, &model, make_opt(Opt::Adam, false), config(2))?;
        let mut replica = model.init();
        train(&mut e, &mut replica, 0..2)?;
        assert_eq!(e.poll_checkpoint()?, None, "nothing in flight");
        e.save_checkpoint_async(checkpoints.next_dir(2), &mut replica, &options(2))?;
        // Every rank gets the same answer, so every rank polls as often.
        let saved = loop {
            if let Some(saved) = e.poll_checkpoint()? {
                break saved;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        };
        assert_eq!(saved.dir, checkpoints.next_dir(2));
        assert!(checkpoints.next_dir(2).join(MANIFEST_FILE).exists());
        train(&mut e, &mut replica, 2..3)?;
        e.save_checkpoint_async(checkpoints.next_dir(3), &mut replica, &options(3))?;
        // Dropped in flight: the files are finished, no manifest written.
        drop(e);
        Ok(())
    });
    assert!(checkpoints.next_dir(3).exists());
    assert!(!checkpoints.next_dir(3).join(MANIFEST_FILE).exists());
    assert_eq!(
        StepCheckpoints::resolve(root.path()).unwrap(),
        checkpoints.next_dir(2)
    );
}
