//! The workspace's Candle (`vendor/candle-core`, see `vendor/README.md`) keeps
//! a tensor's first gradient as computed instead of adding it to a zeroed
//! tensor, and still sums every gradient of a tensor used more than once,
//! subtractions included. A first gradient kept as computed may be a view
//! into a larger one (rows of a concatenation's gradient): the fused ops'
//! backward reads it from where it starts.

use candle_core::{
    CpuStorage, CustomOp1, DType, Device, Layout, Module, Result, Shape, Tensor, Var,
};
use rand::{rngs::StdRng, Rng, SeedableRng};
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

/// Seeded values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

/// The gradients of two inputs of `op` when its two outputs are stacked
/// along rows before the loss (so the second output's gradient is a view
/// starting past the first's rows) and when each output has a loss of its
/// own: the same values either way.
fn expect_offset_gradients_reach(
    what: &str,
    rows: usize,
    width: usize,
    op: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<()> {
    let device = Device::Cpu;
    let a = Var::from_vec(values(rows * width, 1), (rows, width), &device)?;
    let b = Var::from_vec(values(rows * width, 2), (rows, width), &device)?;
    let (ya, yb) = (op(a.as_tensor())?, op(b.as_tensor())?);
    let (out_rows, out_width) = ya.dims2()?;
    let wa = Tensor::from_vec(
        values(out_rows * out_width, 3),
        (out_rows, out_width),
        &device,
    )?;
    let wb = Tensor::from_vec(
        values(out_rows * out_width, 4),
        (out_rows, out_width),
        &device,
    )?;

    let stacked = Tensor::cat(&[&ya, &yb], 0)?;
    let grads = stacked
        .mul(&Tensor::cat(&[&wa, &wb], 0)?)?
        .sum_all()?
        .backward()?;
    let separate = ya
        .mul(&wa)?
        .sum_all()?
        .add(&yb.mul(&wb)?.sum_all()?)?
        .backward()?;
    for (name, x) in [("first", &a), ("second", &b)] {
        let through_cat = grads
            .get(x)
            .expect("a gradient")
            .flatten_all()?
            .to_vec1::<f32>()?;
        let alone = separate
            .get(x)
            .expect("a gradient")
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(through_cat, alone, "{what}: the {name} input's gradient");
    }
    Ok(())
}

#[test]
fn the_fused_ops_take_an_output_gradient_that_starts_inside_a_larger_one() -> Result<()> {
    use zero_candle::nn::ops::{causal_self_attention_rows, gelu, silu, swiglu};
    use zero_candle::nn::{Linear, RmsNorm};
    let device = Device::Cpu;
    let (rows, width) = (6, 8);
    expect_offset_gradients_reach("gelu", rows, width, gelu)?;
    expect_offset_gradients_reach("silu", rows, width, silu)?;
    expect_offset_gradients_reach("swiglu", rows, width, |x| swiglu(x, &x.affine(0.5, 0.1)?))?;
    // Two sequences of three positions, two heads of 4 over a packed qkv.
    expect_offset_gradients_reach("attention", rows, 3 * width, |qkv| {
        causal_self_attention_rows(qkv, 3, 2)
    })?;
    let weight = Tensor::from_vec(values(width, 5), width, &device)?;
    let norm = RmsNorm::new(weight, 1e-5, None);
    expect_offset_gradients_reach("rms_norm", rows, width, |x| norm.forward(x))?;
    let w = Tensor::from_vec(values(5 * width, 6), (5, width), &device)?;
    let bias = Tensor::from_vec(values(5, 7), 5, &device)?;
    let linear = Linear::new(w, Some(bias), None);
    expect_offset_gradients_reach("linear", rows, width, |x| linear.forward(x))?;
    Ok(())
}
