//! DeepSeek-V2's multi-head latent attention ([`LatentAttention`]): its
//! projections, the query and key heads they make, and the rows of its
//! variables reordered from the checkpoint's.

use super::config::LatentAttention;
use super::LlamaConfig;
use crate::models::rope::halves_from_interleaved;
use crate::nn::{LayerNorm, Linear};
use candle_core::{Module, Tensor};
use std::sync::Arc;

/// The queries' projections: one, or down, norm and up.
#[derive(Clone)]
pub(super) enum LatentQuery {
    /// `q_proj`.
    Direct(Linear),
    /// `q_a_proj`, `q_a_layernorm`, `q_b_proj`.
    Ranked(Linear, LayerNorm, Linear),
}

/// One block's latent attention before the attention itself.
///
/// The variables' rows put each query head's rotated values first (the
/// checkpoint's are last), in rotate_half's order (the checkpoint's may be
/// interleaved pairs; [`latent_rows`]), and the key heads are made the
/// same way: `[rotated, not rotated]`. A dot product does not see the
/// order, so the scores are the checkpoint's, and the rotation is the one
/// of the first `rotary_dim` values that Phi-3's partial rotation uses.
#[derive(Clone)]
pub(super) struct Latent {
    pub(super) query: LatentQuery,
    /// `kv_a_proj_with_mqa`: the latent, then the shared rotated key.
    pub(super) kv_a: Linear,
    /// `kv_a_layernorm`.
    pub(super) kv_norm: LayerNorm,
    /// `kv_b_proj`: each head's key values that do not rotate, then its
    /// values.
    pub(super) kv_b: Linear,
    pub(super) heads: usize,
    pub(super) shape: LatentAttention,
    /// The rotated values of each query and key head.
    pub(super) rotary_dim: usize,
}

impl Latent {
    /// The queries, keys and values `[batch, time, heads, head_dim]` of
    /// `h` rows `[batch * time, hidden]`, the queries and keys rotated by
    /// `rotate`; the values padded with zeros to `head_dim` (the fused
    /// attention takes one width; the output's padding is cut off after).
    pub(super) fn heads(
        &self,
        h: &Tensor,
        (batch, time): (usize, usize),
        rotate: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<[Tensor; 3]> {
        let (heads, rope) = (self.heads, self.rotary_dim);
        let LatentAttention {
            kv_rank,
            nope_dim,
            value_dim,
            ..
        } = self.shape;
        let head_dim = nope_dim + rope;
        let q = match &self.query {
            LatentQuery::Direct(q) => q.forward(h)?,
            LatentQuery::Ranked(down, norm, up) => up.forward(&norm.forward(&down.forward(h)?)?)?,
        };
        let q = rotate(&q.reshape((batch, time, heads, head_dim))?)?;
        let compressed = self.kv_a.forward(h)?;
        let latent = self
            .kv_norm
            .forward(&compressed.narrow(1, 0, kv_rank)?.contiguous()?)?;
        let shared = compressed
            .narrow(1, kv_rank, rope)?
            .reshape((batch, time, 1, rope))?;
        let shared = rotate(&shared)?.broadcast_as((batch, time, heads, rope))?;
        let kv = self
            .kv_b
            .forward(&latent)?
            .reshape((batch, time, heads, nope_dim + value_dim))?;
        let k = Tensor::cat(&[&shared, &kv.narrow(3, 0, nope_dim)?], 3)?;
        let v = kv.narrow(3, nope_dim, value_dim)?;
        let v = match head_dim - value_dim {
            0 => v,
            pad => v.pad_with_zeros(3, 0, pad)?,
        };
        Ok([q, k, v])
    }
}

/// The latent attention's variables whose rows [`super::Llama::hub_layout`]
/// reorders, with each one's order: the queries' up projection (`q_proj`
/// or `q_b_proj`) with each head's rotated rows moved first (and from
/// interleaved pairs to halves where the checkpoint stores pairs), and,
/// with pairs, the rotated rows of `kv_a_proj_with_mqa` (and its bias) to
/// halves.
pub(super) fn latent_rows(
    config: &LlamaConfig,
    latent: &LatentAttention,
) -> Vec<(String, Arc<[usize]>)> {
    let (heads, rope) = (config.num_attention_heads, config.rotary_dim);
    let nope = latent.nope_dim;
    let width = nope + rope;
    let turned = match config.rope_interleaved {
        true => halves_from_interleaved(1, rope, rope),
        false => (0..rope).collect(),
    };
    let query: Arc<[usize]> = (0..heads)
        .flat_map(|h| {
            let first = turned.iter().map(move |&r| h * width + nope + r);
            first.chain((0..nope).map(move |d| h * width + d))
        })
        .collect();
    let kv_a: Arc<[usize]> = (0..latent.kv_rank)
        .chain(turned.iter().map(|&r| latent.kv_rank + r))
        .collect();
    let names = config.layer_names;
    let mut vars = Vec::new();
    for i in 0..config.num_hidden_layers {
        let attn = names.attention_at(i);
        let up = match latent.query_rank {
            Some(_) => "q_b_proj",
            None => "q_proj",
        };
        vars.push((format!("{attn}.{up}.weight"), query.clone()));
        if config.rope_interleaved {
            vars.push((format!("{attn}.kv_a_proj_with_mqa.weight"), kv_a.clone()));
            if config.qkv_bias {
                vars.push((format!("{attn}.kv_a_proj_with_mqa.bias"), kv_a.clone()));
            }
        }
    }
    vars
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_query_rows_put_each_heads_rotated_values_first_as_halves() {
        let config = crate::models::llama::LlamaConfig::from_json(&serde_json::json!({
            "model_type": "deepseek_v2",
            "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2,
            "q_lora_rank": null, "kv_lora_rank": 3, "qk_nope_head_dim": 2,
            "qk_rope_head_dim": 4, "v_head_dim": 2, "n_routed_experts": 2,
            "num_experts_per_tok": 1, "moe_intermediate_size": 4
        }))
        .unwrap();
        let latent = config.latent_attention.unwrap();
        let rows = super::latent_rows(&config, &latent);
        let names: Vec<&str> = rows.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
            ]
        );
        // Head 0 holds rows 0-1 unrotated, 2-5 rotated as pairs (2, 3),
        // (4, 5): the halves are rows 2, 4 then 3, 5.
        assert_eq!(&*rows[0].1, &[2, 4, 3, 5, 0, 1, 8, 10, 9, 11, 6, 7]);
        assert_eq!(&*rows[1].1, &[0, 1, 2, 3, 5, 4, 6]);
    }
}
