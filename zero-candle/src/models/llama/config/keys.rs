//! The keys of a Llama-family `config.json` as they are, and what reads
//! them: the sliding windows, the rotated layers, the MLP's activation, the
//! rotary parameters per layer type, and the older or family-specific keys
//! rewritten into the ones the rest reads.

use super::family::{Gemma, TypedRope, Windows, DEFAULT_MAX_WINDOW_LAYERS, DEFAULT_WINDOW};
use super::SlidingWindow;
use crate::models::config_json::{optional_size, size};
use crate::models::rope::{Rope, RopeDialect};
use crate::nn::Activation;
use serde::Deserialize;

/// The keys of `config.json` read as they are.
#[derive(Deserialize)]
pub(super) struct Plain {
    #[serde(deserialize_with = "size")]
    pub(super) vocab_size: usize,
    #[serde(deserialize_with = "size")]
    pub(super) hidden_size: usize,
    /// Absent from Solar Open's files, whose every layer is a mixture.
    #[serde(default, deserialize_with = "optional_size")]
    pub(super) intermediate_size: Option<usize>,
    #[serde(deserialize_with = "size")]
    pub(super) num_hidden_layers: usize,
    #[serde(deserialize_with = "size")]
    pub(super) num_attention_heads: usize,
    #[serde(default, deserialize_with = "optional_size")]
    pub(super) num_key_value_heads: Option<usize>,
    #[serde(default, deserialize_with = "optional_size")]
    pub(super) head_dim: Option<usize>,
    #[serde(default = "default_positions")]
    pub(super) max_position_embeddings: usize,
    #[serde(default)]
    pub(super) rms_norm_eps: Option<f64>,
    #[serde(default)]
    pub(super) tie_word_embeddings: Option<bool>,
    #[serde(default = "default_initializer_range")]
    pub(super) initializer_range: f64,
    #[serde(default)]
    pub(super) attention_bias: Option<bool>,
    #[serde(default)]
    pub(super) pad_token_id: Option<u32>,
    /// Qwen's switch for `sliding_window` (off when absent).
    #[serde(default)]
    pub(super) use_sliding_window: bool,
    /// Qwen's first windowed layer, where `layer_types` does not say.
    #[serde(default)]
    pub(super) max_window_layers: Option<usize>,
    /// Qwen's and Gemma 3's attention per layer (transformers 5).
    #[serde(default)]
    pub(super) layer_types: Option<Vec<String>>,
    /// Gemma 3's windowed layers where `layer_types` does not say: all but
    /// every this-many-th (transformers 5 writes it with a leading `_`).
    #[serde(default, alias = "_sliding_window_pattern")]
    pub(super) sliding_window_pattern: Option<WindowPattern>,
    #[serde(default)]
    pub(super) query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    pub(super) final_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub(super) attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub(super) use_bidirectional_attention: Option<bool>,
    /// Granite SWA's base per layer, 0 where the layer does not rotate.
    #[serde(default)]
    pub(super) layer_rope_theta: Option<Vec<f64>>,
    /// SmolLM3's layers with (1) and without (0) rotary embeddings.
    #[serde(default)]
    pub(super) no_rope_layers: Option<Vec<u8>>,
    /// SmolLM3's NoPE layers where `no_rope_layers` does not say: every
    /// this-many-th.
    #[serde(default = "default_no_rope_interval")]
    pub(super) no_rope_layer_interval: usize,
    #[serde(default)]
    pub(super) embedding_multiplier: Option<f64>,
    #[serde(default)]
    pub(super) attention_multiplier: Option<f64>,
    #[serde(default)]
    pub(super) residual_multiplier: Option<f64>,
    #[serde(default)]
    pub(super) logits_scaling: Option<f64>,
    /// HyperCLOVA X's switch for the norms of the outputs (on when absent).
    #[serde(default)]
    pub(super) use_post_norm: Option<bool>,
    #[serde(default)]
    pub(super) attention_dropout: Option<f64>,
    #[serde(default)]
    pub(super) resid_pdrop: Option<f64>,
    #[serde(default)]
    pub(super) embd_pdrop: Option<f64>,
    #[serde(default)]
    pub(super) residual_dropout: Option<f64>,
    #[serde(default)]
    pub(super) embedding_dropout: Option<f64>,
    /// Seed-OSS's switch for the output projection's bias.
    #[serde(default)]
    pub(super) attention_out_bias: Option<bool>,
    /// Qwen2-MoE's switch for the query, key and value biases.
    #[serde(default)]
    pub(super) qkv_bias: Option<bool>,
    /// GLM-4.5's switch for the query and key norms (Sarvam MoE's, on by
    /// default).
    #[serde(default)]
    pub(super) use_qk_norm: Option<bool>,
    /// Phi's switch for the query and key norms.
    #[serde(default)]
    pub(super) qk_layernorm: bool,
    /// StableLM's switch for the query, key and value biases.
    #[serde(default)]
    pub(super) use_qkv_bias: Option<bool>,
    /// GPT-NeoX's and StableLM's switch for their parallel blocks.
    #[serde(default)]
    pub(super) use_parallel_residual: Option<bool>,
    #[serde(default)]
    pub(super) hidden_dropout: Option<f64>,
    #[serde(default, alias = "norm_epsilon", alias = "norm_eps")]
    pub(super) layer_norm_eps: Option<f64>,
    #[serde(default)]
    pub(super) mlp_bias: Option<bool>,
    #[serde(default)]
    pub(super) use_bias: Option<bool>,
    #[serde(default)]
    pub(super) logit_scale: Option<f64>,
    #[serde(default)]
    pub(super) router_jitter_noise: Option<f64>,
    #[serde(default)]
    pub(super) clip_qkv: Option<f64>,
}

