//! Activation checkpointing (ZeRO-R): [`checkpoint`] runs a block's
//! forward keeping only its input; backward runs the block again and its
//! backward at once.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use zero_candle::{checkpoint, nn, recompute};
//!
//! # fn main() -> candle_core::Result<()> {
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let fc = nn::linear(8, 8, vb.pp("fc"), None)?;
//! let x = candle_core::Var::ones((2, 8), DType::F32, &Device::Cpu)?;
//! // Only `x` is kept for backward; `fc`'s output and tanh are recomputed.
//! let y = checkpoint("block", x.as_tensor(), move |x| fc.forward(x)?.tanh())?;
//! let mut grads = y.sum_all()?.backward()?;
//! recompute::merge_pending(&mut grads)?; // fc's gradients (no hook here)
//! # assert!(grads.get(x.as_tensor()).is_some());
//! # Ok(())
//! # }
//! ```
//!
//! The recomputed forward is the same code on the same values, so the
//! gradients are the plain forward's, bitwise. A layer built with a
//! `ZeroHook` hands its parameter gradients to the engine during the
//! recomputed backward, as it would without checkpointing, and the hook
//! predicts them at the block's place in the gradient order (overlap keeps
//! working); at stage 3 the recompute gathers the block's parameters again.
//! Gradients of other variables inside a block (plain Candle ops) cannot
//! leave a custom op's backward: they are kept per thread and added to the
//! `GradStore` by [`merge_pending`], which `ZeroOptimizer::backward_step`
//! calls for you.
//!
//! The block must compute the same values when run again: random ops
//! (dropout) or state that changes between forward and backward make the
//! recomputed output differ from the first, and backward fails with an
//! error naming the block rather than computing wrong gradients.

use crate::nn::{vars_behind, Behind};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, TensorId,
    Var,
};
use std::cell::RefCell;
use std::sync::{Arc, Mutex, PoisonError};

/// A block's forward.
type Block = dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync;

