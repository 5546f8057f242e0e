//! `train --model gpt` as a user runs it, on text each test writes: it
//! learns, trains the same weights at any world size, resumes from a
//! checkpoint, generates deterministically, and its tied head/embedding
//! weight gets the gradients of both uses.

mod common;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::VarMap;
use clap::Parser;
use common::{max_diff, Weights};
use std::collections::HashMap;
use std::path::Path;
use zero_examples::trainer::{run, Args, Gpt, GptConfig, GptOps, Summary};

/// A corpus with obvious structure: one short sentence, repeated.
fn write_corpus(dir: &Path) -> String {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, "the quick brown fox jumps. ".repeat(200)).unwrap();
    path.to_str().unwrap().to_string()
}

/// A tiny GPT's flags on `corpus`.
fn tiny(corpus: &str) -> Vec<String> {
    [
        "train",
        "--quiet",
        "--model",
        "gpt",
        "--data",
        corpus,
        "--layers",
        "1",
        "--heads",
        "2",
        "--d-model",
        "32",
        "--context",
        "16",
        "--seed",
        "5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn args(base: &[String], extra: &[&str]) -> Args {
    let mut argv = base.to_vec();
    argv.extend(extra.iter().map(|s| s.to_string()));
    Args::parse_from(&argv)
}

fn train(base: &[String], extra: &[&str]) -> Summary {
    common::train(&args(base, extra))
}

/// The weights a run saved.
fn weights(base: &[String], extra: &[&str]) -> Weights {
    common::train_weights(args(base, extra)).1
}

#[test]
fn validation_loss_falls_below_half_a_nat_within_60_steps() {
    let dir = tempfile::tempdir().unwrap();
    let base = tiny(&write_corpus(dir.path()));
    let metrics = dir.path().join("metrics.jsonl");
    let plot = dir.path().join("loss.png");
    let summary = train(
        &base,
        &[
            "--world-size",
            "2",
            "--batch-size",
            "8",
            "--steps",
            "60",
            "--eval-every",
            "20",
            "--metrics",
            metrics.to_str().unwrap(),
            "--plot",
            plot.to_str().unwrap(),
        ],
    );
    // Uniform guessing over 256 bytes costs ln 256 = 5.5 nats; the corpus
    // is one repeated sentence, so a model that learned it is near 0.
    let val = summary.val_loss.unwrap();
    assert!(val < 0.5, "validation loss {val} after 60 steps");
    let measured: Vec<u64> = common::metrics(&metrics)
        .into_iter()
        .filter(|v| v["val_loss"].is_f64())
        .map(|v| v["step"].as_u64().unwrap())
        .collect();
    assert_eq!(measured, vec![20, 40, 60]);
    // A PNG: the signature, then an IHDR chunk with the plot's size.
    let png = std::fs::read(&plot).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(&png[12..16], b"IHDR");
    let width = u32::from_be_bytes(png[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(png[20..24].try_into().unwrap());
    assert_eq!((width, height), (960, 600));
}

#[test]
fn world_size_four_trains_the_same_weights_as_one_rank_on_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let base = tiny(&write_corpus(dir.path()));
    // SGD with momentum, not Adam: the key part of `attn.qkv.bias` has a
    // true gradient of 0 (softmax ignores a shift shared by a row of
    // scores), so its computed gradient is rounding noise of ~1e-9 that
    // differs with the summation order, and Adam divides it by its own
    // size into a step of ~lr either way (2e-3 apart after 20 steps).
    let common = [
        "--steps",
        "20",
        "--stage",
        "2",
        "--eval-every",
        "0",
        "--optimizer",
        "sgd",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
    ];
    let single = weights(
        &base,
        &[&common[..], &["--world-size", "1", "--batch-size", "8"]].concat(),
    );
    let sharded = weights(
        &base,
        &[
            &common[..],
            &[
                "--world-size",
                "4",
                "--batch-size",
                "2",
                "--bucket-mb",
                "0.01",
            ],
        ]
        .concat(),
    );
    let (diff, name) = max_diff(&single, &sharded);
    assert!(
        diff < 1e-5,
        "W=1 and W=4 differ by {diff} in {name} after 20 steps"
    );
}

/// Trains 8 steps straight at W=2, and 4 steps, a checkpoint and a resume
/// with `resume_flags` to step 8; the largest weight difference.
fn resume_difference(extra: &[&str], resume_flags: &[&str]) -> (f32, String) {
    let dir = tempfile::tempdir().unwrap();
    let base = tiny(&write_corpus(dir.path()));
    let ckpt = dir.path().join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let w2 = [
        "--world-size",
        "2",
        "--batch-size",
        "4",
        "--eval-every",
        "0",
    ];
    let w2 = [&w2[..], extra].concat();
    let full = weights(&base, &[&w2[..], &["--steps", "8"]].concat());
    let first_half = [
        "--steps",
        "4",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "4",
    ];
    train(&base, &[&w2[..], &first_half[..]].concat());
    let resume = ["--eval-every", "0", "--steps", "8", "--resume", ckpt];
    let resumed = weights(&base, &[extra, resume_flags, &resume[..]].concat());
    max_diff(&resumed, &full)
}

#[test]
fn resume_at_the_same_world_size_is_bitwise_identical() {
    let same = ["--world-size", "2", "--batch-size", "4"];
    assert_eq!(resume_difference(&[], &same).0, 0.0);
}

#[test]
fn resume_at_another_world_size_and_stage_sees_the_same_batches() {
    // SGD: see the world-size test for why not Adam.
    let sgd = ["--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9"];
    // The same global batch from one rank, at stage 1.
    let one_rank = ["--world-size", "1", "--batch-size", "8", "--stage", "1"];
    let (diff, name) = resume_difference(&sgd, &one_rank);
    assert!(diff < 1e-5, "{name} differs by {diff}");
}

#[test]
fn generation_is_deterministic_for_a_seed() {
    let dir = tempfile::tempdir().unwrap();
    let base = tiny(&write_corpus(dir.path()));
    let flags = [
        "--world-size",
        "1",
        "--steps",
        "3",
        "--eval-every",
        "0",
        "--sample",
        "40",
        "--prompt",
        "the ",
    ];
    let a = train(&base, &flags);
    let b = train(&base, &flags);
    let sample = a.sample.unwrap();
    assert_eq!(sample.len(), 40);
    assert_eq!(Some(sample), b.sample);
}

#[test]
fn bad_gpt_flags_and_missing_text_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let mut argv = tiny(&corpus);
    let heads = argv.iter().position(|a| a == "--heads").unwrap();
    argv[heads + 1] = "3".into();
    let err = run(&Args::parse_from(&argv)).unwrap_err().to_string();
    assert!(err.contains("--heads 3"), "{err}");
    // The flags' ranges bound the shape; a `GptConfig` built in code whose
    // parameter count would overflow is refused too.
    let beyond = GptConfig {
        layers: (1 << 24) + 1,
        heads: 1,
        d_model: 1,
        context: 1,
    };
    let err = beyond.validate().unwrap_err().to_string();
    assert!(err.contains("at most 16777216"), "{err}");
    let huge = GptConfig {
        layers: 1 << 24,
        heads: 1,
        d_model: 1 << 24,
        context: 1,
    };
    let err = huge.validate().unwrap_err().to_string();
    assert!(err.contains("more than this machine can count"), "{err}");
    assert_eq!(huge.num_params(), usize::MAX);
    let mut argv = tiny(dir.path().join("absent.txt").to_str().unwrap());
    argv.extend(["--steps", "1"].map(String::from));
    let err = run(&Args::parse_from(&argv)).unwrap_err().to_string();
    assert!(
        err.contains("absent.txt") && err.contains("cannot read"),
        "{err}"
    );
}

/// The same transformer from plain candle-nn layers and tensor ops, with
/// the head's weight a separate variable holding a copy of the embedding
/// table: its gradient and the embedding's are the two uses' parts.
struct Reference {
    vars: HashMap<String, Var>,
    head: Var,
    config: GptConfig,
}

impl Reference {
    fn new(varmap: &VarMap, config: GptConfig) -> Self {
        let data = varmap.data().lock().unwrap();
        let vars: HashMap<String, Var> = data
            .iter()
            .map(|(name, var)| {
                let copy = var.as_tensor().copy().unwrap();
                (name.clone(), Var::from_tensor(&copy).unwrap())
            })
            .collect();
        let head = Var::from_tensor(&data["wte.weight"].as_tensor().copy().unwrap()).unwrap();
        Self { vars, head, config }
    }

    fn get(&self, name: &str) -> Tensor {
        self.vars[name].as_tensor().clone()
    }

    fn linear(&self, name: &str, x: &Tensor) -> Tensor {
        candle_nn::Linear::new(
            self.get(&format!("{name}.weight")),
            Some(self.get(&format!("{name}.bias"))),
        )
        .forward(x)
        .unwrap()
    }

    /// Layer norm from tensor ops (candle-nn's fused one has no weight
    /// gradient).
    fn layer_norm(&self, name: &str, x: &Tensor) -> Tensor {
        let mean = x.mean_keepdim(D::Minus1).unwrap();
        let centered = x.broadcast_sub(&mean).unwrap();
        let var = centered.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let normed = centered
            .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
            .unwrap();
        normed
            .broadcast_mul(&self.get(&format!("{name}.weight")))
            .unwrap()
            .broadcast_add(&self.get(&format!("{name}.bias")))
            .unwrap()
    }

    fn loss(&self, ids: &Tensor) -> Tensor {
        let (batch, len) = ids.dims2().unwrap();
        let time = len - 1;
        let (d, heads) = (self.config.d_model, self.config.heads);
        let head_dim = d / heads;
        let inputs = ids.narrow(1, 0, time).unwrap();
        let targets = ids.narrow(1, 1, time).unwrap().flatten_all().unwrap();
        let wte = candle_nn::Embedding::new(self.get("wte.weight"), d);
        let positions = Tensor::arange(0u32, time as u32, &Device::Cpu).unwrap();
        let wpe = candle_nn::Embedding::new(self.get("wpe.weight"), d);
        let mut x = wte
            .forward(&inputs)
            .unwrap()
            .broadcast_add(&wpe.forward(&positions).unwrap())
            .unwrap();
        let mask: Vec<f32> = (0..time)
            .flat_map(|i| (0..time).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (time, time), &Device::Cpu).unwrap();
        for i in 0..self.config.layers {
            let p = format!("blocks.{i}");
            let h = self.layer_norm(&format!("{p}.ln1"), &x);
            let qkv = self
                .linear(&format!("{p}.attn.qkv"), &h)
                .reshape((batch, time, 3, heads, head_dim))
                .unwrap();
            let part = |i: usize| {
                qkv.narrow(2, i, 1)
                    .unwrap()
                    .squeeze(2)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let (q, k, v) = (part(0), part(1), part(2));
            let scores = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap()
                / (head_dim as f64).sqrt())
            .unwrap();
            let weights =
                candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
            let y = weights
                .matmul(&v)
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .reshape((batch, time, d))
                .unwrap();
            x = (x + self.linear(&format!("{p}.attn.proj"), &y)).unwrap();
            let h = self.layer_norm(&format!("{p}.ln2"), &x);
            let h = self.linear(&format!("{p}.mlp.fc"), &h).gelu().unwrap();
            x = (x + self.linear(&format!("{p}.mlp.proj"), &h)).unwrap();
        }
        let x = self
            .layer_norm("ln_f", &x)
            .reshape((batch * time, d))
            .unwrap();
        let logits = x.matmul(&self.head.as_tensor().t().unwrap()).unwrap();
        candle_nn::loss::cross_entropy(&logits, &targets).unwrap()
    }
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Both ways of computing the model ([`GptOps`]) against the plain
/// candle-nn reference: the fused attention, GELU and loss give the
/// composed ops' values and gradients.
#[test]
fn the_tied_embedding_gets_the_sum_of_the_embedding_and_head_gradients() {
    for ops in [GptOps::Fused, GptOps::FusedGeluKept, GptOps::Composed] {
        tied_embedding_gradients(ops);
    }
}

/// The GELU on the projection's input (recomputed in the backward) and in
/// the first Linear's epilogue (kept) compute the same bits: the same
/// rounded pre-activation goes through the same activation either way.
#[test]
fn the_gelu_on_the_projection_s_input_gives_the_bits_of_the_gelu_kept() {
    let config = GptConfig {
        layers: 2,
        heads: 2,
        d_model: 16,
        context: 8,
    };
    let ids: Vec<u32> = (0..3 * 9).map(|i| (i * 53 % 256) as u32).collect();
    let ids = Tensor::from_vec(ids, (3, 9), &Device::Cpu).unwrap();
    let run = |ops: GptOps| {
        let varmap = VarMap::new();
        let model = Gpt::new(&varmap, config, 5, &Device::Cpu)
            .unwrap()
            .with_ops(ops);
        let loss = model.loss(&ids).unwrap();
        let grads = loss.backward().unwrap();
        let data = varmap.data().lock().unwrap();
        let mut names: Vec<String> = data.keys().cloned().collect();
        names.sort();
        let grads: Vec<Vec<f32>> = names
            .iter()
            .map(|name| {
                let grad = grads.get(data[name].as_tensor()).unwrap();
                grad.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            })
            .collect();
        (loss.to_scalar::<f32>().unwrap(), names, grads)
    };
    let (on_input, kept) = (run(GptOps::Fused), run(GptOps::FusedGeluKept));
    assert_eq!(on_input.0.to_bits(), kept.0.to_bits(), "the losses");
    assert_eq!(on_input.1, kept.1);
    for (name, (a, b)) in on_input.1.iter().zip(on_input.2.iter().zip(&kept.2)) {
        assert!(a.iter().any(|v| *v != 0.0), "{name}: a gradient of zeros");
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{name}: the gradients differ");
    }
}

fn tied_embedding_gradients(ops: GptOps) {
    let config = GptConfig {
        layers: 2,
        heads: 2,
        d_model: 16,
        context: 8,
    };
    let varmap = VarMap::new();
    let model = Gpt::new(&varmap, config, 11, &Device::Cpu)
        .unwrap()
        .with_ops(ops);
    let ids: Vec<u32> = (0..3 * 9).map(|i| (i * 37 % 256) as u32).collect();
    let ids = Tensor::from_vec(ids, (3, 9), &Device::Cpu).unwrap();
    let reference = Reference::new(&varmap, config);

    let loss = model.loss(&ids).unwrap();
    let ref_loss = reference.loss(&ids);
    let loss_diff = max_abs(&loss, &ref_loss);
    assert!(loss_diff < 1e-5, "{ops:?}: losses differ by {loss_diff}");

    let grads = loss.backward().unwrap();
    let ref_grads = ref_loss.backward().unwrap();
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for name in names {
        let grad = grads.get(data[name].as_tensor()).unwrap();
        let mut expected = ref_grads
            .get(reference.vars[name].as_tensor())
            .unwrap()
            .clone();
        if name == "wte.weight" {
            let head = ref_grads.get(reference.head.as_tensor()).unwrap();
            // Both uses contribute: neither part alone is the gradient.
            assert!(max_abs(grad, &expected) > 1e-4);
            assert!(max_abs(grad, head) > 1e-4);
            expected = (expected + head).unwrap();
        }
        let diff = max_abs(grad, &expected);
        assert!(diff < 1e-5, "{ops:?} {name}: gradient differs by {diff}");
    }
    assert_eq!(model.config(), config);
    assert_eq!(DType::F32, loss.dtype());
}

#[test]
fn checkpoint_activations_trains_the_same_weights_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let mut base = tiny(&write_corpus(dir.path()));
    // Two blocks: the second's input gradient goes through the first's
    // recompute.
    let layers = base.iter().position(|a| a == "--layers").unwrap();
    base[layers + 1] = "2".into();
    for stage in ["2", "3"] {
        let run = [
            "--world-size",
            "2",
            "--batch-size",
            "4",
            "--steps",
            "4",
            "--eval-every",
            "0",
            "--stage",
            stage,
            "--persist-numel",
            "0",
            "--clip-norm",
            "1.0",
        ];
        let plain = weights(&base, &run);
        let recomputed = weights(&base, &[&run[..], &["--checkpoint-activations"]].concat());
        assert_eq!(plain, recomputed, "stage {stage}");
    }
}

#[test]
fn checkpoint_activations_resumes_a_checkpoint_saved_without() {
    let with = [
        "--world-size",
        "2",
        "--batch-size",
        "4",
        "--checkpoint-activations",
    ];
    assert_eq!(resume_difference(&[], &with).0, 0.0);
}

#[test]
fn checkpoint_activations_is_refused_for_the_mlp() {
    let args = Args::parse_from([
        "train",
        "--quiet",
        "--steps",
        "1",
        "--checkpoint-activations",
    ]);
    let err = run(&args).expect_err("refused").to_string();
    assert!(err.contains("--model gpt"), "{err}");
}

/// `GptConfig::num_params` (what `bench gpu-largest` and `gpu-headline`
/// size their models by) counts the variables a built GPT has.
#[test]
fn the_parameter_count_is_the_built_models() {
    for (layers, heads, d_model, context) in [(1, 2, 32, 16), (3, 4, 48, 24)] {
        let config = GptConfig {
            layers,
            heads,
            d_model,
            context,
        };
        let varmap = VarMap::new();
        Gpt::new(&varmap, config, 0, &Device::Cpu).unwrap();
        let built: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
        assert_eq!(config.num_params(), built, "{config:?}");
    }
}
