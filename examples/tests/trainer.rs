//! The trainer as a user runs it: parity across world sizes and stages, and
//! clear errors for bad flags and files.

mod common;

use clap::Parser;
use common::{max_diff, Weights};
use std::process::Command;
use zero_examples::trainer::{run, Args, Summary};

fn args(flags: &[&str]) -> Args {
    let mut argv = vec!["train", "--quiet"];
    argv.extend_from_slice(flags);
    Args::parse_from(argv)
}

fn train(flags: &[&str]) -> Summary {
    common::train(&args(flags))
}

/// A run and the weights it saved.
fn train_weights(flags: &[&str]) -> (Summary, Weights) {
    common::train_weights(args(flags))
}

/// A run's weights.
fn weights(flags: &[&str]) -> Weights {
    train_weights(flags).1
}

fn max_abs_diff(a: &Weights, b: &Weights) -> f32 {
    max_diff(a, b).0
}

#[test]
fn world_size_four_trains_the_same_weights_as_one_rank_on_the_global_batch() {
    let common = [
        "--steps",
        "12",
        "--hidden",
        "16",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
    ];
    let single = weights(&[&common[..], &["--world-size", "1", "--batch-size", "32"]].concat());
    for stage in ["0", "1", "2"] {
        for partitioner in ["flat", "greedy"] {
            let sharded = weights(
                &[
                    &common[..],
                    &["--world-size", "4", "--batch-size", "8"],
                    &[
                        "--stage",
                        stage,
                        "--partitioner",
                        partitioner,
                        "--bucket-mb",
                        "0.001",
                    ],
                ]
                .concat(),
            );
            let diff = max_abs_diff(&single, &sharded);
            assert!(
                diff < 1e-4,
                "stage {stage} {partitioner}: weights differ from one rank by {diff}"
            );
        }
    } // Sharded in groups (`node`: the threads' one machine).
    for stage in ["1", "2", "3"] {
        for group in ["2", "1", "node"] {
            let grouped = weights(
                &[
                    &common[..],
                    &["--world-size", "4", "--batch-size", "8", "--stage", stage],
                    &["--shard-group", group, "--persist-numel", "64"],
                ]
                .concat(),
            );
            let diff = max_abs_diff(&single, &grouped);
            assert!(diff < 1e-4, "stage {stage} group {group}: {diff}");
        }
    }
    // Each bucket averaged across the groups before it steps during
    // backward.
    let interleaved = weights(
        &[
            &common[..],
            &["--world-size", "4", "--batch-size", "8", "--stage", "2"],
            &["--shard-group", "2", "--overlap", "interleaved"],
        ]
        .concat(),
    );
    let diff = max_abs_diff(&single, &interleaved);
    assert!(diff < 1e-4, "interleaved in groups: {diff}");
}

#[test]
fn shard_group_node_reads_the_launcher_and_bad_groups_are_usage_errors() {
    use zero_examples::trainer::{shard_group, TrainError};
    let mpi = |group: &str| args(&["--backend", "mpi", "--shard-group", group]);
    let launched = |name: &'static str| move |var: &str| (var == name).then(|| "2".to_string());
    for name in [
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
    ] {
        assert_eq!(shard_group(&mpi("node"), launched(name)).unwrap(), Some(2));
    }
    assert_eq!(shard_group(&mpi("3"), |_| None).unwrap(), Some(3));
    assert_eq!(shard_group(&args(&[]), |_| None).unwrap(), None);
    let one_thread = args(&["--world-size", "1", "--shard-group", "node"]);
    assert_eq!(shard_group(&one_thread, |_| None).unwrap(), None);
    for (group, says) in [
        ("node", "did not say"),
        ("0", "a number of ranks"),
        ("x", "`node`"),
    ] {
        match shard_group(&mpi(group), |_| None) {
            Err(TrainError::Usage(m)) => assert!(m.contains(says), "{m}"),
            other => panic!("--shard-group {group}: {other:?}"),
        }
    }
    // The replicas' average in a 16-bit dtype reaches the engine.
    let narrow = |dtype: &str| {
        let given = ["--shard-group", "2", "--replica-reduce-dtype", dtype];
        zero_examples::trainer::engine_config(&args(&given)).replica_reduce_dtype
    };
    assert_eq!(narrow("bf16"), Some(zero_core::DType::BF16));
    assert_eq!(narrow("f16"), Some(zero_core::DType::F16));
}

