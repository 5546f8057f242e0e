//! GPT-2 from a hub directory against `transformers` itself: the fixtures in
//! `tests/fixtures/gpt2/` (a tiny random `GPT2LMHeadModel`, unsharded and
//! sharded, with its tokenizer, and the logits, loss, gradients and one SGD
//! step it computes on a fixed batch) are made by `make_fixtures.py` there.

mod hub_support;

use candle_core::{DType, Device, Tensor};
use hub_support::{
    f32_values, four_windows, hub_tensors, input_ids, relative_error, values, Golden, Run,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_candle::hub::HubDir;
use zero_candle::models::{Gpt2, Gpt2Config};
use zero_candle::{ZeroHook, ZeroOptimizer};
use zero_core::engine::{EngineConfig, Stage};
use zero_core::optim::{Sgd, SgdConfig};
use zero_core::{ThreadComm, ThreadGroup};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpt2")
}

fn golden() -> Golden {
    hub_support::golden(&fixtures())
}

fn golden_f64(golden: &Golden, name: &str) -> Vec<f64> {
    values(&golden[name])
}

/// `[a, b]` values read as `[b, a]` (a Conv1D weight in the hub's orientation).
fn transposed(values: &[f64], shape: &[usize]) -> Vec<f64> {
    let (rows, cols) = (shape[0], shape[1]);
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| (r, c)))
        .map(|(r, c)| values[r * cols + c])
        .collect()
}

/// A variable's values in the hub's orientation.
fn as_in_hub(name: &str, tensor: &Tensor, config: &Gpt2Config) -> Vec<f64> {
    let v = values(tensor);
    match Gpt2::hub_layout(config).is_transposed(name) {
        true => transposed(&v, tensor.dims()),
        false => v,
    }
}

#[test]
fn logits_loss_and_gradients_equal_transformers() {
    let golden = golden();
    let (config, map) = Gpt2::open_hub(fixtures().join("tiny")).unwrap();
    let model = Gpt2::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let ids = input_ids(&golden);

    let logits = model.forward(&ids.narrow(1, 0, 16).unwrap()).unwrap();
    assert_eq!(logits.dims(), &[2, 16, config.vocab_size]);
    // No positions: no logits, not an error.
    let empty = model.forward(&ids.narrow(1, 0, 0).unwrap()).unwrap();
    assert_eq!(empty.dims(), &[2, 0, config.vocab_size]);
    let err = relative_error(&values(&logits), &golden_f64(&golden, "logits"));
    assert!(err < 1e-5, "logits differ by {err:e} (relative)");

    let loss = model.loss(&ids).unwrap();
    let (ours, theirs) = (values(&loss)[0], golden_f64(&golden, "loss")[0]);
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "loss {ours} vs {theirs}"
    );

    let grads = loss.backward().unwrap();
    let vars = map.varmap().data().lock().unwrap().clone();
    assert_eq!(vars.len(), 28, "one variable per tensor of the checkpoint");
    for (name, var) in &vars {
        let grad = grads.get(var.as_tensor()).unwrap();
        let err = relative_error(
            &as_in_hub(name, grad, &config),
            &golden_f64(&golden, &format!("grad.{name}")),
        );
        assert!(
            err < 1e-5,
            "gradient of {name} differs by {err:e} (relative)"
        );
    }
}

fn file_bytes(path: PathBuf) -> Vec<u8> {
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn loading_then_saving_reproduces_the_checkpoint_tensor_for_tensor() {
    let ids = input_ids(&golden());
    for fixture in ["tiny", "tiny-sharded"] {
        let dir = fixtures().join(fixture);
        for (stage, world) in [(Stage::Ddp, 1), (Stage::Parameters, 2)] {
            let out = tempfile::tempdir().unwrap();
            Run::new(stage, world, 0).train(&dir, &ids, out.path());
            assert_eq!(
                hub_tensors(out.path()),
                hub_tensors(&dir),
                "{fixture} saved at {stage:?} on {world} rank(s)"
            );
            let hub = HubDir::open(&dir).unwrap();
            let saved = HubDir::open(out.path()).unwrap();
            assert_eq!(saved.files(), hub.files(), "{fixture}: the same files");
            for name in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
                assert_eq!(
                    file_bytes(out.path().join(name)),
                    file_bytes(dir.join(name))
                );
            }
        }
    }
}

/// One SGD step, then saved at stage 3 (each Conv1D weight gathered whole
/// and transposed back): the weights `transformers` and `torch.optim.SGD`
/// compute, whichever layout the checkpoint has and at 1 or 2 ranks.
#[test]
fn one_sgd_step_equals_torch_at_stage_0_and_at_stage_3_on_two_ranks() {
    let golden = golden();
    let ids = input_ids(&golden);
    for (fixture, stage, world) in [
        ("tiny", Stage::Ddp, 1),
        ("tiny", Stage::Parameters, 2),
        ("tiny-sharded", Stage::Parameters, 2),
    ] {
        let dir = fixtures().join(fixture);
        let out = tempfile::tempdir().unwrap();
        Run::new(stage, world, 1).train(&dir, &ids, out.path());
        let saved = HubDir::open(out.path()).unwrap();
        assert!(saved.is_sharded() == (fixture == "tiny-sharded"));
        let mut count = 0;
        for name in saved.names() {
            let ours = saved.tensor(name).unwrap().to_vec_as::<f64>().unwrap();
            let theirs = golden_f64(&golden, &format!("sgd.{name}"));
            let err = relative_error(&ours, &theirs);
            assert!(
                err < 1e-5,
                "{fixture} at {stage:?} on {world}: {name} differs by {err:e} after one step"
            );
            count += 1;
        }
        assert_eq!(count, 28);
    }
}

