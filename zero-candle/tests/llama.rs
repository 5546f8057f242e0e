//! Llama from a hub directory against `transformers` itself: the fixtures in
//! `tests/fixtures/llama/` (tiny random `LlamaForCausalLM`s with grouped
//! key/value heads, one with an untied head and one tied with llama3 RoPE
//! scaling; a Mistral, a Qwen2, a Qwen3, Phi-3 (also with longrope), Gemma
//! 1, 2 and 3, a SmolLM3, a Granite, an OLMo 2 and an OLMo 3, and the
//! mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, FlexOlmo,
//! GLM-4.5 and MiniMax-M2, GLM-4 (`glm`, `glm4`), Cohere, ERNIE 4.5,
//! dots.llm1, StarCoder2, Phi, Arcee, Nemotron, EXAONE 4, Seed-OSS, GPT-NeoX, StableLM, OLMo, NanoChat, Hunyuan, Jais 2, Helium, Ministral, CWM, Solar Open, Ministral 3, Mistral 3's text model, GPT-J and Falcon; and the logits, loss, gradients and one SGD step each computes on a fixed
//! batch) are made by `make_fixtures.py` there.

mod hub_support;

use candle_core::{DType, Device, Tensor};
use hub_support::{
    f32_values, four_windows, hub_tensors, input_ids, relative_error, values, Golden, Run,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zero_candle::hub::{Arrangement, HubDir};
use zero_candle::models::{Llama, LlamaConfig, RopeScaling};
use zero_candle::nn::{GradCollector, GradHook};
use zero_core::engine::Stage;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama")
}

fn golden() -> Golden {
    hub_support::golden(&fixtures())
}

/// The golden model a fixture folder holds (`gqa-sharded` is `gqa`).
fn model_of(fixture: &str) -> &str {
    fixture.trim_end_matches("-sharded")
}

/// Every Llama fixture runs on a GPU too (`gpu_hub.rs`'s lists, under its
/// golden prefix): one added here and forgotten there fails on the CPU.
#[test]
fn every_fixture_is_among_the_gpu_tests() {
    use hub_support::gpu_fixtures::{BALANCED, FIXTURES, LATER};
    let listed: Vec<&(&str, &str)> = FIXTURES.iter().chain(BALANCED).chain(LATER).collect();
    let mut checked = 0;
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let path = entry.unwrap().path();
        let folder = path.file_name().unwrap().to_str().unwrap().to_string();
        if !path.join("config.json").exists() || folder == "gqa-sharded" {
            continue;
        }
        let (name, prefix) = (format!("llama/{folder}"), format!("{folder}."));
        assert!(
            listed.contains(&&(name.as_str(), prefix.as_str())),
            "{name} is not among gpu_hub.rs's fixtures (hub_support/gpu_fixtures.rs)"
        );
        checked += 1;
    }
    assert!(checked > 70, "{checked} fixtures");
}

#[test]
fn logits_loss_and_gradients_equal_transformers() {
    let golden = golden();
    let ids = input_ids(&golden);
    let cases = [
        ("gqa", 21),
        ("tied", 20),
        ("mistral", 21),
        ("qwen2", 27),
        ("qwen3", 24),
        ("phi3", 15),
        ("gemma", 20),
        ("gemma3", 28),
        ("gemma2", 24),
        ("phi3long", 15),
        ("smollm3", 20),
        ("granite", 21),
        ("olmo2", 25),
        ("olmo3", 25),
        ("gemma3mm", 28),
        ("mixtral", 41),
        ("qwen2moe", 41),
        ("qwen3moe", 69),
        ("olmoe", 45),
        ("flexolmo", 45),
        // Their routing biases are buffers of the file, not variables.
        ("glm4moe", 56),
        ("minimaxm2", 45),
        ("glm", 25),
        ("glm4", 29),
        ("cohere", 18),
        ("cohere2", 18),
        // Biases on every projection (`use_bias`).
        ("ernie", 34),
        ("erniemoe", 45),
        ("dots1", 58),
        ("cohereqk", 22),
        // LayerNorms with biases, biases on every projection.
        ("starcoder2", 35),
        // Phi's names, the head's bias, biased head norms.
        ("phi", 41),
        // Squared ReLU between up and down; LayerNorm1P.
        ("arcee", 19),
        ("nemotron", 36),
        ("exaone4", 25),
        ("seedoss", 35),
        // query_key_value's rows head by head in the file.
        ("gptneox", 28),
        // A tensor per head's norm.
        ("stablelm", 44),
        ("stablelmpar", 22),
        // Norms without parameters; clamped projections.
        ("olmo", 16),
        ("nanochat", 14),
        // Norms of the rotated heads; NTK alpha.
        ("hunyuan", 25),
        ("jais2", 36),
        ("helium", 27),
        ("ministral", 21),
        ("cwm", 21),
        // Its routing biases are buffers.
        ("solaropen", 77),
        // Queries scaled by position; Mistral 3's text model.
        ("ministral3", 21),
        ("mistral3mm", 21),
        // GPT-2's keys; interleaved pairs in part of each head.
        ("gptj", 25),
        // One key and one value head; group by group; head by head.
        ("falcon", 15),
        ("falconnew", 28),
        ("falconseq", 19),
        // The latent attention; DeepSeek-V2's grouped softmax router.
        ("deepseekv2", 52),
        ("deepseekv3", 52),
        ("glm4moelite", 52),
        // Queries scaled by position; groups ranked by their two best.
        ("mistral4", 52),
        // Run as Llama by transformers.
        ("internlm3", 35),
        ("iquestcoder", 21),
        // Its experts fused in its files under its own names.
        ("granitemoe", 41),
        // A shared MLP whose gate and up are one weight.
        ("granitemoeshared", 45),
        // Its routing bias beside the router, a buffer.
        ("exaonemoe", 50),
        // Sinks; experts with biases, fused and transposed in the files.
        ("gptoss", 61),
        // Run as Llama under its own names and keys.
        ("exaone", 21),
        // A router of its own name beside a shared MLP.
        ("hunyuanmoe", 51),
        // GLM-4.5's under its own names, q, k and v fused.
        ("sarvammoe", 48),
        // DeepSeek-V3's attention with one q_proj.
        ("sarvammla", 48),
        // Sinks, a base per layer (none in one), windows.
        ("graniteswa", 22),
        ("granitemoeswa", 43),
        // Gemma 2's without the norms of the outputs.
        ("vaultgemma", 20),
        // Norms of the outputs under its own names; logits times the scale.
        ("hyperclovax", 25),
        // The latent attention rotating halves; its multipliers.
        ("minicpm3", 26),
        // xIELU's parameters (its buffers are not variables).
        ("apertus", 27),
        // The latent attention in every layer, dense MLPs.
        ("youtu", 26),
    ];
    for (fixture, variables) in cases {
        let (config, map) = Llama::open_hub(fixtures().join(fixture)).unwrap();
        assert_eq!(
            config.tie_word_embeddings,
            matches!(
                fixture,
                "tied"
                    | "qwen3"
                    | "gemma"
                    | "gemma3"
                    | "gemma2"
                    | "smollm3"
                    | "gemma3mm"
                    | "cohere"
                    | "cohere2"
                    | "ernie"
                    | "erniemoe"
                    | "cohereqk"
                    | "starcoder2"
                    | "falcon"
                    | "falconseq"
                    | "graniteswa"
                    | "vaultgemma"
                    | "minicpm3"
                    | "youtu"
            )
        );
        let per_head = matches!(
            fixture,
            "qwen3"
                | "qwen3moe"
                | "gemma3"
                | "gemma3mm"
                | "glm4moe"
                | "dots1"
                | "phi"
                | "exaone4"
                | "exaonemoe"
                | "nanochat"
                | "hunyuan"
                | "hunyuanmoe"
                | "sarvammoe"
                | "apertus"
        );
        let whole = matches!(
            fixture,
            "olmo2" | "olmo3" | "olmoe" | "flexolmo" | "minimaxm2" | "cohereqk" | "stablelm"
        );
        assert_eq!(config.qk_norm.is_some(), per_head || whole);
        assert_eq!(
            config.fused_qkv,
            fixture.starts_with("phi3")
                || fixture.starts_with("falcon")
                || matches!(fixture, "gptneox" | "sarvammoe")
        );
        assert_eq!(
            config.fused_gate_up,
            fixture.starts_with("phi3") || matches!(fixture, "glm" | "glm4")
        );
        assert_eq!(
            config.rope_interleaved,
            matches!(
                fixture,
                "glm"
                    | "glm4"
                    | "cohere"
                    | "cohere2"
                    | "ernie"
                    | "erniemoe"
                    | "cohereqk"
                    | "helium"
                    | "gptj"
                    | "deepseekv2"
                    | "deepseekv3"
                    | "sarvammla"
                    | "mistral4"
                    | "youtu"
            )
        );
        assert_eq!(
            config.latent_attention.is_some(),
            matches!(
                fixture,
                "deepseekv2"
                    | "deepseekv3"
                    | "glm4moelite"
                    | "mistral4"
                    | "sarvammla"
                    | "minicpm3"
                    | "youtu"
            )
        );
        assert_eq!(
            config.layer_norms,
            fixture.starts_with("cohere")
                || fixture.starts_with("stablelm")
                || fixture.starts_with("falcon")
                || matches!(
                    fixture,
                    "starcoder2" | "phi" | "nemotron" | "gptneox" | "olmo" | "jais2" | "gptj"
                )
        );
        assert_eq!(
            config.ungated_mlp.is_some(),
            matches!(
                fixture,
                "starcoder2"
                    | "phi"
                    | "arcee"
                    | "apertus"
                    | "nemotron"
                    | "gptneox"
                    | "nanochat"
                    | "jais2"
                    | "gptj"
                    | "falcon"
                    | "falconnew"
                    | "falconseq"
            )
        );
        let layout = Llama::hub_layout(&config);
        let model = Llama::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
        map.materialize_all().unwrap();
        let case = fixture;

        let logits = model.forward(&ids.narrow(1, 0, 16).unwrap()).unwrap();
        assert_eq!(logits.dims(), &[2, 16, config.vocab_size]);
        let err = relative_error(
            &values(&logits),
            &values(&golden[&format!("{fixture}.logits")]),
        );
        assert!(err < 1e-5, "{case}: logits differ by {err:e} (relative)");

        let loss = model.loss(&ids).unwrap();
        let (ours, theirs) = (
            values(&loss)[0],
            values(&golden[&format!("{fixture}.loss")])[0],
        );
        assert!(
            ((ours - theirs) / theirs).abs() < 1e-5,
            "{case}: loss {ours} vs {theirs}"
        );

        let grads = loss.backward().unwrap();
        let vars = map.varmap().data().lock().unwrap().clone();
        assert_eq!(vars.len(), variables, "{case}: one variable per tensor");
        for (name, var) in &vars {
            let grad = grads.get(var.as_tensor()).unwrap();
            let theirs = golden[&format!("{fixture}.grad.{name}")].clone();
            // GLM's queries and keys: the variable's rows in rotate_half's
            // order, the file's (and transformers') interleaved.
            let theirs = match layout.arrangement(name) {
                Arrangement::RowsPermuted(rows) => {
                    let index: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
                    let index = Tensor::new(index.as_slice(), &Device::Cpu).unwrap();
                    theirs
                        .reshape((rows.len(), theirs.elem_count() / rows.len()))
                        .and_then(|t| t.index_select(&index, 0))
                        .and_then(|t| t.reshape(theirs.shape()))
                        .unwrap()
                }
                _ => theirs,
            };
            let err = relative_error(&values(grad), &values(&theirs));
            assert!(err < 1e-5, "{case}: gradient of {name} differs by {err:e}");
        }
    }
}

#[test]
fn loading_then_saving_reproduces_the_checkpoint_tensor_for_tensor() {
    let ids = input_ids(&golden());
    for fixture in [
        "gqa",
        "gqa-sharded",
        "tied",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma3",
        "gemma3mm",
        "mixtral",
        "qwen2moe",
        "glm4moe",
        "minimaxm2",
        "glm",
        "glm4",
        "cohere2",
        "ernie",
        "erniemoe",
        "dots1",
        "cohereqk",
        "starcoder2",
        "phi",
        "nemotron",
        "exaone4",
        "seedoss",
        "gptneox",
        "stablelm",
        "stablelmpar",
        "olmo",
        "nanochat",
        "hunyuan",
        "jais2",
        "helium",
        "cwm",
        "solaropen",
        "mistral3mm",
        "gptj",
        "falcon",
        "falconnew",
        "falconseq",
        "deepseekv2",
        "deepseekv3",
        "glm4moelite",
        "mistral4",
        "internlm3",
        "granitemoe",
        "granitemoeshared",
        "exaonemoe",
        "gptoss",
        "exaone",
        "hunyuanmoe",
        "sarvammoe",
        "sarvammla",
        "graniteswa",
        "granitemoeswa",
        "vaultgemma",
        "hyperclovax",
        "minicpm3",
        "apertus",
        "youtu",
    ] {
        let dir = fixtures().join(fixture);
        for (stage, world) in [(Stage::Ddp, 1), (Stage::Parameters, 2)] {
            let out = tempfile::tempdir().unwrap();
            Run::new(stage, world, 0).train(&dir, &ids, out.path());
            assert_eq!(
                hub_tensors(out.path()),
                hub_tensors(&dir),
                "{fixture} saved at {stage:?} on {world} rank(s)"
            );
            let (hub, saved) = (
                HubDir::open(&dir).unwrap(),
                HubDir::open(out.path()).unwrap(),
            );
            assert_eq!(saved.files(), hub.files(), "{fixture}: the same files");
        }
    }
}

/// One SGD step, then saved: the weights `transformers` and
/// `torch.optim.SGD` compute, at 1 rank (stage 0) and at stage 3 on 2.
#[test]
fn one_sgd_step_equals_torch_at_stage_0_and_at_stage_3_on_two_ranks() {
    let golden = golden();
    let ids = input_ids(&golden);
    for (fixture, stage, world, tensors) in [
        ("gqa", Stage::Ddp, 1, 21),
        ("gqa-sharded", Stage::Parameters, 2, 21),
        ("tied", Stage::Parameters, 2, 20),
        ("mistral", Stage::Parameters, 2, 21),
        ("qwen2", Stage::Parameters, 2, 27),
        ("qwen3", Stage::Parameters, 2, 24),
        ("phi3", Stage::Parameters, 2, 15),
        ("gemma", Stage::Parameters, 2, 20),
        ("gemma3", Stage::Parameters, 2, 28),
        ("gemma2", Stage::Parameters, 2, 24),
        ("phi3long", Stage::Parameters, 2, 15),
        ("smollm3", Stage::Parameters, 2, 20),
        ("granite", Stage::Parameters, 2, 21),
        ("olmo2", Stage::Parameters, 2, 25),
        ("olmo3", Stage::Parameters, 2, 25),
        ("gemma3mm", Stage::Parameters, 2, 62),
        // With the load-balancing loss at one rank: that loss is not a
        // mean over tokens, so each rank's own over its half of the batch
        // (as under DDP) is not the whole batch's.
        ("mixtral", Stage::Parameters, 1, 41),
        ("qwen2moe", Stage::Parameters, 2, 41),
        ("qwen3moe", Stage::Parameters, 1, 69),
        ("olmoe", Stage::Parameters, 2, 45),
        ("flexolmo", Stage::Parameters, 2, 45),
        // The routing biases saved back as they were read.
        ("glm4moe", Stage::Parameters, 2, 57),
        ("minimaxm2", Stage::Parameters, 1, 47),
        ("glm", Stage::Parameters, 2, 25),
        ("glm4", Stage::Parameters, 2, 29),
        ("cohere", Stage::Parameters, 2, 18),
        ("cohere2", Stage::Parameters, 2, 18),
        ("ernie", Stage::Parameters, 2, 34),
        ("erniemoe", Stage::Parameters, 2, 46),
        ("dots1", Stage::Parameters, 2, 59),
        ("cohereqk", Stage::Parameters, 2, 22),
        ("starcoder2", Stage::Parameters, 2, 35),
        ("phi", Stage::Parameters, 2, 41),
        ("arcee", Stage::Parameters, 2, 19),
        ("nemotron", Stage::Parameters, 2, 36),
        ("exaone4", Stage::Parameters, 2, 25),
        ("seedoss", Stage::Parameters, 2, 35),
        ("gptneox", Stage::Parameters, 2, 28),
        ("stablelm", Stage::Parameters, 2, 44),
        ("stablelmpar", Stage::Parameters, 2, 22),
        ("olmo", Stage::Parameters, 2, 16),
        ("nanochat", Stage::Parameters, 2, 14),
        ("hunyuan", Stage::Parameters, 2, 25),
        ("jais2", Stage::Parameters, 2, 36),
        ("helium", Stage::Parameters, 2, 27),
        ("ministral", Stage::Parameters, 2, 21),
        ("cwm", Stage::Parameters, 2, 21),
        ("solaropen", Stage::Parameters, 2, 79),
        ("ministral3", Stage::Parameters, 2, 21),
        ("mistral3mm", Stage::Parameters, 2, 36),
        ("gptj", Stage::Parameters, 2, 25),
        ("falcon", Stage::Parameters, 2, 15),
        ("falconnew", Stage::Parameters, 2, 28),
        ("falconseq", Stage::Parameters, 2, 19),
        ("deepseekv2", Stage::Parameters, 2, 52),
        // The routing biases saved back as they were read.
        ("deepseekv3", Stage::Parameters, 2, 53),
        ("glm4moelite", Stage::Parameters, 2, 53),
        // Its experts fused in two tensors per layer, as transformers 5 saves them.
        ("mistral4", Stage::Parameters, 2, 30),
        ("internlm3", Stage::Parameters, 2, 35),
        ("iquestcoder", Stage::Parameters, 2, 21),
        ("granitemoe", Stage::Parameters, 2, 21),
        ("granitemoeshared", Stage::Parameters, 2, 25),
        ("exaonemoe", Stage::Parameters, 2, 51),
        // Sinks through the hook; its load-balancing loss at one rank (as
        // Mixtral's).
        ("gptoss", Stage::Parameters, 1, 37),
        // Saved back under its own names.
        ("exaone", Stage::Parameters, 2, 21),
        ("hunyuanmoe", Stage::Parameters, 2, 51),
        // The routing bias saved back as it was read, under its own name.
        ("sarvammoe", Stage::Parameters, 2, 49),
        ("sarvammla", Stage::Parameters, 2, 49),
        ("graniteswa", Stage::Parameters, 2, 22),
        ("granitemoeswa", Stage::Parameters, 2, 23),
        ("vaultgemma", Stage::Parameters, 2, 20),
        ("hyperclovax", Stage::Parameters, 2, 25),
        ("minicpm3", Stage::Parameters, 2, 26),
        // xIELU's buffers saved back as they were read.
        ("apertus", Stage::Parameters, 2, 31),
        ("youtu", Stage::Parameters, 2, 26),
    ] {
        let out = tempfile::tempdir().unwrap();
        Run::new(stage, world, 1).train(&fixtures().join(fixture), &ids, out.path());
        let saved = HubDir::open(out.path()).unwrap();
        let mut count = 0;
        for name in saved.names() {
            let ours = saved.tensor(name).unwrap().to_vec_as::<f64>().unwrap();
            let theirs = values(&golden[&format!("{}.sgd.{name}", model_of(fixture))]);
            let err = relative_error(&ours, &theirs);
            assert!(
                err < 1e-5,
                "{fixture} at {stage:?} on {world}: {name} differs by {err:e} after one step"
            );
            count += 1;
        }
        assert_eq!(count, tensors, "{fixture}");
    }
}

