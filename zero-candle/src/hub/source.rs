//! A hub checkpoint as the source of a model's initial values.

use super::{Arrangement, HubDir, HubLayout};
use crate::init::ParamSource;
use crate::{Error, Result};
use candle_nn::Init;
use std::ops::Range;
use std::sync::Arc;

/// The values of a model's variables from a hub checkpoint
/// ([`ShardedVarMap::new`](crate::ShardedVarMap::new) with this source):
/// memory-mapped, so at stage 3 a rank reads only its shard of each large
/// variable, whatever the tensor's dtype in the file (converted), transposed
/// or with its rows reordered where the [`HubLayout`] says.
#[derive(Clone, Debug)]
pub struct HubSource {
    dir: Arc<HubDir>,
    layout: HubLayout,
}

impl HubSource {
    /// Values from `dir`, placed by `layout`.
    pub fn new(dir: Arc<HubDir>, layout: HubLayout) -> Self {
        Self { dir, layout }
    }

    /// The directory read from.
    pub fn dir(&self) -> &Arc<HubDir> {
        &self.dir
    }

    /// How the variables sit in it.
    pub fn layout(&self) -> &HubLayout {
        &self.layout
    }

    /// The tensor of `var`, checked against the variable's shape.
    fn tensor(&self, var: &str, shape: &[usize]) -> Result<zero_core::checkpoint::TensorBytes<'_>> {
        let Some(tensor) = self
            .layout
            .tensor_of(&self.dir, var)
            .and_then(|name| self.dir.tensor(&name))
        else {
            return Err(Error::Variable {
                name: var.into(),
                detail: format!(
                    "{} has no tensor of that name; is it a checkpoint of this model's \
                     architecture?",
                    self.dir.dir().display()
                ),
            });
        };
        let mut expected = shape.to_vec();
        if self.layout.is_transposed(var) {
            expected.reverse();
        }
        if let Some((name, _, count)) = self.layout.fused_part(var) {
            // One of `count` equal parts, one after another (each stored
            // transposed where the layout says).
            let numel = shape.iter().product::<usize>();
            let holds = tensor.shape.iter().product::<usize>() == count * numel
                && tensor.shape.last() == expected.last();
            if !holds {
                return Err(Error::Variable {
                    name: var.into(),
                    detail: format!(
                        "{} holds it as one of {count} parts of {name} {:?}, the model built from \
                         its config.json needs parts of {shape:?}; does config.json describe these \
                         weights?",
                        self.dir.dir().display(),
                        tensor.shape
                    ),
                });
            }
            return Ok(tensor);
        }
        if tensor.shape != expected {
            return Err(Error::Variable {
                name: var.into(),
                detail: format!(
                    "{} holds it as {:?}, the model built from its config.json needs {expected:?}; \
                     does config.json describe these weights?",
                    self.dir.dir().display(),
                    tensor.shape
                ),
            });
        }
        if let Arrangement::RowsPermuted(rows) = self.layout.arrangement(var) {
            let numel = shape.iter().product::<usize>();
            let fits = rows.is_empty() && numel == 0 || !rows.is_empty() && numel % rows.len() == 0;
            if !fits || !is_permutation(rows) {
                return Err(Error::Variable {
                    name: var.into(),
                    detail: format!(
                        "its layout reorders it as {} rows, which are not a permutation of equal \
                         rows of its {numel} elements: the layout was built for another model; build it \
                         from this model's config (`Llama::hub_layout`, `Gpt2::hub_layout`)",
                        rows.len(),
                    ),
                });
            }
        }
        Ok(tensor)
    }
}

/// Whether `rows` holds each of `0..rows.len()` once.
fn is_permutation(rows: &[usize]) -> bool {
    let mut seen = vec![false; rows.len()];
    rows.iter()
        .all(|&r| r < seen.len() && !std::mem::replace(&mut seen[r], true))
}

impl ParamSource for HubSource {
    fn fill(
        &self,
        name: &str,
        shape: &[usize],
        _init: Init,
        range: Range<usize>,
        out: &mut [f64],
    ) -> Result<()> {
        let tensor = self.tensor(name, shape)?;
        // A fused tensor's part starts where the parts before it end.
        let offset = match self.layout.fused_part(name) {
            Some((_, at, _)) => at * shape.iter().product::<usize>(),
            None => 0,
        };
        match self.layout.arrangement(name) {
            Arrangement::AsIs => {
                return Ok(tensor.read_range_as(offset + range.start..offset + range.end, out)?)
            }
            Arrangement::RowsPermuted(rows) => {
                // Each of the variable's rows in the range is a run of the
                // tensor's row it comes from.
                let cols = shape.iter().product::<usize>() / rows.len().max(1);
                let mut at = range.start;
                while at < range.end {
                    let (row, col) = (at / cols, at % cols);
                    let len = (cols - col).min(range.end - at);
                    let from = offset + rows[row] * cols + col;
                    let start = at - range.start;
                    tensor.read_range_as(from..from + len, &mut out[start..start + len])?;
                    at += len;
                }
                return Ok(());
            }
            Arrangement::Transposed => {}
        }
        // The variable is [rows, cols], the file [cols, rows]: the
        // variable's rows `first..=last` are a contiguous run of each of the
        // file's rows.
        let &[rows, cols] = shape else {
            return Err(Error::Variable {
                name: name.into(),
                detail: format!("is {shape:?}; only a 2-d variable can be stored transposed"),
            });
        };
        if range.is_empty() {
            return Ok(());
        }
        let (first, last) = (range.start / cols, (range.end - 1) / cols);
        let mut run = vec![0f64; last - first + 1];
        for col in 0..cols {
            let start = offset + col * rows + first;
            tensor.read_range_as(start..start + run.len(), &mut run)?;
            for (i, &value) in run.iter().enumerate() {
                let element = (first + i) * cols + col;
                if range.contains(&element) {
                    out[element - range.start] = value;
                }
            }
        }
        Ok(())
    }

    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.tensor(name, shape).map(drop)
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let tensor = self.layout.tensor_of(&self.dir, name)?;
        let mut shape = self.dir.tensor(&tensor)?.shape.clone();
        if let Some((_, _, count)) = self.layout.fused_part(name) {
            // A part: the tensor's first dimension counting the parts, or
            // its rows split `count` ways.
            shape = match shape.split_first() {
                Some((&first, rest)) if first == count => rest.to_vec(),
                _ => {
                    let last = *shape.last()?;
                    let numel = shape.iter().product::<usize>();
                    vec![numel / count.max(1) / last.max(1), last]
                }
            };
        }
        if self.layout.is_transposed(name) {
            shape.reverse();
        }
        Some(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::is_permutation;

    #[test]
    fn a_permutation_holds_each_row_once() {
        assert!(is_permutation(&[2, 0, 1]));
        assert!(is_permutation(&[]));
        assert!(!is_permutation(&[0, 0, 1]), "a row twice");
        assert!(!is_permutation(&[0, 1, 3]), "a row past the end");
        assert!(!is_permutation(&[1, 2]), "a row missing");
    }
}
