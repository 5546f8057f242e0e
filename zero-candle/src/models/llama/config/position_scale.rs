//! [`PositionScale`]: Llama 4's and Ministral 3's scale of the queries by
//! position, and how a config gives it.

/// Llama 4's and Ministral 3's scale of the queries by position: the query
/// at position `t` times `1 + beta · ln(1 + ⌊t / every⌋)`, 1 within the
/// first `every` positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PositionScale {
    /// `llama_4_scaling_beta`.
    pub beta: f64,
    /// The rotary parameters' `original_max_position_embeddings`.
    pub every: usize,
}

impl PositionScale {
    /// The factors of positions `0..time`.
    pub fn factors(&self, time: usize) -> Vec<f32> {
        let every = self.every.max(1);
        (0..time)
            .map(|t| (1.0 + self.beta * (1.0 + (t / every) as f64).ln()) as f32)
            .collect()
    }
}

/// The position scale a Ministral 3 config's rotary parameters give
/// (`llama_4_scaling_beta` over `original_max_position_embeddings`), none
/// where they name no beta.
pub(super) fn position_scale_of(
    config: &serde_json::Value,
) -> std::result::Result<Option<PositionScale>, String> {
    let Some(params) = ["rope_parameters", "rope_scaling"]
        .iter()
        .find_map(|key| config.get(key).filter(|p| p.is_object()))
    else {
        return Ok(None);
    };
    let Some(beta) = params.get("llama_4_scaling_beta").filter(|b| !b.is_null()) else {
        return Ok(None);
    };
    let beta = beta
        .as_f64()
        .filter(|b| b.is_finite())
        .ok_or_else(|| format!("`llama_4_scaling_beta` is {beta}; a number is expected"))?;
    let every = params
        .get("original_max_position_embeddings")
        .and_then(|v| v.as_u64())
        .and_then(|v| usize::try_from(v).ok())
        .filter(|&v| v > 0)
        .ok_or(
            "`llama_4_scaling_beta` scales the queries past `original_max_position_embeddings`, \
             which the rotary parameters do not give: add it",
        )?;
    Ok(Some(PositionScale { beta, every }))
}