/// GLM-4.5's routing bias is a buffer: read whole from the checkpoint
/// through the builder (a tensor of the source, not a variable), zeros in a
/// fresh model, whose source (a seed) holds no tensors.
#[test]
fn glm_routing_bias_is_a_buffer_of_the_checkpoint() {
    let dir = fixtures().join("glm4moe");
    let name = "model.layers.1.mlp.gate.e_score_correction_bias";
    let (config, map) = Llama::open_hub(&dir).unwrap();
    let vb = map.builder(DType::F32, &Device::Cpu);
    assert!(vb.contains_tensor(name));
    let read = values(&vb.get_unchecked(name).unwrap());
    let file = HubDir::open(&dir).unwrap();
    assert_eq!(read, file.tensor(name).unwrap().to_vec_as::<f64>().unwrap());
    assert!(read.iter().any(|&b| b != 0.0));
    Llama::new(vb, &config, None).unwrap();
    let vars = map.varmap().data().lock().unwrap().clone();
    assert!(!vars.contains_key(name), "a buffer is not a variable");
    assert!(vars.contains_key("model.layers.1.mlp.gate.weight"));

    // A checkpoint's tensors the model does not build (GLM-4.5's
    // multi-token prediction layer, `model.layers.{num_hidden_layers}.*`)
    // load and are saved back as they were, beside the buffer.
    let with_mtp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, with_mtp.path().join(path.file_name().unwrap())).unwrap();
    }
    let mut tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mtp = "model.layers.2.eh_proj.weight";
    let extra = candle_core::Tensor::arange(0f32, 64.0, &Device::Cpu).unwrap();
    tensors.insert(mtp.to_string(), extra.reshape((2, 32)).unwrap());
    candle_core::safetensors::save(&tensors, with_mtp.path().join("model.safetensors")).unwrap();
    let out = tempfile::tempdir().unwrap();
    Run::new(Stage::Parameters, 2, 1).train(with_mtp.path(), &input_ids(&golden()), out.path());
    let saved = HubDir::open(out.path()).unwrap();
    for kept in [mtp, name] {
        assert_eq!(
            saved.tensor(kept).unwrap().to_vec_as::<f64>().unwrap(),
            HubDir::open(with_mtp.path())
                .unwrap()
                .tensor(kept)
                .unwrap()
                .to_vec_as::<f64>()
                .unwrap(),
            "{kept}"
        );
    }

    let fresh = zero_candle::ShardedVarMap::seeded(3);
    let vb = fresh.builder(DType::F32, &Device::Cpu);
    assert!(!vb.contains_tensor(name));
    let err = vb.get_unchecked(name).unwrap_err().to_string();
    assert!(err.contains("holds no tensor"), "{err}");
    let model = Llama::new(vb, &config, None).unwrap();
    fresh.materialize_all().unwrap();
    let ids = input_ids(&golden());
    let loss = values(&model.loss(&ids).unwrap())[0];
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
}

/// Stage 3 at 4 ranks, and at 2 with each block recomputed in backward,
/// train what one rank at stage 0 trains (three steps over 4 windows),
/// every tensor changed.
#[test]
fn stage_3_on_four_ranks_equals_stage_0_on_one() {
    // OLMoE and GLM-4.5: mixtures whose ranks route different tokens.
    for fixture in ["gqa", "olmoe", "glm4moe", "glm4", "erniemoe"] {
        four_ranks_train_what_one_does(fixture);
    }
}

fn four_ranks_train_what_one_does(fixture: &str) {
    let ids = four_windows(&input_ids(&golden()));
    let dir = fixtures().join(fixture);
    let mut results = Vec::new();
    let checkpointed = Run {
        checkpointed: true,
        ..Run::new(Stage::Parameters, 2, 3)
    };
    // Weights gathered a few hundred values at a time: each expert's in
    // pieces.
    let in_pieces = Run {
        gather_bytes: Some(1 << 10),
        ..Run::new(Stage::Parameters, 2, 3)
    };
    let runs = [
        Run::new(Stage::Ddp, 1, 3),
        Run::new(Stage::Parameters, 4, 3),
        checkpointed,
        in_pieces,
    ];
    for run in runs {
        let out = tempfile::tempdir().unwrap();
        run.train(&dir, &ids, out.path());
        results.push(hub_tensors(out.path()));
    }
    let initial = hub_tensors(&dir);
    for (name, (_, _, bytes)) in &results[0] {
        for (run, result) in runs[1..].iter().zip(&results[1..]) {
            let err = relative_error(&f32_values(&result[name].2), &f32_values(bytes));
            assert!(err < 1e-5, "{fixture}: {name}: {run:?} differs by {err:e}");
        }
        // A buffer (GLM-4.5's routing bias) is saved as it was read.
        match name.ends_with(".e_score_correction_bias") {
            true => assert_eq!(bytes, &initial[name].2, "{fixture}: {name} changed"),
            false => assert_ne!(bytes, &initial[name].2, "{fixture}: {name} did not train"),
        }
    }
}

/// One token reaches 2 of OLMoE's 4 experts per layer: the logits are
/// still transformers', the other two experts' gradients are zeros
/// (present, as transformers 5's fused expert weights give them), the
/// chosen ones' not, with the experts as one op (hooked) as without.
#[test]
fn experts_no_token_chose_get_zero_gradients() {
    let golden = golden();
    let ids = input_ids(&golden).narrow(0, 0, 1).unwrap();
    // Unhooked (one Linear per projection, idle experts on a zero-weighted
    // row) and hooked (the experts' op, idle experts computing nothing):
    // the same gradients.
    let mut per_path = Vec::new();
    for hooked in [false, true] {
        let (config, map) = Llama::open_hub(fixtures().join("olmoe")).unwrap();
        let collector = Arc::new(GradCollector::new());
        let hook: Option<Arc<dyn GradHook>> = hooked.then(|| collector.clone() as _);
        let model = Llama::new(map.builder(DType::F32, &Device::Cpu), &config, hook).unwrap();
        map.materialize_all().unwrap();
        let logits = model.forward(&ids.narrow(1, 0, 1).unwrap()).unwrap();
        let theirs = golden["olmoe.logits"].narrow(0, 0, 1).unwrap();
        let err = relative_error(&values(&logits), &values(&theirs.narrow(1, 0, 1).unwrap()));
        assert!(err < 1e-5, "hooked {hooked}: logits differ by {err:e}");
        let mut grads = model
            .loss(&ids.narrow(1, 0, 2).unwrap())
            .unwrap()
            .backward()
            .unwrap();
        collector.merge_into(&mut grads).unwrap();
        let vars = map.varmap().data().lock().unwrap().clone();
        let mut expert_grads = Vec::new();
        for layer in 0..config.num_hidden_layers {
            let idle = (0..4)
                .filter(|e| {
                    let zero = ["gate_proj", "up_proj", "down_proj"].map(|part| {
                        let name = format!("model.layers.{layer}.mlp.experts.{e}.{part}.weight");
                        let grad = values(grads.get(vars[&name].as_tensor()).expect("a gradient"));
                        let zero = grad.iter().all(|&g| g == 0.0);
                        expert_grads.push((name, grad));
                        zero
                    });
                    assert!(
                        zero.iter().all(|&z| z == zero[0]),
                        "hooked {hooked}: layer {layer}: expert {e}"
                    );
                    zero[0]
                })
                .count();
            assert_eq!(
                idle, 2,
                "hooked {hooked}: layer {layer}: experts without a token"
            );
        }
        per_path.push(expert_grads);
    }
    for ((name, plain), (_, hooked)) in per_path[0].iter().zip(&per_path[1]) {
        let err = relative_error(hooked, plain);
        assert!(err < 1e-5, "{name}: the experts' op differs by {err:e}");
    }
}

fn config_of(fixture: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixtures().join(fixture).join("config.json")).unwrap())
        .unwrap()
}

/// `config_of(fixture)` without `keys` (the file silent on them).
fn config_without(fixture: &str, keys: &[&str]) -> serde_json::Value {
    let mut config = config_of(fixture);
    let object = config.as_object_mut().unwrap();
    for key in keys {
        object.remove(*key);
    }
    config
}

/// transformers 5 writes the rotary settings as `rope_parameters`, 4 as
/// `rope_theta` and `rope_scaling`: both read as the same config, whose
/// llama3 frequencies are transformers' (the tied golden's logits check
/// them in use).
#[test]
fn both_config_forms_read_alike_and_llama3_scales_the_low_frequencies() {
    let old = config_of("tied");
    let mut new = old.clone();
    let object = new.as_object_mut().unwrap();
    let mut rope = object.remove("rope_scaling").unwrap();
    rope["rope_theta"] = object.remove("rope_theta").unwrap();
    object.insert("rope_parameters".into(), rope);
    let (a, b) = (
        LlamaConfig::from_json(&old).unwrap(),
        LlamaConfig::from_json(&new).unwrap(),
    );
    assert_eq!(a, b);
    assert!(matches!(a.rope.scaling, RopeScaling::Llama3(_)));
    // Wavelengths 6.3 (kept), 63 (blended), 628 and 6283 (divided by 8).
    let plain: Vec<f64> = (0..4)
        .map(|i| 10000f64.powf(-(2.0 * i as f64) / 8.0))
        .collect();
    let scaled = a.inv_freq();
    assert_eq!(scaled[0], plain[0]);
    assert!(
        scaled[1] < plain[1] && scaled[1] > plain[1] / 8.0,
        "{scaled:?}"
    );
    assert!((scaled[2] - plain[2] / 8.0).abs() < 1e-15);
    assert!((scaled[3] - plain[3] / 8.0).abs() < 1e-15);
    let gqa = LlamaConfig::from_json(&config_of("gqa")).unwrap();
    assert_eq!((gqa.num_attention_heads, gqa.num_key_value_heads), (4, 2));
    assert!(gqa.rope.scaling == RopeScaling::None && gqa.rope.theta == 10000.0);
    for fixture in [
        "gqa",
        "tied",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma",
        "gemma3",
        "gemma2",
        "phi3long",
        "smollm3",
        "granite",
        "olmo2",
        "olmo3",
        "cohere",
        "ernie",
        "starcoder2",
        "phi",
        "arcee",
        "nemotron",
        "exaone4",
        "seedoss",
        "gptneox",
        "stablelm",
        "stablelmpar",
        "olmo",
        "nanochat",
        "hunyuan",
        "jais2",
        "helium",
        "ministral",
        "cwm",
        "gptj",
        "falcon",
        "falconnew",
        "falconseq",
        "internlm3",
        "iquestcoder",
        "exaone",
    ] {
        let config = LlamaConfig::from_json(&config_of(fixture)).unwrap();
        let stored: usize = hub_tensors(&fixtures().join(fixture))
            .values()
            .map(|(_, shape, _)| shape.iter().product::<usize>())
            .sum();
        assert_eq!(config.num_params(), stored, "{fixture}");
    }
}

/// YaRN's frequencies and attention factor against `transformers`' own
/// (`rope_golden.json`: parameter sets the fixture models do not use:
/// `mscale` and `mscale_all_dim`, an explicit `attention_factor`, no
/// truncation, other betas, `factor` from the context lengths), read from
/// both config forms; `linear` divides every frequency; `dynamic` keeps
/// them up to its context and refuses longer sequences.
#[test]
fn yarn_and_linear_scaling_are_transformers() {
    let yarn: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(fixtures().join("rope_golden.json")).unwrap())
            .unwrap();
    assert_eq!(yarn.len(), 5);
    for case in &yarn {
        let head_dim = case["head_dim"].as_u64().unwrap() as usize;
        let positions = case["max_position_embeddings"].clone();
        let params = case["rope_parameters"].clone();
        let mut old_params = params.clone();
        let theta = old_params
            .as_object_mut()
            .unwrap()
            .remove("rope_theta")
            .unwrap();
        let forms = [
            serde_json::json!({"max_position_embeddings": positions, "rope_parameters": params}),
            serde_json::json!({
                "max_position_embeddings": positions,
                "rope_theta": theta,
                "rope_scaling": old_params,
            }),
        ];
        for config in forms {
            let mut full = config_of("gqa");
            full.as_object_mut().unwrap().remove("rope_parameters");
            for (key, value) in config.as_object().unwrap() {
                full[key] = value.clone();
            }
            full["head_dim"] = head_dim.into();
            let parsed = LlamaConfig::from_json(&full).unwrap();
            assert!(matches!(parsed.rope.scaling, RopeScaling::Yarn(_)));
            let want: Vec<f64> = serde_json::from_value(case["inv_freq"].clone()).unwrap();
            let got = parsed.inv_freq();
            assert_eq!(got.len(), want.len());
            // transformers computes them in f32.
            let err = relative_error(&got, &want);
            assert!(err < 1e-6, "{params}: frequencies differ by {err:e}");
            let factor = case["attention_factor"].as_f64().unwrap();
            let got = parsed.rope.attention_factor();
            assert!((got - factor).abs() < 1e-12, "{params}: {got} vs {factor}");
        }
    }
    let mistral = LlamaConfig::from_json(&config_of("mistral")).unwrap();
    let mut plain = config_of("mistral");
    plain["rope_parameters"]["rope_type"] = "default".into();
    let plain = LlamaConfig::from_json(&plain).unwrap();
    assert_eq!(mistral.rope.scaling, RopeScaling::Linear { factor: 2.0 });
    for (scaled, plain) in mistral.inv_freq().iter().zip(plain.inv_freq()) {
        assert_eq!(*scaled, plain / 2.0);
    }
    assert_eq!(mistral.rope.attention_factor(), 1.0);

    // `dynamic` is the plain rotation up to max_position_embeddings (as
    // transformers computes it there); past it, refused.
    let mut dynamic = config_of("gqa");
    dynamic["rope_parameters"]["rope_type"] = "dynamic".into();
    dynamic["rope_parameters"]["factor"] = 2.0.into();
    dynamic["max_position_embeddings"] = 12.into();
    let config = LlamaConfig::from_json(&dynamic).unwrap();
    let plain = LlamaConfig::from_json(&config_of("gqa")).unwrap();
    assert_eq!(config.inv_freq(), plain.inv_freq());
    let map = zero_candle::ShardedVarMap::seeded(0);
    let model = Llama::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let ids = input_ids(&golden());
    assert!(model.forward(&ids.narrow(1, 0, 12).unwrap()).is_ok());
    let err = model.forward(&ids.narrow(1, 0, 13).unwrap()).unwrap_err();
    assert!(err.to_string().contains("dynamic"), "{err}");
}