/// `object`'s keys `old` renamed `new` (a null dropped; where the file also
/// gives `new`, its value stays).
pub(super) fn rename_keys(
    object: &mut serde_json::Map<String, serde_json::Value>,
    renames: &[(&str, &str)],
) {
    for &(old, new) in renames {
        if let Some(value) = object.remove(old).filter(|v| !v.is_null()) {
            object.entry(new).or_insert(value);
        }
    }
}

/// GPT-NeoX's config with its transformers 4 rotary keys as later files
/// write them: `rotary_pct` as `partial_rotary_factor`, `rotary_emb_base`
/// as `rope_theta` (where those are absent).
pub(super) fn neox_rotary_keys(config: &serde_json::Value) -> serde_json::Value {
    let mut config = config.clone();
    if let Some(object) = config.as_object_mut() {
        // GPT-NeoX groups no key/value heads whatever the file says.
        object.remove("num_key_value_heads");
        rename_keys(
            object,
            &[
                ("rotary_pct", "partial_rotary_factor"),
                ("rotary_emb_base", "rope_theta"),
            ],
        );
    }
    config
}

/// GPT-J's config with GPT-2's keys as Llama's (`n_embd` as `hidden_size`,
/// `n_inner` as `intermediate_size`, 4 `n_embd` where null, ...), its
/// `rotary_dim` as a `partial_rotary_factor` (the whole head where null).
pub(super) fn gptj_keys(config: &serde_json::Value) -> serde_json::Value {
    let mut config = config.clone();
    let Some(object) = config.as_object_mut() else {
        return config;
    };
    // GPT-J's MLP is `n_inner` wide whatever else the file says.
    object.remove("intermediate_size");
    rename_keys(
        object,
        &[
            ("n_embd", "hidden_size"),
            ("n_layer", "num_hidden_layers"),
            ("n_head", "num_attention_heads"),
            ("n_positions", "max_position_embeddings"),
            ("n_inner", "intermediate_size"),
            ("layer_norm_epsilon", "layer_norm_eps"),
            ("activation_function", "hidden_act"),
            ("attn_pdrop", "attention_dropout"),
        ],
    );
    let hidden = object.get("hidden_size").and_then(|h| h.as_u64());
    if object.get("intermediate_size").is_none() {
        if let Some(hidden) = hidden {
            object.insert("intermediate_size".into(), hidden.saturating_mul(4).into());
        }
    }
    let heads = object.get("num_attention_heads").and_then(|h| h.as_u64());
    let rotary = object.remove("rotary_dim").and_then(|r| r.as_u64());
    if let (Some(hidden), Some(heads), Some(rotary)) = (hidden, heads, rotary) {
        if heads > 0 && hidden >= heads {
            let factor = rotary as f64 / (hidden / heads) as f64;
            object.insert("partial_rotary_factor".into(), factor.into());
        }
    }
    config
}

