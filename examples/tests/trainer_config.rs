//! `--config FILE`: a run configured by a TOML file is the run its flags
//! describe, the command line wins over the file (also with a flag's
//! default value), and a bad file is a usage error naming it and the key.

mod common;

use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::Command;
use zero_examples::trainer::{Args, LrDecayArg, OptimizerKind, TrainError};

/// Writes `text` to `config.toml` in `dir`.
fn config_file(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `train --config FILE FLAGS...`.
fn parse(config: &Path, flags: &[&str]) -> Result<Args, TrainError> {
    let mut argv = vec!["train", "--config", config.to_str().unwrap()];
    argv.extend_from_slice(flags);
    Args::parse_with_config(argv)
}

/// `path` as a TOML string.
fn toml_path(path: &Path) -> String {
    toml::Value::String(path.to_str().unwrap().into()).to_string()
}

/// The (step, loss, learning rate) of every step a `--metrics` file
/// records.
fn losses_and_rates(metrics: &Path) -> Vec<(u64, f64, f64)> {
    common::metrics(metrics)
        .iter()
        .map(|l| {
            let number = |k: &str| l[k].as_f64().unwrap();
            (l["step"].as_u64().unwrap(), number("loss"), number("lr"))
        })
        .collect()
}

#[test]
fn a_run_configured_by_a_file_is_the_run_of_the_same_flags() {
    let dir = tempfile::tempdir().unwrap();
    let (file_metrics, file_weights) = (dir.path().join("f.jsonl"), dir.path().join("f.st"));
    // No value is the flag's default, and every kind of flag is there: a
    // number, a float, a name, lists (one of two values), a switch, a
    // true/false flag, text and paths; one key in snake_case.
    let config = config_file(
        dir.path(),
        &format!(
            "world-size = 2\n\
             hidden = [16, 8]\n\
             steps = 4\n\
             batch_size = 8\n\
             optimizer = \"sgd\"\n\
             lr = 3e-2\n\
             momentum = 0.9\n\
             betas = [0.8, 0.99]\n\
             nesterov = true\n\
             warmup-steps = 1\n\
             lr-decay = \"cosine\"\n\
             min-lr = 1e-3\n\
             seed = 3\n\
             clip-norm = 1.0\n\
             offload-pinned = false\n\
             loss-scale = 1024\n\
             quiet = true\n\
             metrics = {}\n\
             save = {}\n",
            toml_path(&file_metrics),
            toml_path(&file_weights)
        ),
    );
    let (flag_metrics, flag_weights) = (dir.path().join("a.jsonl"), dir.path().join("a.st"));
    let flags = [
        "train",
        "--world-size",
        "2",
        "--hidden",
        "16,8",
        "--steps",
        "4",
        "--batch-size",
        "8",
        "--optimizer",
        "sgd",
        "--lr",
        "0.03",
        "--momentum",
        "0.9",
        "--betas",
        "0.8,0.99",
        "--nesterov",
        "--warmup-steps",
        "1",
        "--lr-decay",
        "cosine",
        "--min-lr",
        "0.001",
        "--seed",
        "3",
        "--clip-norm",
        "1",
        "--offload-pinned",
        "false",
        "--loss-scale",
        "1024",
        "--quiet",
        "--metrics",
        flag_metrics.to_str().unwrap(),
        "--save",
        flag_weights.to_str().unwrap(),
    ];
    let by_flags = Args::parse_from(flags);
    let by_file = parse(&config, &[]).unwrap();
    assert_eq!(by_file.config.as_deref(), Some(config.as_path()));
    // Every field, the output paths and the file itself aside.
    let mut same_paths = by_file.clone();
    same_paths.config = None;
    same_paths.metrics.clone_from(&by_flags.metrics);
    same_paths.save.clone_from(&by_flags.save);
    assert_eq!(format!("{same_paths:?}"), format!("{by_flags:?}"));

    let (_, trained_by_flags) = common::train_weights(by_flags);
    let (_, trained_by_file) = common::train_weights(by_file);
    assert_eq!(common::max_diff(&trained_by_file, &trained_by_flags).0, 0.0);
    let steps = losses_and_rates(&file_metrics);
    assert_eq!(steps.len(), 4);
    assert_eq!(steps, losses_and_rates(&flag_metrics));
}

#[test]
fn the_command_line_wins_over_the_file_even_with_a_default_value() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(
        dir.path(),
        "steps = 3\n\
         lr = 0.05\n\
         seed = 7\n\
         optimizer = \"sgd\"\n\
         hidden = [8, 8]\n\
         nesterov = false\n\
         offload-pinned = false\n\
         lr-decay = \"linear\"\n",
    );
    // Each flag given here has its default value but `--hidden` and
    // `--nesterov`.
    let args = parse(
        &config,
        &[
            "--seed",
            "0",
            "--lr",
            "0.01",
            "--optimizer",
            "adamw",
            "--hidden",
            "16",
            "--nesterov",
            "--offload-pinned",
            "true",
            "--lr-decay",
            "constant",
        ],
    )
    .unwrap();
    assert_eq!(args.steps, 3, "from the file");
    assert_eq!(args.seed, 0);
    assert_eq!(args.lr, 0.01);
    assert_eq!(args.optimizer, OptimizerKind::Adamw);
    assert_eq!(args.hidden, [16], "replaced, not appended to");
    assert!(args.nesterov);
    assert!(args.offload_pinned);
    assert_eq!(args.lr_decay, LrDecayArg::Constant);

    // And the run is that of the command line's seed, not the file's.
    let run = |flags: &[&str]| {
        let common = ["--quiet", "--steps", "2", "--hidden", "16"];
        common::train_weights(parse(&config, &[&common[..], flags].concat()).unwrap()).1
    };
    let seed_0 = common::train_weights(Args::parse_from([
        "train",
        "--quiet",
        "--steps",
        "2",
        "--hidden",
        "16",
        "--lr",
        "0.05",
        "--optimizer",
        "sgd",
        "--lr-decay",
        "linear",
        "--offload-pinned",
        "false",
    ]))
    .1;
    assert_eq!(common::max_diff(&run(&["--seed", "0"]), &seed_0).0, 0.0);
    assert!(
        common::max_diff(&run(&[]), &seed_0).0 > 0.0,
        "seed 7 trains others"
    );
}