/// Stage 3 at 4 ranks trains what one rank at stage 0 trains (three steps
/// over a batch of 4 windows), and no rank held a sharded weight whole.
#[test]
fn stage_3_on_four_ranks_equals_stage_0_on_one() {
    // Four windows: the golden two and the same reversed in time.
    let ids = four_windows(&input_ids(&golden()));
    let dir = fixtures().join("tiny");
    let mut results = Vec::new();
    for (stage, world) in [(Stage::Ddp, 1), (Stage::Parameters, 4)] {
        let out = tempfile::tempdir().unwrap();
        Run::new(stage, world, 3).train(&dir, &ids, out.path());
        results.push(hub_tensors(out.path()));
        drop(out);
    }
    let initial = hub_tensors(&dir);
    for (name, (_, _, bytes)) in &results[0] {
        let (one, four) = (f32_values(bytes), f32_values(&results[1][name].2));
        let err = relative_error(&four, &one);
        assert!(err < 1e-5, "{name}: stage 3 on 4 ranks differs by {err:e}");
        assert_ne!(bytes, &initial[name].2, "{name} did not train");
    }
}

fn write_hub(dir: &Path, config: &serde_json::Value) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        fixtures().join("tiny/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
}

fn tiny_config() -> serde_json::Value {
    serde_json::from_slice(&file_bytes(fixtures().join("tiny/config.json"))).unwrap()
}

fn open_error(config: serde_json::Value) -> String {
    let dir = tempfile::tempdir().unwrap();
    write_hub(dir.path(), &config);
    let err = match Gpt2::open_hub(dir.path()) {
        Ok((config, map)) => {
            match Gpt2::new(map.builder(DType::F32, &Device::Cpu), &config, None) {
                Ok(_) => panic!("built a model from {config:?}"),
                Err(e) => e,
            }
        }
        Err(e) => e,
    };
    err.to_string()
}

#[test]
fn unusable_checkpoints_are_errors_naming_the_key_or_the_tensor() {
    let mut llama = tiny_config();
    llama["model_type"] = "llama".into();
    let err = open_error(llama);
    assert!(err.contains("model_type") && err.contains("llama"), "{err}");

    let mut arch = tiny_config();
    arch["architectures"] = serde_json::json!(["GPT2ForSequenceClassification"]);
    let err = open_error(arch);
    assert!(err.contains("GPT2ForSequenceClassification"), "{err}");

    let mut cross = tiny_config();
    cross["add_cross_attention"] = true.into();
    let err = open_error(cross);
    assert!(err.contains("add_cross_attention"), "{err}");

    let mut untied = tiny_config();
    untied["tie_word_embeddings"] = false.into();
    let err = open_error(untied);
    assert!(err.contains("tie_word_embeddings"), "{err}");

    let mut relu = tiny_config();
    relu["activation_function"] = "relu".into();
    let err = open_error(relu);
    assert!(err.contains("activation_function"), "{err}");

    let mut wide = tiny_config();
    wide["n_embd"] = 64.into();
    let err = open_error(wide);
    assert!(
        err.contains("transformer.wte.weight") && err.contains("[384, 64]"),
        "{err}"
    );

    let mut deep = tiny_config();
    deep["n_layer"] = 3.into();
    let err = open_error(deep);
    assert!(err.contains("transformer.h.2."), "{err}");

    // Quantized weights (FP8 blocks, MXFP4, GPTQ, ...): refused by name
    // before any tensor is read.
    let mut quantized = tiny_config();
    quantized["quantization_config"] = serde_json::json!({"quant_method": "fp8"});
    let err = open_error(quantized);
    assert!(
        err.contains("quantization_config") && err.contains("\"fp8\""),
        "{err}"
    );

    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("config.json"), "{}").unwrap();
    let err = Gpt2::open_hub(empty.path()).err().unwrap().to_string();
    assert!(err.contains("model.safetensors"), "{err}");

    let bad_json = tempfile::tempdir().unwrap();
    write_hub(bad_json.path(), &tiny_config());
    std::fs::write(bad_json.path().join("config.json"), "{ not json").unwrap();
    let err = Gpt2::open_hub(bad_json.path()).err().unwrap().to_string();
    assert!(err.contains("config.json") && err.contains("JSON"), "{err}");

    // An index naming a file that lacks the tensor.
    let sharded = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures().join("tiny-sharded")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, sharded.path().join(path.file_name().unwrap())).unwrap();
    }
    let index_path = sharded.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&file_bytes(index_path.clone())).unwrap();
    index["weight_map"]["transformer.ln_f.bias"] = "model-00001-of-00003.safetensors".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = Gpt2::open_hub(sharded.path()).err().unwrap().to_string();
    assert!(
        err.contains("transformer.ln_f.bias") && err.contains("model-00001-of-00003"),
        "{err}"
    );
}

