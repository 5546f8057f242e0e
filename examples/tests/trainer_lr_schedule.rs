//! The trainer's learning-rate schedule (`--warmup-steps`, `--lr-decay`,
//! `--min-lr`): the rate of every step follows `LrSchedule`, reaches the
//! update, continues across a resume, and bad combinations are usage
//! errors.

mod common;

use clap::Parser;
use std::path::Path;
use zero_core::optim::{LrDecay, LrSchedule};
use zero_examples::trainer::{run, Args, Summary, TrainError};

fn args(extra: &[&str]) -> Args {
    let mut all = vec!["train", "--quiet", "--hidden", "16", "--world-size", "2"];
    all.extend_from_slice(extra);
    Args::parse_from(all)
}

fn train(extra: &[&str]) -> Summary {
    common::train(&args(extra))
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The (step, learning rate) pairs a `--metrics` file records.
fn recorded_rates(metrics: &Path) -> Vec<(u64, f64)> {
    common::metrics(metrics)
        .iter()
        .map(|line| (line["step"].as_u64().unwrap(), line["lr"].as_f64().unwrap()))
        .collect()
}

/// Whether `a` and `b` agree to a JSON round trip.
fn same_rate(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-15 * a.abs().max(b.abs())
}

#[test]
fn every_step_runs_at_the_rate_of_the_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    // Two micro-steps per step: the rate is per optimizer step.
    train(&[
        "--steps",
        "12",
        "--grad-accum",
        "2",
        "--lr",
        "0.02",
        "--warmup-steps",
        "3",
        "--lr-decay",
        "cosine",
        "--min-lr",
        "0.002",
        "--metrics",
        path(&metrics),
    ]);
    let decay = LrDecay::Cosine {
        total_steps: 12,
        min_lr: 0.002,
    };
    let schedule = LrSchedule::new(0.02, 3, decay).unwrap();
    let rates = recorded_rates(&metrics);
    assert_eq!(rates.len(), 12);
    for &(step, lr) in &rates {
        // Metrics count steps from 1; the schedule from 0.
        let expected = schedule.lr_at(step - 1);
        assert!(same_rate(lr, expected), "step {step}: {lr} != {expected}");
    }
    // The warmup starts at 0 and peaks after 3 steps; the cosine then falls
    // through the midpoint between peak and floor half way through its 9
    // steps (step 3 + 4.5, between the rates of metrics steps 8 and 9).
    assert_eq!(rates[0].1, 0.0);
    assert!(same_rate(rates[1].1, 0.02 / 3.0));
    assert!(same_rate(rates[3].1, 0.02));
    assert!(rates[7].1 > 0.011 && rates[8].1 < 0.011, "{rates:?}");
    assert!(
        rates.windows(2).skip(3).all(|w| w[1].1 < w[0].1),
        "{rates:?}"
    );
    assert!(rates[11].1 > 0.002);
}

#[test]
fn a_step_at_rate_zero_leaves_the_weights_unchanged() {
    // The first step of a warmup has rate 0: SGD's update is then 0, so the
    // saved weights are the initial ones (a run of no steps), and a step at
    // the flat rate moves them.
    let sgd = ["--optimizer", "sgd"];
    let weights = |extra: &[&str]| common::train_weights(args(&[&sgd[..], extra].concat())).1;
    let initial = weights(&["--steps", "0"]);
    let warming = weights(&["--steps", "1", "--warmup-steps", "4"]);
    let flat = weights(&["--steps", "1"]);
    assert_eq!(common::max_diff(&initial, &warming).0, 0.0);
    assert!(common::max_diff(&initial, &flat).0 > 0.0);
}

#[test]
fn a_resumed_run_continues_the_schedule_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let schedule = [
        "--lr",
        "0.02",
        "--warmup-steps",
        "2",
        "--lr-decay",
        "linear",
        "--min-lr",
        "0.001",
    ];
    let straight_metrics = dir.path().join("straight.jsonl");
    let straight_args = ["--steps", "8", "--metrics", path(&straight_metrics)];
    let (_, straight) = common::train_weights(args(&[&schedule[..], &straight_args].concat()));
    // The first half stops at step 4 of the same 8-step schedule.
    let ckpt = dir.path().join("ckpt");
    let first_half = [
        "--steps",
        "4",
        "--lr-decay-steps",
        "8",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "4",
    ];
    train(&[&schedule[..], &first_half].concat());
    let resumed_metrics = dir.path().join("resumed.jsonl");
    let second_half = [
        "--steps",
        "8",
        "--resume",
        path(&ckpt),
        "--metrics",
        path(&resumed_metrics),
    ];
    let (_, resumed) = common::train_weights(args(&[&schedule[..], &second_half].concat()));
    let straight_rates = recorded_rates(&straight_metrics);
    let resumed_rates = recorded_rates(&resumed_metrics);
    assert_eq!(resumed_rates, straight_rates[4..]);
    // The rates still fall after the resume.
    assert!(
        resumed_rates.windows(2).all(|w| w[1].1 < w[0].1),
        "{resumed_rates:?}"
    );
    assert_eq!(common::max_diff(&resumed, &straight).0, 0.0);
}

#[test]
fn bad_schedules_are_usage_errors_naming_the_flags() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "--steps",
                "10",
                "--warmup-steps",
                "11",
                "--lr-decay",
                "cosine",
            ],
            "warmup_steps 11 is more than total_steps 10",
        ),
        (
            &["--lr", "0.01", "--lr-decay", "linear", "--min-lr", "0.1"],
            "min_lr 0.1 is above the peak lr 0.01",
        ),
        (&["--lr-decay", "cosine", "--min-lr=-1"], "min_lr is -1"),
        (
            &["--lr-decay", "cosine", "--min-lr", "NaN"],
            "min_lr is NaN",
        ),
        (
            &["--steps", "0", "--lr-decay", "linear"],
            "total_steps is 0",
        ),
        (&["--min-lr", "0.001"], "add --lr-decay linear or cosine"),
        (&["--lr-decay-steps", "5"], "--lr-decay constant has none"),
        (
            &[
                "--steps",
                "10",
                "--warmup-steps",
                "4",
                "--lr-decay",
                "cosine",
                "--lr-decay-steps",
                "3",
            ],
            "--lr-decay-steps 3: invalid configuration: learning-rate schedule: warmup_steps 4 \
             is more than total_steps 3",
        ),
    ];
    for (flags, needle) in cases {
        let err = run(&args(flags)).expect_err("a bad schedule");
        let TrainError::Usage(message) = &err else {
            panic!("{flags:?}: {err} is not a usage error");
        };
        assert!(
            message.contains(needle),
            "{flags:?}: {message:?} lacks {needle:?}"
        );
        assert!(message.contains("--min-lr"), "{flags:?}: {message:?}");
    }
}