#[test]
fn unusable_configs_are_errors_naming_the_key() {
    let base = config_of("gqa");
    let cases: [(&str, serde_json::Value, &str); 12] = [
        ("model_type", "bloom".into(), "model_type"),
        // Llama clamps no projections.
        ("clip_qkv", 8.0.into(), "clip_qkv"),
        (
            "architectures",
            serde_json::json!(["MistralForCausalLM"]),
            "architectures",
        ),
        (
            "layer_types",
            serde_json::json!(["full_attention", "linear_attention"]),
            "layer_types",
        ),
        ("hidden_act", "gelu".into(), "hidden_act"),
        ("num_key_value_heads", 3.into(), "num_key_value_heads"),
        ("head_dim", 7.into(), "head_dim"),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}),
            "rope_parameters",
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
            "original_max_position_embeddings",
        ),
        (
            "rope_parameters",
            serde_json::json!({"rope_type": "linear", "rope_theta": 10000.0, "factor": -1.0}),
            "factor",
        ),
        ("partial_rotary_factor", 0.5.into(), "partial_rotary_factor"),
        ("pad_token_id", 384.into(), "pad_token_id"),
    ];
    for (key, value, named) in cases {
        let mut config = base.clone();
        config[key] = value;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        std::fs::copy(
            fixtures().join("gqa/model.safetensors"),
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let err = match Llama::open_hub(dir.path()) {
            Ok(_) => panic!("opened a checkpoint with {key} changed"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(named), "{key}: {err}");
        assert!(err.contains("config.json"), "{key}: {err}");
    }
    // `mlp_bias` is Llama's (and SmolLM3's and Granite's): Mistral's MLPs
    // have none.
    let mut mistral = config_of("mistral");
    mistral["mlp_bias"] = true.into();
    let err = LlamaConfig::from_json(&mistral).unwrap_err();
    assert!(err.contains("mlp_bias"), "{err}");
    let mut biased = base.clone();
    biased["mlp_bias"] = true.into();
    let parsed = LlamaConfig::from_json(&biased).unwrap();
    assert!(parsed.mlp_bias && !parsed.qkv_bias);
    let map = zero_candle::ShardedVarMap::seeded(0);
    Llama::new(map.builder(DType::F32, &Device::Cpu), &parsed, None).unwrap();
    let vars = map.varmap().data().lock().unwrap().clone();
    for projection in ["gate_proj", "up_proj", "down_proj"] {
        let bias = format!("model.layers.1.mlp.{projection}.bias");
        assert!(vars.contains_key(&bias), "no {bias}");
    }
    let count: usize = vars.values().map(|v| v.elem_count()).sum();
    assert_eq!(
        count,
        parsed.num_params(),
        "the biases counted by the config"
    );
}

/// `CausalLm` opens whichever model a directory holds, by `model_type`.
#[test]
fn causal_lm_opens_either_model_by_its_model_type() {
    use zero_candle::models::{CausalLm, HubConfig};
    let golden = golden();
    let (config, map) = CausalLm::open_hub(fixtures().join("gqa")).unwrap();
    assert!(matches!(config, HubConfig::Llama(_)));
    let model = CausalLm::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let logits = model
        .forward(&input_ids(&golden).narrow(1, 0, 16).unwrap())
        .unwrap();
    let err = relative_error(&values(&logits), &values(&golden["gqa.logits"]));
    assert!(err < 1e-5, "logits differ by {err:e}");
    let gpt2 = fixtures().join("../gpt2/tiny");
    let (config, _) = CausalLm::open_hub(gpt2).unwrap();
    assert!(matches!(config, HubConfig::Gpt2(_)));
    assert_eq!(config.max_positions(), (32, "n_positions"));
    let mut other = config_of("gqa");
    other["model_type"] = "bloom".into();
    let err = HubConfig::from_json(&other).unwrap_err();
    assert!(err.contains("model_type") && err.contains("llama"), "{err}");
    // Gemma 3 with vision: its text model, from `text_config`.
    other["model_type"] = "gemma3".into();
    other["architectures"] = serde_json::json!(["Gemma3ForConditionalGeneration"]);
    let err = HubConfig::from_json(&other).unwrap_err();
    assert!(err.contains("text_config"), "{err}");
    let multimodal = HubConfig::from_json(&config_of("gemma3mm")).unwrap();
    let HubConfig::Llama(multimodal) = multimodal else {
        panic!("{multimodal:?}")
    };
    assert!(multimodal.text_of_multimodal && multimodal.qk_norm.is_some());
    assert_eq!(multimodal.sliding_window.unwrap().layers, [true, false]);
    // Mistral 3: Mistral or Ministral 3 inside, its head tied as the outer
    // config says (tied where it is silent, as transformers' default).
    let mistral3 = LlamaConfig::from_json(&config_of("mistral3mm")).unwrap();
    assert!(mistral3.text_of_multimodal && !mistral3.tie_word_embeddings);
    assert!(matches!(mistral3.rope.scaling, RopeScaling::Yarn(_)));
    let mut silent = config_of("mistral3mm");
    silent
        .as_object_mut()
        .unwrap()
        .remove("tie_word_embeddings");
    assert!(LlamaConfig::from_json(&silent).unwrap().tie_word_embeddings);
    silent["text_config"]["model_type"] = "qwen2".into();
    let err = LlamaConfig::from_json(&silent).unwrap_err();
    assert!(err.contains("text_config.model_type"), "{err}");
    // Dropout, which training leaves out, is reported (the trainer says so).
    let quiet = HubConfig::from_json(&config_of("phi3")).unwrap();
    assert!(!quiet.asks_for_dropout());
    for key in ["attention_dropout", "resid_pdrop", "embd_pdrop"] {
        let mut config = config_of("phi3");
        config[key] = 0.1.into();
        let config = HubConfig::from_json(&config).unwrap();
        assert!(config.asks_for_dropout(), "{key}");
    }
}

/// The sliding windows read as `transformers` applies them (the fixtures'
/// goldens check them in use: Mistral's window of 5 in every layer, Qwen3's
/// of 6 in its second layer, both shorter than the batch): Mistral in
/// every layer; Qwen only where `use_sliding_window` is on, in the layers
/// `layer_types` names or, in files without it, from `max_window_layers`
/// on; `sliding_window` missing is transformers' 4096, null none.
#[test]
fn sliding_windows_apply_where_transformers_applies_them() {
    use zero_candle::models::SlidingWindow;
    let window =
        |config: &serde_json::Value| LlamaConfig::from_json(config).unwrap().sliding_window;
    let mistral = config_of("mistral");
    let every = |size| {
        Some(SlidingWindow {
            size,
            layers: vec![true, true],
        })
    };
    assert_eq!(window(&mistral), every(5));
    let mut missing = mistral.clone();
    missing.as_object_mut().unwrap().remove("sliding_window");
    assert_eq!(window(&missing), every(4096));
    let mut null = mistral.clone();
    null["sliding_window"] = serde_json::Value::Null;
    assert_eq!(window(&null), None);
    // Phi-3's: every layer, none where the file leaves it out.
    let phi3 = config_of("phi3");
    assert_eq!(window(&phi3), every(7));
    let mut missing = phi3.clone();
    missing.as_object_mut().unwrap().remove("sliding_window");
    assert_eq!(window(&missing), None);

    let qwen3 = config_of("qwen3");
    let second = Some(SlidingWindow {
        size: 6,
        layers: vec![false, true],
    });
    assert_eq!(window(&qwen3), second);
    // transformers 4's form: no layer_types, max_window_layers says.
    let mut old = qwen3.clone();
    old.as_object_mut().unwrap().remove("layer_types");
    assert_eq!(window(&old), second);
    old["max_window_layers"] = 0.into();
    assert_eq!(window(&old), every(6));
    old["max_window_layers"] = 2.into();
    assert_eq!(window(&old), None, "no layer from 2 on");
    let mut off = qwen3.clone();
    off["use_sliding_window"] = false.into();
    assert_eq!(window(&off), None);
    // Qwen2's default (use_sliding_window false) and Llama's (none).
    assert_eq!(window(&config_of("qwen2")), None);
    let mut llama = config_of("gqa");
    llama["sliding_window"] = 4.into();
    assert_eq!(window(&llama), None);

    let mut short = qwen3.clone();
    short["layer_types"] = serde_json::json!(["sliding_attention"]);
    let err = LlamaConfig::from_json(&short).unwrap_err();
    assert!(
        err.contains("layer_types") && err.contains("2 layers"),
        "{err}"
    );
    let mut zero = mistral;
    zero["sliding_window"] = 0.into();
    let err = LlamaConfig::from_json(&zero).unwrap_err();
    assert!(err.contains("sliding_window"), "{err}");
    assert!(
        LlamaConfig::from_json(&config_of("qwen2"))
            .unwrap()
            .qkv_bias
    );

    // A windowed model takes sequences longer than its window, and none.
    let config = LlamaConfig::from_json(&config_of("mistral")).unwrap();
    let map = zero_candle::ShardedVarMap::seeded(0);
    let model = Llama::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let ids = input_ids(&golden()).narrow(1, 0, 16).unwrap();
    assert_eq!(model.forward(&ids).unwrap().dims(), &[2, 16, 384]);
    let empty = model.forward(&ids.narrow(1, 0, 0).unwrap()).unwrap();
    assert_eq!(empty.dims(), &[2, 0, config.vocab_size]);
}

/// Gemma's settings read as `transformers` reads them: Gemma 2's windows
/// and caps; Gemma 3's rotary
/// parameters per layer type (transformers 5) and its earlier form
/// (`rope_theta`, `rope_scaling` for the full layers, `rope_local_base_freq`
/// for the sliding ones, `sliding_window_pattern` for the layer types) read
/// alike; Gemma's defaults (a tied head, heads of 256) and its legacy
/// `hidden_act` "gelu" (the tanh form); what the model does not implement
/// refused by name.
#[test]
fn gemma_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{QkNorm, Rope, SlidingWindow};
    use zero_candle::nn::Activation;
    let new = config_of("gemma3");
    let parsed = LlamaConfig::from_json(&new).unwrap();
    assert_eq!(
        parsed.sliding_window,
        Some(SlidingWindow {
            size: 5,
            layers: vec![true, false],
        })
    );
    assert_eq!(
        parsed.rope,
        Rope {
            theta: 1e6,
            scaling: RopeScaling::Linear { factor: 2.0 },
        }
    );
    assert_eq!(
        parsed.local_rope,
        Some(Rope {
            theta: 100.0,
            scaling: RopeScaling::None,
        })
    );
    assert_eq!(parsed.attention_scale, Some(12f64.powf(-0.5)));
    assert_eq!(parsed.final_logit_softcapping, Some(0.5));
    assert_eq!(parsed.norm_weight_offset, 1.0);
    assert_eq!(parsed.embedding_scale, Some(32f64.sqrt()));
    assert_eq!(parsed.mlp_activation, Activation::Gelu);
    // VaultGemma: Gemma 2's settings, its blocks normalizing their inputs
    // alone.
    let vault = LlamaConfig::from_json(&config_of("vaultgemma")).unwrap();
    assert!(vault.input_norms && !vault.output_norms);
    assert_eq!(
        (vault.attn_logit_softcapping, vault.final_logit_softcapping),
        (Some(1.0), Some(0.5))
    );
    assert_eq!(
        (
            vault.attention_scale,
            vault.norm_weight_offset,
            vault.mlp_activation
        ),
        (Some(12f64.powf(-0.5)), 1.0, Activation::Gelu)
    );
    assert!(parsed.output_norms && parsed.input_norms && parsed.tie_word_embeddings);
    assert_eq!(parsed.qk_norm, Some(QkNorm::PerHead));

    let mut old = new.clone();
    let object = old.as_object_mut().unwrap();
    let mut rope = object.remove("rope_parameters").unwrap();
    object.remove("layer_types");
    object.remove("_sliding_window_pattern");
    object.insert("sliding_window_pattern".into(), 2.into());
    object.insert(
        "rope_theta".into(),
        rope["full_attention"]["rope_theta"].take(),
    );
    rope["full_attention"]
        .as_object_mut()
        .unwrap()
        .remove("rope_theta");
    object.insert("rope_scaling".into(), rope["full_attention"].clone());
    object.insert(
        "rope_local_base_freq".into(),
        rope["sliding_attention"]["rope_theta"].clone(),
    );
    assert_eq!(LlamaConfig::from_json(&old).unwrap(), parsed);
    // Without any: transformers' bases (1e6 and 10,000), one layer in six
    // attending in full.
    let object = old.as_object_mut().unwrap();
    for key in [
        "rope_theta",
        "rope_scaling",
        "rope_local_base_freq",
        "sliding_window_pattern",
    ] {
        object.remove(key);
    }
    object.insert("num_hidden_layers".into(), 7.into());
    let defaults = LlamaConfig::from_json(&old).unwrap();
    assert_eq!(
        (defaults.rope.theta, defaults.rope.scaling),
        (1e6, RopeScaling::None)
    );
    assert_eq!(defaults.local_rope.map(|r| r.theta), Some(1e4));
    let layers = defaults.sliding_window.unwrap().layers;
    assert_eq!(layers, [true, true, true, true, true, false, true]);

    let gemma = config_of("gemma");
    let parsed = LlamaConfig::from_json(&gemma).unwrap();
    assert!(!parsed.output_norms && parsed.qk_norm.is_none() && parsed.local_rope.is_none());
    assert_eq!(parsed.attention_scale, None);
    assert_eq!(parsed.norm_weight_offset, 1.0);
    let mut legacy = gemma.clone();
    legacy["hidden_act"] = "gelu".into();
    let object = legacy.as_object_mut().unwrap();
    object.remove("head_dim");
    object.remove("tie_word_embeddings");
    let legacy = LlamaConfig::from_json(&legacy).unwrap();
    assert_eq!(legacy.mlp_activation, Activation::Gelu);
    assert_eq!(legacy.head_dim, 256, "transformers' default");
    assert!(legacy.tie_word_embeddings, "transformers' default");

    // Gemma 2: every other layer windowed where layer_types does not say,
    // its scores capped; Gemma 3 reads no cap on the scores, as
    // transformers applies none.
    let mut gemma2 = config_of("gemma2");
    let parsed = LlamaConfig::from_json(&gemma2).unwrap();
    assert_eq!(parsed.attn_logit_softcapping, Some(1.0));
    assert_eq!(parsed.final_logit_softcapping, Some(0.5));
    assert!(parsed.output_norms && parsed.qk_norm.is_none() && parsed.local_rope.is_none());
    gemma2.as_object_mut().unwrap().remove("layer_types");
    gemma2["num_hidden_layers"] = 3.into();
    let layers = LlamaConfig::from_json(&gemma2)
        .unwrap()
        .sliding_window
        .unwrap()
        .layers;
    assert_eq!(layers, [true, false, true]);
    let mut capped = config_of("gemma3");
    capped["attn_logit_softcapping"] = 50.0.into();
    assert_eq!(
        LlamaConfig::from_json(&capped)
            .unwrap()
            .attn_logit_softcapping,
        None
    );

    let refused: [(&str, &str, serde_json::Value); 6] = [
        ("gemma2", "attn_logit_softcapping", (-1.0).into()),
        ("gemma3", "use_bidirectional_attention", true.into()),
        ("gemma2", "hidden_activation", "relu".into()),
        ("gemma3", "hidden_activation", "gelu".into()),
        ("gemma", "hidden_act", "silu".into()),
        ("gemma3", "final_logit_softcapping", 0.0.into()),
    ];
    for (fixture, key, value) in refused {
        let mut config = config_of(fixture);
        config[key] = value;
        let err = LlamaConfig::from_json(&config).unwrap_err();
        assert!(err.contains(key), "{fixture} {key}: {err}");
    }
}

/// Phi-3's long-context rotation as `transformers` applies it (the golden
/// batch of 16 tokens, past the original context of 12, rotates with the
/// long factors, its first 8 tokens with the short ones; half of each head
/// rotates), read from "longrope" and from the "su" and "yarn" Phi-3's
/// files name it by; factors that do not fit the rotated half refused.
#[test]
fn longrope_switches_factors_past_the_original_context() {
    use zero_candle::models::LongRopeScaling;
    let golden = golden();
    let (config, map) = Llama::open_hub(fixtures().join("phi3long")).unwrap();
    assert_eq!((config.head_dim, config.rotary_dim), (8, 4));
    let RopeScaling::LongRope(LongRopeScaling {
        original_max_position_embeddings,
        attention_factor,
        ..
    }) = &config.rope.scaling
    else {
        panic!("{:?}", config.rope)
    };
    assert_eq!(*original_max_position_embeddings, 12);
    let factor = 128.0f64 / 12.0;
    let want = (1.0 + factor.ln() / 12f64.ln()).sqrt();
    assert!((attention_factor - want).abs() < 1e-12);
    let model = Llama::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let ids = input_ids(&golden);
    let short = model.forward(&ids.narrow(1, 0, 8).unwrap()).unwrap();
    let err = relative_error(&values(&short), &values(&golden["phi3long.logits_short"]));
    assert!(err < 1e-5, "short factors: logits differ by {err:e}");
    // The same positions rotated with the long factors differ.
    let long = model.forward(&ids.narrow(1, 0, 16).unwrap()).unwrap();
    let first = long.narrow(1, 0, 8).unwrap();
    assert!(relative_error(&values(&first), &values(&short)) > 1e-3);

    for kind in ["su", "yarn"] {
        let mut old = config_of("phi3long");
        old["rope_parameters"]["rope_type"] = kind.into();
        assert_eq!(LlamaConfig::from_json(&old).unwrap(), config, "{kind}");
    }
    let mut wrong = config_of("phi3long");
    wrong["rope_parameters"]["long_factor"] = serde_json::json!([1.0, 2.0, 3.0]);
    let err = LlamaConfig::from_json(&wrong).unwrap_err();
    assert!(err.contains("long_factor"), "{err}");
    let mut missing = config_of("phi3long");
    missing["rope_parameters"]
        .as_object_mut()
        .unwrap()
        .remove("short_factor");
    let err = LlamaConfig::from_json(&missing).unwrap_err();
    assert!(err.contains("short_factor"), "{err}");
    let mut partial = config_of("phi3long");
    partial["rope_parameters"]["partial_rotary_factor"] = 1.5.into();
    let err = LlamaConfig::from_json(&partial).unwrap_err();
    assert!(err.contains("partial_rotary_factor"), "{err}");
}

