//! 16-bit models on the GPU: bf16/f16 weights and gradients, with the
//! engine's f32 master weights, f32 optimizer state and f32 gradient
//! reduction in CUDA memory. The host engine (threads) is the reference:
//! it widens and rounds with the `half` crate.
//!
//! Needs a GPU and NVRTC: `#[ignore]`d, run with `-- --ignored` on a GPU
//! machine.

#![cfg(feature = "nccl")]

mod common;

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use zero_core::engine::{CastParams, EngineConfig, HostGrad, Stage};
use zero_core::optim::{Adam, AdamConfig, FunctionalOptimizer};
use zero_core::{DType, Element, Engine, ParamInfo, ThreadGroup};
use zero_nccl::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use zero_nccl::kernels::{FusedKernels, Half};
use zero_nccl::{cuda_engine, DeviceComm, DeviceView, NcclComm, ViewElement};

/// A 16-bit element type as both engines take it.
trait Sixteen: Element + ViewElement + Half {
    fn host(grad: &[Self]) -> HostGrad<'_, f32>;
    /// Its unit in the last place at `x`, relative: 2^-7 or 2^-10.
    const EPSILON: f32;
}

impl Sixteen for bf16 {
    fn host(grad: &[Self]) -> HostGrad<'_, f32> {
        HostGrad::Bf16(grad)
    }
    const EPSILON: f32 = 1.0 / 128.0;
}

impl Sixteen for f16 {
    fn host(grad: &[Self]) -> HostGrad<'_, f32> {
        HostGrad::F16(grad)
    }
    const EPSILON: f32 = 1.0 / 1024.0;
}

fn comm() -> NcclComm {
    common::nccl_comm()
}

fn params(dtype: DType) -> Vec<ParamInfo> {
    vec![
        ParamInfo::new("a.bias", vec![7], dtype),
        ParamInfo::new("a.weight", vec![7, 13], dtype),
        ParamInfo::new("b.weight", vec![300], dtype),
        ParamInfo::new("c.frozen", vec![5], dtype).with_trainable(false),
    ]
}

/// Per step, one gradient slot per parameter.
type StepGrads<H> = Vec<Vec<Option<Vec<H>>>>;

/// Initial weights and per-step gradients in `H`; parameter 2 has no
/// gradient on odd steps.
fn data<H: Sixteen>(steps: usize) -> (Vec<Vec<H>>, StepGrads<H>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let ps = params(H::DTYPE);
    let mut draw = |n: usize| -> Vec<H> {
        (0..n)
            .map(|_| H::from_f64(rng.gen_range(-1.0..1.0)))
            .collect()
    };
    let init = ps.iter().map(|p| draw(p.numel())).collect();
    let grads = (0..steps)
        .map(|s| {
            ps.iter()
                .enumerate()
                .map(|(i, p)| (!(i == 2 && s % 2 == 1)).then(|| draw(p.numel())))
                .collect()
        })
        .collect();
    (init, grads)
}

/// Adam with a learning rate small enough that most updates are below half
/// a 16-bit ulp: without f32 master weights they would be lost.
fn adam() -> Box<dyn FunctionalOptimizer<f32>> {
    Box::new(Adam::new(AdamConfig::default().with_lr(1e-3)).unwrap())
}

fn host_run<H: Sixteen>(config: &EngineConfig, steps: usize) -> Vec<Vec<H>> {
    let (init, grads) = data::<H>(steps);
    let mut out = ThreadGroup::new(1).run(|comm| {
        let mut engine = Engine::<f32, _>::new(comm, params(H::DTYPE), adam(), config.clone())?;
        let mut replica = CastParams(init.clone());
        for step in &grads {
            let slots: Vec<Option<HostGrad<'_, f32>>> =
                step.iter().map(|g| g.as_deref().map(H::host)).collect();
            engine.step(&slots, &mut replica)?;
        }
        Ok::<_, zero_core::Error>(replica.0)
    });
    out.remove(0).unwrap().unwrap()
}

