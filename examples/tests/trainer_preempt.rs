//! Preemption: a signal (or, in-process, a request on one rank) stops
//! every rank after the same step with a checkpoint, and `--resume` then
//! ends with the weights of a run that never stopped, bitwise.

mod common;

use clap::Parser;
use common::Weights;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use zero_core::Preemption;
use zero_examples::trainer::{preempted_message, run_with_preemption, Args, Outcome, Summary};

fn args(extra: &[&str]) -> Args {
    let mut all = vec!["train", "--quiet", "--hidden", "16,16", "--seed", "3"];
    all.extend_from_slice(extra);
    Args::parse_from(all)
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A run in which rank `asked` alone is asked to stop at its `poll`-th
/// step boundary.
fn preempted(extra: &[&str], asked: usize, poll: u64) -> Summary {
    let args = args(extra);
    let preemption = |rank: usize| {
        if rank == asked {
            Preemption::requested_at_poll(poll)
        } else {
            Preemption::manual()
        }
    };
    match run_with_preemption(&args, &preemption) {
        Ok(summary) => summary,
        Err(e) => panic!("training with {args:?} failed: {e}"),
    }
}

/// The step directories of a checkpoint directory, sorted.
fn step_dirs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("step-"))
        .collect();
    names.sort();
    names
}

