//! What a user can get wrong is an error, never a panic or a hang:
//!
//! - every fixture's `config.json` with each key changed (to zero, to
//!   negative, fractional and huge numbers, to other types, removed; lists
//!   shortened, lengthened and with an entry changed; the same one level
//!   down, in `rope_parameters` and the like): reading it gives an error or
//!   a config; a config whose sizes are small builds a model that takes a
//!   step on the CPU, or is an error; changed less (zero, one, null, off
//!   by one or doubled) and read beside the fixture's own weights (which it
//!   may no longer match), it opens and trains one step, or is an error;
//! - a model whose variables a `ShardedVarMap` created, run before the
//!   optimizer filled them.

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use zero_candle::models::{CausalLm, HubConfig};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{ThreadComm, ThreadGroup};

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut dirs = vec![root.join("gpt2/tiny")];
    for entry in std::fs::read_dir(root.join("llama")).unwrap() {
        let path = entry.unwrap().path();
        if path.join("config.json").exists() {
            dirs.push(path);
        }
    }
    dirs.sort();
    dirs
}

fn config_of(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

/// How much of a config to change.
#[derive(Clone, Copy, PartialEq)]
enum Changes {
    /// Every value below, huge numbers and other types included.
    Every,
    /// Values that keep a model small: zero, one, null, a number off by
    /// one or doubled, lists changed (what makes a config disagree with
    /// its weights).
    Small,
}

/// Values to put in place of `value`.
fn replacements(value: &Value, changes: Changes) -> Vec<Value> {
    let mut out = vec![json!(0), json!(1), json!(null)];
    if changes == Changes::Every {
        out.extend([
            json!(-1),
            json!(2),
            json!(3),
            json!(0.5),
            json!(true),
            json!("x"),
            json!([]),
            json!({}),
            json!(1e9),
            json!(f64::MAX),
            json!(1u64 << 32),
            json!(1u64 << 40),
            json!(u64::MAX),
        ]);
    }
    if let Some(n) = value.as_u64() {
        out.extend([json!(n + 1), json!(n * 2), json!(n.saturating_sub(1))]);
    }
    if let Some(list) = value.as_array().filter(|l| !l.is_empty()) {
        out.push(json!(list[..list.len() - 1]));
        let mut longer = list.clone();
        longer.push(list[0].clone());
        out.push(json!(longer));
        for i in 0..list.len() {
            for entry in [
                json!(0),
                json!(-1),
                json!(null),
                json!("x"),
                json!(u64::MAX),
            ] {
                let mut changed = list.clone();
                changed[i] = entry;
                out.push(json!(changed));
            }
        }
    }
    out
}

/// `base` with one key (or one key of an object it holds) removed or
/// replaced, and what was done.
fn variants(base: &Value, changes: Changes) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (key, value) in base.as_object().unwrap() {
        let mut removed = base.clone();
        removed.as_object_mut().unwrap().remove(key);
        out.push((format!("without {key}"), removed));
        for replacement in replacements(value, changes) {
            let mut changed = base.clone();
            changed[key] = replacement.clone();
            out.push((format!("{key} = {replacement}"), changed));
        }
        for (inner, inner_value) in value.as_object().into_iter().flatten() {
            let mut removed = base.clone();
            removed[key].as_object_mut().unwrap().remove(inner);
            out.push((format!("without {key}.{inner}"), removed));
            for replacement in replacements(inner_value, changes) {
                let mut changed = base.clone();
                changed[key][inner] = replacement.clone();
                out.push((format!("{key}.{inner} = {replacement}"), changed));
            }
        }
    }
    out
}

/// Runs `check` on every variant of every fixture's config, catching
/// panics; the panics' messages, each with its fixture and variant, and
/// how many variants `check` passed.
fn panics_of(
    changes: Changes,
    check: impl Fn(&Path, &Value) -> Result<(), String>,
) -> (Vec<String>, usize) {
    let (mut panics, mut passed) = (Vec::new(), 0);
    for dir in fixtures() {
        let name = dir
            .strip_prefix(dir.parent().unwrap().parent().unwrap())
            .unwrap();
        for (what, config) in variants(&config_of(&dir), changes) {
            match catch_unwind(AssertUnwindSafe(|| check(&dir, &config))) {
                Ok(result) => passed += usize::from(result.is_ok()),
                Err(panic) => {
                    let message = panic_message(panic);
                    panics.push(format!("{}, {what}: {message}", name.display()));
                }
            }
        }
    }
    (panics, passed)
}