#[test]
fn a_bad_file_is_a_usage_error_naming_the_file_and_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str)] = &[
        (
            "wrold-size = 2\n",
            &[],
            "unknown key `wrold-size`; the keys are the long flags of `train --help`",
        ),
        ("help = true\n", &[], "unknown key `help`"),
        (
            "world-size = \"two\"\n",
            &[],
            "`world-size = \"two\"`: --world-size takes a number, not a TOML string",
        ),
        // Checked even where the command line overrides it.
        (
            "world-size = \"two\"\n",
            &["--world-size", "2"],
            "--world-size takes a number",
        ),
        (
            "world-size = 0\n",
            &[],
            "`world-size = 0`: invalid value '0' for '--world-size <WORLD_SIZE>': 0 is not in \
             1..=1024",
        ),
        (
            "steps = 2.5\n",
            &[],
            "`steps = 2.5`: invalid value '2.5' for '--steps <STEPS>'",
        ),
        (
            "nesterov = 1\n",
            &[],
            "`nesterov = 1`: --nesterov takes true or false, not a TOML integer",
        ),
        (
            "optimizer = \"adamm\"\n",
            &[],
            "[possible values: sgd, adam, adamw, adagrad, rmsprop]",
        ),
        (
            "lr = [0.1]\n",
            &[],
            "`lr = [0.1]`: --lr takes one value, not a TOML array",
        ),
        (
            "hidden = [16, \"8\"]\n",
            &[],
            "--hidden takes a number, not a TOML string",
        ),
        (
            "data = 5\n",
            &[],
            "--data takes a string, not a TOML integer",
        ),
        (
            "[model]\nlayers = 2\n",
            &[],
            "--model takes a string, not a TOML table",
        ),
        (
            "world-size = 2\nworld_size = 2\n",
            &[],
            "`world-size` and `world_size` are the same flag --world-size; give it once",
        ),
        (
            "config = \"other.toml\"\n",
            &[],
            "`config` names another file; a config file cannot include one",
        ),
        ("lr = \n", &[], "not a TOML file"),
    ];
    for (text, flags, needle) in cases {
        let config = config_file(dir.path(), text);
        let err = parse(&config, flags).expect_err("a bad file");
        let TrainError::Usage(message) = &err else {
            panic!("{text:?}: {err} is not a usage error");
        };
        let named = format!("--config {}: ", config.display());
        assert!(message.starts_with(&named), "{text:?}: {message:?}");
        assert!(
            message.contains(needle),
            "{text:?}: {message:?} lacks {needle:?}"
        );
    }

    let missing = dir.path().join("missing.toml");
    let err = parse(&missing, &[]).expect_err("no file");
    let message = err.to_string();
    assert!(matches!(err, TrainError::Usage(_)), "{message}");
    assert!(
        message.contains(&format!("--config {}: cannot read it", missing.display())),
        "{message}"
    );

    // The command line itself stays clap's to report (and to exit on).
    let config = config_file(dir.path(), "steps = 1\n");
    let err = parse(&config, &["--stepz", "1"]).expect_err("a bad flag");
    assert!(matches!(err, TrainError::CommandLine(_)), "{err}");
}

#[test]
fn the_binary_reports_a_bad_file_as_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = config_file(dir.path(), "wrold-size = 2\n");
    let out = Command::new(env!("CARGO_BIN_EXE_train"))
        .args(["--config", config.to_str().unwrap()])
        .output()
        .expect("run the train binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "error: --config {}: unknown key",
            config.display()
        )),
        "{stderr}"
    );
}