/// Falcon's switches, as `transformers` defaults them (the new decoder
/// architecture, Falcon 40B, 180B and 2, implying them parallel, not
/// `multi_query`, and a norm per branch unless `num_ln_in_parallel_attn` is 1).
pub(super) struct FalconSwitches {
    /// One key and one value head (the old architecture's `multi_query`).
    pub(super) multi_query: bool,
    pub(super) parallel: bool,
    pub(super) norm_per_branch: bool,
    pub(super) bias: bool,
}

/// Falcon's config with its keys as Llama's (`num_kv_heads`,
/// `layer_norm_epsilon`, `activation`, `ffn_hidden_size`, 4 `hidden_size`
/// where null; the RefinedWeb files' `n_embed`, `n_head`, `n_layer`), the
/// key/value heads as its architecture has them, and its switches; ALiBi
/// refused.
pub(super) fn falcon_keys(
    config: &serde_json::Value,
) -> std::result::Result<(serde_json::Value, FalconSwitches), String> {
    let mut config = config.clone();
    let flag =
        |key: &str, default: bool| config.get(key).and_then(|v| v.as_bool()).unwrap_or(default);
    if flag("alibi", false) {
        return Err(
            "`alibi` is true: ALiBi (Falcon-RW's positions) is not implemented here; this reads \
             Falcon's rotary models"
                .into(),
        );
    }
    let new_architecture = flag("new_decoder_architecture", false);
    let switches = FalconSwitches {
        multi_query: !new_architecture && flag("multi_query", true),
        parallel: new_architecture || flag("parallel_attn", true),
        norm_per_branch: new_architecture
            && config
                .get("num_ln_in_parallel_attn")
                .and_then(|n| n.as_u64())
                .is_none_or(|n| n == 2),
        bias: flag("bias", false),
    };
    let Some(object) = config.as_object_mut() else {
        return Ok((config, switches));
    };
    // Falcon's MLP is `ffn_hidden_size` wide whatever else the file says.
    object.remove("num_key_value_heads");
    object.remove("intermediate_size");
    rename_keys(
        object,
        &[
            ("n_embed", "hidden_size"),
            ("n_head", "num_attention_heads"),
            ("n_layer", "num_hidden_layers"),
            ("layer_norm_epsilon", "layer_norm_eps"),
            ("activation", "hidden_act"),
            ("ffn_hidden_size", "intermediate_size"),
        ],
    );
    let hidden = object.get("hidden_size").and_then(|h| h.as_u64());
    if let (None, Some(hidden)) = (object.get("intermediate_size"), hidden) {
        object.insert("intermediate_size".into(), hidden.saturating_mul(4).into());
    }
    let heads = object.get("num_attention_heads").cloned();
    let kv_heads = match (new_architecture, switches.multi_query) {
        (true, _) => object
            .remove("num_kv_heads")
            .filter(|v| !v.is_null())
            .or(heads),
        (false, true) => Some(1.into()),
        (false, false) => heads,
    };
    object.remove("num_kv_heads");
    if let Some(kv_heads) = kv_heads {
        object.insert("num_key_value_heads".into(), kv_heads);
    }
    Ok((config, switches))
}