/// What a caught panic says.
fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    match panic.downcast::<String>() {
        Ok(message) => *message,
        Err(panic) => panic
            .downcast_ref::<&str>()
            .map_or(String::new(), |s| s.to_string()),
    }
}

/// Fails listing `failures`, if any.
fn assert_none(failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Ids every fixture's vocabulary holds.
fn ids() -> Tensor {
    Tensor::new(&[[0u32, 1, 1, 0, 1, 0, 0, 1, 1]], &Device::Cpu).unwrap()
}

/// Reads `config`; where its model is small, builds it fresh on the CPU and
/// takes one backward pass.
fn read_and_build(config: &Value) -> Result<(), String> {
    let config = HubConfig::from_json(config)?;
    if config.num_params() > 3_000_000 {
        return Ok(());
    }
    let map = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let model = CausalLm::new(vb, &config, None).map_err(|e| e.to_string())?;
    let loss = model.loss(&ids()).map_err(|e| e.to_string())?;
    loss.backward().map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn changed_configs_are_errors_or_models_never_panics() {
    let (panics, built) = panics_of(Changes::Every, |_, config| read_and_build(config));
    assert_none(&panics);
    // Most changes keep a buildable model: the check reached the step.
    assert!(built > 10_000, "{built} configs built");
}

/// Opens `config` beside the weights of the fixture `dir` and takes one
/// SGD step at stage 0 on one rank.
fn open_and_step(dir: &Path, config: &Value) -> Result<(), String> {
    let out = beside(dir, &["config.json"]);
    std::fs::write(out.path().join("config.json"), config.to_string()).unwrap();
    step_in(out.path())
}

/// A folder of links to the files of the fixture `dir` (`safetensors` and
/// `json`) but `except`.
fn beside(dir: &Path, except: &[&str]) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if path
            .extension()
            .is_some_and(|e| e == "safetensors" || e == "json")
            && !except.iter().any(|e| name == *e)
        {
            std::os::unix::fs::symlink(&path, out.path().join(name)).unwrap();
        }
    }
    out
}

/// Opens the hub folder `dir` and takes one SGD step at stage 0 on one
/// rank (a model of more than 3M parameters is only opened).
fn step_in(dir: &Path) -> Result<(), String> {
    let step = |comm: ThreadComm| -> zero_candle::Result<()> {
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let (config, map) = CausalLm::open_hub(dir)?;
        if config.num_params() > 3_000_000 {
            return Ok(());
        }
        let as_hook: std::sync::Arc<dyn zero_candle::nn::GradHook> = hook.clone();
        let model = CausalLm::new(
            map.builder(DType::F32, &Device::Cpu),
            &config,
            Some(as_hook),
        )?;
        let engine = EngineConfig::default().with_stage(Stage::Ddp);
        let sgd = Sgd::new(SgdConfig::default().with_lr(0.1))?;
        let mut opt = ZeroOptimizer::new_sharded(&map, comm, engine, Box::new(sgd), &hook)?;
        opt.backward_step(&model.loss(&ids())?)?;
        Ok(())
    };
    // A rank that panics is a panic here too.
    match ThreadGroup::new(1).run(step).remove(0) {
        Ok(stepped) => stepped.map_err(|e| e.to_string()),
        Err(panicked) => panic!("{panicked}"),
    }
}

#[test]
fn changed_configs_beside_the_weights_are_errors_or_train_never_panics() {
    let (panics, stepped) = panics_of(Changes::Small, open_and_step);
    assert_none(&panics);
    assert!(stepped > 5_000, "{stepped} configs stepped");
}

/// A width the file leaves out is made from another (GPT-J's and Falcon's
/// MLPs four times the model's): from a huge one, an error too.
#[test]
fn a_default_width_made_from_a_huge_one_is_an_error() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    for (fixture, width, inner) in [
        ("gptj", "n_embd", "n_inner"),
        ("falcon", "hidden_size", "ffn_hidden_size"),
    ] {
        let mut config = config_of(&root.join(fixture));
        config[width] = json!(u64::MAX);
        config.as_object_mut().unwrap().remove(inner);
        let err = HubConfig::from_json(&config).unwrap_err();
        assert!(
            err.contains("18446744073709551615 is above"),
            "{fixture}: {err}"
        );
    }
}