#[test]
fn accumulation_equals_the_larger_batch() {
    // Micro-step m of a rank takes rows of global micro-batch m, so 3
    // micro-steps of 4 rows on 2 ranks cover the same 24 rows per step as
    // one step of 12 rows on 2 ranks, or of 4 rows on 6 ranks.
    let common = [
        "--steps",
        "6",
        "--hidden",
        "8",
        "--optimizer",
        "sgd",
        "--momentum",
        "0.9",
    ];
    let accum = weights(
        &[
            &common[..],
            &[
                "--world-size",
                "2",
                "--batch-size",
                "4",
                "--grad-accum",
                "3",
                "--stage",
                "2",
            ],
        ]
        .concat(),
    );
    let big = weights(&[&common[..], &["--world-size", "2", "--batch-size", "12"]].concat());
    let wide = weights(&[&common[..], &["--world-size", "6", "--batch-size", "4"]].concat());
    for (name, other) in [("2 x 12 rows", &big), ("6 x 4 rows", &wide)] {
        let diff = max_abs_diff(&accum, other);
        assert!(diff < 1e-5, "accumulation differs from {name} by {diff}");
    }
    let no_accum = weights(&[&common[..], &["--world-size", "2", "--batch-size", "4"]].concat());
    assert!(
        max_abs_diff(&accum, &no_accum) > 1e-4,
        "accumulation must change the result"
    );
}

#[test]
fn loss_goes_down_on_the_synthetic_task() {
    let short = train(&["--steps", "1", "--world-size", "2"]);
    let long = train(&["--steps", "60", "--world-size", "2"]);
    assert!(
        long.final_loss < short.final_loss * 0.5,
        "loss {} after 60 steps vs {} after 1",
        long.final_loss,
        short.final_loss
    );
}

#[test]
fn save_then_init_round_trips_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let path_s = path.to_str().unwrap();
    let trained = weights(&["--steps", "3", "--save", path_s]);
    // Zero steps from the saved weights returns them unchanged.
    let loaded = weights(&["--steps", "0", "--init", path_s]);
    assert_eq!(max_abs_diff(&trained, &loaded), 0.0);
}

fn train_binary(flags: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(flags)
        .output()
        .expect("run the train binary");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !stderr.contains("panicked"),
        "the trainer panicked on {flags:?}: {stderr}"
    );
    (out.status.success(), stderr)
}

#[test]
fn bad_flags_and_files_are_clear_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let garbage = garbage.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["--stage", "4"], "stage"),
        (&["--stage", "3", "--overlap", "interleaved"], "stage 3"),
        (&["--stage", "3", "--partitioner", "greedy"], "stage 3"),
        (&["--world-size", "0"], "world-size"),
        (&["--optimizer", "lamb"], "lamb"),
        (
            &["--data", "/nonexistent/data.safetensors"],
            "/nonexistent/data.safetensors",
        ),
        (&["--data", garbage], "not a safetensors file"),
        (&["--init", garbage], "garbage.safetensors"),
        (&["--lr=-1"], "--lr"),
        (&["--hidden", "0"], "--hidden"),
        (&["--hidden", "18446744073709551615"], "at most 16777216"),
        (&["--prefetch-mb", "nan"], "--prefetch-mb"),
        (&["--max-live-mb=-1"], "--max-live-mb"),
        (&["--checkpoint-every", "5"], "--checkpoint-dir"),
        (&["--keep-checkpoints", "2"], "--checkpoint-dir"),
        (&["--keep-checkpoints", "0"], "keep-checkpoints"),
        (&["--resume", "/nonexistent/ckpt"], "does not exist"),
        (&["--timeout-s", "1e300"], "--timeout-s"),
        (
            &[
                "--backend",
                "nccl",
                "--precision",
                "bf16",
                "--no-master-weights",
            ],
            "f32 master weights",
        ),
        (
            &[
                "--backend",
                "nccl",
                "--precision",
                "f16",
                "--reduce-in-param-dtype",
            ],
            "reduce their gradients in f32",
        ),
    ];
    for (flags, needle) in cases {
        let (ok, stderr) = train_binary(&[&["--steps", "1"], *flags].concat());
        assert!(!ok, "{flags:?} should fail");
        assert!(
            stderr.contains(needle),
            "{flags:?}: message {stderr:?} should mention {needle:?}"
        );
    }
}