/// Hunyuan's config with its "dynamic" rotation with an `alpha` (NTK-aware
/// scaling, static: `transformers`' `ntk_alpha`) as the default rotation
/// of base `rope_theta · alpha^(d / (d - 2))`, `d` the head's width.
pub(super) fn ntk_alpha_as_theta(
    config: &serde_json::Value,
) -> std::result::Result<serde_json::Value, String> {
    let mut config = config.clone();
    let Some(key) = ["rope_parameters", "rope_scaling"].into_iter().find(|key| {
        config
            .get(key)
            .and_then(|p| p.get("alpha"))
            .is_some_and(|a| !a.is_null())
    }) else {
        return Ok(config);
    };
    let params = &config[key];
    let kind = params.get("rope_type").or_else(|| params.get("type"));
    if kind.and_then(|k| k.as_str()) != Some("dynamic") {
        return Ok(config);
    }
    let alpha = params["alpha"]
        .as_f64()
        .filter(|a| *a > 0.0)
        .ok_or_else(|| {
            format!(
                "`{key}.alpha` is {}; a positive number is expected",
                params["alpha"]
            )
        })?;
    let theta = params
        .get("rope_theta")
        .or_else(|| config.get("rope_theta"))
        .and_then(|t| t.as_f64())
        .unwrap_or(10_000.0);
    let heads = config
        .get("num_attention_heads")
        .and_then(|h| h.as_u64())
        .unwrap_or(0);
    let hidden = config
        .get("hidden_size")
        .and_then(|h| h.as_u64())
        .unwrap_or(0);
    let width = match config.get("head_dim").and_then(|d| d.as_u64()) {
        Some(width) => width,
        None if heads > 0 => hidden / heads,
        None => 0,
    } as f64;
    if width <= 2.0 {
        return Err(format!(
            "heads of {width} values with an NTK `alpha`; the rotation needs heads wider than 2"
        ));
    }
    let base = theta * alpha.powf(width / (width - 2.0));
    let object = config
        .as_object_mut()
        .expect("a config with a rotation is an object");
    object.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_type": "default", "rope_theta": base}),
    );
    for old in ["rope_scaling", "rope_theta"] {
        object.remove(old);
    }
    Ok(config)
}

/// `config` with `rope` (a `rope_parameters` object) where it gives no
/// rotation (none of `rope_parameters`, `rope_scaling`, `rope_theta`).
pub(super) fn with_default_rope(config: &serde_json::Value, rope: &str) -> serde_json::Value {
    let mut config = config.clone();
    let given = ["rope_parameters", "rope_scaling", "rope_theta"]
        .iter()
        .any(|key| config.get(key).is_some_and(|v| !v.is_null()));
    if let (false, Some(object)) = (given, config.as_object_mut()) {
        let rope: serde_json::Value =
            serde_json::from_str(rope).expect("a family's default rotation is JSON");
        object.insert("rope_parameters".into(), rope);
    }
    config
}

/// Gemma's and EXAONE 4's `sliding_window_pattern`: every this-many-th
/// layer full, or (EXAONE 4) letters repeating over the layers, `L` a
/// sliding one and `G` a full one (`"LLLG"`).
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum WindowPattern {
    Every(usize),
    Letters(String),
}

impl WindowPattern {
    /// Per layer of `n`, whether it is windowed.
    fn layers(&self, n: usize) -> std::result::Result<Vec<bool>, String> {
        match self {
            Self::Every(0) => Err("`sliding_window_pattern` is 0; set it to at least 1".into()),
            &Self::Every(every) => Ok((0..n).map(|i| (i + 1) % every != 0).collect()),
            Self::Letters(letters)
                if letters.is_empty() || letters.chars().any(|c| !matches!(c, 'L' | 'G')) =>
            {
                Err(format!(
                    "`sliding_window_pattern` is {letters:?}; give a number, or letters L \
                     (sliding) and G (full), one per layer, repeating"
                ))
            }
            Self::Letters(letters) => {
                let letters: Vec<char> = letters.chars().collect();
                Ok((0..n).map(|i| letters[i % letters.len()] == 'L').collect())
            }
        }
    }
}

/// `transformers`' `no_rope_layer_interval` (SmolLM3).
fn default_no_rope_interval() -> usize {
    4
}