/// A `ShardedVarMap`'s variables hold no values until the optimizer fills
/// them: a model run before that, hooked or not, is an error naming the
/// fix, in every family (Candle's kernels would read past the storage).
#[test]
fn a_model_run_before_its_optimizer_is_an_error() {
    for dir in fixtures() {
        let (config, map) = CausalLm::open_hub(&dir).unwrap();
        let zero = ZeroHook::<ThreadComm, f32>::new();
        let as_hook: std::sync::Arc<dyn zero_candle::nn::GradHook> = zero;
        for hook in [None, Some(as_hook)] {
            let hooked = hook.is_some();
            let model =
                CausalLm::new(map.builder(DType::F32, &Device::Cpu), &config, hook).unwrap();
            let run = catch_unwind(AssertUnwindSafe(|| model.loss(&ids()).map(|_| ())));
            let err = match run {
                Ok(Ok(())) => panic!("{}: ran without values", dir.display()),
                Ok(Err(e)) => e.to_string(),
                Err(_) => panic!("{} (hooked: {hooked}): panicked", dir.display()),
            };
            assert!(
                err.contains("ZeroOptimizer::new_sharded"),
                "{}: {err}",
                dir.display()
            );
        }
    }
}

/// `model.safetensors`' bytes as its header (JSON) and its data.
fn split_safetensors(bytes: &[u8]) -> (Value, &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&bytes[8..8 + n]).unwrap(),
        &bytes[8 + n..],
    )
}

/// A safetensors file of `header` (and `pad` spaces after it) and `data`.
fn join_safetensors(header: &Value, pad: usize, data: &[u8]) -> Vec<u8> {
    let mut text = serde_json::to_vec(header).unwrap();
    text.resize(text.len() + pad, b' ');
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    bytes
}

/// Each fixture's `model.safetensors` damaged (truncated; the header's
/// length wrong; a tensor's dtype, shape or byte range changed in the
/// header): opening it and stepping is an error, never a panic. And the
/// same file with its header padded to every length (data not aligned to
/// 8 bytes, which the format allows) trains.
#[test]
fn damaged_weights_are_errors_and_unaligned_ones_train() {
    let mut panics = Vec::new();
    for dir in fixtures() {
        let Ok(bytes) = std::fs::read(dir.join("model.safetensors")) else {
            continue;
        };
        let (header, data) = split_safetensors(&bytes);
        let header_end = bytes.len() - data.len();
        let mut damaged: Vec<(String, Vec<u8>)> =
            [0, 4, 8, header_end / 2, header_end, bytes.len() - 1]
                .into_iter()
                .map(|len| (format!("truncated to {len} bytes"), bytes[..len].to_vec()))
                .collect();
        for len in [
            0u64,
            1,
            (header_end - 8) as u64 - 1,
            header_end as u64,
            u64::MAX,
        ] {
            let mut changed = bytes.clone();
            changed[..8].copy_from_slice(&len.to_le_bytes());
            damaged.push((format!("header length {len}"), changed));
        }
        // The first and the last tensor's entries.
        let names: Vec<&String> = header
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "__metadata__")
            .collect();
        for name in [names[0], names[names.len() - 1]] {
            let entry = &header[name];
            let shape = entry["shape"].as_array().unwrap().clone();
            let offsets = entry["data_offsets"].clone();
            let mut changes: Vec<(&str, Value)> =
                ["F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "XX"]
                    .into_iter()
                    .map(|d| ("dtype", json!(d)))
                    .collect();
            let mut reversed = shape.clone();
            reversed.reverse();
            let mut wider = shape.clone();
            wider[0] = json!(wider[0].as_u64().unwrap() + 1);
            changes.extend([
                ("shape", json!([])),
                ("shape", json!([0])),
                ("shape", json!([1])),
                ("shape", json!(reversed)),
                ("shape", json!(wider)),
                ("shape", json!([u64::MAX, 2])),
                ("data_offsets", json!([offsets[1], offsets[0]])),
                ("data_offsets", json!([0, u64::MAX])),
                ("data_offsets", json!([0, 4])),
            ]);
            for (key, value) in changes {
                let mut changed = header.clone();
                changed[name.as_str()][key] = value.clone();
                damaged.push((
                    format!("{name}.{key} = {value}"),
                    join_safetensors(&changed, 0, data),
                ));
            }
        }
        for (what, weights) in damaged {
            let out = beside(&dir, &["model.safetensors"]);
            std::fs::write(out.path().join("model.safetensors"), weights).unwrap();
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| step_in(out.path()))) {
                let message = panic_message(panic);
                panics.push(format!("{}, {what}: {message}", dir.display()));
            }
        }
        for pad in 1..8 {
            let out = beside(&dir, &["model.safetensors"]);
            std::fs::write(
                out.path().join("model.safetensors"),
                join_safetensors(&header, pad, data),
            )
            .unwrap();
            match catch_unwind(AssertUnwindSafe(|| step_in(out.path()))) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panics.push(format!("{}, padded by {pad}: {e}", dir.display())),
                Err(_) => panics.push(format!("{}, padded by {pad}: panicked", dir.display())),
            }
        }
    }
    assert_none(&panics);
}