/// The CUDA engine through `grads`, from `weights` on the GPU.
fn device_steps<H: Sixteen>(
    engine: &mut zero_nccl::CudaEngine,
    weights: &mut Vec<CudaSlice<H>>,
    grads: &[Vec<Option<Vec<H>>>],
) {
    let stream = engine.comm().compute_stream().clone();
    for step in grads {
        let device: Vec<Option<CudaSlice<H>>> = step
            .iter()
            .map(|g| g.as_ref().map(|g| stream.clone_htod(g).unwrap()))
            .collect();
        let slots: Vec<Option<DeviceView<'_>>> = device
            .iter()
            .map(|g| g.as_ref().map(|g| H::view(g)))
            .collect();
        engine.step(&slots, weights).unwrap();
    }
}

fn to_host<H: Sixteen>(comm: &NcclComm, weights: &[CudaSlice<H>]) -> Vec<Vec<H>> {
    let stream = comm.compute_stream();
    weights
        .iter()
        .map(|w| stream.clone_dtoh(w).unwrap())
        .collect()
}

fn device_run<H: Sixteen>(config: &EngineConfig, steps: usize) -> Vec<Vec<H>> {
    let (init, grads) = data::<H>(steps);
    let comm = comm();
    let stream = comm.compute_stream().clone();
    let mut engine = cuda_engine(comm, params(H::DTYPE), adam(), config.clone()).unwrap();
    let mut weights: Vec<CudaSlice<H>> =
        init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
    device_steps(&mut engine, &mut weights, &grads);
    to_host(engine.comm(), &weights)
}

