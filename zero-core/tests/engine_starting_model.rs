//! `Engine::sync_starting_model`: every rank's parameters become rank 0's,
//! bit for bit (signed zeros, NaN and infinities included, frozen
//! parameters too, a parameter straddling the broadcast's pieces), at any
//! stage and world size; `StartingModel::Verify` copies nothing and names
//! the first parameter that differs.

use zero_core::engine::{Engine, EngineConfig, Stage, StartingModel};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{Error, ParamInfo, ThreadComm, ThreadGroup};

const SHAPES: [(&str, usize); 4] = [("a", 5), ("b", 37), ("c", 1), ("d", 64)];

fn infos() -> Vec<ParamInfo> {
    SHAPES
        .iter()
        .map(|&(name, n)| {
            // A frozen parameter is part of the starting model too.
            ParamInfo::new(name, vec![n], zero_core::DType::F32).with_trainable(name != "c")
        })
        .collect()
}

/// Rank `rank`'s own values: special values on rank 0, others elsewhere.
fn values(rank: usize) -> Vec<Vec<f32>> {
    let special = [
        -0.0,
        0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -1e-40,
    ];
    SHAPES
        .iter()
        .enumerate()
        .map(|(p, &(_, n))| {
            (0..n)
                .map(|i| match (rank, special.get(i)) {
                    (0, Some(&v)) => v,
                    _ => ((rank * 131 + p * 17 + i * 7) % 29) as f32 / 7.0 - 2.0,
                })
                .collect()
        })
        .collect()
}

fn bits(values: &[Vec<f32>]) -> Vec<Vec<u32>> {
    values
        .iter()
        .map(|p| p.iter().map(|v| v.to_bits()).collect())
        .collect()
}

fn synced(comm: ThreadComm, config: EngineConfig) -> zero_core::Result<Vec<Vec<f32>>> {
    let rank = zero_core::Communicator::rank(&comm);
    let sgd = Box::new(Sgd::new(SgdConfig::default())?);
    let mut engine: Engine<f32, ThreadComm> = Engine::new(comm, infos(), sgd, config)?;
    let mut params = values(rank);
    engine.sync_starting_model(&mut params)?;
    Ok(params)
}

#[test]
fn every_rank_holds_rank_zeros_bits_after_the_broadcast() {
    for world in 1..=4 {
        for stage in [
            Stage::Ddp,
            Stage::OptimizerState,
            Stage::Gradients,
            Stage::Parameters,
        ] {
            // 48-byte pieces: 12 elements, so `b` and `d` straddle pieces.
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(48);
            let results = ThreadGroup::new(world).run(|comm| synced(comm, config.clone()));
            for (rank, r) in results.into_iter().enumerate() {
                let got = r.expect("no panic").expect("synced");
                assert_eq!(
                    bits(&got),
                    bits(&values(0)),
                    "world {world}, {stage:?}, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn verify_names_the_first_parameter_that_differs_and_copies_nothing() {
    let config = EngineConfig::default().with_starting_model(StartingModel::Verify);
    for r in ThreadGroup::new(3).run(|comm| synced(comm, config.clone())) {
        match r.expect("no panic") {
            Err(Error::StartingModelDiffers { param, rank }) => {
                assert_eq!((param.as_str(), rank), ("a", 1));
            }
            other => panic!("expected StartingModelDiffers, got {other:?}"),
        }
    }
    // Ranks that agree pass, their values untouched.
    let results = ThreadGroup::new(3).run(|comm| -> zero_core::Result<Vec<Vec<f32>>> {
        let sgd = Box::new(Sgd::new(SgdConfig::default())?);
        let mut engine: Engine<f32, ThreadComm> = Engine::new(comm, infos(), sgd, config.clone())?;
        let mut params = values(1);
        engine.sync_starting_model(&mut params)?;
        Ok(params)
    });
    for r in results {
        assert_eq!(
            bits(&r.expect("no panic").expect("agree")),
            bits(&values(1))
        );
    }
}
