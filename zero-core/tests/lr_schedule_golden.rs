//! `LrSchedule` against `transformers`' learning-rate schedules (cosine and
//! linear with warmup, with and without a floor, constant with warmup).
//!
//! The golden values come from `golden/gen_lr_schedule_golden.py` (torch and
//! transformers versions recorded in the JSON): the learning rate of every
//! optimizer step of a torch optimizer under each schedule.

use serde_json::Value;
use zero_core::optim::{LrDecay, LrSchedule};

const GOLDEN: &str = include_str!("golden/lr_schedule_golden.json");

/// The schedule a golden case describes.
fn schedule(case: &Value) -> LrSchedule {
    let lr = case["lr"].as_f64().unwrap();
    let warmup_steps = case["warmup_steps"].as_u64().unwrap();
    let decay = match case["decay"].as_str().unwrap() {
        "constant" => LrDecay::Constant,
        kind => {
            let total_steps = case["total_steps"].as_u64().unwrap();
            let min_lr = case["min_lr"].as_f64().unwrap();
            match kind {
                "cosine" => LrDecay::Cosine {
                    total_steps,
                    min_lr,
                },
                "linear" => LrDecay::Linear {
                    total_steps,
                    min_lr,
                },
                other => panic!("unknown decay {other}"),
            }
        }
    };
    LrSchedule::new(lr, warmup_steps, decay).unwrap()
}

fn cases() -> Vec<Value> {
    let golden: Value = serde_json::from_str(GOLDEN).unwrap();
    golden["cases"].as_array().unwrap().clone()
}

#[test]
fn every_step_matches_transformers_within_1e_12_relative() {
    let cases = cases();
    assert_eq!(cases.len(), 6);
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let schedule = schedule(case);
        let rates = case["rates"].as_array().unwrap();
        for (step, expected) in rates.iter().enumerate() {
            let expected = expected.as_f64().unwrap();
            let got = schedule.lr_at(step as u64);
            assert!(
                (got - expected).abs() <= 1e-12 * expected.abs(),
                "{name}, step {step}: {got} against transformers' {expected}"
            );
        }
    }
}

#[test]
fn the_decays_hold_the_floor_from_total_steps_on() {
    for case in cases().iter().filter(|c| c["decay"] != "constant") {
        let name = case["name"].as_str().unwrap();
        let schedule = schedule(case);
        let total = case["total_steps"].as_u64().unwrap();
        let min_lr = case["min_lr"].as_f64().unwrap();
        // The golden rates reach the floor at `total_steps`.
        let at_total = case["rates"][total as usize].as_f64().unwrap();
        assert!((at_total - min_lr).abs() <= 1e-12 * min_lr, "{name}");
        for step in [total, total + 1, 2 * total, u64::MAX] {
            assert_eq!(schedule.lr_at(step), min_lr, "{name}, step {step}");
        }
        // Just before the end the rate is still above the floor.
        assert!(schedule.lr_at(total - 1) > min_lr, "{name}");
    }
}

#[test]
fn the_warmup_rises_from_zero_to_the_peak() {
    for case in cases() {
        let name = case["name"].as_str().unwrap();
        let schedule = schedule(&case);
        let (lr, warmup) = (schedule.peak_lr(), schedule.warmup_steps());
        if warmup == 0 {
            assert_eq!(schedule.lr_at(0), lr, "{name}");
            continue;
        }
        assert_eq!(schedule.lr_at(0), 0.0, "{name}");
        let rates: Vec<f64> = (0..=warmup).map(|s| schedule.lr_at(s)).collect();
        assert!(rates.windows(2).all(|w| w[1] > w[0]), "{name}: {rates:?}");
        assert_eq!(schedule.lr_at(warmup), lr, "{name}");
    }
}
