//! Weights files written from the optimizer's variables, one tensor at a
//! time: the one writer behind `save_weights` and `save_hub`.

use super::{lent, ZeroOptimizer};
use crate::memory::{candle_dtype, CandleMemory};
use crate::{Error, Result};
use candle_core::{Tensor, WithDType};
use std::path::PathBuf;
use zero_core::checkpoint::TensorWriter;
use zero_core::{Communicator, DType, Element};

/// A safetensors file to write: its path and its tensors.
pub(crate) struct WeightsFile<'a> {
    pub(crate) path: PathBuf,
    pub(crate) tensors: Vec<SavedTensor<'a>>,
}

/// One tensor of a [`WeightsFile`]: its name, dtype and shape in the file,
/// and where its values come from.
pub(crate) struct SavedTensor<'a> {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) from: Saved<'a>,
}

/// How a variable's values are arranged in its tensor of a file (a
/// [`HubLayout`](crate::hub::HubLayout) says, for a hub checkpoint).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Arrangement {
    /// As the variable holds them.
    #[default]
    AsIs,
    /// A 2-d variable `[a, b]` stored `[b, a]`.
    Transposed,
    /// The variable viewed as `rows.len()` rows of equal length: its row
    /// `r` is the tensor's row `rows[r]` (GLM's queries and keys, whose
    /// rotated pairs the checkpoint interleaves and the model holds as
    /// halves).
    RowsPermuted(std::sync::Arc<[usize]>),
}

/// Where a saved tensor's values come from.
pub(crate) enum Saved<'a> {
    /// Variable `index`'s full values, rounded to the file's dtype and
    /// arranged as the file holds them.
    Var {
        index: usize,
        arrangement: Arrangement,
    },
    /// These bytes, as they are (a tensor the model does not train,
    /// borrowed from the file it was read from).
    Bytes(&'a [u8]),
    /// These variables' values one after another, each arranged as
    /// `arrangement` says (a mixture's experts fused in one tensor); their
    /// indices consecutive.
    Vars {
        indices: Vec<usize>,
        arrangement: Arrangement,
    },
}