/// Within one ulp of the 16-bit type: the fused kernels agree with the host
/// optimizer to f32 rounding, which can move a rounding to 16 bits by one.
fn assert_within_an_ulp<H: Sixteen>(device: &[Vec<H>], host: &[Vec<H>], what: &str) {
    let mut differing = 0;
    for (i, (d, h)) in device.iter().zip(host).enumerate() {
        for (j, (x, y)) in d.iter().zip(h).enumerate() {
            let (x, y) = (x.to_f64() as f32, y.to_f64() as f32);
            differing += usize::from(x != y);
            assert!(
                (x - y).abs() <= H::EPSILON * y.abs().max(1e-3),
                "{what}: parameter {i} element {j}: device {x}, host {y}"
            );
        }
    }
    let total: usize = host.iter().map(Vec::len).sum();
    assert!(
        differing * 100 <= total,
        "{what}: {differing} of {total} weights differ"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sixteen_bit_models_train_like_host_memory_at_stages_0_to_2() {
    fn check<H: Sixteen>() {
        for stage in [Stage::Ddp, Stage::OptimizerState, Stage::Gradients] {
            let config = EngineConfig::default()
                .with_stage(stage)
                .with_bucket_bytes(256);
            let host = host_run::<H>(&config, 8);
            let device = device_run::<H>(&config, 8);
            let what = format!("{:?} {stage:?}", H::DTYPE);
            assert_within_an_ulp(&device, &host, &what);
            // Adam's steps of 1e-3 are below half an ulp for every weight
            // above 0.25 in magnitude, three in four of them: without f32
            // master weights those never move. With them, most do.
            let (init, _) = data::<H>(0);
            let trainable: usize = init.iter().take(3).map(Vec::len).sum();
            let moved = device
                .iter()
                .zip(&init)
                .take(3)
                .flat_map(|(d, i)| d.iter().zip(i))
                .filter(|(d, i)| d != i)
                .count();
            assert!(
                2 * moved > trainable,
                "{what}: only {moved} of {trainable} weights moved"
            );
        }
    }
    check::<bf16>();
    check::<f16>();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn master_weights_on_the_gpu_survive_save_and_resume_bitwise() {
    let (init, grads) = data::<bf16>(8);
    let (first, second) = grads.split_at(4);
    let config = EngineConfig::default()
        .with_stage(Stage::Gradients)
        .with_bucket_bytes(256);
    let dir = std::env::temp_dir().join(format!("zero-nccl-bf16-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);

    let uninterrupted = {
        let comm = comm();
        let stream = comm.compute_stream().clone();
        let mut engine = cuda_engine(comm, params(DType::BF16), adam(), config.clone()).unwrap();
        let mut weights: Vec<CudaSlice<bf16>> =
            init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
        device_steps(&mut engine, &mut weights, first);
        engine
            .save_checkpoint(&dir, &mut weights, &zero_core::SaveOptions::default())
            .unwrap();
        device_steps(&mut engine, &mut weights, second);
        to_host(engine.comm(), &weights)
    };
    // A fresh engine from the 16-bit weights alone would have lost the
    // masters' low bits; from the checkpoint it continues bitwise.
    let comm = comm();
    let stream = comm.compute_stream().clone();
    let mut engine = cuda_engine(comm, params(DType::BF16), adam(), config).unwrap();
    let mut weights: Vec<CudaSlice<bf16>> =
        init.iter().map(|w| stream.clone_htod(w).unwrap()).collect();
    engine.load_checkpoint(&dir, &mut weights).unwrap();
    device_steps(&mut engine, &mut weights, second);
    let resumed = to_host(engine.comm(), &weights);
    assert_eq!(resumed, uninterrupted);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every bf16 and f16 bit pattern widens exactly; f32 values around every
/// rounding boundary (ties, subnormals, overflow, NaN) narrow as the host
/// engine rounds them (the `half` crate's f32 conversions: to nearest, ties
/// to even).
#[test]
#[ignore = "needs a CUDA GPU"]
fn widening_and_narrowing_kernels_match_the_half_crate() {
    fn check<H: Sixteen + PartialEq>(from_bits: fn(u16) -> H, to_bits: fn(H) -> u16) {
        let ctx = common::cuda_context();
        let stream = ctx.default_stream();
        let kernels = FusedKernels::new(&ctx).unwrap();
        let all: Vec<H> = (0..=u16::MAX).map(from_bits).collect();
        let src = stream.clone_htod(&all).unwrap();
        // Widen into the middle of a buffer, then add the same again.
        let mut flat = stream.alloc_zeros::<f32>(all.len() + 3).unwrap();
        let entry = [(3, &src as &dyn DevicePtr<H>, 0..all.len())];
        kernels
            .widen_ranges(&stream, &entry, &mut flat, false)
            .unwrap();
        let widened = stream.clone_dtoh(&flat).unwrap();
        kernels
            .widen_ranges(&stream, &entry, &mut flat, true)
            .unwrap();
        let doubled = stream.clone_dtoh(&flat).unwrap();
        for (bits, h) in all.iter().enumerate() {
            let want = h.to_f64() as f32;
            let got = widened[3 + bits];
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{:?} {bits:#06x} widened to {got}, not {want}",
                H::DTYPE
            );
            let twice = doubled[3 + bits];
            assert!(
                twice == want + want || (twice.is_nan() && want.is_nan()),
                "{:?} {bits:#06x} added to {twice}",
                H::DTYPE
            );
        }
        // Each 16-bit value, its neighbours at the f32 level, the exact
        // midpoints to the next value, and one f32 ulp either side of them.
        let mut values: Vec<f32> = Vec::new();
        for h in &all {
            let x = h.to_f64() as f32;
            if !x.is_finite() {
                values.push(x);
                continue;
            }
            let b = x.to_bits();
            values.extend([x, f32::from_bits(b + 1), f32::from_bits(b.wrapping_sub(1))]);
        }
        for w in all.windows(2) {
            let (a, b) = (w[0].to_f64(), w[1].to_f64());
            if a.is_finite() && b.is_finite() {
                let mid = ((a + b) / 2.0) as f32;
                let m = mid.to_bits();
                values.extend([mid, f32::from_bits(m + 1), f32::from_bits(m - 1)]);
            }
        }
        values.extend([f32::MAX, -f32::MAX, 1e-45, -1e-45, f32::NAN, -f32::NAN]);
        let flat = stream.clone_htod(&values).unwrap();
        let mut dst = stream
            .clone_htod(&vec![from_bits(0); values.len() + 5])
            .unwrap();
        let mut pieces = [(0, &mut dst as &mut dyn DevicePtrMut<H>, 5..5 + values.len())];
        kernels.narrow_ranges(&stream, &flat, &mut pieces).unwrap();
        let narrowed = stream.clone_dtoh(&dst).unwrap();
        assert!(narrowed[..5].iter().all(|h| to_bits(*h) == 0));
        for (x, got) in values.iter().zip(&narrowed[5..]) {
            let want = H::from_f64(*x as f64);
            let same =
                to_bits(*got) == to_bits(want) || (got.to_f64().is_nan() && want.to_f64().is_nan());
            assert!(
                same,
                "{:?}: {x:e} ({:#010x}) narrowed to {:#06x}, not {:#06x}",
                H::DTYPE,
                x.to_bits(),
                to_bits(*got),
                to_bits(want)
            );
        }
    }
    check::<bf16>(bf16::from_bits, bf16::to_bits);
    check::<f16>(f16::from_bits, f16::to_bits);
}

/// A 16-bit wire rounds what it gathers (the receiving side gets the
/// 16-bit values widened), an f32 wire does not. (The engine uses it from
/// two ranks on: one GPU can show the memory's part only.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn gathers_in_sixteen_bits_round_on_the_wire() {
    use zero_core::engine::ShardMemory;
    let comm = comm();
    let mut memory = zero_nccl::CudaMemory::new(&comm).unwrap();
    let stream = comm.compute_stream().clone();
    let values: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * 1e-4).collect();
    let send = stream.clone_htod(&values).unwrap();
    for (wire, round) in [
        (DType::F32, (|x: f32| x) as fn(f32) -> f32),
        (DType::BF16, |x: f32| bf16::from_f32(x).to_f32()),
        (DType::F16, |x: f32| f16::from_f32(x).to_f32()),
    ] {
        // A chunk, then a longer one (the 16-bit staging grows), then a
        // shorter one again (it is reused).
        for (from, to) in [(100..600, 10..510), (0..1000, 5..1005), (300..400, 0..100)] {
            let mut recv = stream.alloc_zeros::<f32>(1010).unwrap();
            memory
                .all_gather_as(&comm, &send, from.clone(), &mut recv, to.clone(), wire)
                .unwrap();
            comm.wait_compute("test").unwrap();
            let got = stream.clone_dtoh(&recv).unwrap();
            let outside = got[..to.start].iter().chain(&got[to.end..]);
            assert!(outside.into_iter().all(|&x| x == 0.0), "{wire:?} {to:?}");
            for (g, x) in got[to].iter().zip(&values[from]) {
                assert_eq!(*g, round(*x), "{wire:?}");
            }
        }
    }
}

/// A bucket's write-back: more parameters than a launch's table, of odd
/// lengths and offsets, one of them written in two parts, in f32 and
/// bf16; each copy's range gets its values (rounded in bf16) and nothing
/// else is touched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_buckets_write_back_writes_each_copy_and_nothing_else() {
    use zero_core::engine::{ParamCopy, ShardMemory};
    let comm = comm();
    let mut memory = zero_nccl::CudaMemory::new(&comm).unwrap();
    let stream = comm.compute_stream().clone();
    let lens: Vec<usize> = (0..150).map(|p| 1 + (p * 7) % 37).collect();
    // Parameter 3 in two parts, the second after parameter 4's copy.
    let mut copies: Vec<ParamCopy> = Vec::new();
    let mut at = 0;
    for (param, &len) in lens.iter().enumerate() {
        let param_range = if param == 3 { 0..len / 2 } else { len / 3..len };
        copies.push(ParamCopy {
            param,
            param_range,
            at,
        });
        at += len + param % 3;
        if param == 4 {
            copies.push(ParamCopy {
                param: 3,
                param_range: lens[3] / 2..lens[3],
                at,
            });
            at += lens[3];
        }
    }
    let values: Vec<f32> = (0..at).map(|i| 1.0 + i as f32 * 1.001e-3).collect();
    let flat = stream.clone_htod(&values).unwrap();
    let expect = |round: &dyn Fn(f32) -> f32, fill: f32| -> Vec<Vec<f32>> {
        let mut want: Vec<Vec<f32>> = lens.iter().map(|&len| vec![fill; len]).collect();
        for c in &copies {
            for (i, x) in c.param_range.clone().zip(&values[c.at..]) {
                want[c.param][i] = round(*x);
            }
        }
        want
    };
    let mut f32s: Vec<CudaSlice<f32>> = lens
        .iter()
        .map(|&len| stream.clone_htod(&vec![-1f32; len]).unwrap())
        .collect();
    ShardMemory::<f32, NcclComm>::write_params(&mut memory, &mut f32s, &copies, &flat).unwrap();
    let got: Vec<Vec<f32>> = f32s.iter().map(|p| stream.clone_dtoh(p).unwrap()).collect();
    assert_eq!(got, expect(&|x| x, -1.0), "f32");
    let mut bf16s: Vec<CudaSlice<bf16>> = lens
        .iter()
        .map(|&len| stream.clone_htod(&vec![bf16::from_f32(-1.0); len]).unwrap())
        .collect();
    ShardMemory::<f32, NcclComm>::write_params(&mut memory, &mut bf16s, &copies, &flat).unwrap();
    let got: Vec<Vec<f32>> = bf16s
        .iter()
        .map(|p| {
            stream
                .clone_dtoh(p)
                .unwrap()
                .iter()
                .map(|h| h.to_f32())
                .collect()
        })
        .collect();
    assert_eq!(got, expect(&|x| bf16::from_f32(x).to_f32(), -1.0), "bf16");
}

/// A chunk rounded to 16 bits and packed on the host (offload's
/// write-back of a 16-bit model) gathers into the same values as the f32
/// chunk gathered in that dtype, bit for bit: nothing is rounded twice.
#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_sixteen_bit_chunks_gather_as_their_f32_values_would() {
    use zero_core::engine::{pack_narrow, packed_len, PackedGathers, ShardMemory};
    let comm = comm();
    let mut memory = zero_nccl::CudaMemory::new(&comm).unwrap();
    let stream = comm.compute_stream().clone();
    let values: Vec<f32> = (0..999).map(|i| (i as f32 - 500.0) * 1.37e-3).collect();
    let send = stream.clone_htod(&values).unwrap();
    for wire in [DType::BF16, DType::F16] {
        // A chunk, then a longer one (the 16-bit staging grows), then a
        // shorter one again.
        for n in [500, 999, 101] {
            let mut packed = vec![0f32; packed_len::<f32>(n)];
            pack_narrow(&values[..n], wire, &mut packed);
            let packed = stream.clone_htod(&packed).unwrap();
            let (mut want, mut got) = (
                stream.alloc_zeros::<f32>(1010).unwrap(),
                stream.alloc_zeros::<f32>(1010).unwrap(),
            );
            memory
                .all_gather_as(&comm, &send, 0..n, &mut want, 7..7 + n, wire)
                .unwrap();
            memory
                .all_gather_packed(&comm, &packed, n, &mut got, 7..7 + n, wire)
                .unwrap();
            comm.wait_compute("test").unwrap();
            let (want, got) = (
                stream.clone_dtoh(&want).unwrap(),
                stream.clone_dtoh(&got).unwrap(),
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{wire:?}, {n} values");
            assert_ne!(got[7], 0.0, "{wire:?}: nothing gathered");
        }
    }
    let short = stream.alloc_zeros::<f32>(10).unwrap();
    let mut recv = stream.alloc_zeros::<f32>(100).unwrap();
    assert!(
        memory
            .all_gather_packed(&comm, &short, 100, &mut recv, 0..100, DType::BF16)
            .is_err(),
        "100 packed values in 10 elements"
    );
}