/// `--save` and `--plot` are written at the end of a run: a path that
/// cannot be written fails before the first step, not after the last.
#[test]
fn an_unwritable_output_fails_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    for flag in ["--save", "--plot"] {
        let path = missing.join("out");
        let flags = [
            "--model",
            "gpt",
            "--steps",
            "2",
            flag,
            path.to_str().unwrap(),
        ];
        let (ok, stderr) = train_binary(&flags);
        assert!(!ok, "{flag} into a missing folder should fail");
        assert!(
            stderr.contains(flag) && stderr.contains("does not exist"),
            "{flag}: {stderr}"
        );
        assert!(
            !stderr.contains("step 1:"),
            "{flag}: trained first: {stderr}"
        );
    }
}

#[cfg(not(feature = "nccl"))]
#[test]
fn the_nccl_backend_without_its_feature_says_how_to_build_it() {
    let (ok, stderr) = train_binary(&["--steps", "1", "--backend", "nccl"]);
    assert!(!ok);
    assert!(stderr.contains("--features nccl"), "{stderr}");
}

#[test]
fn init_with_a_missing_tensor_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    let path_s = path.to_str().unwrap();
    train(&["--steps", "1", "--hidden", "8", "--save", path_s]);
    // A deeper model needs `layers.2.*`, which the file lacks.
    let (ok, stderr) = train_binary(&["--steps", "1", "--hidden", "8,8", "--init", path_s]);
    assert!(!ok);
    // The first difference in the order the model creates its variables:
    // `layers.1.weight` is [4, 8] in the file.
    assert!(
        stderr.contains("\"layers.1.weight\"")
            && stderr.contains("holds it as [4, 8], the model needs [8, 8]"),
        "{stderr}"
    );
}

