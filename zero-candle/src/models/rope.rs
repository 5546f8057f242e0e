//! Rotary position embeddings' settings as `transformers` reads them from a
//! Llama-family `config.json`: the base and the frequency scaling
//! (`default`, `linear`, `dynamic`, `llama3`, `yarn`, `longrope`), and the
//! frequencies and the factor on the cosines and sines they give.

use serde::Deserialize;

/// Rotary embeddings: the base of the frequencies and their scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// How the frequencies are scaled (`rope_type`).
    pub scaling: RopeScaling,
}

/// A `rope_type` and its parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `default`: the frequencies as they are.
    None,
    /// `linear`: every frequency divided by `factor` (positions
    /// interpolated).
    Linear {
        /// How much the frequencies are divided by.
        factor: f64,
    },
    /// `dynamic` (NTK-aware): the frequencies as they are up to
    /// `max_position_embeddings`, a larger base past it. Only the first
    /// is implemented: the models refuse longer sequences.
    Dynamic {
        /// How much the base grows past the context (unused here).
        factor: f64,
    },
    /// `llama3` (Llama 3.1 and later): the low frequencies divided.
    Llama3(Llama3Scaling),
    /// `yarn` (Qwen's long contexts, DeepSeek): low frequencies
    /// interpolated, high ones kept, a ramp between, and the cosines and
    /// sines scaled.
    Yarn(YarnScaling),
    /// `longrope` (Phi-3's long contexts, and the "su" and "yarn" its files
    /// name it by): each frequency divided by its own factor, short ones up
    /// to the original context and long ones past it, and the cosines and
    /// sines scaled.
    LongRope(LongRopeScaling),
}

/// The `longrope` frequency scaling, as `transformers` computes it.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRopeScaling {
    /// One divisor per rotated pair, for sequences up to
    /// `original_max_position_embeddings`.
    pub short_factor: Vec<f64>,
    /// One divisor per rotated pair, for longer sequences.
    pub long_factor: Vec<f64>,
    /// The context the model was trained with before scaling: a sequence
    /// longer than this rotates with `long_factor`.
    pub original_max_position_embeddings: usize,
    /// The factor on the cosines and sines (`attention_factor`, else
    /// `√(1 + ln(factor) / ln(original))` with `factor` the contexts'
    /// ratio).
    pub attention_factor: f64,
}

/// The `llama3` frequency scaling.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Llama3Scaling {
    /// How much the low frequencies are divided by.
    pub factor: f64,
    /// Wavelengths above `original_max_position_embeddings /
    /// low_freq_factor` are scaled by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths below `original_max_position_embeddings /
    /// high_freq_factor` are kept; those between are blended.
    pub high_freq_factor: f64,
    /// The context the model was trained with before scaling.
    pub original_max_position_embeddings: f64,
}

/// The `yarn` frequency scaling (YaRN, arXiv 2309.00071), as `transformers`
/// computes it.
#[derive(Clone, Debug, PartialEq)]
pub struct YarnScaling {
    /// How much the interpolated frequencies are divided by.
    pub factor: f64,
    /// The context the model was trained with before scaling.
    pub original_max_position_embeddings: f64,
    /// Rotations over the original context above which a frequency is kept
    /// (`beta_fast`, 32 by default).
    pub beta_fast: f64,
    /// Rotations below which it is interpolated (`beta_slow`, 1).
    pub beta_slow: f64,
    /// The ramp's ends rounded outwards to whole dimensions (`truncate`,
    /// on by default).
    pub truncate: bool,
    /// The factor on the cosines and sines (`attention_factor`, else from
    /// `factor`, `mscale` and `mscale_all_dim`).
    pub attention_factor: f64,
}

/// How a family reads its rotary settings beyond Llama's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RopeDialect {
    /// "su" and "yarn" mean longrope (Phi-3).
    pub(crate) longrope_names: bool,
    /// `partial_rotary_factor` is read (by [`partial_rotary_factor`]), this
    /// where the file leaves it out: the first part of each head rotates
    /// (Phi-3, GLM-4.5, MiniMax-M2); `None`: whole heads only.
    pub(crate) partial: Option<f64>,
    /// The checkpoint's heads rotate interleaved pairs (GLM-4's
    /// `rotate_half`, which pairs `x(2i)` with `x(2i+1)`); see
    /// [`halves_from_interleaved`].
    pub(crate) interleaved: bool,
}

