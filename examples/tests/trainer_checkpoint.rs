//! The trainer's `--checkpoint-dir/--checkpoint-every` and `--resume`:
//! an interrupted run continues as if it never stopped, at the same or
//! another world size and stage.

mod common;

use clap::Parser;
use common::Weights;
use std::path::Path;
use zero_examples::trainer::{Args, Outcome, Summary};

fn args(extra: &[&str]) -> Args {
    let mut all = vec!["train", "--quiet", "--hidden", "16,16", "--seed", "3"];
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

fn max_diff(a: &Weights, b: &Weights) -> f32 {
    common::max_diff(a, b).0
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The steps a `--metrics` file records.
fn steps_run(metrics: &Path) -> Vec<u64> {
    common::metrics(metrics)
        .iter()
        .map(|line| line["step"].as_u64().unwrap())
        .collect()
}

#[test]
fn resume_at_same_world_size_is_bitwise_identical() {
    let common = ["--world-size", "2", "--stage", "2", "--batch-size", "8"];
    let (_, full) = train_weights(&[&common[..], &["--steps", "6"]].concat());
    // With --defer-gathers the checkpoint is saved right after a step whose
    // all-gathers are still running: the save waits for them.
    for extra in [&[][..], &["--defer-gathers"][..]] {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let common = [&common[..], extra].concat();
        let ckpt_args = [
            "--steps",
            "3",
            "--checkpoint-dir",
            path(&ckpt),
            "--checkpoint-every",
            "3",
        ];
        train(&[&common[..], &ckpt_args[..]].concat());
        let metrics = dir.path().join("metrics.jsonl");
        let resume_args = [
            "--steps",
            "6",
            "--resume",
            path(&ckpt),
            "--metrics",
            path(&metrics),
        ];
        let (resumed, resumed_weights) = train_weights(&[&common[..], &resume_args[..]].concat());
        // Only steps 4..=6 ran after the resume.
        assert_eq!(steps_run(&metrics), vec![4, 5, 6], "{extra:?}");
        assert_eq!(resumed.steps, 6);
        // The resumed run's own steps (4..=6) deferred when asked to.
        let deferring = if extra.is_empty() { 0 } else { 3 };
        assert_eq!(resumed.deferred_steps, deferring, "{extra:?}");
        assert_eq!(max_diff(&resumed_weights, &full), 0.0, "{extra:?}");
    }
}

#[test]
fn resume_at_another_world_size_and_stage() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let w4 = ["--world-size", "4", "--stage", "2", "--batch-size", "8"];
    let (_, full) = train_weights(&[&w4[..], &["--steps", "6"]].concat());
    let ckpt_args = [
        "--steps",
        "3",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "3",
    ];
    train(&[&w4[..], &ckpt_args[..]].concat());
    // The same global batch: half the ranks, twice the rows each.
    let w2 = ["--world-size", "2", "--stage", "1", "--batch-size", "16"];
    let metrics = dir.path().join("metrics.jsonl");
    let resume_args = [
        "--steps",
        "6",
        "--resume",
        path(&ckpt),
        "--metrics",
        path(&metrics),
    ];
    let (_, resumed) = train_weights(&[&w2[..], &resume_args[..]].concat());
    // Only steps 4..=6 ran after the resume.
    assert_eq!(steps_run(&metrics), vec![4, 5, 6]);
    let diff = max_diff(&resumed, &full);
    assert!(diff < 1e-4, "{diff}");
}

#[test]
fn resume_at_or_past_steps_trains_nothing_and_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let common = ["--world-size", "2", "--batch-size", "8"];
    let (done, weights) = train_weights(
        &[
            &common[..],
            &[
                "--steps",
                "4",
                "--checkpoint-dir",
                path(&ckpt),
                "--checkpoint-every",
                "2",
            ],
        ]
        .concat(),
    );
    assert_eq!(done.outcome, Outcome::Finished);
    // At --steps, and past it (a run asked for fewer steps than it has).
    for steps in ["4", "3"] {
        let metrics = dir.path().join(format!("metrics-{steps}.jsonl"));
        let resume_args = [
            "--steps",
            steps,
            "--resume",
            path(&ckpt),
            "--metrics",
            path(&metrics),
        ];
        let (resumed, resumed_weights) = train_weights(&[&common[..], &resume_args[..]].concat());
        assert_eq!(
            resumed.outcome,
            Outcome::AlreadyDone { checkpoint_step: 4 },
            "--steps {steps}"
        );
        assert_eq!(resumed.steps, 4);
        assert!(!metrics.exists(), "--steps {steps}: a step ran");
        // --save writes the checkpoint's weights.
        assert_eq!(max_diff(&resumed_weights, &weights), 0.0, "--steps {steps}");
    }
}