#[test]
fn trains_on_a_data_file_and_rejects_a_malformed_one() {
    use candle_core::{Device, Tensor};
    use std::collections::HashMap;
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("data.safetensors");
    // Class = sign of the first input: learnable.
    let rows = 64;
    let x: Vec<f32> = (0..rows * 3)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 11.0)
        .collect();
    let y: Vec<i64> = x.chunks(3).map(|r| i64::from(r[0] > 0.0)).collect();
    let tensors = HashMap::from([
        (
            "inputs".to_string(),
            Tensor::from_vec(x, (rows, 3), &Device::Cpu).unwrap(),
        ),
        (
            "targets".to_string(),
            Tensor::from_vec(y, rows, &Device::Cpu).unwrap(),
        ),
    ]);
    candle_core::safetensors::save(&tensors, &good).unwrap();
    let good_s = good.to_str().unwrap();
    let first = train(&["--data", good_s, "--steps", "1", "--hidden", "8"]);
    let (trained, trained_weights) = train_weights(&[
        "--data", good_s, "--steps", "80", "--hidden", "8", "--lr", "0.05",
    ]);
    // The model's shape comes from the file: 3 inputs, 2 classes.
    let names: Vec<(&str, usize)> = trained_weights
        .iter()
        .map(|(n, w)| (n.as_str(), w.len()))
        .collect();
    assert_eq!(
        names,
        [
            ("layers.0.bias", 8),
            ("layers.0.weight", 24),
            ("layers.1.bias", 2),
            ("layers.1.weight", 16)
        ]
    );
    assert!(
        trained.final_loss < first.final_loss * 0.5,
        "{} vs {}",
        trained.final_loss,
        first.final_loss
    );

    let bad = dir.path().join("bad.safetensors");
    let tensors = HashMap::from([
        (
            "inputs".to_string(),
            Tensor::zeros((4, 3), candle_core::DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "targets".to_string(),
            Tensor::zeros(4, candle_core::DType::F32, &Device::Cpu).unwrap(),
        ),
    ]);
    candle_core::safetensors::save(&tensors, &bad).unwrap();
    let (ok, stderr) = train_binary(&["--steps", "1", "--data", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(stderr.contains("expected i64 [n]"), "{stderr}");
}

#[test]
fn metrics_report_the_process_peak_heap_counted_by_the_binary() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let (ok, stderr) = train_binary(&[
        "--steps",
        "3",
        "--world-size",
        "2",
        "--hidden",
        "256,256",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(ok, "{stderr}");
    let lines = common::metrics(&metrics);
    assert_eq!(lines.len(), 3);
    for line in &lines {
        let peak = line["peak_heap_bytes"]
            .as_u64()
            .expect("the train binary counts its heap");
        // At least both ranks' replicas of the weights exist at once.
        let replica = line["memory"]["params"].as_u64().unwrap();
        assert!(peak > replica, "peak {peak} <= one rank's params {replica}");
    }
    // A peak never goes down.
    let peaks: Vec<u64> = lines
        .iter()
        .map(|l| l["peak_heap_bytes"].as_u64().unwrap())
        .collect();
    assert!(peaks.windows(2).all(|w| w[0] <= w[1]), "{peaks:?}");
}

#[test]
fn every_overlap_schedule_trains_the_same_weights_bitwise() {
    let common = [
        "--steps",
        "6",
        "--hidden",
        "16,16",
        "--world-size",
        "2",
        "--batch-size",
        "8",
        "--bucket-mb",
        "0.001",
        "--grad-accum",
        "2",
    ];
    for stage in ["0", "1", "2"] {
        let with = |overlap: &str| {
            weights(&[&common[..], &["--stage", stage, "--overlap", overlap]].concat())
        };
        let serial = with("none");
        for overlap in ["after-backward", "interleaved"] {
            assert_eq!(
                max_abs_diff(&serial, &with(overlap)),
                0.0,
                "stage {stage}, --overlap {overlap}"
            );
            if stage != "0" {
                let (deferred, deferred_weights) = train_weights(
                    &[
                        &common[..],
                        &["--stage", stage, "--overlap", overlap, "--defer-gathers"],
                    ]
                    .concat(),
                );
                assert_eq!(
                    max_abs_diff(&serial, &deferred_weights),
                    0.0,
                    "stage {stage}, --overlap {overlap} --defer-gathers"
                );
                // Six steps of two micro-steps: every step deferred.
                assert_eq!(
                    deferred.deferred_steps, 6,
                    "stage {stage}, --overlap {overlap}"
                );
            }
        }
    }
}

#[test]
fn deferred_gathers_train_the_gpt_of_gathers_in_the_step_bitwise() {
    // Every layer of the GPT waits for its own parameters (a tied
    // embedding, layer norms), and sampling after training reads them.
    let gpt = [
        "--model",
        "gpt",
        "--steps",
        "3",
        "--world-size",
        "2",
        "--sample",
        "8",
    ];
    let (gathered, gathered_weights) = train_weights(&gpt);
    let (deferred, deferred_weights) = train_weights(&[&gpt[..], &["--defer-gathers"]].concat());
    assert_eq!(gathered.deferred_steps, 0);
    assert_eq!(
        deferred.deferred_steps, 3,
        "the tied head is hooked: every step defers"
    );
    assert_eq!(max_abs_diff(&gathered_weights, &deferred_weights), 0.0);
    assert_eq!(gathered.sample, deferred.sample);
    let argv = ["train", "--quiet", "--stage", "0", "--defer-gathers"];
    let err = run(&Args::parse_from(argv)).expect_err("nothing to defer at stage 0");
    assert!(err.to_string().contains("--stage 1 or 2"), "{err}");
}

#[test]
fn stage_3_on_a_gpu_backend_needs_only_the_gpu_build() {
    // Stage 3 runs on the GPU backends: what stops it here is this build,
    // which has no `nccl` feature, and the error says which build it needs.
    for backend in ["nccl", "cuda-threads"] {
        let argv = ["train", "--quiet", "--backend", backend, "--stage", "3"];
        let err = run(&Args::parse_from(argv)).expect_err("no GPU build");
        assert!(
            err.to_string().contains("--features nccl"),
            "{backend}: {err}"
        );
    }
}

#[test]
fn the_ranks_in_this_process_decide_the_process_settings() {
    let threads = Args::parse_from(["train", "--world-size", "3"]);
    assert_eq!(threads.ranks_in_process(), 3);
    for backend in ["mpi", "nccl"] {
        let args = Args::parse_from(["train", "--world-size", "3", "--backend", backend]);
        assert_eq!(args.ranks_in_process(), 1, "{backend}: a process per rank");
    }
}

#[test]
fn stage_3_trains_the_weights_of_stage_2_bitwise() {
    // Weights of 16x16 and 16x8 elements: sharded with --persist-numel 64,
    // biases replicated; accumulation and tiny buckets on three ranks; and
    // the GPT (a tied embedding, layer norms, sampling on every rank).
    let mlp = [
        "--steps",
        "5",
        "--hidden",
        "16,16",
        "--world-size",
        "3",
        "--batch-size",
        "6",
        "--bucket-mb",
        "0.0005",
        "--grad-accum",
        "2",
        "--persist-numel",
        "64",
    ];
    let gpt = [
        "--model",
        "gpt",
        "--steps",
        "3",
        "--world-size",
        "2",
        "--persist-numel",
        "1000",
        "--sample",
        "8",
    ];
    for common in [&mlp[..], &gpt[..]] {
        let (stage2, stage2_weights) = train_weights(&[common, &["--stage", "2"]].concat());
        for extra in [&["--prefetch-mb", "64"][..], &["--prefetch-mb", "0"][..]] {
            let (stage3, stage3_weights) =
                train_weights(&[common, &["--stage", "3"], extra].concat());
            assert_eq!(
                max_abs_diff(&stage2_weights, &stage3_weights),
                0.0,
                "{common:?} {extra:?}"
            );
            assert_eq!(stage2.sample, stage3.sample);
        }
        // Layers gathered in 256-byte pieces: split rows are summed in
        // another order than one matmul, so the weights agree to f32
        // rounding (4e-9 for the GPT), while a missing or wrong piece
        // would move them by about a step (the GPT's three SGD steps move
        // its weights by 5e-5 in the median, up to 3e-2).
        // SGD, not the default AdamW: Adam divides a gradient that is near
        // 0 by its own size, so rounding noise in it becomes a difference
        // in the step (4e-5 in one GPT weight after the first step; see
        // tests/gpt.rs).
        let sgd = ["--optimizer", "sgd", "--momentum", "0.9"];
        let stage2 = weights(&[common, &sgd[..], &["--stage", "2"]].concat());
        let pieces = ["--stage", "3", "--gather-mb", "0.000244140625"];
        let stage3 = weights(&[common, &sgd[..], &pieces[..]].concat());
        let (diff, name) = max_diff(&stage2, &stage3);
        assert!(diff < 1e-5, "{common:?} in pieces: {diff} in {name}");
    }
}

#[test]
fn a_stage_3_run_resumes_at_another_world_size_and_stage() {
    // Saved by stage 3 at two ranks after sharding (step 4), resumed at
    // three ranks by stage 3 and by stage 2 with the same global batch:
    // both follow a straight stage-2 run within float noise (three ranks
    // sum the gradients in another grouping than two).
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let common = ["--hidden", "64,64", "--persist-numel", "256"];
    train(
        &[
            &common[..],
            &[
                "--stage",
                "3",
                "--steps",
                "4",
                "--world-size",
                "2",
                "--batch-size",
                "12",
                "--checkpoint-dir",
                ckpt,
                "--checkpoint-every",
                "4",
            ],
        ]
        .concat(),
    );
    let straight = weights(
        &[
            &common[..],
            &[
                "--stage",
                "2",
                "--steps",
                "8",
                "--world-size",
                "2",
                "--batch-size",
                "12",
            ],
        ]
        .concat(),
    );
    for stage in ["3", "2"] {
        let resumed = weights(
            &[
                &common[..],
                &[
                    "--stage",
                    stage,
                    "--steps",
                    "8",
                    "--world-size",
                    "3",
                    "--batch-size",
                    "8",
                    "--resume",
                    ckpt,
                ],
            ]
            .concat(),
        );
        let diff = max_abs_diff(&straight, &resumed);
        assert!(diff < 1e-5, "stage {stage}: {diff}");
    }
}

#[test]
fn interleaved_overlap_with_clipping_is_a_usage_error() {
    let argv = [
        "train",
        "--quiet",
        "--overlap",
        "interleaved",
        "--clip-norm",
        "1",
    ];
    let err = run(&Args::parse_from(argv)).expect_err("interleaved cannot clip");
    assert!(
        err.to_string().contains("--overlap after-backward"),
        "{err}"
    );
}

#[test]
fn offload_where_it_cannot_be_is_a_usage_error_saying_what_to_do() {
    // The threads backend keeps everything in host memory already.
    let argv = ["train", "--quiet", "--stage", "2", "--offload", "optimizer"];
    let err = run(&Args::parse_from(argv)).expect_err("nothing to offload on threads");
    assert!(err.to_string().contains("--backend nccl"), "{err}");
    // Stage 0 has no shard to offload (checked before any GPU is touched).
    let argv = [
        "train",
        "--quiet",
        "--backend",
        "nccl",
        "--stage",
        "0",
        "--offload",
        "optimizer",
    ];
    let err = run(&Args::parse_from(argv)).expect_err("no shard to offload");
    assert!(err.to_string().contains("--stage 1, 2 or 3"), "{err}");
}

#[test]
fn offloaded_shards_are_page_locked_unless_the_user_says_not_to() {
    use zero_examples::trainer::engine_config;
    let offload = ["--backend", "nccl", "--offload", "optimizer"];
    assert!(engine_config(&args(&offload)).offload_pin_memory);
    let mut unpinned = offload.to_vec();
    unpinned.extend(["--offload-pinned", "false"]);
    assert!(!engine_config(&args(&unpinned)).offload_pin_memory);
    // The transfers on the compute stream unless asked for a stream of
    // their own.
    assert!(!engine_config(&args(&offload)).offload_copy_stream);
    let mut copy_stream = offload.to_vec();
    copy_stream.push("--offload-copy-stream");
    assert!(engine_config(&args(&copy_stream)).offload_copy_stream);
}

/// Offloaded at stage 1 or 2, the host steps each bucket as it lands
/// unless told otherwise or clipping needs every gradient first.
#[test]
fn offload_steps_buckets_as_they_land_unless_asked_otherwise() {
    use zero_core::engine::Overlap;
    use zero_examples::trainer::engine_config;
    let overlap = |flags: &[&str]| engine_config(&args(flags)).overlap;
    let offload = ["--backend", "nccl", "--offload", "optimizer"];
    for stage in ["1", "2"] {
        let flags = [&offload[..], &["--stage", stage]].concat();
        assert_eq!(overlap(&flags), Overlap::Interleaved, "stage {stage}");
    }
    let cases: [&[&str]; 5] = [
        &[],
        &["--stage", "2"],
        &[
            "--stage",
            "3",
            "--backend",
            "nccl",
            "--offload",
            "optimizer",
        ],
        &[&offload[..], &["--clip-norm", "1.0"]].concat(),
        &[&offload[..], &["--overlap", "after-backward"]].concat(),
    ];
    for flags in cases {
        assert_eq!(overlap(flags), Overlap::AfterBackward, "{flags:?}");
    }
    // The norm is there to report only when every gradient is.
    assert!(!engine_config(&args(&offload)).compute_grad_norm);
    assert!(engine_config(&args(&[])).compute_grad_norm);
}

#[test]
fn a_copy_stream_without_offload_is_a_usage_error() {
    let argv = ["train", "--quiet", "--offload-copy-stream"];
    let err = run(&Args::parse_from(argv)).expect_err("nothing to copy");
    assert!(
        err.to_string().contains("with --offload optimizer"),
        "{err}"
    );
}

#[test]
fn the_gpu_backends_refuse_what_they_do_not_train_before_touching_a_gpu() {
    for backend in ["nccl", "cuda-threads"] {
        let argv = [
            "train",
            "--quiet",
            "--backend",
            backend,
            "--precision",
            "bf16",
            "--no-master-weights",
        ];
        let err = run(&Args::parse_from(argv)).expect_err("no masters on a GPU backend");
        assert!(
            err.to_string().contains("master weights"),
            "{backend}: {err}"
        );
    }
    // Without the `nccl` feature the backend says which build it needs.
    #[cfg(not(feature = "nccl"))]
    {
        let argv = [
            "train",
            "--quiet",
            "--backend",
            "cuda-threads",
            "--steps",
            "1",
        ];
        let err = run(&Args::parse_from(argv)).expect_err("no CUDA in this build");
        assert!(err.to_string().contains("--features nccl"), "{err}");
    }
}