/// ERNIE 4.5's configs read as `transformers` reads them (the goldens check
/// them in use): `use_bias` on every projection, the mixture's layers,
/// router and shared experts, transformers' defaults where the file is
/// silent; what is not implemented, refused by name.
#[test]
fn ernie_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{MoeConfig, MoeRouting, MoeStyle};
    let ernie = LlamaConfig::from_json(&config_of("ernie")).unwrap();
    assert!(ernie.qkv_bias && ernie.o_bias && ernie.mlp_bias && ernie.rope_interleaved);
    let mut silent = config_of("ernie");
    let object = silent.as_object_mut().unwrap();
    for key in [
        "head_dim",
        "rope_parameters",
        "use_bias",
        "tie_word_embeddings",
    ] {
        object.remove(key);
    }
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(parsed.head_dim, 128);
    assert_eq!(parsed.rope.theta, 500_000.0);
    assert!(parsed.tie_word_embeddings && !parsed.qkv_bias && !parsed.mlp_bias);
    let moe = |config: &serde_json::Value| LlamaConfig::from_json(config).map(|c| c.moe.unwrap());
    assert_eq!(
        moe(&config_of("erniemoe")).unwrap(),
        MoeConfig {
            num_experts: 8,
            experts_per_token: 3,
            expert_size: 16,
            normalize: true,
            shared_expert_size: Some(32),
            layers: vec![false, true],
            aux_loss_coef: None,
            style: MoeStyle::Ernie,
            routing: MoeRouting::BiasedSoftmax { min_sum: 1e-12 },
            clamped_swiglu: None,
            router_in_f32: true,
        }
    );
    let mut silent = config_of("erniemoe");
    let object = silent.as_object_mut().unwrap();
    for key in [
        "moe_num_experts",
        "moe_k",
        "moe_intermediate_size",
        "moe_num_shared_experts",
        "moe_layer_start_index",
        "moe_layer_end_index",
        "moe_layer_interval",
        "moe_norm_min",
    ] {
        object.remove(key);
    }
    object.insert("num_hidden_layers".into(), 4.into());
    let defaults = moe(&silent).unwrap();
    assert_eq!(
        (
            defaults.num_experts,
            defaults.experts_per_token,
            defaults.expert_size
        ),
        (64, 6, 1536)
    );
    assert_eq!(defaults.shared_expert_size, Some(2 * 1536));
    assert_eq!(defaults.layers, [false, true, true, true]);
    silent["moe_layer_interval"] = 2.into();
    silent["moe_layer_end_index"] = 2.into();
    assert_eq!(moe(&silent).unwrap().layers, [false, true, false, false]);
    for (key, value) in [
        ("output_router_logits", serde_json::Value::from(true)),
        ("use_bias", true.into()),
        ("moe_norm_min", (-1.0).into()),
        ("moe_layer_interval", 0.into()),
    ] {
        let mut config = config_of("erniemoe");
        config[key] = value;
        let err = moe(&config).unwrap_err();
        assert!(err.contains(key), "{key}: {err}");
    }
}

/// dots.llm1's config read as `transformers` reads it (the goldens check
/// it in use): GLM-4.5's router unnormalized by default, every layer a
/// mixture by default, windows from `max_window_layers` (62) on without a
/// switch.
#[test]
fn dots1_config_reads_as_transformers_reads_it() {
    use zero_candle::models::{MoeRouting, QkNorm};
    let dots = LlamaConfig::from_json(&config_of("dots1")).unwrap();
    assert!(dots.qkv_bias && dots.o_bias && dots.qk_norm == Some(QkNorm::PerHead));
    assert_eq!(dots.sliding_window.as_ref().unwrap().layers, [false, true]);
    let moe = dots.moe.unwrap();
    assert!(!moe.normalize && moe.layers == [false, true]);
    assert_eq!(moe.shared_expert_size, Some(32));
    assert_eq!(
        moe.routing,
        MoeRouting::Sigmoid {
            groups: 4,
            top_groups: 2,
            scale: 2.5
        }
    );
    let mut silent = config_of("dots1");
    let object = silent.as_object_mut().unwrap();
    for key in ["layer_types", "norm_topk_prob", "first_k_dense_replace"] {
        object.remove(key);
    }
    object.insert("num_hidden_layers".into(), 3.into());
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(parsed.sliding_window.unwrap().layers, [false, true, true]);
    let moe = parsed.moe.unwrap();
    assert!(!moe.normalize && moe.layers == [true, true, true]);
    silent.as_object_mut().unwrap().remove("max_window_layers");
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert!(parsed.sliding_window.is_none(), "windows from layer 62 on");
}

/// Cohere's configs read as `transformers` reads them (the goldens check
/// them in use): LayerNorms and their epsilon, parallel blocks, the logits'
/// scale, Cohere 2's rotation in its sliding layers only, Command R+'s
/// norms of each head with weights of its own.
#[test]
fn cohere_configs_read_as_transformers_reads_them() {
    use zero_candle::models::QkNorm;
    let cohere = LlamaConfig::from_json(&config_of("cohere")).unwrap();
    assert!(cohere.layer_norms && cohere.parallel_blocks && cohere.rope_interleaved);
    assert!(cohere.tie_word_embeddings && cohere.sliding_window.is_none());
    assert_eq!(cohere.logit_scale, Some(0.25));
    assert_eq!(cohere.rotated_layers, None, "every layer rotates");
    let cohere2 = LlamaConfig::from_json(&config_of("cohere2")).unwrap();
    assert_eq!(cohere2.logit_scale, Some(0.0625));
    assert_eq!(
        cohere2.sliding_window.as_ref().unwrap().layers,
        [true, false]
    );
    assert_eq!(cohere2.rotated_layers, Some(vec![true, false]));
    // transformers' defaults where the file is silent: the scale 0.0625,
    // epsilon 1e-5, a tied head; Cohere 2's window of 4096 in three layers
    // of four, which alone rotate.
    let mut silent = config_of("cohere2");
    let object = silent.as_object_mut().unwrap();
    for key in [
        "logit_scale",
        "layer_norm_eps",
        "tie_word_embeddings",
        "sliding_window",
        "layer_types",
    ] {
        object.remove(key);
    }
    object.insert("num_hidden_layers".into(), 8.into());
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(
        (parsed.logit_scale, parsed.rms_norm_eps),
        (Some(0.0625), 1e-5)
    );
    assert!(parsed.tie_word_embeddings);
    let window = parsed.sliding_window.unwrap();
    assert_eq!(window.size, 4096);
    let pattern = [true, true, true, false, true, true, true, false];
    assert_eq!(window.layers, pattern);
    assert_eq!(parsed.rotated_layers.unwrap(), pattern);
    let plus = LlamaConfig::from_json(&config_of("cohereqk")).unwrap();
    assert_eq!(plus.qk_norm, Some(QkNorm::HeadWeights));
    // The norms' weights reorder element by element, as their heads' rows.
    let layout = Llama::hub_layout(&plus);
    let Arrangement::RowsPermuted(k) = layout.arrangement("model.layers.0.self_attn.k_norm.weight")
    else {
        panic!("the key norm keeps its order")
    };
    assert_eq!(&k[8..16], &[8, 10, 12, 14, 9, 11, 13, 15]);
}

/// Starcoder2's config read as `transformers` reads it: `use_bias` on by
/// default, `norm_epsilon`, `hidden_act` as `ACT2FN` takes it, windows in
/// every layer where the file sets one.
#[test]
fn starcoder2_configs_read_as_transformers_reads_them() {
    use zero_candle::models::UngatedMlp;
    use zero_candle::nn::Activation;
    let config = LlamaConfig::from_json(&config_of("starcoder2")).unwrap();
    assert!(config.layer_norms && config.norm_bias && !config.parallel_blocks);
    assert!(config.qkv_bias && config.o_bias && config.mlp_bias);
    assert_eq!(config.ungated_mlp, Some(UngatedMlp::CFc));
    assert_eq!(config.mlp_activation, Activation::Gelu);
    assert_eq!(config.sliding_window.unwrap().layers, [true, true]);
    // Silent: biases, epsilon 1e-5, tanh GELU, a tied head, no window.
    let silent = config_without(
        "starcoder2",
        &[
            "use_bias",
            "norm_epsilon",
            "rms_norm_eps",
            "hidden_act",
            "tie_word_embeddings",
            "sliding_window",
        ],
    );
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert!(parsed.qkv_bias && parsed.o_bias && parsed.mlp_bias && parsed.norm_bias);
    assert_eq!(parsed.rms_norm_eps, 1e-5);
    assert_eq!(parsed.mlp_activation, Activation::Gelu);
    assert!(parsed.tie_word_embeddings && parsed.sliding_window.is_none());
    // Without biases the projections have none; the LayerNorms keep theirs.
    let mut plain = config_of("starcoder2");
    plain["use_bias"] = false.into();
    plain["norm_epsilon"] = 1e-3.into();
    plain["hidden_act"] = "gelu".into();
    let parsed = LlamaConfig::from_json(&plain).unwrap();
    assert!(!parsed.qkv_bias && !parsed.o_bias && !parsed.mlp_bias && parsed.norm_bias);
    assert_eq!(parsed.rms_norm_eps, 1e-3);
    assert_eq!(parsed.mlp_activation, Activation::GeluErf);
    let stored: usize = hub_tensors(&fixtures().join("starcoder2"))
        .values()
        .map(|(_, shape, _)| shape.iter().product::<usize>())
        .sum();
    let biases = 2 * (32 + 2 * 16 + 32 + 48 + 32);
    assert_eq!(parsed.num_params(), stored - biases);
    plain["hidden_act"] = "relu".into();
    let err = LlamaConfig::from_json(&plain).unwrap_err();
    assert!(err.contains("`hidden_act` is \"relu\""), "{err}");
}

/// Phi's config read as `transformers` reads it: biases whatever the file
/// says, half of each head rotating by default, `qk_layernorm`, Phi's
/// names; a tied head with its bias refused.
#[test]
fn phi_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{LayerNames, QkNorm, UngatedMlp};
    use zero_candle::nn::Activation;
    let config = LlamaConfig::from_json(&config_of("phi")).unwrap();
    assert!(config.layer_norms && config.norm_bias && config.parallel_blocks);
    assert!(config.qkv_bias && config.o_bias && config.mlp_bias && config.head_bias);
    assert_eq!(config.ungated_mlp, Some(UngatedMlp::Fc));
    assert_eq!(config.layer_names, LayerNames::Phi);
    assert_eq!(config.qk_norm, Some(QkNorm::PerHead));
    assert_eq!((config.head_dim, config.rotary_dim), (8, 6));
    assert_eq!(config.mlp_activation, Activation::Gelu);
    let mut silent = config_of("phi");
    let object = silent.as_object_mut().unwrap();
    for key in ["qk_layernorm", "hidden_act", "rope_parameters"] {
        object.remove(key);
    }
    object.insert("attention_bias".into(), false.into());
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(parsed.qk_norm, None);
    assert_eq!(parsed.rotary_dim, 4, "half of each head by default");
    assert!(parsed.qkv_bias && parsed.o_bias && parsed.mlp_bias);
    assert_eq!(parsed.mlp_activation, Activation::Gelu);
    let mut tied = config_of("phi");
    tied["tie_word_embeddings"] = true.into();
    let err = LlamaConfig::from_json(&tied).unwrap_err();
    assert!(err.contains("untie it"), "{err}");
}

/// Arcee's and Nemotron's configs read as `transformers` reads them:
/// squared ReLU by default, Nemotron's norms scaling by `1 + weight`
/// (`norm_eps`) with half of each head rotating by default.
#[test]
fn arcee_and_nemotron_configs_read_as_transformers_reads_them() {
    use zero_candle::models::UngatedMlp;
    use zero_candle::nn::Activation;
    for fixture in ["arcee", "nemotron"] {
        let config = LlamaConfig::from_json(&config_of(fixture)).unwrap();
        assert_eq!(config.ungated_mlp, Some(UngatedMlp::UpDown), "{fixture}");
        assert_eq!(config.mlp_activation, Activation::Relu2, "{fixture}");
        let mut silent = config_of(fixture);
        silent.as_object_mut().unwrap().remove("hidden_act");
        let parsed = LlamaConfig::from_json(&silent).unwrap();
        assert_eq!(parsed.mlp_activation, Activation::Relu2, "{fixture}");
        let mut silu = config_of(fixture);
        silu["hidden_act"] = "silu".into();
        let parsed = LlamaConfig::from_json(&silu).unwrap();
        assert_eq!(parsed.mlp_activation, Activation::Silu, "{fixture}");
    }
    let arcee = LlamaConfig::from_json(&config_of("arcee")).unwrap();
    assert!(!arcee.layer_norms && !arcee.mlp_bias && arcee.norm_weight_offset == 0.0);
    let nemotron = LlamaConfig::from_json(&config_of("nemotron")).unwrap();
    assert!(nemotron.layer_norms && nemotron.norm_bias);
    assert!(nemotron.mlp_bias && nemotron.qkv_bias && nemotron.o_bias);
    assert_eq!(nemotron.norm_weight_offset, 1.0);
    assert_eq!((nemotron.head_dim, nemotron.rotary_dim), (8, 4));
    let mut eps = config_of("nemotron");
    eps["norm_eps"] = 1e-3.into();
    assert_eq!(LlamaConfig::from_json(&eps).unwrap().rms_norm_eps, 1e-3);
}

/// EXAONE 4's config read as `transformers` reads it: OLMo 2's norms with
/// norms of each head, windows by `layer_types` or `sliding_window_pattern`
/// (a number, or letters), only the windowed layers rotating, every layer
/// without windows. Seed-OSS's output bias apart from the others'.
#[test]
fn exaone4_and_seed_oss_configs_read_as_transformers_reads_them() {
    use zero_candle::models::QkNorm;
    let exaone = LlamaConfig::from_json(&config_of("exaone4")).unwrap();
    assert!(!exaone.input_norms && exaone.output_norms);
    assert_eq!(exaone.qk_norm, Some(QkNorm::PerHead));
    assert_eq!(exaone.sliding_window.unwrap().layers, [true, false]);
    assert_eq!(exaone.rotated_layers, Some(vec![true, false]));
    let mut letters = config_of("exaone4");
    let object = letters.as_object_mut().unwrap();
    object.remove("layer_types");
    object.insert("num_hidden_layers".into(), 8.into());
    object.insert("sliding_window_pattern".into(), "LLLG".into());
    let parsed = LlamaConfig::from_json(&letters).unwrap();
    let pattern = [true, true, true, false, true, true, true, false];
    assert_eq!(parsed.sliding_window.unwrap().layers, pattern);
    assert_eq!(parsed.rotated_layers.unwrap(), pattern);
    letters["sliding_window_pattern"] = 4.into();
    let parsed = LlamaConfig::from_json(&letters).unwrap();
    assert_eq!(parsed.sliding_window.unwrap().layers, pattern);
    letters["sliding_window_pattern"] = "LLX".into();
    let err = LlamaConfig::from_json(&letters).unwrap_err();
    assert!(err.contains("letters L"), "{err}");
    // No window: every layer attends to all and rotates.
    let mut full = config_of("exaone4");
    full["sliding_window"] = serde_json::Value::Null;
    let parsed = LlamaConfig::from_json(&full).unwrap();
    assert!(parsed.sliding_window.is_none() && parsed.rotated_layers.is_none());

    let seed = LlamaConfig::from_json(&config_of("seedoss")).unwrap();
    assert!(seed.qkv_bias && seed.o_bias && seed.mlp_bias);
    assert_eq!(seed.head_dim, 16);
    // transformers' defaults: q, k and v biased, o not, heads of 128; the
    // released files' dropout 0.1 read (training here leaves it out).
    let mut silent = config_of("seedoss");
    let object = silent.as_object_mut().unwrap();
    for key in [
        "attention_bias",
        "attention_out_bias",
        "mlp_bias",
        "head_dim",
        "attention_dropout",
        "residual_dropout",
    ] {
        object.remove(key);
    }
    object.insert("attention_dropout".into(), 0.1.into());
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert!(parsed.qkv_bias && !parsed.o_bias && !parsed.mlp_bias);
    assert_eq!((parsed.head_dim, parsed.dropout), (128, 0.1));
}

