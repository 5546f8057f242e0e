//! 16-bit Candle models: bf16/f16 variables trained by an f32 engine
//! (master weights), through the hook and through the `GradStore`, with
//! dynamic loss scaling for f16; and without master weights.

mod nn_support;

use candle_core::{DType, Device, Module, Tensor, WithDType};
use candle_nn::{VarBuilder, VarMap};
use std::sync::Arc;
use zero_candle::nn::{self, GradHook};
use zero_candle::{CandleMemory, ZeroHook, ZeroOptimizer};
use zero_core::engine::{DynamicLossScale, EngineConfig, LossScale, Overlap, Stage, StepReport};
use zero_core::optim::{AdamW, AdamWConfig};
use zero_core::{Communicator, Element, ThreadComm, ThreadGroup};

const STEPS: usize = 8;

/// A dynamic loss scale starting at 2^8: at GradScaler's 2^16 this small
/// model's first steps overflow f16 and are skipped (as they would be in
/// torch) until the scale has backed off.
fn scale_from_256() -> LossScale {
    LossScale::Dynamic(DynamicLossScale {
        init_scale: 256.0,
        ..DynamicLossScale::default()
    })
}

/// This rank's batch at `step`: inputs `[8, 6]` (model dtype) and targets
/// `[8, 3]` (f32). `blow_up` multiplies the inputs by 1000 (overflows f16
/// gradients at the default loss scale).
fn batch(step: usize, rank: usize, dtype: DType, blow_up: bool) -> (Tensor, Tensor) {
    let x = nn_support::data((step * 10 + rank) as u64, &[8, 6], DType::F32);
    let x = if blow_up { (x * 1000.0).unwrap() } else { x };
    let y = nn_support::data((step * 10 + rank + 500) as u64, &[8, 3], DType::F32);
    (x.to_dtype(dtype).unwrap(), y)
}

struct Run {
    /// Per rank: the weights (as f64) after every step, and the reports.
    weights: Vec<Vec<Vec<f64>>>,
    reports: Vec<Vec<Option<StepReport>>>,
    losses: Vec<Vec<f64>>,
}

/// Trains Linear(6, 16), ReLU, Linear(16, 3) of `dtype` on two ranks at
/// stage 2 with an engine of element type `T`; the loss (MSE) is computed
/// in f32, as autocast would. `blow_up`: (step, rank) whose inputs overflow.
fn train<T>(
    dtype: DType,
    hooked: bool,
    loss_scale: LossScale,
    blow_up: Option<(usize, usize)>,
) -> Run
where
    T: Element + WithDType + zero_core::optim::Float,
    <ThreadComm as Communicator>::Memory: CandleMemory<T, ThreadComm>,
{
    train_with::<T>(dtype, hooked, loss_scale, blow_up, Overlap::default())
}

/// Sets every variable of `varmap` to seeded values of `dtype`, in name
/// order.
fn seed(varmap: &VarMap, dtype: DType) -> candle_core::Result<()> {
    let data = varmap.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        var.set(&nn_support::data(100 + i as u64, var.dims(), dtype))?;
    }
    Ok(())
}

