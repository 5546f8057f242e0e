//! [`LatentAttention`]: DeepSeek-V2's multi-head latent attention, and how
//! a `config.json` describes it.

use crate::models::config_json::{check_sizes, optional_size, read_keys, size};
use serde::Deserialize;

/// The epsilon of the latent attention's own RMS norms (`q_a_layernorm`,
/// `kv_a_layernorm`): `transformers` builds them with its RMS norm's
/// default, whatever `rms_norm_eps` says.
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// Multi-head latent attention (DeepSeek-V2's MLA, also DeepSeek-V3's and
/// GLM-4.7-Flash's). The keys and values of every head come from one
/// latent of `kv_rank` values per token (`kv_a_proj_with_mqa`, then its
/// RMS norm `kv_a_layernorm` and the up projection `kv_b_proj` to each
/// head's `nope_dim` key values and `value_dim` values), beside one
/// rotated key part of [`crate::models::llama::LlamaConfig::rotary_dim`]
/// values that every head shares. The queries come from `q_proj`, or
/// through a latent of `query_rank` values (`q_a_proj`, `q_a_layernorm`,
/// `q_b_proj`). Each query and key head is `nope_dim + rotary_dim` wide
/// (the config's `head_dim`); the scores are scaled by that width's
/// inverse square root (times the square of YaRN's `mscale_all_dim`
/// factor, as the config's `attention_scale`).
///
/// With `attention_bias`, `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`
/// have biases (`q_proj`, `q_b_proj` and `kv_b_proj` never do).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentAttention {
    /// `q_lora_rank`: the queries' latent width; `None`: one `q_proj`.
    pub query_rank: Option<usize>,
    /// `kv_lora_rank`: the keys' and values' latent width.
    pub kv_rank: usize,
    /// `qk_nope_head_dim`: the values of each query and key head that do
    /// not rotate.
    pub nope_dim: usize,
    /// `v_head_dim`: the width of each value head (at most a query head's).
    pub value_dim: usize,
}

/// The keys of `config.json` that describe the latent attention, with
/// `transformers`' defaults (DeepSeek-V2's and V3's; GLM-4.7-Flash's
/// files give them all).
#[derive(Deserialize)]
struct LatentKeys {
    #[serde(default = "default_query_rank", deserialize_with = "optional_size")]
    q_lora_rank: Option<usize>,
    #[serde(default = "default_kv_rank", deserialize_with = "size")]
    kv_lora_rank: usize,
    #[serde(default = "default_nope_dim", deserialize_with = "size")]
    qk_nope_head_dim: usize,
    #[serde(default = "default_rope_dim", deserialize_with = "size")]
    qk_rope_head_dim: usize,
    #[serde(default = "default_value_dim", deserialize_with = "size")]
    v_head_dim: usize,
    /// DeepSeek-V3's: the rotated values stored as interleaved pairs.
    #[serde(default)]
    rope_interleave: Option<bool>,
}

fn default_query_rank() -> Option<usize> {
    Some(1536)
}
fn default_kv_rank() -> usize {
    512
}
fn default_nope_dim() -> usize {
    128
}
fn default_rope_dim() -> usize {
    64
}
fn default_value_dim() -> usize {
    128
}

/// How a latent family stores the rotated values of each head.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum LatentRope {
    /// As interleaved pairs (DeepSeek-V2's).
    Pairs,
    /// As pairs where `rope_interleave` (true where absent) says so, else
    /// as halves (DeepSeek-V3's).
    Switched,
    /// As halves, `rotate_half`'s (MiniCPM3's; `rope_interleave` is not
    /// read, as `transformers` does not read it).
    Halves,
}

/// What a latent family's `config.json` gives: the attention, the rotated
/// width of each head (`qk_rope_head_dim`) and whether the rotated values
/// are stored as interleaved pairs.
pub(super) fn latent_of(
    config: &serde_json::Value,
    stored: LatentRope,
) -> std::result::Result<(LatentAttention, usize, bool), String> {
    let keys: LatentKeys = read_keys(config)?;
    let latent = LatentAttention {
        query_rank: keys.q_lora_rank,
        kv_rank: keys.kv_lora_rank,
        nope_dim: keys.qk_nope_head_dim,
        value_dim: keys.v_head_dim,
    };
    let interleaved = match stored {
        LatentRope::Pairs => true,
        LatentRope::Switched => keys.rope_interleave.unwrap_or(true),
        LatentRope::Halves => false,
    };
    Ok((latent, keys.qk_rope_head_dim, interleaved))
}

impl LatentAttention {
    /// Checks the widths against a model's `head_dim` (a query or key
    /// head's) and `rotary_dim`.
    pub(super) fn validate(
        &self,
        head_dim: usize,
        rotary_dim: usize,
    ) -> std::result::Result<(), String> {
        check_sizes(&[
            ("q_lora_rank", self.query_rank.unwrap_or(1)),
            ("kv_lora_rank", self.kv_rank),
            ("v_head_dim", self.value_dim),
        ])?;
        if self.nope_dim + rotary_dim != head_dim {
            return Err(format!(
                "a latent attention's heads are `qk_nope_head_dim` {} + `qk_rope_head_dim` {} \
                 wide, but `head_dim` is {head_dim}; set `head_dim` to their sum",
                self.nope_dim, rotary_dim
            ));
        }
        if self.value_dim > head_dim {
            return Err(format!(
                "`v_head_dim` {} is wider than the query and key heads ({head_dim}); a latent \
                 attention with wider values is not implemented here",
                self.value_dim
            ));
        }
        Ok(())
    }