fn default_positions() -> usize {
    2048
}

fn default_initializer_range() -> f64 {
    0.02
}

/// The sliding window as `transformers` applies it: Mistral's
/// `sliding_window` in every layer; Qwen's where `use_sliding_window` is on,
/// in the layers whose `layer_types` entry is `sliding_attention` (without
/// `layer_types`, those from `max_window_layers` on). `None` where no layer
/// uses one.
pub(super) fn sliding_window_of(
    config: &serde_json::Value,
    plain: &Plain,
    windows: Windows,
    rotated_layers: Option<&[bool]>,
) -> std::result::Result<Option<SlidingWindow>, String> {
    if let Some(types) = &plain.layer_types {
        if let Some(other) = types
            .iter()
            .find(|t| !["full_attention", "sliding_attention"].contains(&t.as_str()))
        {
            return Err(format!(
                "`layer_types` has {other:?}; full and sliding attention only"
            ));
        }
    }
    if windows == Windows::Unsupported && plain.use_sliding_window {
        return Err(
            "`use_sliding_window` is true; this model type's sliding windows are not implemented \
             here: set it to false (as the published checkpoints have it)"
                .into(),
        );
    }
    let n = plain.num_hidden_layers;
    let typed = |types: &Vec<String>| types.iter().map(|t| t == "sliding_attention").collect();
    let layers = match windows {
        Windows::Never | Windows::Unsupported => return Ok(None),
        Windows::Switched | Windows::NoRope if !plain.use_sliding_window => return Ok(None),
        Windows::NoRope => match (&plain.layer_types, rotated_layers) {
            (Some(types), _) => typed(types),
            (None, Some(rotated)) => rotated.iter().map(|r| !r).collect(),
            (None, None) => vec![false; n],
        },
        Windows::EveryLayer { .. } => vec![true; n],
        Windows::Switched => match &plain.layer_types {
            Some(types) => typed(types),
            None => {
                let from = plain.max_window_layers.unwrap_or(DEFAULT_MAX_WINDOW_LAYERS);
                (0..n).map(|i| i >= from).collect()
            }
        },
        Windows::FromLayer { layers } => match &plain.layer_types {
            Some(types) => typed(types),
            None => {
                let from = plain.max_window_layers.unwrap_or(layers);
                (0..n).map(|i| i >= from).collect()
            }
        },
        Windows::Listed { every, .. } => match &plain.layer_types {
            Some(types) => typed(types),
            None if every <= 1 => vec![true; n],
            None => (0..n).map(|i| i % every != 0).collect(),
        },
        Windows::Typed { pattern, .. } => match &plain.layer_types {
            Some(types) => typed(types),
            None => match &plain.sliding_window_pattern {
                Some(given) => given.layers(n)?,
                None => WindowPattern::Every(pattern).layers(n)?,
            },
        },
    };
    let missing = match windows {
        Windows::EveryLayer { missing } => missing,
        Windows::Listed { missing, .. } | Windows::Typed { missing, .. } => Some(missing),
        Windows::NoRope => None,
        _ => Some(DEFAULT_WINDOW),
    };
    let size = match config.get("sliding_window") {
        None => missing,
        Some(v) if v.is_null() => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|w| usize::try_from(w).ok())
                .ok_or_else(|| format!("`sliding_window` is {v}; a whole number is expected"))?,
        ),
    };
    Ok(size
        .filter(|_| layers.contains(&true))
        .map(|size| SlidingWindow { size, layers }))
}

/// SmolLM3's layers with rotary embeddings: `no_rope_layers` (1 rotates, 0
/// does not), or all but every `no_rope_layer_interval`-th.
pub(super) fn rotated_layers(plain: &Plain) -> std::result::Result<Vec<bool>, String> {
    match (&plain.no_rope_layers, plain.no_rope_layer_interval) {
        (Some(flags), _) => flags
            .iter()
            .map(|&f| match f {
                0 | 1 => Ok(f == 1),
                other => Err(format!(
                    "`no_rope_layers` holds {other}; 1 (rotary) or 0 (none) per layer"
                )),
            })
            .collect(),
        (None, 0) => Err("`no_rope_layer_interval` is 0; set it to at least 1".into()),
        (None, every) => Ok((0..plain.num_hidden_layers)
            .map(|i| (i + 1) % every != 0)
            .collect()),
    }
}