/// GPT-NeoX's config read as `transformers` reads it, in its transformers 4
/// form too (`rotary_pct`, `rotary_emb_base`: Pythia's files); the fused
/// projection's rows reordered head by head.
#[test]
fn gpt_neox_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{LayerNames, UngatedMlp};
    use zero_candle::nn::Activation;
    let config = LlamaConfig::from_json(&config_of("gptneox")).unwrap();
    assert!(config.parallel_blocks && config.parallel_mlp_norm && config.qkv_per_head);
    assert!(config.layer_norms && config.norm_bias && config.fused_qkv);
    assert!(config.qkv_bias && config.o_bias && config.mlp_bias);
    assert_eq!(config.layer_names, LayerNames::NeoX);
    assert_eq!(config.ungated_mlp, Some(UngatedMlp::NeoX));
    assert_eq!(config.mlp_activation, Activation::GeluErf);
    assert_eq!((config.head_dim, config.rotary_dim), (8, 2));
    // Pythia's form: the rotary keys of transformers 4, no attention_bias.
    let mut old = config_of("gptneox");
    let object = old.as_object_mut().unwrap();
    for key in ["rope_parameters", "attention_bias", "hidden_act"] {
        object.remove(key);
    }
    object.insert("rotary_pct".into(), 0.5.into());
    object.insert("rotary_emb_base".into(), 500.into());
    object.insert("use_parallel_residual".into(), false.into());
    let parsed = LlamaConfig::from_json(&old).unwrap();
    assert_eq!((parsed.rotary_dim, parsed.rope.theta), (4, 500.0));
    assert!(parsed.qkv_bias && parsed.o_bias && parsed.mlp_bias);
    assert_eq!(parsed.mlp_activation, Activation::GeluErf);
    assert!(!parsed.parallel_blocks && !parsed.parallel_mlp_norm);
    // Without attention biases the MLP keeps its own.
    old["attention_bias"] = false.into();
    let parsed = LlamaConfig::from_json(&old).unwrap();
    assert!(!parsed.qkv_bias && !parsed.o_bias && parsed.mlp_bias);
    // Query rows first, head by head: head 1's queries are the file's rows
    // 24..32 (after head 0's queries, keys and values).
    let layout = Llama::hub_layout(&config);
    let Arrangement::RowsPermuted(rows) =
        layout.arrangement("gpt_neox.layers.1.attention.query_key_value.weight")
    else {
        panic!("the fused rows keep the file's order")
    };
    assert_eq!(&rows[8..16], &[24, 25, 26, 27, 28, 29, 30, 31]);
    assert_eq!(&rows[32..34], &[8, 9], "head 0's keys");
    // GPT-NeoX groups no heads, whatever the file says.
    let mut grouped = config_of("gptneox");
    grouped["num_key_value_heads"] = 2.into();
    let parsed = LlamaConfig::from_json(&grouped).unwrap();
    assert_eq!(parsed.num_key_value_heads, parsed.num_attention_heads);
}

/// StableLM's configs read as `transformers` reads them: its switches
/// (`use_qkv_bias`, `qk_layernorm`, `use_parallel_residual`) and a quarter
/// of each head rotating by default.
#[test]
fn stablelm_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{LayerNames, QkNorm};
    let config = LlamaConfig::from_json(&config_of("stablelm")).unwrap();
    assert!(config.layer_norms && config.norm_bias && !config.parallel_blocks);
    assert!(config.qkv_bias && !config.o_bias && !config.mlp_bias);
    assert_eq!(config.qk_norm, Some(QkNorm::HeadWeights));
    assert_eq!(config.layer_names, LayerNames::StableLm);
    assert_eq!(config.rotary_dim, 4);
    let parallel = LlamaConfig::from_json(&config_of("stablelmpar")).unwrap();
    assert!(parallel.parallel_blocks && !parallel.parallel_mlp_norm);
    assert!(!parallel.qkv_bias && parallel.qk_norm.is_none());
    assert_eq!(parallel.rotary_dim, 2, "a quarter of each head by default");
    assert!(parallel.ungated_mlp.is_none(), "StableLM's MLP is gated");
}

/// OLMo's config read as `transformers` reads it: LayerNorms without
/// parameters (epsilon 1e-5 whatever the file says), `clip_qkv`, which
/// OLMoE reads too.
#[test]
fn olmo_configs_read_as_transformers_reads_them() {
    let olmo = LlamaConfig::from_json(&config_of("olmo")).unwrap();
    assert!(olmo.layer_norms && !olmo.norm_weights && !olmo.norm_bias);
    assert_eq!((olmo.clip_qkv, olmo.rms_norm_eps), (Some(0.25), 1e-5));
    let mut silent = config_of("olmo");
    silent["clip_qkv"] = serde_json::Value::Null;
    silent["rms_norm_eps"] = 1e-3.into();
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!((parsed.clip_qkv, parsed.rms_norm_eps), (None, 1e-5));
    let mut olmoe = config_of("olmoe");
    olmoe["clip_qkv"] = 8.0.into();
    assert_eq!(LlamaConfig::from_json(&olmoe).unwrap().clip_qkv, Some(8.0));
    let mut negative = config_of("olmo");
    negative["clip_qkv"] = (-1.0).into();
    let err = LlamaConfig::from_json(&negative).unwrap_err();
    assert!(err.contains("`clip_qkv` is -1"), "{err}");
}

/// NanoChat's config read as `transformers` reads it: RMS norms without
/// parameters (the embeddings' too), squared ReLU and a cap of 15 on the
/// logits by default.
#[test]
fn nanochat_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{QkNorm, UngatedMlp};
    use zero_candle::nn::Activation;
    let config = LlamaConfig::from_json(&config_of("nanochat")).unwrap();
    assert!(!config.layer_norms && !config.norm_weights && config.embedding_norm);
    assert!(
        config.rope_negated,
        "nanochat's rotate_half turns the other way"
    );
    assert_eq!(config.qk_norm, Some(QkNorm::PerHead));
    assert_eq!(config.ungated_mlp, Some(UngatedMlp::Fc));
    assert_eq!(config.final_logit_softcapping, Some(2.0));
    let silent = config_without("nanochat", &["final_logit_softcapping", "hidden_act"]);
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(parsed.final_logit_softcapping, Some(15.0));
    assert_eq!(parsed.mlp_activation, Activation::Relu2);
    assert_eq!(parsed.rms_norm_eps, 1e-5, "the file's epsilon");
}

/// Hunyuan's config read as `transformers` reads it: norms of the rotated
/// heads under its names, its "dynamic" rotation with an `alpha` as NTK's
/// static base (in transformers 4's form too); without `alpha`, dynamic.
#[test]
fn hunyuan_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{LayerNames, QkNorm};
    let config = LlamaConfig::from_json(&config_of("hunyuan")).unwrap();
    assert_eq!(config.qk_norm, Some(QkNorm::PerHead));
    assert!(config.qk_norm_after_rotation);
    assert_eq!(config.layer_names, LayerNames::Hunyuan);
    let base = 10000.0 * 1000f64.powf(8.0 / 6.0);
    assert!(
        (config.rope.theta - base).abs() < 1e-6 * base,
        "{}",
        config.rope.theta
    );
    assert_eq!(config.rope.scaling, RopeScaling::None);
    let mut old = config_of("hunyuan");
    let object = old.as_object_mut().unwrap();
    object.remove("rope_parameters");
    object.insert("rope_theta".into(), 10000.0.into());
    object.insert(
        "rope_scaling".into(),
        serde_json::json!({"type": "dynamic", "alpha": 1000.0, "factor": 1.0}),
    );
    assert_eq!(LlamaConfig::from_json(&old).unwrap().rope, config.rope);
    let mut zero = old.clone();
    zero["rope_scaling"]["alpha"] = 0.0.into();
    let err = LlamaConfig::from_json(&zero).unwrap_err();
    assert!(err.contains("alpha"), "{err}");
    let mut plain = old.clone();
    plain["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
    let dynamic = LlamaConfig::from_json(&plain).unwrap();
    assert!(
        matches!(dynamic.rope.scaling, RopeScaling::Dynamic { .. }),
        "{:?}",
        dynamic.rope
    );
}

/// Jais 2's and Helium's configs read as `transformers` reads them: their
/// defaults where the files are silent (Jais 2's biases, Helium's heads of
/// 128 and epsilon 1e-8).
#[test]
fn jais2_and_helium_configs_read_as_transformers_reads_them() {
    use zero_candle::nn::Activation;
    let mut jais = config_without("jais2", &["attention_bias", "mlp_bias", "hidden_act"]);
    let parsed = LlamaConfig::from_json(&jais).unwrap();
    assert!(parsed.qkv_bias && parsed.o_bias && parsed.mlp_bias && parsed.norm_bias);
    assert_eq!(parsed.mlp_activation, Activation::Relu2);
    jais["mlp_bias"] = false.into();
    assert!(!LlamaConfig::from_json(&jais).unwrap().mlp_bias);
    let helium = LlamaConfig::from_json(&config_of("helium")).unwrap();
    assert!(helium.rope_interleaved && helium.qkv_bias && !helium.o_bias);
    let silent = config_without("helium", &["head_dim", "rms_norm_eps"]);
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!((parsed.head_dim, parsed.rms_norm_eps), (128, 1e-8));
    let llama = LlamaConfig::from_json(&serde_json::json!({
        "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2
    }))
    .unwrap();
    assert_eq!(llama.rms_norm_eps, 1e-6, "Llama's default");
}

/// Ministral's and CWM's windows where `layer_types` puts them, and where
/// their files leave it out: Ministral's in every layer, CWM's in all but
/// every fourth from the first, of 8192 by default; CWM's default rotation.
#[test]
fn ministral_and_cwm_configs_read_as_transformers_reads_them() {
    let ministral = LlamaConfig::from_json(&config_of("ministral")).unwrap();
    assert_eq!(ministral.sliding_window.unwrap().layers, [true, false]);
    let cwm = LlamaConfig::from_json(&config_of("cwm")).unwrap();
    let window = cwm.sliding_window.clone().unwrap();
    assert_eq!((window.size, window.layers), (5, vec![false, true]));
    assert!(matches!(cwm.rope.scaling, RopeScaling::Llama3(_)));
    let mut silent = config_without("cwm", &["layer_types", "sliding_window", "rope_parameters"]);
    silent["num_hidden_layers"] = 8.into();
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    let window = parsed.sliding_window.unwrap();
    let pattern = [false, true, true, true, false, true, true, true];
    assert_eq!(
        (window.size, window.layers.as_slice()),
        (8192, &pattern[..])
    );
    assert_eq!(parsed.rope, cwm.rope, "the default rotation is the file's");
    let mut silent = config_of("ministral");
    silent.as_object_mut().unwrap().remove("layer_types");
    let window = LlamaConfig::from_json(&silent)
        .unwrap()
        .sliding_window
        .unwrap();
    assert_eq!(window.layers, [true, true]);
    silent["sliding_window"] = serde_json::Value::Null;
    assert!(LlamaConfig::from_json(&silent)
        .unwrap()
        .sliding_window
        .is_none());
}

/// Solar Open's config read as `transformers` reads it: GLM-4.5's router in
/// every layer, no `intermediate_size` needed.
#[test]
fn solar_open_config_reads_as_transformers_reads_it() {
    use zero_candle::models::{MoeRouting, MoeStyle};
    let config = LlamaConfig::from_json(&config_of("solaropen")).unwrap();
    let moe = config.moe.clone().unwrap();
    assert_eq!(moe.layers, [true, true], "no dense layer");
    assert_eq!(moe.style, MoeStyle::Glm);
    assert!(matches!(
        moe.routing,
        MoeRouting::Sigmoid {
            groups: 4,
            top_groups: 2,
            ..
        }
    ));
    assert_eq!((moe.expert_size, moe.shared_expert_size), (16, Some(16)));
    assert!(config.qkv_bias && !config.o_bias && config.qk_norm.is_none());
    assert_eq!((config.head_dim, config.rotary_dim), (8, 8));
    assert_eq!(config.intermediate_size, 16, "the experts' width");
    let mut silent = config_of("solaropen");
    silent
        .as_object_mut()
        .unwrap()
        .remove("moe_intermediate_size");
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(parsed.moe.unwrap().expert_size, 1280);
    let mut mixtral = config_of("mixtral");
    mixtral.as_object_mut().unwrap().remove("intermediate_size");
    let err = LlamaConfig::from_json(&mixtral).unwrap_err();
    assert!(err.contains("intermediate_size"), "{err}");
}

/// A config that ties the head while the files hold a head of their own
/// (Mistral Small's: Mistral 3's outer config ties by default) reads as
/// untied, as `transformers` 5 unties it, and the model is transformers';
/// files without a head of their own stay tied.
#[test]
fn a_head_the_files_hold_apart_is_untied_whatever_the_config_says() {
    let golden = golden();
    let ids = input_ids(&golden);
    let dir = tempfile::tempdir().unwrap();
    let from = fixtures().join("mistral3mm");
    for entry in std::fs::read_dir(&from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let silent = config_without("mistral3mm", &["tie_word_embeddings"]);
    std::fs::write(dir.path().join("config.json"), silent.to_string()).unwrap();
    assert!(LlamaConfig::from_json(&silent).unwrap().tie_word_embeddings);
    let (config, map) = Llama::open_hub(dir.path()).unwrap();
    assert!(!config.tie_word_embeddings, "the files hold their own head");
    let model = Llama::new(map.builder(DType::F32, &Device::Cpu), &config, None).unwrap();
    map.materialize_all().unwrap();
    let logits = model.forward(&ids.narrow(1, 0, 16).unwrap()).unwrap();
    let err = relative_error(&values(&logits), &values(&golden["mistral3mm.logits"]));
    assert!(err < 1e-5, "logits differ by {err:e}");
    let (tied, _) = Llama::open_hub(fixtures().join("tied")).unwrap();
    assert!(tied.tie_word_embeddings, "no head of its own in the files");
}

/// Ministral 3's config read as `transformers` reads it: its default YaRN
/// rotation, the queries scaled by position past the original context.
#[test]
fn ministral3_configs_read_as_transformers_reads_them() {
    let config = LlamaConfig::from_json(&config_of("ministral3")).unwrap();
    let scale = config.position_scale.unwrap();
    assert_eq!((scale.beta, scale.every), (0.5, 4));
    let factors = scale.factors(9);
    assert_eq!(&factors[..4], &[1.0; 4]);
    assert!((factors[4] - (1.0 + 0.5 * 2f32.ln())).abs() < 1e-7);
    assert!((factors[8] - (1.0 + 0.5 * 3f32.ln())).abs() < 1e-7);
    let mut silent = config_of("ministral3");
    silent.as_object_mut().unwrap().remove("rope_parameters");
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    let scale = parsed.position_scale.unwrap();
    assert_eq!((scale.beta, scale.every), (0.1, 16384));
    assert_eq!(parsed.rope.theta, 1e6);
    assert!(matches!(parsed.rope.scaling, RopeScaling::Yarn(_)));
    let mut no_context = config_of("ministral3");
    let rope = no_context["rope_parameters"].as_object_mut().unwrap();
    rope.remove("original_max_position_embeddings");
    rope.insert("rope_type".into(), "default".into());
    let err = LlamaConfig::from_json(&no_context).unwrap_err();
    assert!(err.contains("original_max_position_embeddings"), "{err}");
}

/// GPT-J's config read as `transformers` reads it: GPT-2's keys, `n_inner`
/// (4 `n_embd` where null), `rotary_dim` (the whole head where null).
#[test]
fn gptj_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{LayerNames, UngatedMlp};
    let config = LlamaConfig::from_json(&config_of("gptj")).unwrap();
    assert_eq!(
        (
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers
        ),
        (32, 48, 2)
    );
    assert_eq!((config.head_dim, config.rotary_dim), (8, 4));
    assert!(config.parallel_blocks && config.rope_interleaved && config.head_bias);
    assert!(!config.qkv_bias && !config.o_bias && config.mlp_bias && config.norm_bias);
    assert_eq!(config.layer_names, LayerNames::GptJ);
    assert_eq!(config.ungated_mlp, Some(UngatedMlp::FcInOut));
    let mut silent = config_of("gptj");
    silent["n_inner"] = serde_json::Value::Null;
    silent["rotary_dim"] = serde_json::Value::Null;
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!((parsed.intermediate_size, parsed.rotary_dim), (128, 8));
}