/// [`train`] with an overlap schedule.
fn train_with<T>(
    dtype: DType,
    hooked: bool,
    loss_scale: LossScale,
    blow_up: Option<(usize, usize)>,
    overlap: Overlap,
) -> Run
where
    T: Element + WithDType + zero_core::optim::Float,
    <ThreadComm as Communicator>::Memory: CandleMemory<T, ThreadComm>,
{
    let out = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<_> {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
        let hook = ZeroHook::<ThreadComm, T>::new();
        let as_hook: Option<Arc<dyn GradHook>> = hooked.then(|| hook.clone() as Arc<dyn GradHook>);
        let l1 = nn::linear(6, 16, vb.pp("l1"), as_hook.clone())?;
        let l2 = nn::linear(16, 3, vb.pp("l2"), as_hook)?;
        seed(&varmap, dtype)?;
        let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
        let config = EngineConfig::default()
            .with_stage(Stage::Gradients)
            .with_loss_scale(loss_scale)
            .with_overlap(overlap);
        let mut opt = ZeroOptimizer::<ThreadComm, T>::new(&varmap, comm, config, Box::new(adamw))?;
        if hooked {
            opt = opt.with_hook(&hook)?;
        }
        let (mut weights, mut reports, mut losses) = (Vec::new(), Vec::new(), Vec::new());
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, dtype, blow_up == Some((step, rank)));
            let out = l2.forward(&l1.forward(&x)?.relu()?)?;
            let loss = out.to_dtype(DType::F32)?.sub(&y)?.sqr()?.mean_all()?;
            losses.push(loss.to_scalar::<f32>()? as f64);
            reports.push(opt.backward_step(&loss)?);
            let mut all = Vec::new();
            for var in opt.vars() {
                assert_eq!(var.dtype(), dtype, "variables keep the model's dtype");
                all.extend(nn_support::values(var.as_tensor()));
            }
            weights.push(all);
        }
        Ok((weights, reports, losses))
    });
    let mut run = Run {
        weights: Vec::new(),
        reports: Vec::new(),
        losses: Vec::new(),
    };
    for (rank, r) in out.into_iter().enumerate() {
        let (w, rep, l) = match r {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("rank {rank} failed: {e}"),
            Err(e) => panic!("rank {rank}: {e}"),
        };
        run.weights.push(w);
        run.reports.push(rep);
        run.losses.push(l);
    }
    run
}

#[test]
fn bf16_model_with_f32_masters_trains_alike_through_the_hook_and_the_grad_store() {
    let hooked = train::<f32>(DType::BF16, true, LossScale::None, None);
    let plain = train::<f32>(DType::BF16, false, LossScale::None, None);
    assert_eq!(hooked.weights, plain.weights, "hooked and GradStore paths");
    assert_eq!(hooked.weights[0], hooked.weights[1], "ranks agree");
    let first: f64 = hooked.losses.iter().map(|l| l[0]).sum();
    let last: f64 = hooked.losses.iter().map(|l| l[STEPS - 1]).sum();
    assert!(last < first, "the loss falls: {first} -> {last}");
}

#[test]
fn master_weights_step_alike_under_every_overlap_schedule() {
    // The interleaved schedule steps buckets during backward: the masters
    // must not be re-read from the bf16 replica there either.
    let after = train::<f32>(DType::BF16, true, LossScale::None, None);
    for overlap in [Overlap::None, Overlap::Interleaved] {
        let run = train_with::<f32>(DType::BF16, true, LossScale::None, None, overlap);
        assert_eq!(run.weights, after.weights, "{overlap:?}");
    }
}