/// Row `r` of the result is the row of `heads` heads of `head_dim` (each
/// rotating its first `rotary_dim` values as interleaved pairs, `(x0,
/// x1), (x2, x3), …`) that holds the value rotate_half's order puts at
/// `r`: `x0, x2, …, x1, x3, …`, then the values that do not rotate as
/// they are. Queries and keys reordered alike give the same scores, and
/// rotate_half rotates pair `i` with the frequency the interleaved
/// rotation gives it.
pub(crate) fn halves_from_interleaved(
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
) -> Vec<usize> {
    let half = rotary_dim / 2;
    (0..heads * head_dim)
        .map(|row| {
            let (head, i) = (row / head_dim, row % head_dim);
            let within = match i {
                i if i < half => 2 * i,
                i if i < rotary_dim => 2 * (i - half) + 1,
                i => i,
            };
            head * head_dim + within
        })
        .collect()
}

impl Rope {
    /// The settings of `config` (a hub `config.json`): `rope_parameters`
    /// (transformers 5) or `rope_theta` with `rope_scaling` (earlier
    /// files), `rope_theta` `default_theta` where absent;
    /// `max_positions` is its `max_position_embeddings`; `dialect` says
    /// whether "su" and "yarn" mean longrope and whether
    /// `partial_rotary_factor` is allowed, as `transformers` reads them for
    /// the family. An error names the key it cannot honour.
    pub(crate) fn from_json(
        config: &serde_json::Value,
        max_positions: usize,
        dialect: RopeDialect,
        default_theta: f64,
    ) -> Result<Self, String> {
        let (params, key) = match config.get("rope_parameters") {
            Some(p) if !p.is_null() => (Some(p), "rope_parameters"),
            _ => match config.get("rope_scaling") {
                Some(s) if !s.is_null() => (Some(s), "rope_scaling"),
                _ => (None, "rope_scaling"),
            },
        };
        // A value of the rotary parameters, else of the config itself.
        let value = |name: &str| {
            params
                .and_then(|p| p.get(name))
                .or_else(|| config.get(name))
                .filter(|v| !v.is_null())
        };
        let number = |name: &str| {
            value(name)
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| format!("`{name}` is {v}; a number is expected"))
                })
                .transpose()
        };
        if let Some(partial) =
            number("partial_rotary_factor")?.filter(|&f| f != 1.0 && dialect.partial.is_none())
        {
            return Err(format!(
                "`partial_rotary_factor` is {partial}; rotary embeddings over whole heads only \
                 (Phi-3's, GLM's and MiniMax-M2's rotate part of each head)"
            ));
        }
        let theta = number("rope_theta")?.unwrap_or(default_theta);
        let kind = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let required = |name: &str| {
            number(name)?.ok_or_else(|| format!("`{key}` of type {kind} has no `{name}`"))
        };
        let factors = |name: &str| -> Result<Vec<f64>, String> {
            let list = value(name).and_then(|v| v.as_array()).ok_or_else(|| {
                format!("`{key}` of type longrope has no `{name}` (a list of numbers)")
            })?;
            list.iter()
                .map(|v| v.as_f64().filter(|f| *f > 0.0 && f.is_finite()))
                .collect::<Option<Vec<f64>>>()
                .ok_or_else(|| {
                    format!(
                        "`{name}` holds {v}; positive numbers are expected",
                        v = value(name).unwrap_or(&serde_json::Value::Null)
                    )
                })
        };
        let scaling = match kind {
            "su" | "yarn" | "longrope" if dialect.longrope_names || kind == "longrope" => {
                let original = required("original_max_position_embeddings")?;
                let factor = number("factor")?.unwrap_or(max_positions as f64 / original);
                let attention_factor = match number("attention_factor")? {
                    Some(f) => f,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / original.ln()).sqrt(),
                };
                RopeScaling::LongRope(LongRopeScaling {
                    short_factor: factors("short_factor")?,
                    long_factor: factors("long_factor")?,
                    original_max_position_embeddings: original as usize,
                    attention_factor,
                })
            }
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: required("factor")?,
            },
            "dynamic" => RopeScaling::Dynamic {
                factor: required("factor")?,
            },
            "llama3" => RopeScaling::Llama3(
                Llama3Scaling::deserialize(params.unwrap_or(&serde_json::Value::Null))
                    .map_err(|e| format!("`{key}` of type llama3: {e}"))?,
            ),
            "yarn" => {
                let original = required("original_max_position_embeddings")?;
                let factor = number("factor")?.unwrap_or(max_positions as f64 / original);
                // As Python's `or`: a missing or zero value takes the default.
                let or = |name: &str, default: f64| -> Result<f64, String> {
                    Ok(number(name)?.filter(|&v| v != 0.0).unwrap_or(default))
                };
                let attention_factor = match number("attention_factor")? {
                    Some(f) => f,
                    None => match (or("mscale", 0.0)?, or("mscale_all_dim", 0.0)?) {
                        (m, all) if m != 0.0 && all != 0.0 => {
                            yarn_mscale(factor, m) / yarn_mscale(factor, all)
                        }
                        _ => yarn_mscale(factor, 1.0),
                    },
                };
                RopeScaling::Yarn(YarnScaling {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: or("beta_fast", 32.0)?,
                    beta_slow: or("beta_slow", 1.0)?,
                    truncate: value("truncate").and_then(|v| v.as_bool()).unwrap_or(true),
                    attention_factor,
                })
            }
            other => {
                return Err(format!(
                    "`{key}` has rope_type {other:?}; \"default\", \"linear\", \"dynamic\", \
                     \"llama3\", \"yarn\" and \"longrope\" are supported"
                ))
            }
        };
        let rope = Self { theta, scaling };
        rope.validate()?;
        Ok(rope)
    }

    /// Checks that the settings give finite, positive frequencies.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.theta.is_nan() || self.theta <= 0.0 {
            return Err(format!("`rope_theta` {} must be positive", self.theta));
        }
        let factor = match &self.scaling {
            RopeScaling::None => return Ok(()),
            RopeScaling::LongRope(scaling) => scaling.attention_factor,
            RopeScaling::Linear { factor } | RopeScaling::Dynamic { factor, .. } => *factor,
            RopeScaling::Llama3(scaling) => scaling.factor,
            RopeScaling::Yarn(scaling) => scaling.factor,
        };
        if factor.is_nan() || factor <= 0.0 {
            return Err(format!(
                "the rotary scaling's `factor` {factor} must be positive"
            ));
        }
        Ok(())
    }

    /// The rotary frequencies of a head of `head_dim` (its rotated part):
    /// `1 / theta^(2i / head_dim)` for `i < head_dim / 2`, scaled as
    /// `transformers` scales them (`longrope`: with its short factors).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f64> {
        self.inv_freq_at(head_dim, 0)
    }

    /// [`Rope::inv_freq`] for sequences of `time` positions: `longrope`'s
    /// long factors past its original context, the same frequencies at
    /// every length otherwise.
    pub fn inv_freq_at(&self, head_dim: usize, time: usize) -> Vec<f64> {
        let half = head_dim / 2;
        let plain = |i: usize| 1.0 / self.theta.powf(2.0 * i as f64 / head_dim as f64);
        match &self.scaling {
            RopeScaling::LongRope(scaling) => {
                let factors = match time > scaling.original_max_position_embeddings {
                    true => &scaling.long_factor,
                    false => &scaling.short_factor,
                };
                // As transformers: the divisor in f32, times the power.
                (0..half)
                    .map(|i| {
                        1.0 / (factors[i] as f32 as f64
                            * self.theta.powf(2.0 * i as f64 / head_dim as f64))
                    })
                    .collect()
            }
            RopeScaling::None | RopeScaling::Dynamic { .. } => (0..half).map(plain).collect(),
            RopeScaling::Linear { factor } => (0..half).map(|i| plain(i) / factor).collect(),
            RopeScaling::Llama3(scaling) => (0..half).map(|i| scaling.apply(plain(i))).collect(),
            RopeScaling::Yarn(scaling) => scaling.inv_freq(self.theta, head_dim),
        }
    }

    /// The factor on the cosines and sines (YaRN's and longrope's attention
    /// factor; 1 otherwise).
    pub fn attention_factor(&self) -> f64 {
        match &self.scaling {
            RopeScaling::Yarn(scaling) => scaling.attention_factor,
            RopeScaling::LongRope(scaling) => scaling.attention_factor,
            _ => 1.0,
        }
    }

    /// The sequence length past which the frequencies change (`longrope`'s
    /// original context), if they do.
    pub fn switches_after(&self) -> Option<usize> {
        match &self.scaling {
            RopeScaling::LongRope(scaling) => Some(scaling.original_max_position_embeddings),
            _ => None,
        }
    }

    /// Checks that `longrope`'s factors give one divisor per rotated pair of
    /// a head that rotates `rotary_dim` values.
    pub(crate) fn validate_for(&self, rotary_dim: usize) -> Result<(), String> {
        if let RopeScaling::LongRope(scaling) = &self.scaling {
            for (name, factors) in [
                ("short_factor", &scaling.short_factor),
                ("long_factor", &scaling.long_factor),
            ] {
                if factors.len() != rotary_dim / 2 {
                    return Err(format!(
                        "`{name}` has {} entries; a head rotating {rotary_dim} values takes {}",
                        factors.len(),
                        rotary_dim / 2
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Llama3Scaling {
    /// One frequency scaled: low ones divided by `factor`, high ones kept,
    /// those between blended.
    fn apply(&self, freq: f64) -> f64 {
        let old = self.original_max_position_embeddings;
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        if wavelen < old / self.high_freq_factor {
            freq
        } else if wavelen > old / self.low_freq_factor {
            freq / self.factor
        } else {
            let smooth = (old / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * freq / self.factor + smooth * freq
        }
    }
}

/// The `partial_rotary_factor` of `config` (in `rope_parameters`,
/// `rope_scaling` or at the top), `missing` when absent: the fraction of
/// each head that rotates (Phi-3's, GLM-4.5's and MiniMax-M2's; others refuse it
/// when reading their [`Rope`]).
pub(crate) fn partial_rotary_factor(
    config: &serde_json::Value,
    missing: f64,
) -> Result<f64, String> {
    let found = ["rope_parameters", "rope_scaling"]
        .iter()
        .filter_map(|key| config.get(key).and_then(|p| p.get("partial_rotary_factor")))
        .chain(config.get("partial_rotary_factor"))
        .find(|v| !v.is_null());
    match found {
        None => Ok(missing),
        Some(v) => match v.as_f64() {
            Some(f) if f > 0.0 && f <= 1.0 => Ok(f),
            _ => Err(format!(
                "`partial_rotary_factor` is {v}; a number in (0, 1] is expected"
            )),
        },
    }
}

/// YaRN's `get_mscale`: `0.1 mscale ln(scale) + 1`, 1 for no scaling.
pub(crate) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl YarnScaling {
    /// The frequencies of a head of `head_dim`: each plain frequency kept
    /// (extrapolated) below the ramp's start, divided by `factor`
    /// (interpolated) past its end, and blended linearly between, the
    /// ramp running over the dimensions whose wavelengths make `beta_fast`
    /// to `beta_slow` rotations over the original context.
    fn inv_freq(&self, theta: f64, head_dim: usize) -> Vec<f64> {
        let dim = head_dim as f64;
        // The dimension at which a frequency makes `rotations` turns over
        // the original context.
        let correction = |rotations: f64| {
            dim * (self.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
                / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..head_dim / 2)
            .map(|i| {
                let plain = 1.0 / theta.powf(2.0 * i as f64 / dim);
                // 0: kept, 1: interpolated.
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                plain / self.factor * ramp + plain * (1.0 - ramp)
            })
            .collect()
    }
}