#[test]
fn one_rank_preempted_stops_every_rank_and_resume_is_bitwise_identical() {
    // (world size, the step the last rank is asked to stop at,
    // --checkpoint-every): at 3 ranks the stop step has no periodic save;
    // at 2 it has one, which the preemption does not write twice; with
    // background saves the one in flight completes first, and is the
    // preemption's checkpoint when it is of the stop step.
    let cases = [
        (3u64, 3u64, None, false),
        (2, 4, Some("2"), false),
        (2, 4, Some("2"), true),
        (2, 5, Some("2"), true),
    ];
    for (world_size, stop, every, background) in cases {
        let ws = world_size.to_string();
        let common = ["--world-size", ws.as_str(), "--batch-size", "8"];
        let (_, full) = common::train_weights(args(&[&common[..], &["--steps", "8"]].concat()));
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let saved = dir.path().join("never.safetensors");
        let mut flags = vec!["--steps", "8", "--checkpoint-dir", path(&ckpt)];
        flags.extend(["--save", path(&saved)]);
        if let Some(every) = every {
            flags.extend(["--checkpoint-every", every]);
        }
        if background {
            flags.push("--checkpoint-async");
        }
        let summary = preempted(
            &[&common[..], &flags[..]].concat(),
            world_size as usize - 1,
            stop,
        );
        let step_dir = ckpt.join(format!("step-{stop:06}"));
        assert_eq!(
            summary.outcome,
            Outcome::Preempted {
                step: stop,
                checkpoint: Some(step_dir.clone())
            },
            "world size {world_size}"
        );
        assert_eq!(summary.steps, stop);
        assert!(!saved.exists(), "a preempted run wrote --save");
        let mut expected: Vec<String> = match every {
            Some(_) => vec!["step-000002".into(), "step-000004".into()],
            None => Vec::new(),
        };
        if stop % 2 == 1 {
            expected.push(format!("step-{stop:06}"));
        }
        assert_eq!(step_dirs(&ckpt), expected);
        assert_eq!(
            std::fs::read_to_string(ckpt.join("latest")).unwrap(),
            format!("step-{stop:06}\n"),
            "world size {world_size}, background {background}"
        );

        let metrics = dir.path().join("metrics.jsonl");
        let resume = [
            "--steps",
            "8",
            "--resume",
            path(&ckpt),
            "--metrics",
            path(&metrics),
        ];
        let (resumed, weights) = common::train_weights(args(&[&common[..], &resume[..]].concat()));
        assert_eq!(resumed.outcome, Outcome::Finished);
        let steps: Vec<u64> = common::metrics(&metrics)
            .iter()
            .map(|line| line["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, (stop + 1..=8).collect::<Vec<_>>());
        let (diff, name) = common::max_diff(&weights, &full);
        assert_eq!(diff, 0.0, "world size {world_size}: {name} differs");
    }
}

#[test]
fn preempted_without_checkpoint_dir_saves_nothing_and_at_the_last_step_finishes() {
    let common = ["--world-size", "2", "--batch-size", "8", "--steps", "5"];
    let summary = preempted(&common, 0, 2);
    assert_eq!(
        summary.outcome,
        Outcome::Preempted {
            step: 2,
            checkpoint: None
        }
    );
    // Asked at the last step boundary: the run is complete anyway.
    let summary = preempted(&common, 1, 5);
    assert_eq!(summary.outcome, Outcome::Finished);
    assert_eq!(summary.steps, 5);
}

#[test]
fn the_message_names_the_checkpoint_and_the_command_that_resumes() {
    let args = args(&["--checkpoint-dir", "/runs/a b", "--steps", "100"]);
    let argv = [
        "train",
        "--checkpoint-dir",
        "/runs/a b",
        "--resume",
        "/old",
        "--resume=/older",
        "--lr",
        "0.1",
        "--prompt",
        "it's",
    ];
    let message = preempted_message(&args, 37, Some(Path::new("/runs/a b/step-000037")), argv);
    assert_eq!(
        message,
        "preempted: stopped after step 37 of 100 on a signal; checkpoint saved in \
         /runs/a b/step-000037\n\
         resume with: train --checkpoint-dir '/runs/a b' --lr 0.1 --prompt 'it'\\''s' \
         --resume '/runs/a b'"
    );
    let message = preempted_message(&args, 37, None, ["train"]);
    assert!(message.contains("nothing was saved"), "{message}");
}

/// Waits (at most `limit`) for `child` to exit; kills it past that.
fn wait_bounded(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the trainer still ran {limit:?} after it was signalled");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts the `train` binary on a run far too long to finish, and waits
/// until it has committed a checkpoint (it is training).
fn start_long_run(flags: &[&str], ckpt: &Path) -> std::process::Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(flags)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !ckpt.join("latest").exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the trainer exited ({status}) before its first checkpoint");
        }
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("no checkpoint within 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn signal(child: &std::process::Child, name: &str) {
    let status = Command::new("kill")
        .args([format!("-{name}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} failed");
}

fn stderr_of(child: &mut std::process::Child) -> String {
    use std::io::Read;
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    stderr
}

#[cfg(unix)]
#[test]
fn sigterm_stops_the_binary_with_143_and_its_resume_command_continues_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let common = [
        "--quiet",
        "--hidden",
        "8",
        "--batch-size",
        "8",
        "--seed",
        "3",
        "--world-size",
        "2",
    ];
    let long = [
        "--steps",
        "100000000",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "5",
    ];
    let flags = [&common[..], &long[..]].concat();
    let mut child = start_long_run(&flags, &ckpt);
    signal(&child, "TERM");
    let status = wait_bounded(&mut child, Duration::from_secs(30));
    let stderr = stderr_of(&mut child);
    assert_eq!(status.code(), Some(143), "{stderr}");
    // "preempted: stopped after step K of 100000000 on a signal; ..."
    let step: u64 = stderr
        .split("stopped after step ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|k| k.parse().ok())
        .unwrap_or_else(|| panic!("no step in {stderr:?}"));
    let step_dir = ckpt.join(format!("step-{step:06}"));
    assert!(
        stderr.contains(&format!("checkpoint saved in {}", step_dir.display())),
        "{stderr}"
    );
    let command = format!(
        "resume with: {} {} --resume {}",
        env!("CARGO_BIN_EXE_train"),
        flags.join(" "),
        ckpt.display()
    );
    assert!(stderr.contains(&command), "{stderr:?} lacks {command:?}");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest")).unwrap(),
        format!("step-{step:06}\n")
    );

    // The command it printed, stopped 3 steps later, against a run that
    // never stopped.
    let end = (step + 3).to_string();
    let resumed = dir.path().join("resumed.safetensors");
    let resume = [
        "--steps",
        &end,
        "--resume",
        path(&ckpt),
        "--save",
        path(&resumed),
    ];
    let status = Command::new(env!("CARGO_BIN_EXE_train"))
        .args([&common[..], &resume[..]].concat())
        .status()
        .unwrap();
    assert!(status.success());
    let resumed: Weights = zero_examples::trainer::read_weights(&resumed).unwrap();
    let mut straight = vec!["train"];
    straight.extend_from_slice(&common);
    straight.extend(["--steps", &end]);
    let (_, straight) = common::train_weights(Args::parse_from(straight));
    let (diff, name) = common::max_diff(&resumed, &straight);
    assert_eq!(diff, 0.0, "{name} differs after the resume");
}

#[cfg(unix)]
#[test]
fn a_second_signal_exits_at_once_and_leaves_a_loadable_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let flags = [
        "--quiet",
        "--hidden",
        "8",
        "--batch-size",
        "8",
        "--world-size",
        "2",
        "--steps",
        "100000000",
        "--checkpoint-dir",
        path(&ckpt),
        "--checkpoint-every",
        "1",
        "--preempt-signals",
        "USR1,TERM",
        "--preempt-exit-code",
        "99",
    ];
    let mut child = start_long_run(&flags, &ckpt);
    signal(&child, "USR1");
    signal(&child, "TERM");
    let status = wait_bounded(&mut child, Duration::from_secs(30));
    let stderr = stderr_of(&mut child);
    assert_eq!(status.code(), Some(99), "{stderr}");
    // Whatever it was doing, `latest` names a complete checkpoint, and it
    // loads: one more step from it.
    let latest: PathBuf = zero_core::checkpoint::StepCheckpoints::new(&ckpt)
        .latest()
        .unwrap()
        .expect("a complete checkpoint");
    let name = latest.file_name().unwrap().to_str().unwrap();
    let step: u64 = name.trim_start_matches("step-").parse().unwrap();
    let end = (step + 1).to_string();
    let status = Command::new(env!("CARGO_BIN_EXE_train"))
        .args([
            "--quiet",
            "--hidden",
            "8",
            "--batch-size",
            "8",
            "--world-size",
            "2",
        ])
        .args(["--steps", &end, "--resume", path(&ckpt)])
        .status()
        .unwrap();
    assert!(
        status.success(),
        "resuming from {} failed",
        latest.display()
    );
}