#[test]
fn loss_scaling_with_the_interleaved_schedule_is_an_error_at_construction() {
    let out = ThreadGroup::new(1).run(|comm| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F16, &Device::Cpu);
        let _layer = candle_nn::linear(2, 2, vb.pp("l")).unwrap();
        let adamw = AdamW::new(AdamWConfig::default()).unwrap();
        let config = EngineConfig::default()
            .with_loss_scale(LossScale::dynamic())
            .with_overlap(Overlap::Interleaved);
        ZeroOptimizer::<ThreadComm, f32>::new(&varmap, comm, config, Box::new(adamw)).map(|_| ())
    });
    match &out[0] {
        Ok(Err(zero_candle::Error::Zero(zero_core::Error::Config(message)))) => {
            assert!(message.contains("after-backward"), "{message}");
        }
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn f16_model_with_dynamic_loss_scale_skips_an_overflowing_step_on_every_rank() {
    // Rank 1's inputs at step 3 are 1000x larger: its f16 gradients
    // overflow. Every rank skips that step (weights unchanged), the scale
    // halves, and training goes on.
    let run = train::<f32>(DType::F16, true, scale_from_256(), Some((3, 1)));
    for rank in 0..2 {
        let reports: Vec<StepReport> = run.reports[rank].iter().map(|r| r.unwrap()).collect();
        for (step, report) in reports.iter().enumerate() {
            assert_eq!(report.skipped, step == 3, "rank {rank} step {step}");
            let want = if step <= 3 { 256.0 } else { 128.0 };
            assert_eq!(report.loss_scale, Some(want), "rank {rank} step {step}");
        }
        assert_eq!(
            run.weights[rank][3], run.weights[rank][2],
            "rank {rank}: skipped step"
        );
        assert_ne!(
            run.weights[rank][4], run.weights[rank][3],
            "rank {rank}: next step"
        );
    }
    assert_eq!(run.weights[0], run.weights[1], "ranks agree");
}

#[test]
fn f16_model_with_f32_masters_follows_the_f32_model() {
    let f16 = train::<f32>(DType::F16, true, scale_from_256(), None);
    assert!(f16.reports[0].iter().all(|r| !r.unwrap().skipped));
    let f32 = train::<f32>(DType::F32, true, LossScale::None, None);
    for (a, b) in f16.weights[0][STEPS - 1]
        .iter()
        .zip(&f32.weights[0][STEPS - 1])
    {
        assert!((a - b).abs() < 2e-2, "f16 {a} vs f32 {b}");
    }
}

#[test]
fn the_default_scale_backs_off_until_f16_gradients_fit() {
    // GradScaler's 2^16 overflows this model's f16 gradients at first: the
    // scale halves on each skipped step until they fit, then training runs.
    let run = train::<f32>(DType::F16, true, LossScale::dynamic(), None);
    let reports: Vec<StepReport> = run.reports[0].iter().map(|r| r.unwrap()).collect();
    let skipped = reports.iter().take_while(|r| r.skipped).count();
    assert!(skipped > 0 && skipped < STEPS, "{skipped} steps skipped");
    for (k, report) in reports.iter().enumerate().take(skipped + 1) {
        assert_eq!(report.loss_scale, Some(65536.0 / f64::from(1 << k)));
    }
    assert!(reports[skipped..].iter().all(|r| !r.skipped));
    assert_ne!(run.weights[0][STEPS - 1], run.weights[0][0]);
}

#[test]
fn bf16_model_without_master_weights_still_trains() {
    let run = train::<half::bf16>(DType::BF16, true, LossScale::None, None);
    let first: f64 = run.losses.iter().map(|l| l[0]).sum();
    let last: f64 = run.losses.iter().map(|l| l[STEPS - 1]).sum();
    assert!(last < first, "the loss falls: {first} -> {last}");
}

#[test]
fn an_engine_narrower_than_the_variables_is_an_error_at_construction() {
    let out = ThreadGroup::new(1).run(|comm| {
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
        let _layer = candle_nn::linear(2, 2, vb.pp("l")).unwrap();
        let adamw = AdamW::new(AdamWConfig::default()).unwrap();
        ZeroOptimizer::<ThreadComm, half::bf16>::new(
            &varmap,
            comm,
            EngineConfig::default(),
            Box::new(adamw),
        )
        .map(|_| ())
    });
    match &out[0] {
        Ok(Err(zero_candle::Error::Zero(zero_core::Error::ParamDType {
            param, engine, ..
        }))) => {
            assert_eq!(*param, zero_core::DType::F32);
            assert_eq!(*engine, zero_core::DType::BF16);
        }
        other => panic!("expected a ParamDType error, got {other:?}"),
    }
}

/// The full weights after each step of a 16-bit model under an f32
/// engine at `stage` (persistence 0: at stage 3 every weight and bias is
/// sharded after the first step, gathered in pieces of `gather_bytes`
/// when it is larger), and the gathers made.
fn full_weights_per_step(dtype: DType, stage: Stage, gather_bytes: usize) -> (Vec<Vec<f64>>, u64) {
    let out = ThreadGroup::new(2).run(|comm| -> zero_candle::Result<_> {
        let rank = comm.rank();
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
        let hook = ZeroHook::<ThreadComm, f32>::new();
        let as_hook: Option<Arc<dyn GradHook>> = Some(hook.clone());
        let l1 = nn::linear(6, 16, vb.pp("l1"), as_hook.clone())?;
        let l2 = nn::linear(16, 3, vb.pp("l2"), as_hook)?;
        seed(&varmap, dtype)?;
        let adamw = AdamW::new(AdamWConfig::default().with_lr(1e-2))?;
        let config = EngineConfig::default()
            .with_stage(stage)
            .with_persist_numel(0)
            .with_bucket_bytes(64)
            .with_gather_bytes(gather_bytes);
        let mut opt =
            ZeroOptimizer::<ThreadComm, f32>::new(&varmap, comm, config, Box::new(adamw))?
                .with_hook(&hook)?;
        let mut weights = Vec::new();
        for step in 0..STEPS {
            let (x, y) = batch(step, rank, dtype, false);
            let out = l2.forward(&l1.forward(&x)?.relu()?)?;
            opt.backward_step(&out.to_dtype(DType::F32)?.sub(&y)?.sqr()?.mean_all()?)?;
            let mut all = Vec::new();
            for (_, w) in opt.full_weights()? {
                assert_eq!(w.dtype(), dtype, "full weights in the model's dtype");
                all.extend(nn_support::values(&w));
            }
            weights.push(all);
        }
        let gathers = opt.fetch_stats().map_or(0, |s| s.gathers.iter().sum());
        Ok((weights, gathers))
    });
    let mut runs = out
        .into_iter()
        .map(|r| r.expect("no panic").expect("training works"));
    let (first, gathers) = runs.next().expect("two ranks");
    for (other, _) in runs {
        assert_eq!(other, first, "ranks agree");
    }
    (first, gathers)
}

#[test]
fn stage_3_over_a_16_bit_model_with_f32_masters_trains_the_weights_of_stage_2() {
    // Stage 3 gathers the f32 masters and rounds them to the model's dtype
    // on use, the values stage 2's write-back gives its replica: the same
    // arithmetic, so the same bits.
    for dtype in [DType::BF16, DType::F16] {
        let (stage2, _) = full_weights_per_step(dtype, Stage::Gradients, 1 << 20);
        let (stage3, gathers) = full_weights_per_step(dtype, Stage::Parameters, 1 << 20);
        assert!(gathers > 0, "{dtype:?}: stage 3 sharded and gathered");
        assert_eq!(stage3, stage2, "{dtype:?}: stage 3 against stage 2");
    }
}

#[test]
fn stage_3_in_pieces_over_a_16_bit_model_with_f32_masters_follows_stage_2() {
    // 24-byte pieces: 3 masters of each rank's chunk, so every row of l1
    // (6 wide) and l2 (16 wide) is put together from stretches, each
    // rounded to the model's dtype as it is lent. Split rows are summed in
    // f32 in another order than stage 2's matmul, so an activation may
    // differ in its last bit; AdamW's first steps move a weight by about lr
    // whatever its gradient's size, so a near-zero gradient element whose
    // sign that flips moves its weight the other way. Measured over the 8
    // steps: at most 4 of 163 weights more than one 16-bit ulp from stage
    // 2's, none by more than 0.008. A wrong or missing piece gives wrong
    // activations and most weights would move apart by a step (1e-2).
    for (dtype, mantissa_bits) in [(DType::BF16, 7), (DType::F16, 10)] {
        let (stage2, _) = full_weights_per_step(dtype, Stage::Gradients, 1 << 20);
        let (stage3, gathers) = full_weights_per_step(dtype, Stage::Parameters, 24);
        assert!(gathers > 0, "{dtype:?}: stage 3 sharded and gathered");
        for (step, (a, b)) in stage2.iter().zip(&stage3).enumerate() {
            let ulp = |x: f64, y: f64| {
                let size = x.abs().max(y.abs()).max(1.0 / 64.0);
                2f64.powi(size.log2().floor() as i32 - mantissa_bits)
            };
            let apart = a
                .iter()
                .zip(b)
                .filter(|&(x, y)| (x - y).abs() > ulp(*x, *y))
                .count();
            let most = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(
                apart * 20 <= a.len() && most < 0.02,
                "{dtype:?} step {step}: {apart} of {} weights more than an ulp from stage 2's, \
                 {most} at most",
                a.len()
            );
        }
    }
}
