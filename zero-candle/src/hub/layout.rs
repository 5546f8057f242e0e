//! How a model's variables sit in a hub checkpoint.

use super::{Arrangement, HubDir};
use std::collections::BTreeMap;
use std::sync::Arc;

/// How a model's variables map onto the tensors of a hub checkpoint: a
/// variable is the tensor of the same name, or of that name without an
/// optional prefix (GPT-2's first checkpoints name `h.0.attn.c_attn.weight`
/// what `transformers` saves as `transformer.h.0.attn.c_attn.weight`);
/// some are stored transposed (GPT-2's Conv1D weights are `[in, out]`,
/// the variable is a Linear's `[out, in]`), or with their rows in another
/// order (GLM's interleaved rotary pairs); a tensor may hold a variable
/// again (a head tied to the embedding, when a file keeps it); the model
/// may be part of a larger one whose file names its variables under a
/// prefix of their own (Gemma 3's text model as `language_model.model.*`
/// beside its vision tower); a tensor may hold several variables one after
/// another (a mixture's experts fused in one tensor, as `transformers` 5
/// holds them).
#[derive(Clone, Debug, Default)]
pub struct HubLayout {
    optional_prefix: Option<String>,
    /// Variable-name prefix -> the tensor-name prefix it is stored under.
    renamed: Option<(String, String)>,
    arranged: BTreeMap<String, Arrangement>,
    /// Tensor name -> the variable it repeats.
    tied: BTreeMap<String, String>,
    /// Tensor name -> the variables it holds one after another.
    fused: BTreeMap<String, Arc<[String]>>,
    /// Variable name -> its fused tensor and its place there.
    parts: BTreeMap<String, (String, usize)>,
}

impl HubLayout {
    /// Every variable is the tensor of its name, as it is.
    pub fn new() -> Self {
        Self::default()
    }

    /// Variables whose names start with `prefix` may be stored without it.
    pub fn with_optional_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.optional_prefix = Some(prefix.into());
        self
    }

    /// Variables whose names start with `var_prefix` are stored under
    /// `tensor_prefix` instead (`"model."` as `"language_model.model."`);
    /// a file's other tensors are the larger model's, kept as they are.
    pub fn with_renamed_prefix(
        mut self,
        var_prefix: impl Into<String>,
        tensor_prefix: impl Into<String>,
    ) -> Self {
        self.renamed = Some((var_prefix.into(), tensor_prefix.into()));
        self
    }

    /// The variable `var` (2-d) is stored transposed.
    pub fn with_transposed(mut self, var: impl Into<String>) -> Self {
        self.arranged.insert(var.into(), Arrangement::Transposed);
        self
    }

    /// The variable `var`, viewed as `rows.len()` rows of equal length (a
    /// Linear weight's rows, a bias's or a norm's elements), has as its row
    /// `r` its tensor's row `rows[r]`: `rows` is a permutation of
    /// `0..rows.len()`.
    pub fn with_rows_permuted(mut self, var: impl Into<String>, rows: Arc<[usize]>) -> Self {
        self.arranged
            .insert(var.into(), Arrangement::RowsPermuted(rows));
        self
    }

    /// The tensor `tensor` holds the variables `parts`, of equal sizes, one
    /// after another (their elements in order, as a concatenation along
    /// the first dimension): a mixture's experts fused in one tensor
    /// (`mlp.experts.gate_up_proj` `[experts, 2 * width, hidden]` holding
    /// each expert's gate and up weights in turn). The parts' names must
    /// sort in this order with no other variable's between them: the
    /// engine orders the variables by name, and the tensor is written from
    /// its parts as they come.
    pub fn with_fused(mut self, tensor: impl Into<String>, parts: Vec<String>) -> Self {
        let tensor = tensor.into();
        for (at, part) in parts.iter().enumerate() {
            self.parts.insert(part.clone(), (tensor.clone(), at));
        }
        self.fused.insert(tensor, parts.into());
        self
    }

    /// The fused tensor that holds `var`, its place among the parts and
    /// their number ([`HubLayout::with_fused`]).
    pub fn fused_part(&self, var: &str) -> Option<(&str, usize, usize)> {
        let (tensor, at) = self.parts.get(var)?;
        let count = self.fused.get(tensor).map_or(0, |p| p.len());
        Some((tensor.as_str(), *at, count))
    }

    /// The variables the tensor `tensor` holds one after another, if the
    /// layout fuses it.
    pub fn parts_of(&self, tensor: &str) -> Option<&[String]> {
        self.fused.get(tensor).map(|p| &p[..])
    }

    /// How `var`'s values are arranged in its tensor.
    pub fn arrangement(&self, var: &str) -> &Arrangement {
        const AS_IS: &Arrangement = &Arrangement::AsIs;
        self.arranged.get(var).unwrap_or(AS_IS)
    }

    /// A tensor named `tensor`, where a file has one, holds variable `var`
    /// again (it is read from `var` and written from it).
    pub fn with_tied(mut self, tensor: impl Into<String>, var: impl Into<String>) -> Self {
        self.tied.insert(tensor.into(), var.into());
        self
    }

    /// Whether `var` is stored transposed.
    pub fn is_transposed(&self, var: &str) -> bool {
        *self.arrangement(var) == Arrangement::Transposed
    }

    /// The name of `var`'s tensor in `dir`: its own (renamed where the
    /// layout renames it), else without the optional prefix; `None` if
    /// `dir` has neither.
    pub fn tensor_of(&self, dir: &HubDir, var: &str) -> Option<String> {
        if let Some((tensor, _, _)) = self.fused_part(var) {
            return dir.tensor(tensor).is_some().then(|| tensor.to_string());
        }
        if let Some((var_prefix, tensor_prefix)) = &self.renamed {
            if let Some(rest) = var.strip_prefix(var_prefix.as_str()) {
                let name = format!("{tensor_prefix}{rest}");
                return dir.tensor(&name).is_some().then_some(name);
            }
        }
        if dir.tensor(var).is_some() {
            return Some(var.to_string());
        }
        let short = var.strip_prefix(self.optional_prefix.as_deref()?)?;
        dir.tensor(short).is_some().then(|| short.to_string())
    }

    /// The index in `vars` of the variable tensor `tensor` of `dir` holds:
    /// its own name, the name with the optional prefix, or the variable it
    /// is tied to; `None` for a tensor the model does not train (a buffer).
    pub fn var_of(&self, tensor: &str, vars: &[String]) -> Option<usize> {
        let find = |name: &str| vars.iter().position(|v| v == name);
        if let Some((var_prefix, tensor_prefix)) = &self.renamed {
            return match tensor.strip_prefix(tensor_prefix.as_str()) {
                Some(rest) => find(&format!("{var_prefix}{rest}")),
                None => self.tied.get(tensor).and_then(|var| find(var)),
            };
        }
        find(tensor)
            .or_else(|| find(&format!("{}{tensor}", self.optional_prefix.as_deref()?)))
            .or_else(|| find(self.tied.get(tensor)?))
    }
}