/// Falcon's configs read as `transformers` reads them: its architectures'
/// key/value heads, row orders and blocks, its RefinedWeb keys; ALiBi
/// refused.
#[test]
fn falcon_configs_read_as_transformers_reads_them() {
    use zero_candle::models::LayerNames;
    let seven = LlamaConfig::from_json(&config_of("falcon")).unwrap();
    assert_eq!(seven.num_key_value_heads, 1);
    assert!(seven.fused_qkv && !seven.qkv_per_head && seven.parallel_blocks);
    assert!(!seven.parallel_mlp_norm && !seven.qkv_bias && seven.tie_word_embeddings);
    assert_eq!(
        (seven.layer_names, seven.intermediate_size),
        (LayerNames::Falcon, 48)
    );
    let new = LlamaConfig::from_json(&config_of("falconnew")).unwrap();
    assert_eq!(new.num_key_value_heads, 2);
    assert!(new.qkv_per_head && new.parallel_blocks && new.parallel_mlp_norm);
    assert!(new.qkv_bias && new.o_bias && new.mlp_bias);
    // Group by group: K/V head 1's two query heads are the file's heads 4
    // and 5 (after group 0's two queries, key and value).
    let layout = Llama::hub_layout(&new);
    let Arrangement::RowsPermuted(rows) =
        layout.arrangement("transformer.h.0.self_attention.query_key_value.weight")
    else {
        panic!("the fused rows keep the file's order")
    };
    assert_eq!(rows[16], 4 * 8, "query head 2");
    assert_eq!(rows[32], 2 * 8, "key head 0");
    assert_eq!(rows[48], 3 * 8, "value head 0");
    let sequential = LlamaConfig::from_json(&config_of("falconseq")).unwrap();
    assert_eq!(sequential.num_key_value_heads, 4);
    assert!(sequential.qkv_per_head && !sequential.parallel_blocks);
    // One norm in the new architecture where `num_ln_in_parallel_attn` is 1.
    let mut one = config_of("falconnew");
    one["num_ln_in_parallel_attn"] = 1.into();
    assert!(!LlamaConfig::from_json(&one).unwrap().parallel_mlp_norm);
    // RefinedWeb's keys.
    let mut old = config_without(
        "falcon",
        &["hidden_size", "num_attention_heads", "ffn_hidden_size"],
    );
    old["n_embed"] = 32.into();
    old["n_head"] = 4.into();
    let parsed = LlamaConfig::from_json(&old).unwrap();
    assert_eq!((parsed.hidden_size, parsed.intermediate_size), (32, 128));
    let mut alibi = config_of("falcon");
    alibi["alibi"] = true.into();
    let err = LlamaConfig::from_json(&alibi).unwrap_err();
    assert!(err.contains("alibi"), "{err}");
}

/// GLM-4's configs read as `transformers` reads them, and the query and
/// key rows the layout reorders (the goldens check them in use).
#[test]
fn glm_configs_read_as_transformers_reads_them() {
    use zero_candle::models::NormNames;
    let glm = LlamaConfig::from_json(&config_of("glm")).unwrap();
    assert!(glm.qkv_bias && !glm.o_bias && glm.fused_gate_up && !glm.fused_qkv);
    assert!(glm.rope_interleaved && !glm.output_norms);
    assert_eq!((glm.head_dim, glm.rotary_dim), (16, 8));
    let glm4 = LlamaConfig::from_json(&config_of("glm4")).unwrap();
    assert!(glm4.input_norms && glm4.output_norms && glm4.rope_interleaved);
    assert_eq!(glm4.norm_names, NormNames::Glm4);
    // transformers' defaults where the file is silent: biases on q, k and
    // v, heads of 128, half of each rotating.
    for fixture in ["glm", "glm4"] {
        let mut silent = config_of(fixture);
        let object = silent.as_object_mut().unwrap();
        for key in ["attention_bias", "head_dim", "rope_parameters"] {
            object.remove(key);
        }
        object.insert("hidden_size".into(), 512.into());
        let parsed = LlamaConfig::from_json(&silent).unwrap();
        assert!(parsed.qkv_bias && !parsed.o_bias, "{fixture}");
        assert_eq!((parsed.head_dim, parsed.rotary_dim), (128, 64), "{fixture}");
        silent["attention_bias"] = false.into();
        let parsed = LlamaConfig::from_json(&silent).unwrap();
        assert!(!parsed.qkv_bias && !parsed.o_bias, "{fixture}");
    }
    // The rows reordered: each head's first 8 values rotate as pairs (x0,
    // x1), (x2, x3), ..., which rotate_half's order holds as x0, x2, x4,
    // x6, x1, x3, x5, x7; the other 8 stay.
    let layout = Llama::hub_layout(&glm);
    let Arrangement::RowsPermuted(q) = layout.arrangement("model.layers.1.self_attn.q_proj.bias")
    else {
        panic!("the query biases keep their order")
    };
    assert_eq!(q.len(), 64);
    assert_eq!(
        &q[16..32],
        &[16, 18, 20, 22, 17, 19, 21, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    );
    assert!(matches!(
        layout.arrangement("model.layers.0.self_attn.k_proj.weight"),
        Arrangement::RowsPermuted(k) if k.len() == 32
    ));
    for untouched in [
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight",
    ] {
        assert_eq!(
            *layout.arrangement(untouched),
            Arrangement::AsIs,
            "{untouched}"
        );
    }
}

/// SmolLM3's layers without rotary embeddings and Granite's multipliers
/// read as `transformers` reads them (the goldens check them in use): the
/// NoPE layers from `no_rope_layers` or every fourth, windows only where
/// `use_sliding_window` is on (in the NoPE layers where `layer_types` does
/// not say); Granite's multipliers of 1 are none; what does not fit,
/// refused by name.
#[test]
fn smollm3_and_granite_configs_read_as_transformers_reads_them() {
    use zero_candle::models::SlidingWindow;
    let smollm3 = config_of("smollm3");
    let parsed = LlamaConfig::from_json(&smollm3).unwrap();
    assert_eq!(parsed.rotated_layers, Some(vec![true, false]));
    let windowed = Some(SlidingWindow {
        size: 5,
        layers: vec![false, true],
    });
    assert_eq!(parsed.sliding_window, windowed);
    assert!(parsed.tie_word_embeddings);
    let mut old = smollm3.clone();
    let object = old.as_object_mut().unwrap();
    object.remove("layer_types");
    object.remove("no_rope_layers");
    object.remove("rope_parameters");
    object.insert("num_hidden_layers".into(), 5.into());
    let defaults = LlamaConfig::from_json(&old).unwrap();
    assert_eq!(defaults.rope.theta, 2e6, "SmolLM3's default base");
    let every_fourth = vec![true, true, true, false, true];
    assert_eq!(defaults.rotated_layers.as_ref(), Some(&every_fourth));
    let nope: Vec<bool> = every_fourth.iter().map(|r| !r).collect();
    assert_eq!(defaults.sliding_window.unwrap().layers, nope);
    old["use_sliding_window"] = false.into();
    assert_eq!(LlamaConfig::from_json(&old).unwrap().sliding_window, None);

    let granite = LlamaConfig::from_json(&config_of("granite")).unwrap();
    assert_eq!(
        (
            granite.embedding_scale,
            granite.attention_scale,
            granite.residual_multiplier,
            granite.logits_scaling
        ),
        (Some(3.0), Some(0.2), Some(0.5), Some(4.0))
    );
    let mut plain = config_of("granite");
    for key in [
        "embedding_multiplier",
        "attention_multiplier",
        "residual_multiplier",
        "logits_scaling",
    ] {
        plain[key] = 1.0.into();
    }
    let plain = LlamaConfig::from_json(&plain).unwrap();
    assert_eq!(plain.attention_scale, None);
    assert_eq!(plain.residual_multiplier, None);
    // Llama reads none of them.
    let mut llama = config_of("gqa");
    llama["residual_multiplier"] = 0.5.into();
    assert_eq!(
        LlamaConfig::from_json(&llama).unwrap().residual_multiplier,
        None
    );

    let refused: [(&str, &str, serde_json::Value); 4] = [
        ("smollm3", "no_rope_layers", serde_json::json!([1, 2])),
        ("smollm3", "no_rope_layers", serde_json::json!([1])),
        ("granite", "logits_scaling", 0.0.into()),
        ("granite", "residual_multiplier", (-1.0).into()),
    ];
    for (fixture, key, value) in refused {
        let mut config = config_of(fixture);
        config[key] = value;
        let err = LlamaConfig::from_json(&config).unwrap_err();
        assert!(err.contains(key), "{fixture} {key}: {err}");
    }
}

/// The mixtures' settings as `transformers` reads them: the fixtures', the
/// defaults where a file is silent, and errors naming what cannot be
/// honoured.
#[test]
fn moe_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{MoeConfig, MoeRouting, MoeStyle};
    let moe = |config: &serde_json::Value| -> MoeConfig {
        LlamaConfig::from_json(config).unwrap().moe.unwrap()
    };
    let mixtral = moe(&config_of("mixtral"));
    assert_eq!(
        mixtral,
        MoeConfig {
            num_experts: 4,
            experts_per_token: 2,
            expert_size: 48,
            normalize: true,
            shared_expert_size: None,
            layers: vec![true, true],
            aux_loss_coef: Some(0.5),
            style: MoeStyle::Mixtral,
            routing: MoeRouting::Softmax,
            clamped_swiglu: None,
            router_in_f32: false,
        }
    );
    let qwen2 = moe(&config_of("qwen2moe"));
    assert_eq!(
        (qwen2.expert_size, qwen2.shared_expert_size, qwen2.normalize),
        (24, Some(40), false)
    );
    assert_eq!(
        (qwen2.layers, qwen2.aux_loss_coef),
        (vec![false, true], None)
    );
    let qwen3 = moe(&config_of("qwen3moe"));
    assert_eq!(
        (qwen3.num_experts, qwen3.experts_per_token, qwen3.normalize),
        (8, 3, true)
    );
    assert_eq!(qwen3.style, MoeStyle::Qwen);
    let olmoe = LlamaConfig::from_json(&config_of("olmoe")).unwrap();
    assert_eq!(olmoe.qk_norm, Some(zero_candle::models::QkNorm::Projection));
    assert!(olmoe.input_norms && !olmoe.output_norms);
    assert_eq!(olmoe.moe.as_ref().unwrap().expert_size, 48);
    // FlexOlmo: OLMo 2's norms of the outputs, OLMoE's mixture.
    let flex = LlamaConfig::from_json(&config_of("flexolmo")).unwrap();
    assert!(!flex.input_norms && flex.output_norms);
    assert_eq!(flex.qk_norm, Some(zero_candle::models::QkNorm::Projection));
    let flex_moe = flex.moe.unwrap();
    assert_eq!(
        (
            flex_moe.num_experts,
            flex_moe.experts_per_token,
            flex_moe.expert_size
        ),
        (4, 2, 48)
    );
    assert!(!flex_moe.normalize && flex_moe.aux_loss_coef.is_none());
    // Each mixture layer: its router and its experts (plus Qwen2's shared
    // expert and gate) in place of the dense MLP.
    let dense = LlamaConfig::from_json(&config_of("gqa")).unwrap();
    let (d, inner) = (32, 48);
    assert_eq!(
        LlamaConfig::from_json(&config_of("mixtral"))
            .unwrap()
            .num_params(),
        dense.num_params() + 2 * (4 * (d + 3 * d * inner) - 3 * d * inner)
    );

    // transformers' defaults where the file is silent.
    let mut silent = config_without(
        "qwen2moe",
        &[
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "norm_topk_prob",
            "mlp_only_layers",
            "router_aux_loss_coef",
        ],
    );
    silent["output_router_logits"] = true.into();
    silent["decoder_sparse_step"] = 2.into();
    let defaults = moe(&silent);
    assert_eq!(
        (
            defaults.num_experts,
            defaults.experts_per_token,
            defaults.expert_size
        ),
        (60, 4, 1408)
    );
    assert_eq!(defaults.shared_expert_size, Some(5632));
    assert_eq!(defaults.layers, vec![false, true], "every second layer");
    assert_eq!(defaults.aux_loss_coef, Some(0.001));
    // GLM-4.5: the grouped sigmoid router, shared experts as one MLP, the
    // first layers dense; transformers' defaults where the file is silent.
    let glm = LlamaConfig::from_json(&config_of("glm4moe")).unwrap();
    assert_eq!(glm.qk_norm, Some(zero_candle::models::QkNorm::PerHead));
    assert!(
        glm.qkv_bias && !glm.o_bias,
        "attention_bias is q's, k's and v's"
    );
    assert_eq!((glm.head_dim, glm.rotary_dim), (16, 8));
    assert_eq!(
        glm.moe.clone().unwrap(),
        MoeConfig {
            num_experts: 8,
            experts_per_token: 3,
            expert_size: 16,
            normalize: true,
            shared_expert_size: Some(32),
            layers: vec![false, true],
            aux_loss_coef: None,
            style: MoeStyle::Glm,
            routing: MoeRouting::Sigmoid {
                groups: 4,
                top_groups: 2,
                scale: 2.5,
            },
            clamped_swiglu: None,
            router_in_f32: true,
        }
    );
    let mut silent = config_without(
        "glm4moe",
        &[
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_shared_experts",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "first_k_dense_replace",
            "norm_topk_prob",
            "use_qk_norm",
            "rope_parameters",
        ],
    );
    silent["output_router_logits"] = true.into();
    let defaults = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!((defaults.qk_norm, defaults.rotary_dim), (None, 8));
    let defaults = defaults.moe.unwrap();
    assert_eq!(
        (
            defaults.num_experts,
            defaults.experts_per_token,
            defaults.expert_size,
            defaults.shared_expert_size,
            defaults.normalize,
        ),
        (128, 8, 1408, Some(1408), true)
    );
    assert_eq!(defaults.layers, vec![false, true]);
    assert_eq!(
        defaults.routing,
        MoeRouting::Sigmoid {
            groups: 1,
            top_groups: 1,
            scale: 1.0
        }
    );
    assert_eq!(defaults.aux_loss_coef, None, "transformers adds none");
    // The shared experts (no gate) and the router in each mixture layer.
    assert_eq!(
        glm.num_params(),
        LlamaConfig::from_json(&config_of("glm4moe"))
            .map(|mut dense| {
                dense.moe = None;
                dense.num_params()
            })
            .unwrap()
            + 8 * (d + 3 * d * 16)
            + 3 * d * 32
            - 3 * d * inner
    );

    // MiniMax-M2: Mixtral's mixture with the sigmoid router, neither grouped
    // nor scaled; its released files' `rotary_dim` in place of a factor.
    let minimax = LlamaConfig::from_json(&config_of("minimaxm2")).unwrap();
    assert_eq!(
        minimax.qk_norm,
        Some(zero_candle::models::QkNorm::Projection)
    );
    assert_eq!((minimax.head_dim, minimax.rotary_dim), (16, 8));
    let minimax_moe = minimax.moe.unwrap();
    assert_eq!(
        (
            minimax_moe.style,
            minimax_moe.normalize,
            minimax_moe.aux_loss_coef
        ),
        (MoeStyle::MiniMax, true, Some(0.5))
    );
    assert_eq!(
        minimax_moe.routing,
        MoeRouting::Sigmoid {
            groups: 1,
            top_groups: 1,
            scale: 1.0
        }
    );
    let mut legacy = config_of("minimaxm2");
    legacy.as_object_mut().unwrap().remove("rope_parameters");
    legacy["rope_theta"] = 5e6.into();
    legacy["rotary_dim"] = 4.into();
    let legacy = LlamaConfig::from_json(&legacy).unwrap();
    assert_eq!(
        legacy.rotary_dim, 4,
        "rotary_dim read where no factor is given"
    );
    assert_eq!(legacy.rope, minimax.rope);

    let mut jitter = config_of("mixtral");
    jitter["router_jitter_noise"] = 0.1.into();
    assert_eq!(
        LlamaConfig::from_json(&jitter).unwrap().dropout,
        0.1,
        "reported as left out, as dropout is"
    );

    // A file holding a layer's experts fused, as transformers 5 holds them:
    // read as such, each expert's projection a part of its layer's tensor
    // (Mistral 4's fixture trains and saves through it).
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures().join("qwen2moe/config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let fused = candle_core::Tensor::zeros((4, 48, 32), DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(
        &std::collections::HashMap::from([("model.layers.1.mlp.experts.gate_up_proj", fused)]),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let hub = HubDir::open(dir.path()).unwrap();
    let config = LlamaConfig::from_hub(&hub).unwrap();
    assert!(config.fused_experts);
    let layout = Llama::hub_layout(&config);
    assert_eq!(
        layout.fused_part("model.layers.1.mlp.experts.gate_up_proj.3.up.weight"),
        Some(("model.layers.1.mlp.experts.gate_up_proj", 7, 8))
    );
    assert_eq!(
        layout.tensor_of(
            &hub,
            "model.layers.1.mlp.experts.gate_up_proj.0.gate.weight"
        ),
        Some("model.layers.1.mlp.experts.gate_up_proj".into())
    );
    assert!(
        !LlamaConfig::from_hub(&HubDir::open(fixtures().join("qwen2moe")).unwrap())
            .unwrap()
            .fused_experts
    );

    let cases: [(&str, &str, serde_json::Value, &str); 7] = [
        ("glm4moe", "n_group", 3.into(), "n_group"),
        ("glm4moe", "topk_group", 5.into(), "topk_group"),
        (
            "glm4moe",
            "num_experts_per_tok",
            5.into(),
            "num_experts_per_tok",
        ),
        (
            "qwen3moe",
            "use_sliding_window",
            true.into(),
            "use_sliding_window",
        ),
        (
            "mixtral",
            "num_experts_per_tok",
            5.into(),
            "num_experts_per_tok",
        ),
        (
            "qwen2moe",
            "mlp_only_layers",
            serde_json::json!([2]),
            "mlp_only_layers",
        ),
        (
            "qwen2moe",
            "decoder_sparse_step",
            0.into(),
            "decoder_sparse_step",
        ),
    ];
    for (fixture, key, value, named) in cases {
        let mut config = config_of(fixture);
        config[key] = value;
        let err = LlamaConfig::from_json(&config).unwrap_err();
        assert!(err.contains(named), "{fixture} {key}: {err}");
    }
}

/// DeepSeek-V2's, V3's and GLM-4.7-Flash's configs: the latent attention's
/// widths, `transformers`' defaults where a file is silent, the score
/// scale YaRN's `mscale_all_dim` gives, the routers, and the refusals.
#[test]
fn latent_attention_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{LatentAttention, MoeRouting, MoeStyle, PositionScale};
    let v2 = LlamaConfig::from_json(&config_of("deepseekv2")).unwrap();
    assert_eq!(
        v2.latent_attention,
        Some(LatentAttention {
            query_rank: None,
            kv_rank: 12,
            nope_dim: 8,
            value_dim: 6,
        })
    );
    assert_eq!(
        (v2.head_dim, v2.rotary_dim, v2.num_key_value_heads),
        (12, 4, 4)
    );
    assert!(v2.rope_interleaved && v2.qkv_bias && v2.o_bias);
    // 12^-1/2 times get_mscale(4, 0.5)².
    let mscale = 0.1 * 0.5 * 4f64.ln() + 1.0;
    let scale = v2.attention_scale.unwrap();
    assert!(
        (scale - mscale * mscale / 12f64.sqrt()).abs() < 1e-12,
        "{scale}"
    );
    let moe = v2.moe.clone().unwrap();
    // transformers computes DeepSeek-V2's router in f32, Mistral 4's in the
    // model's dtype.
    let mistral4 = LlamaConfig::from_json(&config_of("mistral4")).unwrap();
    assert!(moe.router_in_f32 && !mistral4.moe.unwrap().router_in_f32);
    assert_eq!(moe.style, MoeStyle::DeepSeek);
    assert_eq!(
        moe.routing,
        MoeRouting::GroupedSoftmax {
            groups: 4,
            top_groups: 3,
            ranked_by: 1,
            scale: 2.0
        }
    );
    assert!(!moe.normalize && moe.aux_loss_coef.is_none());
    assert_eq!(
        (moe.layers.as_slice(), moe.shared_expert_size),
        (&[false, true][..], Some(32))
    );

    // The released files' keys, the rest transformers' defaults.
    let v3 = LlamaConfig::from_json(&serde_json::json!({
        "model_type": "deepseek_v3",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 128,
        "head_dim": 64,
        "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
        "rope_theta": 10000, "max_position_embeddings": 163840
    }))
    .unwrap();
    assert_eq!(
        v3.latent_attention,
        Some(LatentAttention {
            query_rank: Some(1536),
            kv_rank: 512,
            nope_dim: 128,
            value_dim: 128,
        })
    );
    assert_eq!(
        (v3.head_dim, v3.rotary_dim, v3.num_key_value_heads),
        (192, 64, 4)
    );
    assert!(v3.rope_interleaved && !v3.qkv_bias);
    let mscale = 0.1 * 40f64.ln() + 1.0;
    let scale = v3.attention_scale.unwrap();
    assert!(
        (scale - mscale * mscale / 192f64.sqrt()).abs() < 1e-12,
        "{scale}"
    );
    let moe = v3.moe.clone().unwrap();
    assert_eq!(moe.style, MoeStyle::Glm);
    assert_eq!(
        moe.routing,
        MoeRouting::Sigmoid {
            groups: 8,
            top_groups: 4,
            scale: 2.5
        }
    );
    assert_eq!(
        (moe.num_experts, moe.experts_per_token, moe.expert_size),
        (256, 8, 2048)
    );
    assert!(moe.normalize);
    assert_eq!(
        moe.layers,
        [false, false, false, true],
        "3 dense layers first"
    );

    let lite = LlamaConfig::from_json(&config_of("glm4moelite")).unwrap();
    assert!(!lite.rope_interleaved && lite.attention_scale.is_none());
    assert_eq!(lite.moe.as_ref().unwrap().layers, [true, false]);
    let mut default_layers = config_of("glm4moelite");
    default_layers
        .as_object_mut()
        .unwrap()
        .remove("mlp_layer_types");
    let parsed = LlamaConfig::from_json(&default_layers).unwrap();
    assert_eq!(parsed.moe.unwrap().layers, [false, true]);

    // Mistral 4: groups ranked by their two best, normalized; the position
    // scale; YaRN by default.
    let m4 = LlamaConfig::from_json(&config_of("mistral4")).unwrap();
    let moe = m4.moe.clone().unwrap();
    assert_eq!(
        moe.routing,
        MoeRouting::GroupedSoftmax {
            groups: 4,
            top_groups: 2,
            ranked_by: 2,
            scale: 1.5
        }
    );
    assert!(moe.normalize);
    assert_eq!(
        (moe.style, moe.shared_expert_size),
        (MoeStyle::DeepSeek, Some(16))
    );
    assert_eq!(
        m4.position_scale,
        Some(PositionScale {
            beta: 0.5,
            every: 4
        })
    );
    let silent = LlamaConfig::from_json(&config_without(
        "mistral4",
        &[
            "rope_parameters",
            "n_shared_experts",
            "norm_topk_prob",
            "routed_scaling_factor",
        ],
    ))
    .unwrap();
    assert!(matches!(
        silent.rope.scaling,
        RopeScaling::Yarn(ref y) if y.factor == 128.0
    ));
    assert_eq!(silent.position_scale.map(|p| p.every), Some(8192));
    let mscale = 0.1 * 128f64.ln() + 1.0;
    let scale = silent.attention_scale.unwrap();
    assert!(
        (scale - mscale * mscale / 12f64.sqrt()).abs() < 1e-12,
        "{scale}"
    );
    let moe = silent.moe.unwrap();
    assert!(moe.normalize && moe.shared_expert_size == Some(16));

    // The num_params of each model: its stored tensors but the routing
    // biases (buffers).
    for fixture in ["deepseekv2", "deepseekv3", "glm4moelite", "mistral4"] {
        let config = LlamaConfig::from_json(&config_of(fixture)).unwrap();
        let stored: usize = hub_tensors(&fixtures().join(fixture))
            .iter()
            .filter(|(name, _)| !name.ends_with("e_score_correction_bias"))
            .map(|(_, (_, shape, _))| shape.iter().product::<usize>())
            .sum();
        assert_eq!(config.num_params(), stored, "{fixture}");
    }

    let refused = [
        (
            "deepseekv2",
            "topk_method",
            "noaux_tc".into(),
            "topk_method",
        ),
        ("deepseekv2", "n_group", serde_json::Value::Null, "n_group"),
        ("deepseekv2", "v_head_dim", 13.into(), "v_head_dim"),
        ("deepseekv2", "n_group", 3.into(), "n_group"),
        (
            "glm4moelite",
            "mlp_layer_types",
            serde_json::json!(["sparse"]),
            "mlp_layer_types",
        ),
        (
            "glm4moelite",
            "mlp_layer_types",
            serde_json::json!(["sparse", "moe"]),
            "mlp_layer_types",
        ),
        (
            "deepseekv3",
            "rope_parameters",
            serde_json::json!({"rope_type": "linear", "rope_theta": 10000.0,
                "mscale_all_dim": 1.0}),
            "factor",
        ),
    ];
    for (fixture, key, value, named) in refused {
        let mut config = config_of(fixture);
        config[key] = value;
        let err = LlamaConfig::from_json(&config).unwrap_err();
        assert!(err.contains(named), "{fixture} {key}: {err}");
    }
}