/// Granite SWA's `layer_rope_theta` (a base per layer, 0 where the layer
/// does not rotate) as the layers that rotate and the rotations of the
/// full-attention and the sliding layers (`rope` with their bases), as
/// `transformers` builds a rotary embedding per base; `None` where the
/// file gives no list (every layer `rope`'s base).
pub(super) fn layer_thetas(
    plain: &Plain,
    window: Option<&SlidingWindow>,
    rope: &Rope,
) -> std::result::Result<Option<LayerRopes>, String> {
    let Some(thetas) = &plain.layer_rope_theta else {
        return Ok(None);
    };
    if thetas.len() != plain.num_hidden_layers {
        return Err(format!(
            "`layer_rope_theta` has {} bases for {} layers; give one per layer (0 for none)",
            thetas.len(),
            plain.num_hidden_layers
        ));
    }
    if let Some(bad) = thetas.iter().find(|t| !(t.is_finite() && **t >= 0.0)) {
        return Err(format!(
            "`layer_rope_theta` holds {bad}; each base is positive, or 0 for none"
        ));
    }
    let sliding: Vec<bool> = (0..thetas.len())
        .map(|i| window.is_some_and(|w| w.layers[i]))
        .collect();
    let with_base = |theta: f64| Rope {
        theta,
        scaling: rope.scaling.clone(),
    };
    let (full, local) = (
        one_base(thetas, &sliding, false)?,
        one_base(thetas, &sliding, true)?,
    );
    let global = with_base(full.unwrap_or(rope.theta));
    Ok(Some(LayerRopes {
        rotated: thetas.iter().map(|&t| t != 0.0).collect(),
        local: local.filter(|&t| t != global.theta).map(with_base),
        global,
    }))
}

/// The one nonzero base of the sliding layers (`want_sliding`) or of the
/// others: the model keeps one rotation for each attention type.
fn one_base(
    thetas: &[f64],
    sliding: &[bool],
    want_sliding: bool,
) -> std::result::Result<Option<f64>, String> {
    let mut bases = thetas
        .iter()
        .zip(sliding)
        .filter(|&(&t, &s)| s == want_sliding && t != 0.0)
        .map(|(&t, _)| t);
    let first = bases.next();
    match (first, bases.find(|&t| Some(t) != first)) {
        (Some(first), Some(other)) => {
            Err(format!(
            "`layer_rope_theta` gives the {} layers the bases {first} and {other}; one base per \
             attention type (full, sliding) is implemented here",
            if want_sliding { "sliding" } else { "full-attention" },
        ))
        }
        _ => Ok(first),
    }
}

/// The rotations [`layer_thetas`] reads.
pub(super) struct LayerRopes {
    /// Per layer, whether it rotates.
    pub(super) rotated: Vec<bool>,
    /// The full-attention layers' rotation.
    pub(super) global: Rope,
    /// The sliding layers', where its base differs.
    pub(super) local: Option<Rope>,
}