/// The first GPT-2 checkpoints name their tensors without `transformer.`
/// (`h.0.attn.c_attn.weight`): they load, and save back under their names.
#[test]
fn a_checkpoint_without_the_transformer_prefix_loads_and_saves_under_its_names() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), tiny_config().to_string()).unwrap();
    let full = hub_tensors(&fixtures().join("tiny"));
    let renamed: Vec<(String, zero_core::DType, Vec<usize>, Vec<u8>)> = full
        .iter()
        .map(|(name, (_, shape, bytes))| {
            let short = name.strip_prefix("transformer.").unwrap().to_string();
            (short, zero_core::DType::F32, shape.clone(), bytes.clone())
        })
        .collect();
    let header: Vec<_> = renamed
        .iter()
        .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
        .collect();
    let mut writer =
        zero_core::checkpoint::TensorWriter::create(dir.path().join("model.safetensors"), &header)
            .unwrap();
    for (_, _, _, bytes) in &renamed {
        writer.write(bytes).unwrap();
    }
    writer.finish().unwrap();

    let golden = golden();
    let (config, map) = Gpt2::open_hub(dir.path()).unwrap();
    let model = Gpt2::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let loss = model.loss(&input_ids(&golden)).unwrap();
    let (ours, theirs) = (values(&loss)[0], golden_f64(&golden, "loss")[0]);
    assert!(
        ((ours - theirs) / theirs).abs() < 1e-5,
        "loss {ours} vs {theirs}"
    );

    let out = tempfile::tempdir().unwrap();
    Run::new(Stage::Gradients, 1, 0).train(dir.path(), &input_ids(&golden), out.path());
    assert_eq!(hub_tensors(out.path()), hub_tensors(dir.path()));
}

/// A source that counts the elements asked of it.
struct Counting {
    inner: zero_candle::hub::HubSource,
    read: Arc<std::sync::atomic::AtomicUsize>,
}

impl zero_candle::ParamSource for Counting {
    fn fill(
        &self,
        name: &str,
        shape: &[usize],
        init: candle_nn::Init,
        range: std::ops::Range<usize>,
        out: &mut [f64],
    ) -> zero_candle::Result<()> {
        self.read
            .fetch_add(range.len(), std::sync::atomic::Ordering::Relaxed);
        self.inner.fill(name, shape, init, range, out)
    }

    fn check(&self, name: &str, shape: &[usize]) -> zero_candle::Result<()> {
        self.inner.check(name, shape)
    }
}

/// At stage 3 a rank reads from the checkpoint only its shard of each
/// sharded weight (and the small ones whole), and holds no whole copy.
#[test]
fn at_stage_3_each_rank_reads_only_its_shard_of_the_checkpoint() {
    const PERSIST: usize = 64;
    let dir = fixtures().join("tiny");
    let (config, _) = Gpt2::open_hub(&dir).unwrap();
    let total = config.num_params();
    let results = ThreadGroup::new(2).run(|comm| {
        let hub = Arc::new(HubDir::open(&dir).unwrap());
        let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let source = Counting {
            inner: zero_candle::hub::HubSource::new(hub, Gpt2::hub_layout(&config)),
            read: read.clone(),
        };
        let map = zero_candle::ShardedVarMap::new(source);
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let as_hook: Arc<dyn zero_candle::nn::GradHook> = hook.clone();
        let _model = Gpt2::new(
            map.builder(DType::F32, &Device::Cpu),
            &config,
            Some(as_hook),
        )
        .unwrap();
        let engine = EngineConfig::default()
            .with_stage(Stage::Parameters)
            .with_persist_numel(PERSIST);
        let sgd = Sgd::new(SgdConfig::default()).unwrap();
        let opt = ZeroOptimizer::new_sharded(&map, comm, engine, Box::new(sgd), &hook).unwrap();
        let (mut small, mut held_large) = (0, 0);
        for var in opt.vars() {
            if var.elem_count() <= PERSIST {
                small += var.elem_count();
            } else if zero_candle::holds_values(var.as_tensor()) {
                held_large += var.elem_count();
            }
        }
        (
            read.load(std::sync::atomic::Ordering::Relaxed),
            small,
            held_large,
        )
    });
    let mut large_read_by_all = 0;
    let mut large = 0;
    for result in results {
        let (read, small, held_large) = result.unwrap();
        assert_eq!(held_large, 0, "a sharded weight is held whole");
        large = total - small;
        assert!(
            read >= small + large / 2 - 8 && read <= small + large / 2 + 8,
            "read {read} elements; the small ones are {small}, half the large ones {}",
            large / 2
        );
        large_read_by_all += read - small;
    }
    // The shards tile each large weight: read once over all ranks.
    assert_eq!(large_read_by_all, large);
}