/// Token ids a model cannot take (ids outside the vocabulary, of a float
/// dtype, negative; not `[batch, time]`) are errors of the forward and of
/// the loss in every family, never panics; so are ids a loss cannot take
/// (no sequence, fewer than two positions: nothing to predict), whose
/// forward gives its logits (none without a sequence or a position); i64
/// and strided ids are read as u32 and contiguous ones.
#[test]
fn token_ids_a_model_cannot_take_are_errors() {
    let mut failures = Vec::new();
    for dir in fixtures() {
        let config = HubConfig::from_json(&config_of(&dir)).unwrap();
        let vocab = config.vocab_size() as u32;
        let map = candle_nn::VarMap::new();
        let vb = candle_nn::VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
        let model = CausalLm::new(vb, &config, None).unwrap();
        let cpu = &Device::Cpu;
        let strided = Tensor::new(&[[0u32, 1], [1, 0], [1, 1]], cpu)
            .unwrap()
            .t()
            .unwrap();
        // What each input gives: (forward, loss) succeed.
        let cases = [
            (
                "an id of the vocabulary's size",
                Tensor::new(&[[0u32, vocab, 1]], cpu),
                (false, false),
            ),
            (
                "the largest u32 id",
                Tensor::new(&[[0u32, u32::MAX, 1]], cpu),
                (false, false),
            ),
            (
                "an f32 id",
                Tensor::new(&[[0f32, 1., 1.]], cpu),
                (false, false),
            ),
            (
                "a negative id",
                Tensor::new(&[[0i64, -1, 1]], cpu),
                (false, false),
            ),
            (
                "ids [time]",
                Tensor::new(&[0u32, 1, 1], cpu),
                (false, false),
            ),
            (
                "ids [1, 1, time]",
                Tensor::new(&[[[0u32, 1, 1]]], cpu),
                (false, false),
            ),
            (
                "no sequence",
                Tensor::zeros((0, 4), DType::U32, cpu),
                (true, false),
            ),
            (
                "no position",
                Tensor::zeros((2, 0), DType::U32, cpu),
                (true, false),
            ),
            ("one position", Tensor::new(&[[0u32]], cpu), (true, false)),
            ("i64 ids", Tensor::new(&[[0i64, 1, 1]], cpu), (true, true)),
            ("strided ids", Ok(strided), (true, true)),
        ];
        for (what, ids, expected) in cases {
            let ids = ids.unwrap();
            let forward = || model.forward(&ids).map(|_| ());
            let loss = || model.loss(&ids).and_then(|l| l.backward()).map(|_| ());
            for (pass, run, ok) in [
                ("forward", &forward as &dyn Fn() -> _, expected.0),
                ("loss", &loss, expected.1),
            ] {
                match catch_unwind(AssertUnwindSafe(run)) {
                    Ok(result) if result.is_ok() == ok => {}
                    Ok(result) => {
                        failures.push(format!("{}, {what}, {pass}: {result:?}", dir.display()))
                    }
                    Err(_) => failures.push(format!("{}, {what}, {pass}: panicked", dir.display())),
                }
            }
        }
    }
    assert_none(&failures);
}