/// The MLP's activation: SiLU for Llama (`hidden_act`); GELU's tanh form for
/// Gemma (`hidden_act`, where transformers reads `gelu` as the tanh form too)
/// and Gemma 3 (`hidden_activation`); for an MLP without a gate
/// (StarCoder2's, Phi's, Nemotron's, Arcee's), `hidden_act` as
/// `transformers`' `ACT2FN` reads it: GELU's tanh forms, exact GELU
/// (`gelu`), SiLU or squared ReLU (`relu2`), the family's default where the
/// file names none.
pub(super) fn mlp_activation(
    config: &serde_json::Value,
    gemma: Option<Gemma>,
    ungated: Option<Activation>,
) -> std::result::Result<Activation, String> {
    const TANH: [&str; 2] = ["gelu_pytorch_tanh", "gelu_new"];
    const UNGATED: [(&str, Activation); 6] = [
        ("gelu_pytorch_tanh", Activation::Gelu),
        ("gelu_new", Activation::Gelu),
        ("gelu_fast", Activation::Gelu),
        ("gelu", Activation::GeluErf),
        ("silu", Activation::Silu),
        ("relu2", Activation::Relu2),
    ];
    let ungated_names = UNGATED.map(|(name, _)| name);
    let (key, accepted): (&str, &[&str]) = match gemma {
        _ if ungated.is_some() => ("hidden_act", &ungated_names),
        None => ("hidden_act", &["silu"]),
        Some(Gemma::One) => ("hidden_act", &["gelu_pytorch_tanh", "gelu_new", "gelu"]),
        Some(Gemma::Two | Gemma::Three | Gemma::Vault) => ("hidden_activation", &TANH),
    };
    let value = config.get(key).filter(|v| !v.is_null());
    match (value, ungated) {
        (Some(value), _) if !accepted.iter().any(|a| value == a) => Err(format!(
            "`{key}` is {value}; only {} is supported",
            accepted.join(" or ")
        )),
        (_, Some(missing)) => Ok(UNGATED
            .iter()
            .find(|(name, _)| value.is_some_and(|v| v == name))
            .map_or(missing, |&(_, kind)| kind)),
        _ if gemma.is_some() => Ok(Activation::Gelu),
        _ => Ok(Activation::Silu),
    }
}

/// An error naming the first Gemma setting this model does not implement.
pub(super) fn refuse_gemma_settings(plain: &Plain) -> std::result::Result<(), String> {
    if plain.use_bidirectional_attention == Some(true) {
        return Err(
            "`use_bidirectional_attention` is true; only causal attention is supported: use a \
             causal (generative) checkpoint, or set it to false to fine-tune this one as one"
                .into(),
        );
    }
    Ok(())
}

/// The rotations of the full-attention layers and of the sliding-window
/// layers, from `rope_parameters` per layer type (transformers 5) or from
/// `rope_theta` with `rope_scaling` for the full layers and `typed`'s local
/// key for the sliding ones (earlier files). The local one is `None` where
/// it is the same as the global one.
pub(super) fn typed_ropes(
    config: &serde_json::Value,
    max_positions: usize,
    typed: TypedRope,
) -> std::result::Result<(Rope, Option<Rope>), String> {
    use serde_json::{json, Value};
    let get = |key: &str| config.get(key).filter(|v| !v.is_null());
    let per_type = get("rope_parameters")
        .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
    let (global, local) = match per_type {
        Some(p) => (
            p.get("full_attention").cloned(),
            p.get("sliding_attention").cloned(),
        ),
        None => (
            get("rope_parameters").or(get("rope_scaling")).cloned(),
            None,
        ),
    };
    // One layer type's parameters as a config of their own, the base
    // defaulted as transformers defaults it.
    let rope = |params: Option<Value>, theta_key: Option<&str>, default: f64| {
        let mut params = params.unwrap_or_else(|| json!({"rope_type": "default"}));
        if !params.is_object() {
            return Err(format!(
                "`rope_parameters` is {params}; an object is expected"
            ));
        }
        if params.get("rope_theta").is_none_or(Value::is_null) {
            params["rope_theta"] = theta_key.and_then(get).cloned().unwrap_or(default.into());
        }
        let mut alone = json!({ "rope_parameters": params });
        if let Some(partial) = get("partial_rotary_factor") {
            alone["partial_rotary_factor"] = partial.clone();
        }
        Rope::from_json(&alone, max_positions, RopeDialect::default(), default)
    };
    let global = rope(global, Some("rope_theta"), typed.global_theta)?;
    let local = rope(local, typed.local_theta_key, typed.local_theta)?;
    Ok((global.clone(), (local != global).then_some(local)))
}