    /// The attention's parameters in one layer of a model `hidden` wide
    /// with `heads` heads `head_dim` wide, rotating `rope` values each;
    /// with `bias`, those of `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub(super) fn num_params(
        &self,
        hidden: usize,
        (heads, head_dim, rope): (usize, usize, usize),
        bias: bool,
    ) -> u128 {
        let [hidden, heads, head_dim, rope, kv_rank, nope_dim, value_dim] = [
            hidden,
            heads,
            head_dim,
            rope,
            self.kv_rank,
            self.nope_dim,
            self.value_dim,
        ]
        .map(|n| n as u128);
        let (q, bias) = (heads * head_dim, u128::from(bias));
        let query = match self.query_rank.map(|rank| rank as u128) {
            Some(rank) => hidden * rank + rank * bias + rank + rank * q,
            None => hidden * q,
        };
        let kv_a = (hidden + bias) * (kv_rank + rope);
        let kv_b = kv_rank * heads * (nope_dim + value_dim);
        let o = heads * value_dim * hidden + hidden * bias;
        query + kv_a + kv_rank + kv_b + o
    }
}

/// The factor on a latent attention's score scale that its rotary
/// parameters give: YaRN's `get_mscale(factor, mscale_all_dim)` squared
/// where the rotation is scaled (`rope_type` other than `default`) and
/// `mscale_all_dim` is set, as DeepSeek-V2's attention multiplies its
/// `qk_head_dim^-1/2` by it; 1 otherwise.
pub(super) fn score_mscale(config: &serde_json::Value) -> std::result::Result<f64, String> {
    let Some((key, params)) = ["rope_parameters", "rope_scaling"]
        .iter()
        .find_map(|key| Some((*key, config.get(key).filter(|p| p.is_object())?)))
    else {
        return Ok(1.0);
    };
    let kind = ["rope_type", "type"]
        .iter()
        .find_map(|k| params.get(k).and_then(|v| v.as_str()))
        .unwrap_or("default");
    let all_dims = params
        .get("mscale_all_dim")
        .and_then(|v| v.as_f64())
        .unwrap_or(0.0);
    if kind == "default" || all_dims == 0.0 {
        return Ok(1.0);
    }
    let factor = params
        .get("factor")
        .and_then(|v| v.as_f64())
        .filter(|f| f.is_finite())
        .ok_or_else(|| {
            format!(
                "`{key}` sets `mscale_all_dim`, which scales the attention by the rotation's \
                 `factor`, but gives no `factor`: add it"
            )
        })?;
    Ok(crate::models::rope::yarn_mscale(factor, all_dims).powi(2))
}

/// Sarvam MLA's config as DeepSeek-V3's, as `transformers` reads it: one
/// `q_proj` where `q_lora_rank` is absent (DeepSeek-V3's default is a
/// latent), and its released files' rotary scaling "deepseek_yarn" as
/// YaRN.
pub(super) fn sarvam_mla_keys(config: &serde_json::Value) -> serde_json::Value {
    let mut config = config.clone();
    let Some(object) = config.as_object_mut() else {
        return config;
    };
    object
        .entry("q_lora_rank")
        .or_insert(serde_json::Value::Null);
    if let Some(scaling) = object
        .get_mut("rope_scaling")
        .and_then(|s| s.as_object_mut())
    {
        let named = |key: &str| scaling.get(key).and_then(|v| v.as_str()) == Some("deepseek_yarn");
        if named("type") || named("rope_type") {
            scaling.remove("type");
            scaling.insert("rope_type".into(), "yarn".into());
        }
    }
    config
}

/// MiniCPM3's config with its multipliers as Granite's, as `transformers`
/// applies them: the embeddings times `scale_emb` (12 where absent), each
/// residual branch times `scale_depth` (1.4; √layers where null) over
/// √layers, the logits divided by `hidden_size / dim_model_base` (256;
/// `hidden_size` where null); its latent widths' defaults where absent.
pub(super) fn minicpm3_keys(config: &serde_json::Value) -> serde_json::Value {
    let mut config = config.clone();
    let Some(object) = config.as_object_mut() else {
        return config;
    };
    let number = |key: &str| object.get(key).and_then(|v| v.as_f64());
    let layers = number("num_hidden_layers").unwrap_or(62.0);
    let hidden = number("hidden_size").unwrap_or(2560.0);
    let given = |key: &str, default: f64| match object.get(key) {
        None => Some(default),
        Some(v) => v.as_f64(),
    };
    let embedding = given("scale_emb", 12.0).unwrap_or(12.0);
    let depth = given("scale_depth", 1.4).unwrap_or(layers.sqrt());
    let base = given("dim_model_base", 256.0).unwrap_or(hidden);
    for (key, value) in [
        ("embedding_multiplier", embedding),
        ("residual_multiplier", depth / layers.sqrt()),
        ("logits_scaling", hidden / base),
    ] {
        object.insert(key.into(), value.into());
    }
    for (key, width) in [
        ("q_lora_rank", 768),
        ("kv_lora_rank", 256),
        ("qk_nope_head_dim", 64),
        ("qk_rope_head_dim", 32),
        ("v_head_dim", 64),
    ] {
        object.entry(key).or_insert(width.into());
    }
    config
}
