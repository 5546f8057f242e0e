//! What the trainer's integration tests share: a run whose weights come
//! back from the file `--save` writes (the trainer keeps no copy of them),
//! the largest difference between two runs' weights, and the lines of a
//! `--metrics` file.

// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::path::Path;
use zero_examples::trainer::{read_weights, run, Args, Summary};

/// Every trained tensor by name (sorted), as f32.
pub type Weights = Vec<(String, Vec<f32>)>;

/// Runs `args`, panicking with them if training fails.
pub fn train(args: &Args) -> Summary {
    match run(args) {
        Ok(summary) => summary,
        Err(e) => panic!("training with {args:?} failed: {e}"),
    }
}

/// Runs `args` with `--save` (to a temporary file unless `args` names
/// one) and reads the weights the run wrote.
pub fn train_weights(mut args: Args) -> (Summary, Weights) {
    let dir = tempfile::tempdir().unwrap();
    let path = args
        .save
        .get_or_insert_with(|| dir.path().join("weights.safetensors"))
        .clone();
    let summary = train(&args);
    let weights = match read_weights(&path) {
        Ok(weights) => weights,
        Err(e) => panic!("reading the weights of {args:?} failed: {e}"),
    };
    (summary, weights)
}

/// The largest difference between two runs' weights, and the tensor where
/// it is. Both runs must have the same tensors.
pub fn max_diff(a: &Weights, b: &Weights) -> (f32, String) {
    let names = |w: &Weights| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b));
    let mut worst = (0.0f32, String::new());
    for ((name, wa), (_, wb)) in a.iter().zip(b) {
        assert_eq!(wa.len(), wb.len(), "{name}");
        for (x, y) in wa.iter().zip(wb) {
            if (x - y).abs() > worst.0 {
                worst = ((x - y).abs(), name.clone());
            }
        }
    }
    worst
}

/// The JSON objects of a `--metrics` file, one per step.
pub fn metrics(path: &Path) -> Vec<serde_json::Value> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}