impl<C, T> ZeroOptimizer<C, T>
where
    C: Communicator + 'static,
    T: Element + WithDType,
    C::Memory: CandleMemory<T, C>,
{
    /// Writes `files`: rank 0 writes, each file whole or not at all
    /// (written beside its path, then moved). The variables are visited in
    /// collective order; at stage 3 each sharded one is gathered and
    /// written (streamed when it goes to one tensor as it is, else held
    /// whole on rank 0 for that tensor only) before the next. A collective:
    /// every rank calls it with the same files, and gets the error if rank
    /// 0 cannot write.
    pub(crate) fn write_weights(&mut self, mut files: Vec<WeightsFile<'_>>) -> Result<()> {
        self.engine().refresh().wait_all()?;
        // In each file, the variables' tensors in collective order, then the
        // copied bytes: the order the loop below produces them in.
        for file in &mut files {
            file.tensors.sort_by_key(|t| match &t.from {
                Saved::Var { index, .. } => *index,
                Saved::Vars { indices, .. } => indices.first().copied().unwrap_or(usize::MAX),
                Saved::Bytes(_) => usize::MAX,
            });
        }
        let mut destinations: Vec<Vec<(usize, usize)>> = vec![Vec::new(); self.vars.len()];
        for (f, file) in files.iter().enumerate() {
            for (t, tensor) in file.tensors.iter().enumerate() {
                let indices = match &tensor.from {
                    Saved::Var { index, .. } => vec![*index],
                    Saved::Vars { indices, .. } => {
                        // Written as the variables are visited: one after
                        // another, with no other tensor's between them.
                        let first = indices.first().copied().unwrap_or(0);
                        if indices
                            .iter()
                            .enumerate()
                            .any(|(i, &index)| index != first + i)
                        {
                            return Err(Error::Variable {
                                name: tensor.name.clone(),
                                detail: "holds variables whose names do not sort one after \
                                         another (a fused tensor's parts must be consecutive in \
                                         the engine's order, by name)"
                                    .into(),
                            });
                        }
                        indices.clone()
                    }
                    Saved::Bytes(_) => Vec::new(),
                };
                for index in indices {
                    let Some(slot) = destinations.get_mut(index) else {
                        return Err(Error::Variable {
                            name: tensor.name.clone(),
                            detail: format!("internal: variable #{index} does not exist"),
                        });
                    };
                    slot.push((f, t));
                }
            }
        }
        let rank = self.engine().comm().rank();
        // Rank 0's first failure; it keeps taking part in the gathers.
        let mut failure: Option<Error> = None;
        let mut writers: Vec<Option<TensorWriter>> = Vec::new();
        if rank == 0 {
            for file in &files {
                let header: Vec<_> = file
                    .tensors
                    .iter()
                    .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
                    .collect();
                match TensorWriter::create(&file.path, &header) {
                    Ok(w) => writers.push(Some(w)),
                    Err(e) => {
                        failure.get_or_insert(e.into());
                        writers.push(None);
                    }
                }
            }
        }
        let fetcher = self.hook.as_ref().and_then(|h| h.fetcher());
        for (index, places) in destinations.iter().enumerate() {
            if places.is_empty() {
                continue;
            }
            let var = &self.vars[index];
            let dims = var.dims().to_vec();
            let tensor = |&(f, t): &(usize, usize)| &files[f].tensors[t];
            let as_is = |place| {
                matches!(
                    tensor(place).from,
                    Saved::Var {
                        arrangement: Arrangement::AsIs,
                        ..
                    } | Saved::Vars {
                        arrangement: Arrangement::AsIs,
                        ..
                    }
                )
            };
            let sharded = fetcher.as_ref().is_some_and(|f| f.is_sharded(index));
            let whole = if !sharded {
                Some(var.as_tensor().clone())
            } else if places.len() == 1 && as_is(&places[0]) {
                // Piece by piece from the shards, in the tensor's order.
                let (f, t) = places[0];
                let dtype = candle_dtype(files[f].tensors[t].dtype);
                let engine = lent(&mut self.engine);
                C::Memory::stream_params(engine, &[index], 0, &mut |_, _, values| {
                    if let Some(w) = writers.get_mut(f).and_then(Option::as_mut) {
                        let written = values_as_bytes(values, dtype)
                            .map_err(|e| zero_core::Error::State(e.to_string()))
                            .and_then(|bytes| w.write(&bytes));
                        if let Err(e) = written {
                            failure.get_or_insert(e.into());
                            writers[f] = None;
                        }
                    }
                    Ok(())
                })?;
                None
            } else {
                // Gathered whole on rank 0, for this tensor only.
                let mut values = Vec::new();
                let engine = lent(&mut self.engine);
                C::Memory::stream_params(engine, &[index], 0, &mut |_, _, piece: &[T]| {
                    if rank == 0 {
                        values.extend_from_slice(piece);
                    }
                    Ok(())
                })?;
                (rank == 0)
                    .then(|| Tensor::from_vec(values, dims.as_slice(), &candle_core::Device::Cpu))
                    .transpose()?
            };
            let Some(whole) = whole.filter(|_| rank == 0) else {
                continue;
            };
            for &(f, t) in places {
                let Some(w) = writers[f].as_mut() else {
                    continue;
                };
                let saved = &files[f].tensors[t];
                let written = saved_bytes(&whole, saved).and_then(|b| Ok(w.write(&b)?));
                if let Err(e) = written {
                    failure.get_or_insert(e);
                    writers[f] = None;
                }
            }
        }
        for (file, writer) in files.iter().zip(writers) {
            let Some(mut w) = writer else {
                continue;
            };
            let copied = file.tensors.iter().try_for_each(|t| match &t.from {
                Saved::Bytes(bytes) => w.write(bytes),
                Saved::Var { .. } | Saved::Vars { .. } => Ok(()),
            });
            if let Err(e) = copied.and_then(|()| w.finish().map(drop)) {
                failure.get_or_insert(e.into());
            }
        }
        let mut failed = [f32::from(u8::from(failure.is_some()))];
        self.engine_mut()
            .all_reduce_host(&mut failed[..], zero_core::ReduceOp::Max)?;
        match failure {
            Some(e) => Err(e),
            None if failed[0] > 0.0 => Err(Error::Zero(zero_core::Error::State(format!(
                "rank 0 could not write {}; see its error",
                files
                    .iter()
                    .map(|f| f.path.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))),
            None => Ok(()),
        }
    }
}

/// A variable's whole values as `saved`'s bytes: arranged as it asks,
/// rounded to its dtype.
fn saved_bytes(whole: &Tensor, saved: &SavedTensor<'_>) -> Result<Vec<u8>> {
    let arrangement = match &saved.from {
        Saved::Var { arrangement, .. } | Saved::Vars { arrangement, .. } => arrangement,
        Saved::Bytes(_) => &Arrangement::AsIs,
    };
    let tensor = match arrangement {
        Arrangement::Transposed => whole.t()?.contiguous()?,
        Arrangement::RowsPermuted(rows) => {
            // The file's row `rows[r]` is the variable's row `r`.
            let mut from = vec![0u32; rows.len()];
            for (r, &f) in rows.iter().enumerate() {
                from[f] = r as u32;
            }
            let from = Tensor::new(from.as_slice(), whole.device())?;
            let rows = (rows.len(), whole.elem_count() / rows.len().max(1));
            whole
                .reshape(rows)?
                .index_select(&from, 0)?
                .reshape(whole.shape())?
        }
        Arrangement::AsIs => whole.clone(),
    };
    let dtype = candle_dtype(saved.dtype);
    let fits = match &saved.from {
        // One part of several, of equal sizes.
        Saved::Vars { indices: parts, .. } => {
            tensor.elem_count() * parts.len() == saved.shape.iter().product::<usize>()
        }
        _ => tensor.dims() == saved.shape.as_slice(),
    };
    if !fits {
        return Err(Error::Variable {
            name: saved.name.clone(),
            detail: format!(
                "holds {:?}, the file announces {:?}",
                tensor.dims(),
                saved.shape
            ),
        });
    }
    tensor_bytes(&tensor.to_dtype(dtype)?)
}

/// A tensor's elements as little-endian bytes, row-major, in its dtype.
fn tensor_bytes(tensor: &Tensor) -> Result<Vec<u8>> {
    let flat = tensor.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
    Ok(match flat.dtype() {
        candle_core::DType::F32 => bytemuck::cast_slice(&flat.to_vec1::<f32>()?).to_vec(),
        candle_core::DType::F64 => bytemuck::cast_slice(&flat.to_vec1::<f64>()?).to_vec(),
        candle_core::DType::BF16 => bytemuck::cast_slice(&flat.to_vec1::<half::bf16>()?).to_vec(),
        candle_core::DType::F16 => bytemuck::cast_slice(&flat.to_vec1::<half::f16>()?).to_vec(),
        other => {
            return Err(Error::Variable {
                name: "<save_weights>".into(),
                detail: format!("a {other:?} tensor cannot be saved as weights"),
            })
        }
    })
}

/// Gathered values (in the engine's type) as bytes of `dtype`, rounded to
/// it (to nearest, ties to even) where narrower.
fn values_as_bytes<T: Element + WithDType>(
    values: &[T],
    dtype: candle_core::DType,
) -> Result<Vec<u8>> {
    if dtype == <T as WithDType>::DTYPE {
        return Ok(bytemuck::cast_slice(values).to_vec());
    }
    let tensor = Tensor::from_slice(values, values.len(), &candle_core::Device::Cpu)?;
    tensor_bytes(&tensor.to_dtype(dtype)?)
}