/// InternLM3's and IQuest-Coder's configs, which `transformers` runs as
/// Llama's: their defaults, InternLM3's `qkv_bias` and `bias` (its released
/// files' keys) read as `attention_bias` and `mlp_bias` and refused where
/// they differ, and IQuest-Coder's refusal of windows.
#[test]
fn internlm3_and_iquestcoder_configs_read_as_transformers_reads_them() {
    let saved = LlamaConfig::from_json(&config_of("internlm3")).unwrap();
    assert!(saved.qkv_bias && saved.o_bias && saved.mlp_bias);
    let mut released = config_without("internlm3", &["attention_bias", "mlp_bias", "head_dim"]);
    released["qkv_bias"] = true.into();
    released["bias"] = true.into();
    released["architectures"] = serde_json::json!(["InternLM3ForCausalLM"]);
    let parsed = LlamaConfig::from_json(&released).unwrap();
    assert!(parsed.qkv_bias && parsed.o_bias && parsed.mlp_bias);
    assert_eq!(parsed.head_dim, 128, "transformers' default");
    released["bias"] = false.into();
    released["qkv_bias"] = false.into();
    let plain = LlamaConfig::from_json(&released).unwrap();
    assert!(!plain.qkv_bias && !plain.o_bias && !plain.mlp_bias);
    // As transformers refuses them: Llama's one switch cannot hold both.
    for (qkv, bias) in [(true, false), (false, true)] {
        released["qkv_bias"] = qkv.into();
        released["bias"] = bias.into();
        let err = LlamaConfig::from_json(&released).unwrap_err();
        assert!(err.contains("`qkv_bias` differs from its `bias`"), "{err}");
    }
    released.as_object_mut().unwrap().remove("bias");
    released["qkv_bias"] = true.into();
    let err = LlamaConfig::from_json(&released).unwrap_err();
    assert!(err.contains("set both the same"), "{err}");
    // transformers' saved form: the error names its keys.
    let mut saved_form = config_of("internlm3");
    saved_form["attention_bias"] = true.into();
    saved_form["mlp_bias"] = false.into();
    let err = LlamaConfig::from_json(&saved_form).unwrap_err();
    assert!(
        err.contains("`attention_bias` differs from its `mlp_bias`"),
        "{err}"
    );

    let silent = LlamaConfig::from_json(&config_without(
        "iquestcoder",
        &["head_dim", "rms_norm_eps"],
    ))
    .unwrap();
    assert_eq!((silent.head_dim, silent.rms_norm_eps), (128, 1e-5));
    let mut windowed = config_of("iquestcoder");
    windowed["use_sliding_window"] = true.into();
    windowed["sliding_window"] = 4.into();
    let err = LlamaConfig::from_json(&windowed).unwrap_err();
    assert!(err.contains("use_sliding_window"), "{err}");
}

/// EXAONE 3's config as its released files give it (`num_layers`,
/// `layer_norm_epsilon`, `activation_function`; the fixture's) and as
/// `transformers` saves it (Llama's keys), read alike; silent, its
/// defaults: `rms_norm_eps` 1e-5, 8 key/value heads, rotary base 500,000.
#[test]
fn exaone_configs_read_as_transformers_reads_them() {
    let released = config_of("exaone");
    let config = LlamaConfig::from_json(&released).unwrap();
    assert_eq!(
        (
            config.num_hidden_layers,
            config.rms_norm_eps,
            config.num_key_value_heads
        ),
        (2, 1e-5, 2)
    );
    let mut saved = released.clone();
    let object = saved.as_object_mut().unwrap();
    for (theirs, ours) in [
        ("num_layers", "num_hidden_layers"),
        ("layer_norm_epsilon", "rms_norm_eps"),
        ("activation_function", "hidden_act"),
    ] {
        let value = object.remove(theirs).unwrap();
        object.insert(ours.into(), value);
    }
    object.insert(
        "architectures".into(),
        serde_json::json!(["LlamaForCausalLM"]),
    );
    assert_eq!(LlamaConfig::from_json(&saved).unwrap(), config);
    // The activation is read from its key (Llama's MLP takes SiLU only),
    // an error naming the key the file gave.
    let mut relu = released.clone();
    relu["activation_function"] = "relu".into();
    let err = LlamaConfig::from_json(&relu).unwrap_err();
    assert!(err.contains("`activation_function` is \"relu\""), "{err}");
    let mut silent = config_without(
        "exaone",
        &[
            "layer_norm_epsilon",
            "num_key_value_heads",
            "rope_theta",
            "rope_scaling",
        ],
    );
    // Heads enough for the default's 8 key/value heads.
    silent["num_attention_heads"] = 16.into();
    silent["head_dim"] = 2.into();
    let silent = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!((silent.rms_norm_eps, silent.num_key_value_heads), (1e-5, 8));
    assert_eq!(silent.rope.theta, 500_000.0);
}

/// Hunyuan MoE's configs: `moe_topk` a number or one per layer (refused
/// where the layers differ), experts and the shared MLP of
/// `intermediate_size`, no load-balancing loss whatever
/// `output_router_logits` says (as `transformers` adds none).
#[test]
fn hunyuan_moe_configs_read_as_transformers_reads_them() {
    let config = LlamaConfig::from_json(&config_of("hunyuanmoe")).unwrap();
    let moe = config.moe.clone().unwrap();
    assert_eq!(
        (moe.num_experts, moe.experts_per_token, moe.expert_size),
        (4, 2, 48)
    );
    assert_eq!(moe.shared_expert_size, Some(48));
    assert!(moe.normalize && moe.router_in_f32);
    let mut per_layer = config_of("hunyuanmoe");
    per_layer["moe_topk"] = serde_json::json!([2, 2]);
    per_layer["output_router_logits"] = true.into();
    let parsed = LlamaConfig::from_json(&per_layer).unwrap().moe.unwrap();
    assert_eq!((parsed.experts_per_token, parsed.aux_loss_coef), (2, None));
    per_layer["moe_topk"] = serde_json::json!([2, 3]);
    let err = LlamaConfig::from_json(&per_layer).unwrap_err();
    assert!(err.contains("differ by layer"), "{err}");
}

/// Sarvam MoE's configs: its released keys (`num_experts`,
/// `num_shared_experts`, `use_qkv_bias`) read as GLM-4.5's, the head norms
/// on unless `use_qk_norm` is false, the whole head rotating and a base of
/// 8,000,000 by default.
#[test]
fn sarvam_moe_configs_read_as_transformers_reads_them() {
    let saved = LlamaConfig::from_json(&config_of("sarvammoe")).unwrap();
    let mut released = config_without(
        "sarvammoe",
        &[
            "n_routed_experts",
            "n_shared_experts",
            "attention_bias",
            "use_qk_norm",
            "rope_parameters",
        ],
    );
    released["num_experts"] = 8.into();
    released["num_shared_experts"] = 2.into();
    released["use_qkv_bias"] = true.into();
    let parsed = LlamaConfig::from_json(&released).unwrap();
    assert_eq!(parsed.moe, saved.moe);
    assert!(parsed.qkv_bias && !parsed.o_bias);
    assert_eq!(
        parsed.qk_norm,
        Some(zero_candle::models::QkNorm::PerHead),
        "on by default"
    );
    assert_eq!((parsed.rotary_dim, parsed.rope.theta), (16, 8_000_000.0));
    released["use_qk_norm"] = false.into();
    assert_eq!(LlamaConfig::from_json(&released).unwrap().qk_norm, None);
}

/// Sarvam MLA's configs as its released files give them: without
/// `q_lora_rank` one `q_proj` (DeepSeek-V3's default is a latent), the
/// rotary scaling "deepseek_yarn" as YaRN, `num_shared_experts` as
/// `n_shared_experts`; silent, 128 experts in one group, the first layer
/// dense.
#[test]
fn sarvam_mla_configs_read_as_transformers_reads_them() {
    let saved = LlamaConfig::from_json(&config_of("sarvammla")).unwrap();
    let mut released = config_without(
        "sarvammla",
        &[
            "q_lora_rank",
            "n_shared_experts",
            "rope_parameters",
            "head_dim",
        ],
    );
    released["num_shared_experts"] = 1.into();
    // The released files' `head_dim` is vLLM's (kv_lora_rank + rope).
    released["head_dim"] = 20.into();
    let parsed = LlamaConfig::from_json(&released).unwrap();
    assert_eq!(parsed, saved);
    assert_eq!(parsed.latent_attention.unwrap().query_rank, None);
    released["rope_scaling"] = serde_json::json!({
        "type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0
    });
    let yarn = LlamaConfig::from_json(&released).unwrap();
    assert!(
        matches!(yarn.rope.scaling, RopeScaling::Yarn { .. }),
        "{:?}",
        yarn.rope
    );
    let silent = config_without(
        "sarvammla",
        &[
            "n_routed_experts",
            "n_group",
            "topk_group",
            "first_k_dense_replace",
        ],
    );
    let moe = LlamaConfig::from_json(&silent).unwrap().moe.unwrap();
    assert_eq!(moe.num_experts, 128);
    assert_eq!(moe.layers, [false, true]);
    assert!(matches!(
        moe.routing,
        zero_candle::models::MoeRouting::Sigmoid {
            groups: 1,
            top_groups: 1,
            ..
        }
    ));
}