/// A prune killed part-way after the last save leaves a hidden
/// `.step-N.removing`; the run resumed past --steps (a restart loop's)
/// removes it.
#[test]
fn a_run_with_nothing_to_train_finishes_an_interrupted_prune() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = [
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
    ];
    train_weights(&args);
    let leftover = ckpt.join(".step-000001.removing");
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(leftover.join("rank0.safetensors"), b"partial").unwrap();
    let resume = [&args[..], &["--resume", path(&ckpt)][..]].concat();
    let (resumed, _) = train_weights(&resume);
    assert_eq!(resumed.outcome, Outcome::AlreadyDone { checkpoint_step: 4 });
    assert!(!leftover.exists(), "{:?}", names(&ckpt));
}

/// The names in a directory, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn checkpoints_are_kept_by_step_and_pruned_to_keep_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let common = ["--world-size", "2", "--batch-size", "8", "--steps", "6"];
    for (keep, expected) in [
        (
            None,
            &["latest", "step-000002", "step-000004", "step-000006"][..],
        ),
        (Some("2"), &["latest", "step-000004", "step-000006"][..]),
        (Some("1"), &["latest", "step-000006"][..]),
    ] {
        let ckpt = dir.path().join(format!("ckpt-{keep:?}"));
        let mut flags = vec!["--checkpoint-dir", path(&ckpt), "--checkpoint-every", "2"];
        if let Some(keep) = keep {
            flags.extend(["--keep-checkpoints", keep]);
        }
        train(&[&common[..], &flags[..]].concat());
        assert_eq!(names(&ckpt), expected, "--keep-checkpoints {keep:?}");
        assert_eq!(
            std::fs::read_to_string(ckpt.join("latest")).unwrap(),
            "step-000006\n"
        );
        for step_dir in &expected[1..] {
            assert!(ckpt.join(step_dir).join("manifest.json").is_file());
        }
    }
}

#[test]
fn resume_takes_the_latest_step_a_named_step_or_a_single_checkpoint_dir() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let common = ["--world-size", "2", "--batch-size", "8"];
    let (_, full) = train_weights(&[&common[..], &["--steps", "8"]].concat());
    let ckpt_args = [
        "--steps",
        "6",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "2",
    ];
    train(&[&common[..], &ckpt_args[..]].concat());
    // A save of step 8 killed before its manifest: not what a resume takes.
    let killed = ckpt.join("step-000008");
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::write(killed.join("model.step8.safetensors"), b"partial").unwrap();
    // Today's layout before step directories: a checkpoint saved straight
    // into a directory (step 4's files, moved).
    let single = dir.path().join("single");
    std::fs::rename(ckpt.join("step-000004"), &single).unwrap();
    let named = ckpt.join("step-000002");
    for (resume, first_step) in [(&ckpt, 7), (&named, 3), (&single, 5)] {
        let metrics = dir.path().join("metrics.jsonl");
        let resume_args = [
            "--steps",
            "8",
            "--resume",
            path(resume),
            "--metrics",
            path(&metrics),
        ];
        let (_, resumed) = train_weights(&[&common[..], &resume_args[..]].concat());
        let expected: Vec<u64> = (first_step..=8).collect();
        assert_eq!(steps_run(&metrics), expected, "{}", resume.display());
        assert_eq!(max_diff(&resumed, &full), 0.0, "{}", resume.display());
    }
}

