//! Training data: a safetensors file or a synthetic classification task.

use crate::trainer::TrainError;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::path::Path;

/// Rows of inputs and integer class targets.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// Row-major `[rows, width]`.
    pub inputs: Vec<f32>,
    /// One class per row.
    pub targets: Vec<i64>,
    /// Input width.
    pub width: usize,
    /// Number of classes (largest target + 1).
    pub classes: usize,
}

impl Dataset {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.targets.len()
    }

    /// A learnable task: targets are the argmax of a fixed random linear map
    /// of the inputs, so a model can reach low loss.
    pub fn synthetic(seed: u64) -> Self {
        let (rows, width, classes) = (1024, 16, 4);
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_da7a);
        let teacher: Vec<f32> = (0..width * classes)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let inputs: Vec<f32> = (0..rows * width)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let targets = inputs
            .chunks(width)
            .map(|x| {
                (0..classes)
                    .map(|c| {
                        let w = &teacher[c * width..(c + 1) * width];
                        x.iter().zip(w).map(|(a, b)| a * b).sum::<f32>()
                    })
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (c, v)| {
                        if v > best.1 {
                            (c, v)
                        } else {
                            best
                        }
                    })
                    .0 as i64
            })
            .collect();
        Self {
            inputs,
            targets,
            width,
            classes,
        }
    }

    /// Loads `inputs` (f32 `[n, d]`) and `targets` (i64 `[n]`).
    pub fn load(path: &Path) -> Result<Self, TrainError> {
        let bad = |detail: String| TrainError::Data {
            path: path.to_path_buf(),
            detail,
        };
        if !path.is_file() {
            return Err(bad("cannot read: no such file".into()));
        }
        let tensors = candle_core::safetensors::load(path, &candle_core::Device::Cpu)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let inputs = tensors
            .get("inputs")
            .ok_or_else(|| bad("has no tensor named `inputs` (f32 [n, d])".into()))?;
        let targets = tensors
            .get("targets")
            .ok_or_else(|| bad("has no tensor named `targets` (i64 [n])".into()))?;
        let (rows, width) = match (inputs.dtype(), inputs.dims()) {
            (candle_core::DType::F32, &[rows, width]) => (rows, width),
            (dtype, dims) => {
                return Err(bad(format!(
                    "`inputs` is {dtype:?} {dims:?}; expected f32 [n, d]"
                )))
            }
        };
        let target_rows = match (targets.dtype(), targets.dims()) {
            (candle_core::DType::I64, &[n]) => n,
            (dtype, dims) => {
                return Err(bad(format!(
                    "`targets` is {dtype:?} {dims:?}; expected i64 [n]"
                )))
            }
        };
        if target_rows != rows || rows == 0 || width == 0 {
            return Err(bad(format!(
                "`inputs` has {rows} rows of width {width} and `targets` {target_rows} rows; \
                 they must agree and be non-empty"
            )));
        }
        let read = |e: candle_core::Error| bad(format!("cannot read its tensors: {e}"));
        let inputs = inputs
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(read)?;
        let targets = targets.to_vec1::<i64>().map_err(read)?;
        if let Some((row, t)) = targets.iter().enumerate().find(|(_, &t)| t < 0) {
            return Err(bad(format!(
                "`targets`[{row}] is {t}; classes must be >= 0"
            )));
        }
        let classes = targets.iter().copied().max().unwrap_or(0) as usize + 1;
        Ok(Self {
            inputs,
            targets,
            width,
            classes,
        })
    }

    /// The rows rank `rank` trains on at global micro-step `micro_step`:
    /// `(micro_step * W * B + rank * B + i) mod n` for `i < B`.
    pub fn batch(
        &self,
        micro_step: u64,
        world_size: usize,
        rank: usize,
        batch: usize,
    ) -> (Vec<f32>, Vec<i64>) {
        self.batch_at(
            micro_step * (world_size * batch) as u64,
            world_size,
            rank,
            batch,
        )
    }

    /// The rows rank `rank` trains on in the global micro-batch starting at
    /// row `first_row`: `(first_row + rank * B + i) mod n` for `i < B`.
    pub fn batch_at(
        &self,
        first_row: u64,
        world_size: usize,
        rank: usize,
        batch: usize,
    ) -> (Vec<f32>, Vec<i64>) {
        debug_assert!(rank < world_size);
        let n = self.rows() as u64;
        let first = first_row + (rank * batch) as u64;
        let mut x = Vec::with_capacity(batch * self.width);
        let mut y = Vec::with_capacity(batch);
        for i in 0..batch as u64 {
            let row = ((first + i) % n) as usize;
            x.extend_from_slice(&self.inputs[row * self.width..(row + 1) * self.width]);
            y.push(self.targets[row]);
        }
        (x, y)
    }
}