/// Granite MoE's configs: its files always fuse the experts, the router by
/// logit, the load-balancing loss's default weight, and the shared MLP
/// only where `granitemoeshared` gives it a width.
#[test]
fn granite_moe_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{MoeRouting, MoeStyle};
    let granite = LlamaConfig::from_json(&config_of("granitemoe")).unwrap();
    assert!(granite.fused_experts, "whatever the files hold");
    let moe = granite.moe.clone().unwrap();
    assert_eq!(
        (moe.style, &moe.routing, moe.normalize),
        (MoeStyle::Granite, &MoeRouting::TopKSoftmax, false)
    );
    assert_eq!((moe.shared_expert_size, moe.aux_loss_coef), (None, None));
    let mut balanced = config_of("granitemoe");
    balanced["output_router_logits"] = true.into();
    balanced["shared_intermediate_size"] = 24.into();
    let moe = LlamaConfig::from_json(&balanced).unwrap().moe.unwrap();
    assert_eq!(moe.aux_loss_coef, Some(0.001));
    assert_eq!(moe.shared_expert_size, None, "granitemoe has no shared MLP");

    let shared = LlamaConfig::from_json(&config_of("granitemoeshared")).unwrap();
    assert_eq!(shared.moe.unwrap().shared_expert_size, Some(24));
    let none = LlamaConfig::from_json(&config_without(
        "granitemoeshared",
        &["shared_intermediate_size"],
    ))
    .unwrap();
    assert_eq!(none.moe.unwrap().shared_expert_size, None, "0 by default");
}

/// MiniCPM3's config read as `transformers` reads it: its multipliers as
/// Granite's (`scale_emb`, `scale_depth / √layers`, `hidden_size /
/// dim_model_base`), their defaults and null forms, its latent widths'
/// defaults, the rotated values as halves whatever `rope_interleave` says.
#[test]
fn minicpm3_configs_read_as_transformers_reads_them() {
    let fixture = LlamaConfig::from_json(&config_of("minicpm3")).unwrap();
    assert_eq!(fixture.embedding_scale, Some(3.0));
    assert_eq!(fixture.residual_multiplier, Some(1.2 / 2f64.sqrt()));
    assert_eq!(fixture.logits_scaling, Some(4.0));
    assert!(!fixture.rope_interleaved);
    let mut interleave = config_of("minicpm3");
    interleave["rope_interleave"] = true.into();
    assert!(
        !LlamaConfig::from_json(&interleave)
            .unwrap()
            .rope_interleaved
    );

    let silent = LlamaConfig::from_json(&config_without(
        "minicpm3",
        &["scale_emb", "scale_depth", "dim_model_base", "q_lora_rank"],
    ))
    .unwrap();
    assert_eq!(silent.embedding_scale, Some(12.0));
    assert_eq!(silent.residual_multiplier, Some(1.4 / 2f64.sqrt()));
    assert_eq!(silent.logits_scaling, Some(32.0 / 256.0));
    assert_eq!(silent.latent_attention.unwrap().query_rank, Some(768));
    // Null: √layers over √layers, and `hidden_size` over itself.
    let mut null = config_of("minicpm3");
    null["scale_depth"] = serde_json::Value::Null;
    null["dim_model_base"] = serde_json::Value::Null;
    let null = LlamaConfig::from_json(&null).unwrap();
    assert_eq!(
        (null.residual_multiplier, null.logits_scaling),
        (None, None)
    );
}

/// Apertus's config read as `transformers` reads it: xIELU where
/// `hidden_act` is "xielu" or absent, else the activation it names; its
/// default rotation (llama3 over 8,192 positions, base 1.2e7).
#[test]
fn apertus_configs_read_as_transformers_reads_them() {
    use zero_candle::nn::Activation;
    let fixture = LlamaConfig::from_json(&config_of("apertus")).unwrap();
    assert!(fixture.xielu && fixture.ungated_mlp.is_some());
    let silent = LlamaConfig::from_json(&config_without("apertus", &["hidden_act"])).unwrap();
    assert!(silent.xielu, "transformers' default");
    let mut relu2 = config_of("apertus");
    relu2["hidden_act"] = "relu2".into();
    let relu2 = LlamaConfig::from_json(&relu2).unwrap();
    assert_eq!(
        (relu2.xielu, relu2.mlp_activation),
        (false, Activation::Relu2)
    );
    let mut unknown = config_of("apertus");
    unknown["hidden_act"] = "xielu2".into();
    let err = LlamaConfig::from_json(&unknown).unwrap_err();
    assert!(err.contains("`hidden_act`"), "{err}");
    let rope = LlamaConfig::from_json(&config_without("apertus", &["rope_parameters"])).unwrap();
    assert_eq!(rope.rope.theta, 12e6);
    assert!(
        matches!(rope.rope.scaling, RopeScaling::Llama3 { .. }),
        "{:?}",
        rope.rope.scaling
    );
}

/// HyperCLOVA X's config read as `transformers` reads it: `logits_scaling`
/// multiplies the logits, and `use_post_norm` (on by default) switches the
/// norms of the outputs.
#[test]
fn hyperclovax_configs_read_as_transformers_reads_them() {
    let parsed = LlamaConfig::from_json(&config_of("hyperclovax")).unwrap();
    assert_eq!(
        (parsed.logit_scale, parsed.logits_scaling),
        (Some(4.0), None)
    );
    assert!(parsed.output_norms && parsed.input_norms);
    let silent =
        LlamaConfig::from_json(&config_without("hyperclovax", &["use_post_norm"])).unwrap();
    assert!(silent.output_norms, "on by default");
    let mut off = config_of("hyperclovax");
    off["use_post_norm"] = false.into();
    let plain = LlamaConfig::from_json(&off).unwrap();
    assert!(!plain.output_norms && plain.input_norms);
}

/// Granite SWA's and Granite MoE SWA's configs read as `transformers` reads
/// them: where a file is silent, windows of 128 in all but every fourth
/// layer from the first and every layer rotating at `rope_theta`;
/// `layer_rope_theta` gives each layer's base (0: none), one per attention
/// type here, anything else refused by name.
#[test]
fn granite_swa_configs_read_as_transformers_reads_them() {
    use zero_candle::models::MoeStyle;
    let fixture = LlamaConfig::from_json(&config_of("graniteswa")).unwrap();
    assert!(fixture.attention_sinks);
    assert_eq!(fixture.rotated_layers, Some(vec![false, true]));
    assert_eq!(
        (
            fixture.rope.theta,
            fixture.local_rope.as_ref().map(|r| r.theta)
        ),
        (20000.0, Some(100.0))
    );
    let window = fixture.sliding_window.as_ref().unwrap();
    assert_eq!((window.size, window.layers.clone()), (5, vec![false, true]));

    // A file that leaves the layers' settings out: every layer rotating at
    // the one base, windows of 128 in three layers of four.
    let mut silent = config_without(
        "graniteswa",
        &["layer_rope_theta", "layer_types", "sliding_window"],
    );
    silent["num_hidden_layers"] = 8.into();
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    assert_eq!(parsed.rotated_layers, None);
    assert_eq!(
        (parsed.rope.theta, parsed.local_rope.is_none()),
        (20000.0, true)
    );
    let window = parsed.sliding_window.unwrap();
    assert_eq!(window.size, 128);
    assert_eq!(window.layers, [0, 1, 1, 1, 0, 1, 1, 1].map(|w| w == 1));
    let defaults = LlamaConfig::from_json(&config_without(
        "graniteswa",
        &["num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"],
    ))
    .unwrap();
    assert_eq!(
        (
            defaults.num_key_value_heads,
            defaults.rms_norm_eps,
            defaults.tie_word_embeddings
        ),
        (4, 1e-5, true)
    );

    // The same base in both attention types: one rotation.
    let mut same = silent.clone();
    same["layer_rope_theta"] = serde_json::json!([7000, 7000, 0, 7000, 7000, 7000, 7000, 7000]);
    let parsed = LlamaConfig::from_json(&same).unwrap();
    assert_eq!(
        (parsed.rope.theta, parsed.local_rope.is_none()),
        (7000.0, true)
    );
    assert!(
        !parsed.rotated_layers.unwrap()[2],
        "layer 2 does not rotate"
    );
    for (bases, says) in [
        (serde_json::json!([1, 2]), "has 2 bases for 8 layers"),
        (
            serde_json::json!([0, 1, 2, 1, 0, 1, 1, 1]),
            "gives the sliding layers the bases 1 and 2",
        ),
        (
            serde_json::json!([1, 0, 0, 0, 2, 0, 0, 0]),
            "gives the full-attention layers the bases 1 and 2",
        ),
        (serde_json::json!([0, -1, 0, 0, 0, 0, 0, 0]), "holds -1"),
    ] {
        let mut bad = silent.clone();
        bad["layer_rope_theta"] = bases;
        let err = LlamaConfig::from_json(&bad).unwrap_err();
        assert!(
            err.contains("`layer_rope_theta`") && err.contains(says),
            "{err}"
        );
    }

    let moe = LlamaConfig::from_json(&config_of("granitemoeswa")).unwrap();
    assert!(moe.attention_sinks && moe.fused_experts);
    assert_eq!((moe.rope.theta, moe.local_rope.is_none()), (20000.0, true));
    assert_eq!(moe.rotated_layers, Some(vec![true, false]));
    let mixture = moe.moe.unwrap();
    assert_eq!(
        (mixture.style, mixture.shared_expert_size),
        (MoeStyle::GraniteSwa, None)
    );
}

/// gpt-oss's config read as `transformers` reads it: the released 20B's
/// and 120B's files (in `transformers` 4's form, which their bf16 copies
/// keep) count the parameters `transformers` builds (20,914,757,184 and
/// 116,829,156,672); where a file is silent, windows of 128 in every other
/// layer from the first, YaRN (factor 32 over 4,096 positions, not
/// truncated) on a base of 150,000, the clamped SwiGLU's 1.702 and 7.
#[test]
fn gpt_oss_configs_read_as_transformers_reads_them() {
    use zero_candle::models::{ClampedSwiglu, MoeRouting, MoeStyle};
    let released = |layers: usize, experts: usize| {
        serde_json::json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880,
            "layer_types": (0..layers)
                .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>(),
            "max_position_embeddings": 131072, "model_type": "gpt_oss",
            "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": layers,
            "num_key_value_heads": 8, "num_local_experts": experts,
            "output_router_logits": false, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
            "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
            "vocab_size": 201088
        })
    };
    for (layers, experts, params) in [(24, 32, 20_914_757_184), (36, 128, 116_829_156_672)] {
        let config = LlamaConfig::from_json(&released(layers, experts)).unwrap();
        assert_eq!(config.num_params(), params, "{layers} layers");
        assert!(config.attention_sinks && config.qkv_bias && config.o_bias && config.fused_experts);
        let moe = config.moe.unwrap();
        assert_eq!(
            (moe.style, &moe.routing, moe.normalize, moe.aux_loss_coef),
            (MoeStyle::GptOss, &MoeRouting::TopKSoftmax, false, None)
        );
        assert_eq!((moe.num_experts, moe.experts_per_token), (experts, 4));
        let window = config.sliding_window.unwrap();
        assert_eq!(window.size, 128);
        assert_eq!(
            window.layers,
            (0..layers).map(|i| i % 2 == 0).collect::<Vec<_>>()
        );
    }
    let silent = config_without(
        "gptoss",
        &[
            "sliding_window",
            "layer_types",
            "rope_parameters",
            "swiglu_alpha",
            "swiglu_limit",
            "router_aux_loss_coef",
            "head_dim",
            "attention_bias",
        ],
    );
    let parsed = LlamaConfig::from_json(&silent).unwrap();
    let window = parsed.sliding_window.unwrap();
    assert_eq!((window.size, window.layers), (128, vec![true, false]));
    assert_eq!((parsed.head_dim, parsed.qkv_bias), (64, true));
    assert_eq!(parsed.rope.theta, 150_000.0);
    let RopeScaling::Yarn(yarn) = &parsed.rope.scaling else {
        panic!("{:?}", parsed.rope.scaling)
    };
    assert_eq!(
        (yarn.factor, yarn.original_max_position_embeddings),
        (32.0, 4096.0)
    );
    assert!(!yarn.truncate);
    let moe = parsed.moe.unwrap();
    assert_eq!(
        moe.clamped_swiglu,
        Some(ClampedSwiglu {
            alpha: 1.702,
            limit: 7.0
        })
    );
    assert_eq!(moe.aux_loss_coef, Some(0.001), "output_router_logits is on");
    let mut unbounded = config_of("gptoss");
    unbounded["swiglu_limit"] = 0.into();
    let err = LlamaConfig::from_json(&unbounded).unwrap_err();
    assert!(err.contains("swiglu_limit"), "{err}");
}

/// Every family's norm epsilon where its config.json is silent is
/// `transformers`' default: `fixtures/llama/config_defaults.json`, written
/// by `make_config_defaults.py` beside it from each config class.
#[test]
fn a_silent_norm_epsilon_is_transformers_default_in_every_family() {
    let defaults: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("config_defaults.json")).unwrap())
            .unwrap();
    let keys = [
        "rms_norm_eps",
        "layer_norm_eps",
        "norm_eps",
        "layer_norm_epsilon",
        "norm_epsilon",
    ];
    let (mut checked, mut wrong) = (0, Vec::new());
    for entry in std::fs::read_dir(fixtures()).unwrap() {
        let path = entry.unwrap().path().join("config.json");
        if !path.is_file() {
            continue;
        }
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        // A multimodal model's text model by its own type.
        let text = config.get("text_config").unwrap_or(&config);
        let kind = text["model_type"].as_str().unwrap().to_string();
        let Some(eps) = defaults["norm_eps"][&kind].as_f64() else {
            continue; // fixed by the model (OLMo's)
        };
        // Silent at the top and in a multimodal model's `text_config`.
        let map = config.as_object_mut().unwrap();
        for key in keys {
            map.remove(key);
            if let Some(text) = map.get_mut("text_config").and_then(|t| t.as_object_mut()) {
                text.remove(key);
            }
        }
        let parsed = LlamaConfig::from_json(&config).unwrap();
        if parsed.rms_norm_eps != eps {
            wrong.push(format!(
                "{kind}: {} (transformers {eps})",
                parsed.rms_norm_eps
            ));
        }
        checked += 1;
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert!(checked > 50, "{checked} fixtures");
}

/// A number a mixture's config holds.
type MoeSetting = fn(&zero_candle::models::MoeConfig) -> f64;

/// Each fixture's rotary base, head width, tied head and mixture settings
/// (experts, experts per token, their width, the routing scale) where its
/// config.json is silent on them are `transformers`' (`config_defaults.json`'s
/// `silent`, from each config class loaded without the key).
#[test]
fn a_silent_setting_is_transformers_default_in_every_fixture() {
    use zero_candle::models::MoeRouting;
    let defaults: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("config_defaults.json")).unwrap())
            .unwrap();
    let silent = defaults["silent"].as_object().unwrap();
    let mut wrong = Vec::new();
    for (fixture, expected) in silent {
        let without = |keys: &[&str]| LlamaConfig::from_json(&config_without(fixture, keys));
        let rope = without(&["rope_parameters", "rope_theta", "rope_scaling"]).unwrap();
        if let Some(theta) = expected["rope_theta"].as_f64() {
            if rope.rope.theta != theta {
                wrong.push(format!(
                    "{fixture}: rope_theta {} (transformers {theta})",
                    rope.rope.theta
                ));
            }
        }
        if let Some(width) = expected["head_dim"].as_u64() {
            let ours = without(&["head_dim"]).unwrap().head_dim;
            if ours as u64 != width {
                wrong.push(format!("{fixture}: head_dim {ours} (transformers {width})"));
            }
        }
        // A mixture's settings, each under whichever name its file uses.
        let mixture_keys: [(&[&str], MoeSetting); 4] = [
            (&["num_experts_per_tok", "moe_k", "moe_topk"], |m| {
                m.experts_per_token as f64
            }),
            (&["moe_intermediate_size"], |m| m.expert_size as f64),
            (&["routed_scaling_factor"], |m| match m.routing {
                MoeRouting::Sigmoid { scale, .. } | MoeRouting::GroupedSoftmax { scale, .. } => {
                    scale
                }
                _ => 1.0,
            }),
            (
                &[
                    "num_local_experts",
                    "n_routed_experts",
                    "num_experts",
                    "moe_num_experts",
                ],
                |m| m.num_experts as f64,
            ),
        ];
        for (keys, ours) in mixture_keys {
            let Some(value) = expected[keys[0]].as_f64() else {
                continue;
            };
            // Where the default does not fit the fixture's other settings
            // (8 experts per token in 4 chosen of 8), the config is refused
            // here (transformers runs it); nothing to compare.
            let Ok(parsed) = without(keys) else {
                continue;
            };
            let got = ours(parsed.moe.as_ref().unwrap());
            if got != value {
                wrong.push(format!(
                    "{fixture}: {} {got} (transformers {value})",
                    keys[0]
                ));
            }
        }
        let tied = without(&["tie_word_embeddings"])
            .unwrap()
            .tie_word_embeddings;
        if Some(tied) != expected["tie_word_embeddings"].as_bool() {
            wrong.push(format!("{fixture}: tie_word_embeddings {tied}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    assert!(silent.len() > 50, "{} fixtures", silent.len());
}
