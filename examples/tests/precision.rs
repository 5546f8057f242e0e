//! The trainer's `--precision bf16|f16`: 16-bit models with f32 master
//! weights follow f32 training, masters matter, loss scaling and
//! checkpoints work at every stage.

mod common;

use clap::Parser;
use common::{max_diff, Weights};
use std::path::Path;
use zero_examples::trainer::{Args, Summary};

/// Flags for a quiet run, on 2 ranks unless `extra` says otherwise.
fn args(extra: &[&str]) -> Args {
    let mut all = vec!["train", "--quiet"];
    if !extra.contains(&"--world-size") {
        all.extend(["--world-size", "2"]);
    }
    all.extend_from_slice(extra);
    Args::parse_from(all)
}

fn train(extra: &[&str]) -> Summary {
    common::train(&args(extra))
}

/// A run and the weights it saved.
fn train_weights(extra: &[&str]) -> (Summary, Weights) {
    common::train_weights(args(extra))
}

/// The losses a `--metrics` file records, and whether each step was skipped.
fn losses(metrics: &Path) -> Vec<(f64, bool)> {
    common::metrics(metrics)
        .iter()
        .map(|v| {
            (
                v["loss"].as_f64().unwrap(),
                v["skipped"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

#[test]
fn bf16_and_f16_training_follow_f32_on_the_mlp() {
    // 200 steps of AdamW (lr 1e-2) at stage 2: the loss falls from 1.41 to
    // below 0.01 in f32; 16-bit runs with f32 masters end within 0.01 of
    // it, and their mean loss over the 200 steps is within 0.02 of f32's.
    let dir = tempfile::tempdir().unwrap();
    let metrics = |p: &str| dir.path().join(format!("{p}.jsonl"));
    let mut runs = Vec::new();
    for precision in ["f32", "bf16", "f16"] {
        let m = metrics(precision);
        let common = ["--stage", "2", "--steps", "200", "--metrics"];
        let s = train(
            &[
                &common[..],
                &[m.to_str().unwrap(), "--precision", precision],
            ]
            .concat(),
        );
        runs.push((precision, s, losses(&m)));
    }
    let (_, f32_run, f32_losses) = &runs[0];
    assert!(
        f32_run.final_loss < 0.05,
        "f32 trains: {}",
        f32_run.final_loss
    );
    for (precision, run, trace) in &runs[1..] {
        assert!(
            (run.final_loss - f32_run.final_loss).abs() < 0.01,
            "{precision}: final loss {} vs f32 {}",
            run.final_loss,
            f32_run.final_loss
        );
        assert!(
            trace.iter().all(|(_, skipped)| !skipped),
            "{precision}: no step skipped"
        );
        // Single steps wander (a spike at one step in one run, a step later
        // in the other); the mean over the run does not.
        let mean = |t: &[(f64, bool)]| t.iter().map(|l| l.0).sum::<f64>() / t.len() as f64;
        assert!(
            (mean(trace) - mean(f32_losses)).abs() < 0.02,
            "{precision}: mean loss {} vs f32 {}",
            mean(trace),
            mean(f32_losses)
        );
    }
}

#[test]
fn f32_master_weights_keep_the_small_updates_bf16_loses() {
    // lr 1e-4: Adam's updates (about lr each) are below half a bf16 unit
    // in the last place for most weights, so bf16 without masters barely
    // moves (1.406 -> 1.378 in 200 steps) while f32 masters train like f32
    // (1.406 -> 1.315).
    let common = ["--stage", "2", "--steps", "200", "--lr", "1e-4"];
    let f32_run = train(&common);
    let masters = train(&[&common[..], &["--precision", "bf16"]].concat());
    let plain = train(&[&common[..], &["--precision", "bf16", "--no-master-weights"]].concat());
    assert!(
        (masters.final_loss - f32_run.final_loss).abs() < 2e-3,
        "masters {} vs f32 {}",
        masters.final_loss,
        f32_run.final_loss
    );
    assert!(
        plain.final_loss > masters.final_loss + 0.05,
        "without masters {} should lag with masters {}",
        plain.final_loss,
        masters.final_loss
    );
}

#[test]
fn sixteen_bit_runs_train_at_every_stage_with_accumulation_and_loss_scaling() {
    for stage in ["0", "1", "2", "3"] {
        for (precision, scale) in [("f16", "dynamic"), ("bf16", "1024"), ("bf16", "none")] {
            // Stage 3 shards every weight of this small model (the default
            // keeps parameters of up to 100k elements whole).
            let s = train(&[
                "--stage",
                stage,
                "--persist-numel",
                "0",
                "--steps",
                "30",
                "--grad-accum",
                "2",
                "--clip-norm",
                "1.0",
                "--precision",
                precision,
                "--loss-scale",
                scale,
            ]);
            assert!(
                s.final_loss.is_finite() && s.final_loss < 1.2,
                "stage {stage} {precision} {scale}: loss {}",
                s.final_loss
            );
        }
    }
}

#[test]
fn a_bf16_gpt_trains() {
    let s = train(&[
        "--model",
        "gpt",
        "--precision",
        "bf16",
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--context",
        "16",
        "--d-model",
        "32",
        "--lr",
        "3e-3",
        "--eval-every",
        "0",
        "--grad-accum",
        "2",
    ]);
    assert!(
        s.final_loss.is_finite() && s.final_loss < 5.0,
        "{}",
        s.final_loss
    );
}

#[test]
fn bf16_runs_resume_bitwise_and_f32_runs_resume_from_them() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    // Stage 3 too: its checkpoint holds the masters of the sharded weights.
    let stage3 = ["--stage", "3", "--persist-numel", "0"];
    let stage3_ckpt = dir.path().join("ckpt3");
    let stage3_ckpt = stage3_ckpt.to_str().unwrap();
    let mut full = None;
    for (stage, ckpt) in [(&["--stage", "2"][..], ckpt), (&stage3[..], stage3_ckpt)] {
        let common = [stage, &["--precision", "f16", "--batch-size", "8"]].concat();
        let (_, whole) = train_weights(&[&common[..], &["--steps", "8"]].concat());
        train(
            &[
                &common[..],
                &[
                    "--steps",
                    "4",
                    "--checkpoint-dir",
                    ckpt,
                    "--checkpoint-every",
                    "4",
                ],
            ]
            .concat(),
        );
        let (_, resumed) =
            train_weights(&[&common[..], &["--steps", "8", "--resume", ckpt]].concat());
        assert_eq!(
            whole, resumed,
            "{stage:?}: f16 resume (masters, loss scale)"
        );
        full.get_or_insert(whole);
    }
    let full = full.expect("stage 2 ran");

    // An f32 run at another world size and stage (the same global batch)
    // from the f16 checkpoint.
    let (f32_run, f32_weights) = train_weights(&[
        "--stage",
        "1",
        "--world-size",
        "4",
        "--batch-size",
        "4",
        "--steps",
        "8",
        "--resume",
        ckpt,
    ]);
    assert!(f32_run.final_loss.is_finite());
    let (diff, name) = max_diff(&f32_weights, &full);
    assert!(diff < 0.05, "f32 continuation vs f16: {diff} in {name}");
}