#[test]
fn checkpoint_weights_load_with_candle_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let (_, weights) = train_weights(&[
        "--steps",
        "2",
        "--world-size",
        "2",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "2",
    ]);
    let step_dir = "step-000002";
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ckpt.join(step_dir).join("manifest.json")).unwrap(),
    )
    .unwrap();
    let model_file = manifest["checkpoint"]["model_file"].as_str().unwrap();
    let model_file = Path::new(step_dir).join(model_file);
    let device = candle_core::Device::Cpu;
    // SAFETY: the file is not modified while mapped (the test owns it).
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(
            &[ckpt.join(model_file)],
            candle_core::DType::F32,
            &device,
        )
    }
    .unwrap();
    for (name, values) in &weights {
        let shape = if name.ends_with("bias") {
            vec![values.len()]
        } else {
            let out = if name.starts_with("layers.0") || name.starts_with("layers.1") {
                16
            } else {
                4
            };
            vec![out, values.len() / out]
        };
        let tensor = vb.get(shape, name).unwrap();
        assert_eq!(
            &tensor.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            values,
            "{name}"
        );
    }
}

/// Every file of two step directories: the same names, the same bytes.
fn assert_same_files(left: &Path, right: &Path) {
    let files = names(left);
    assert_eq!(
        files,
        names(right),
        "{} vs {}",
        left.display(),
        right.display()
    );
    assert!(files.iter().any(|n| n == "manifest.json"), "{files:?}");
    for name in files {
        let same =
            std::fs::read(left.join(&name)).unwrap() == std::fs::read(right.join(&name)).unwrap();
        assert!(
            same,
            "{name} differs between {} and {}",
            left.display(),
            right.display()
        );
    }
}

#[test]
fn background_checkpoints_are_the_blocking_ones_and_resume_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    for stage in ["2", "3"] {
        let common = ["--world-size", "2", "--stage", stage, "--batch-size", "8"];
        let (_, full) = train_weights(&[&common[..], &["--steps", "6"]].concat());
        let blocking = dir.path().join(format!("blocking-{stage}"));
        let background = dir.path().join(format!("background-{stage}"));
        let every = [
            "--steps",
            "6",
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "2",
        ];
        train(
            &[
                &common[..],
                &every[..],
                &["--checkpoint-dir", path(&blocking)],
            ]
            .concat(),
        );
        // The flag from a --config file, as any other.
        let config = dir.path().join(format!("background-{stage}.toml"));
        std::fs::write(&config, "checkpoint-async = true\n").unwrap();
        let mut argv = vec!["train", "--quiet", "--hidden", "16,16", "--seed", "3"];
        argv.extend([&common[..], &every[..]].concat());
        argv.extend([
            "--checkpoint-dir",
            path(&background),
            "--config",
            path(&config),
        ]);
        let parsed = Args::parse_with_config(argv).unwrap();
        assert!(parsed.checkpoint_async);
        common::train(&parsed);

        assert_eq!(names(&background), ["latest", "step-000004", "step-000006"]);
        assert_eq!(
            std::fs::read_to_string(background.join("latest")).unwrap(),
            "step-000006\n"
        );
        for step_dir in ["step-000004", "step-000006"] {
            assert_same_files(&blocking.join(step_dir), &background.join(step_dir));
        }
        let step_4 = background.join("step-000004");
        let resume = ["--steps", "6", "--resume", path(&step_4)];
        let (resumed, weights) = train_weights(&[&common[..], &resume[..]].concat());
        assert_eq!(resumed.steps, 6);
        assert_eq!(max_diff(&weights, &full), 0.0, "stage {stage}");
    }
}

#[test]
fn a_failed_background_write_fails_the_run_and_latest_stays() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    // A file where step 4's directory goes: its writers cannot create it.
    std::fs::write(ckpt.join("step-000004"), b"in the way").unwrap();
    let flags = [
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--steps",
        "8",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "2",
        "--checkpoint-async",
    ];
    let err = zero_examples::trainer::run(&args(&flags)).expect_err("step 4's save failed");
    assert!(err.to_string().contains("step-000004"), "{err}");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        "step-000002\n"
    );
    assert!(
        !ckpt.join("step-000006").exists(),
        "no save after the failure"
    );
}
