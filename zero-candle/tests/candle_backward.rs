//! The workspace's Candle (`vendor/candle-core`, see its `PATCH.md`) keeps
//! a tensor's first gradient as computed instead of adding it to a zeroed
//! tensor, and still sums every gradient of a tensor used more than once,
//! subtractions included.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor, Var};
use std::sync::{Arc, Mutex};

/// Identity forward; backward returns three times the output's gradient
/// and remembers the tensor it returned.
struct Probe(Arc<Mutex<Option<Tensor>>>);

impl CustomOp1 for Probe {
    fn name(&self) -> &'static str {
        "probe"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(values) = storage else {
            candle_core::bail!("probe: f32 only");
        };
        let (start, end) = layout
            .contiguous_offsets()
            .expect("probe: a contiguous input");
        Ok((
            CpuStorage::F32(values[start..end].to_vec()),
            layout.shape().clone(),
        ))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let grad = grad_res.affine(3.0, 0.0)?;
        *self.0.lock().unwrap() = Some(grad.clone());
        Ok(Some(grad))
    }
}

#[test]
fn a_single_gradient_is_stored_as_computed() -> Result<()> {
    let x = Var::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
    let returned = Arc::new(Mutex::new(None));
    let y = x.apply_op1(Probe(returned.clone()))?;
    assert_eq!(y.to_vec1::<f32>()?, [1.0, 2.0, 3.0]);
    let grads = y.sum_all()?.backward()?;
    let returned = returned.lock().unwrap().clone().expect("backward ran");
    let stored = grads.get(&x).expect("x has a gradient");
    assert_eq!(stored.to_vec1::<f32>()?, [3.0, 3.0, 3.0]);
    // The very tensor the op's backward returned: Candle 0.11 as published
    // stores zeros + it, a new tensor.
    assert_eq!(stored.id(), returned.id());
    Ok(())
}

#[test]
fn a_broadcast_first_gradient_is_stored_contiguous() -> Result<()> {
    let x = Var::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu)?;
    let grads = x.sum_all()?.backward()?;
    let grad = grads.get(&x).expect("x has a gradient");
    assert!(grad.is_contiguous());
    assert_eq!(grad.to_vec2::<f32>()?, [[1.0, 1.0], [1.0, 1.0]]);
    Ok(())
}

#[test]
fn gradients_of_a_tensor_used_several_times_are_summed() -> Result<()> {
    let x = Var::new(&[1f32, -2.0], &Device::Cpu)?;
    let y = Var::new(&[0.5f32, 4.0], &Device::Cpu)?;
    // loss = sum((2x - x) + 3 (y - 2x)) = sum(-5x + 3y): x's gradients
    // arrive as the right side of two subtractions and through a product.
    let a = x.affine(2.0, 0.0)?;
    let b = a.sub(&x)?;
    let c = y.sub(&a)?.affine(3.0, 0.0)?;
    let loss = b.add(&c)?.sum_all()?;
    let grads = loss.backward()?;
    assert_eq!(grads.get(&x).unwrap().to_vec1::<f32>()?, [-5.0, -5.0]);
    assert_eq!(grads.get(&y).unwrap().to_vec1::<f32>()?, [3.0, 3.0]);

    // A tensor's only gradient from a subtraction's right side is negated.
    let grads = y.sub(&x)?.sum_all()?.backward()?;
    assert_eq!(grads.get(&x).unwrap().to_vec1::<f32>()?, [-1.0, -1.0]);
    assert_eq!(grads.get(&x).unwrap().dtype(), DType::F32);
    Ok(())
}