thread_local! {
    /// Gradients of variables inside checkpointed blocks that backward
    /// computed on this thread and no hook took, for [`merge_pending`].
    static PENDING: RefCell<Vec<(TensorId, Tensor)>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f(x)` without keeping what it computes for backward: only `x`
/// (and the output) stay alive; in backward `f` runs again on `x` and its
/// backward follows at once. `name` names the block in errors.
///
/// If `x` carries no gradient (a model input), the block's parameters
/// could get none through a checkpoint: `f(x)` then runs as a plain call.
pub fn checkpoint<F>(name: &str, x: &Tensor, f: F) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    if !x.track_op() {
        return f(x);
    }
    // The first forward, on a detached input: its graph (every
    // intermediate) goes when `y` does, right here.
    let y = f(&x.detach())?;
    // Its variables in backward order, those behind ops inside it (a
    // mixture's experts) included.
    let mut vars: Vec<TensorId> = Vec::new();
    for node in y.sorted_nodes() {
        match node.is_variable() {
            true => vars.push(node.id()),
            false => vars.extend(vars_behind(node.id()).iter().flat_map(|v| v.iter())),
        }
    }
    let output = y.detach().contiguous()?;
    drop(y);
    let op = Checkpointed {
        name: name.to_string(),
        f: Arc::new(f),
        output: Mutex::new(Some(output)),
        vars: Arc::new(vars),
        behind: Arc::default(),
    };
    let (vars, behind) = (op.vars.clone(), op.behind.clone());
    let out = x.apply_op1(op)?;
    behind.place(out.id(), vars);
    Ok(out)
}

/// Adds the gradients that checkpointed blocks' backward computed on this
/// thread for variables no hook took (plain ops inside a block) into
/// `grads`, and forgets them. Call it after `loss.backward()` when you run
/// backward yourself; `ZeroOptimizer::backward_step` does.
pub fn merge_pending(grads: &mut GradStore) -> Result<()> {
    for (id, grad) in PENDING.with(|p| std::mem::take(&mut *p.borrow_mut())) {
        let sum = match grads.get_id(id) {
            Some(before) => (before + grad)?,
            None => grad,
        };
        grads.insert_id(id, sum);
    }
    Ok(())
}

/// Forgets gradients left over by a backward pass that failed.
pub(crate) fn clear_pending() {
    PENDING.with(|p| p.borrow_mut().clear());
}

struct Checkpointed {
    name: String,
    f: Arc<Block>,
    /// The first forward's output, until the op's forward hands it over.
    output: Mutex<Option<Tensor>>,
    vars: Arc<Vec<TensorId>>,
    /// `vars` recorded behind the output, until the graph goes.
    behind: Arc<Behind>,
}

impl Checkpointed {
    /// The first forward's output (the op's forward runs once).
    fn take_output(&self) -> Result<Tensor> {
        self.output
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "checkpoint {:?}: internal: the forward ran twice",
                    self.name
                ))
            })
    }
}

impl CustomOp1 for Checkpointed {
    fn name(&self) -> &'static str {
        "zero-checkpoint"
    }

    fn cpu_fwd(&self, _storage: &CpuStorage, _layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let output = self.take_output()?;
        let (storage, layout) = output.storage_and_layout();
        match &*storage {
            Storage::Cpu(cpu) => Ok((cpu.try_clone(layout)?, output.shape().clone())),
            _ => candle_core::bail!("checkpoint {:?}: the block left the CPU", self.name),
        }
    }

    fn cuda_fwd(&self, _storage: &CudaStorage, _layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let output = self.take_output()?;
        let (storage, layout) = output.storage_and_layout();
        match &*storage {
            Storage::Cuda(cuda) => Ok((cuda.try_clone(layout)?, output.shape().clone())),
            _ => candle_core::bail!("checkpoint {:?}: the block left the GPU", self.name),
        }
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let x = Var::from_tensor(&arg.detach())?;
        let y = (self.f)(x.as_tensor())?;
        if y.shape() != res.shape() || differs(&y, res)? {
            candle_core::bail!(
                "checkpoint {:?}: running the block again in backward gave other values than its \
                 forward (a random op such as dropout, or state that changed between forward and \
                 backward); a checkpointed block must compute the same function of its input",
                self.name
            )
        }
        // The block's backward gets the gradient it would have got without
        // the checkpoint, `g` itself, from an op whose backward hands it
        // over (no product with `y`, no sum, no ones).
        let grads = y.apply_op1(Seed(grad_res.detach()))?.backward()?;
        PENDING.with(|pending| {
            let mut pending = pending.borrow_mut();
            for &id in self.vars.iter() {
                if let Some(grad) = grads.get_id(id) {
                    pending.push((id, grad.clone()));
                }
            }
        });
        Ok(grads.get(x.as_tensor()).cloned())
    }
}

/// A scalar over `y` whose backward gives `y` the gradient `g`: the seed
/// of the recomputed block's backward.
struct Seed(Tensor);

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "zero-checkpoint-seed"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, _layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let zero = storage
            .device()
            .zeros_impl(&Shape::from(()), storage.dtype())?;
        Ok((zero, Shape::from(())))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, _layout: &Layout) -> Result<(CudaStorage, Shape)> {
        let zero = storage
            .device()
            .zeros_impl(&Shape::from(()), storage.dtype())?;
        Ok((zero, Shape::from(())))
    }

    fn bwd(&self, _y: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

/// Whether `a` and `b` differ anywhere (NaN in the same place in both
/// counts as equal: a step that overflowed recomputes its NaN).
fn differs(a: &Tensor, b: &Tensor) -> Result<bool> {
    if let Some(differ) = f32_differs(a, b) {
        return Ok(differ);
    }
    let count = |t: Tensor| -> Result<f64> {
        t.to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()
            .map(f64::from)
    };
    let unequal = count(a.ne(b)?)?;
    if unequal == 0.0 {
        return Ok(false);
    }
    // NaN != NaN: positions where both are NaN.
    let both_nan = count((a.ne(a)? * b.ne(b)?)?)?;
    Ok(unequal > both_nan)
}

/// [`differs`] over contiguous f32 CPU tensors, read in place (no mask);
/// `None` for others.
fn f32_differs(a: &Tensor, b: &Tensor) -> Option<bool> {
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(va)), Storage::Cpu(CpuStorage::F32(vb))) = (&*sa, &*sb)
    else {
        return None;
    };
    let ((a0, a1), (b0, b1)) = (la.contiguous_offsets()?, lb.contiguous_offsets()?);
    let (va, vb) = (&va[a0..a1], &vb[b0..b1]);
    Some(
        va.len() != vb.len()
            || va
                .iter()
                .zip(vb)
                .any(|(x, y)| x != y && !(x.is_nan() && y.is_nan())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Read in place (f32, CPU, views included) or through tensor ops,
    /// the same answer: equal values, NaN where both have one, agree; any
    /// other difference does not.
    #[test]
    fn differs_counts_nan_in_the_same_place_as_equal() {
        let t = |v: &[f32]| Tensor::new(v, &Device::Cpu).unwrap();
        let nan = f32::NAN;
        let cases = [
            (t(&[1.0, 2.0, nan]), t(&[1.0, 2.0, nan]), false),
            (t(&[1.0, 2.0, 3.0]), t(&[1.0, 2.5, 3.0]), true),
            (t(&[1.0, nan, 3.0]), t(&[1.0, 2.0, 3.0]), true),
            (
                t(&[0.0, 7.0, 1.0, 2.0]).narrow(0, 2, 2).unwrap(),
                t(&[1.0, 2.0]),
                false,
            ),
        ];
        for (a, b, expected) in cases {
            assert_eq!(differs(&a, &b).unwrap(), expected, "{a} {b}");
            let (a64, b64) = (
                a.to_dtype(DType::F64).unwrap(),
                b.to_dtype(DType::F64).unwrap(),
            );
            assert_eq!(f32_differs(&a64, &b64), None);
            assert_eq!(differs(&a64, &b64).unwrap(), expected, "f64: {a} {b}");
        }
    }
}
