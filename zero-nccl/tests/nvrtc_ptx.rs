//! The fused kernels through NVRTC and `ptxas`, without a GPU: compiles the
//! library's own `SOURCE` (and the layers' `LAYER_SOURCE`) with its own
//! options for the architecture it would pick on an A100 and an H100,
//! assembles the PTX for sm_80 and sm_90, and checks that every kernel
//! `FusedKernels::new` (`LayerKernels::new`) loads is an entry of it; the
//! same for the vendored Candle's gradient sums (`vendor/README.md`).
//!
//! `scripts/check-nvrtc.sh` installs NVRTC and `ptxas` from PyPI wheels and
//! runs these with `--ignored`, once per NVRTC, naming the one it means to
//! load in `ZERO_EXPECT_NVRTC`; `ptxas` is `$PTXAS`, else the one on
//! `PATH`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;
use zero_nccl::kernels::layers::{compile_layer_ptx_for, LAYER_KERNEL_NAMES};
use zero_nccl::kernels::{
    compile_ptx_for, nvrtc_arch, nvrtc_supported_archs, nvrtc_version, KERNEL_NAMES,
};

const HOW: &str = "run scripts/check-nvrtc.sh, which installs NVRTC and ptxas";

/// NVRTC's targets; panics (the test fails) when there is no NVRTC.
fn supported_archs() -> Vec<i32> {
    nvrtc_supported_archs()
        .unwrap_or_else(|e| panic!("no usable NVRTC ({e}); {HOW}"))
        .unwrap_or_else(|| panic!("this NVRTC does not list its architectures; {HOW}"))
}

fn ptxas() -> PathBuf {
    std::env::var_os("PTXAS").map_or_else(|| PathBuf::from("ptxas"), PathBuf::from)
}

/// Assembles `ptx` for `sm` (`ptxas -v`), panicking with ptxas's output when
/// it fails; returns ptxas's resource report.
fn assemble(ptx: &str, sm: &str, name: &str) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let input = dir.join(format!("{name}-{sm}-{}.ptx", std::process::id()));
    let output = input.with_extension("cubin");
    std::fs::write(&input, ptx).expect("writing the PTX under CARGO_TARGET_TMPDIR");
    let run = Command::new(ptxas())
        .arg(format!("-arch={sm}"))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(&output)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?} ({e}); {HOW}", ptxas()));
    assert!(
        run.status.success(),
        "ptxas -arch={sm} rejected the kernels' PTX ({}):\n{}{}",
        input.display(),
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let cubin = std::fs::metadata(&output).map(|m| m.len()).unwrap_or(0);
    assert!(cubin > 0, "ptxas -arch={sm} wrote no cubin");
    let _ = std::fs::remove_file(&input);
    let _ = std::fs::remove_file(&output);
    format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    )
}

/// Per kernel of a `ptxas -v` report: (name, registers, spill store bytes,
/// spill load bytes, shared memory bytes).
fn resources(report: &str) -> Vec<(String, u32, u32, u32, u32)> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(unit)
            .next()
            .and_then(|head| head.split_whitespace().last())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let mut out = Vec::new();
    let mut current: Option<(String, u32, u32)> = None;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            current = Some((name, 0, 0));
        } else if line.contains("bytes spill stores") {
            if let Some(c) = current.as_mut() {
                c.1 = number_before(line, "bytes spill stores");
                c.2 = number_before(line, "bytes spill loads");
            }
        } else if line.contains("Used") && line.contains("registers") {
            if let Some((name, stores, loads)) = current.take() {
                let registers = number_before(line, "registers");
                let smem = if line.contains("bytes smem") {
                    number_before(line, "bytes smem")
                } else {
                    0
                };
                out.push((name, registers, stores, loads, smem));
            }
        }
    }
    out
}

#[test]
#[ignore = "needs NVRTC and ptxas: run scripts/check-nvrtc.sh"]
fn kernels_compile_with_nvrtc_and_assemble_for_ampere_and_hopper() {
    let supported = supported_archs();
    println!("NVRTC targets {supported:?}");
    for (device, sm) in [((8, 0), "sm_80"), ((9, 0), "sm_90")] {
        // What FusedKernels::new would pick on this device with this NVRTC.
        let arch = nvrtc_arch(device, Some(&supported))
            .unwrap_or_else(|e| panic!("no architecture for {device:?}: {e}"));
        assert_eq!(arch, sm.replace("sm_", "compute_"));
        let ptx = compile_ptx_for(&arch)
            .unwrap_or_else(|e| panic!("NVRTC rejected the kernels for {arch}: {e}"))
            .to_src();
        for name in KERNEL_NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "the PTX for {arch} has no entry {name}, which FusedKernels::new loads"
            );
        }
        assemble(&ptx, sm, "fused-kernels");
    }
}

/// The vendored candle-core's gradient-sum kernels, compiled as it compiles
/// them (`grad_sum.rs`: NVRTC's defaults, `compute_{major}{minor}`): where
/// NVRTC refuses them, the backward falls back to Candle's kernel without a
/// word, so only this check tells.
const GRAD_SUM_SOURCE: &str = include_str!("../../vendor/candle-core/src/cuda_backend/grad_sum.cu");

#[test]
#[ignore = "needs NVRTC and ptxas: run scripts/check-nvrtc.sh"]
fn vendored_gradient_sums_compile_with_nvrtc_and_assemble_for_ampere_and_hopper() {
    supported_archs();
    for sm in ["sm_80", "sm_90"] {
        let arch = sm.replace("sm_", "compute_");
        let options = cudarc::nvrtc::CompileOptions {
            arch: Some(Box::leak(arch.clone().into_boxed_str())),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(GRAD_SUM_SOURCE, options)
            .unwrap_or_else(|e| panic!("NVRTC rejected the gradient sums for {arch}: {e}"))
            .to_src();
        for name in ["grad_sum_bf16", "grad_sum_f16", "grad_sum_f32"] {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "the PTX for {arch} has no entry {name}, which grad_sum.rs loads"
            );
        }
        assemble(&ptx, sm, "grad-sum");
    }
}

/// The most bytes an attention kernel may spill: one or two registers'
/// worth, never an accumulator array.
const SMALL_SPILL: u32 = 16;

#[test]
#[ignore = "needs NVRTC and ptxas: run scripts/check-nvrtc.sh"]
fn layer_kernels_compile_with_nvrtc_and_assemble_for_ampere_and_hopper() {
    let supported = supported_archs();
    for (device, sm) in [((8, 0), "sm_80"), ((9, 0), "sm_90")] {
        let arch = nvrtc_arch(device, Some(&supported))
            .unwrap_or_else(|e| panic!("no architecture for {device:?}: {e}"));
        let started = std::time::Instant::now();
        let ptx = compile_layer_ptx_for(&arch)
            .unwrap_or_else(|e| panic!("NVRTC rejected the layer kernels for {arch}: {e}"))
            .to_src();
        println!(
            "NVRTC compiled the layer kernels for {arch} in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        for name in LAYER_KERNEL_NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "the PTX for {arch} has no entry {name}, which LayerKernels::new loads"
            );
        }
        let report = assemble(&ptx, sm, "layer-kernels");
        let kernels = resources(&report);
        assert_eq!(kernels.len(), LAYER_KERNEL_NAMES.len(), "{report}");
        for (name, registers, stores, loads, smem) in kernels {
            println!(
                "{sm} {name}: {registers} registers, {smem} B shared, spills {stores}/{loads} B"
            );
            // Attention keeps its accumulators in registers: an array in
            // local memory there costs more than the rest of the kernel. A
            // register or two may spill (CUDA 13.0's NVRTC spills 8 bytes of
            // the bf16 d=64 dK/dV kernel for sm_80, 13.5's none; seen on
            // the H100 machine).
            if name.starts_with("attention") {
                assert!(
                    stores <= SMALL_SPILL && loads <= SMALL_SPILL,
                    "{name} spills {stores}/{loads} bytes on {sm}:\n{report}"
                );
            }
        }
    }
}

/// The library used to compile for `compute_60` on every device, which
/// CUDA 13's NVRTC refuses ("invalid value for --gpu-architecture").
#[test]
#[ignore = "needs NVRTC and ptxas: run scripts/check-nvrtc.sh"]
fn a_target_this_nvrtc_dropped_is_refused_by_name() {
    let supported = supported_archs();
    let oldest = supported.iter().copied().min().unwrap_or_default();
    if oldest <= 60 {
        println!("this NVRTC still targets sm_{oldest}: nothing to show");
        return;
    }
    let err = compile_ptx_for("compute_60").expect_err("NVRTC accepted compute_60");
    assert!(err.to_string().contains("gpu-architecture"), "{err}");
    // The library picks no such target, and says why on an old GPU.
    let err = nvrtc_arch((6, 0), Some(&supported)).expect_err("an arch for sm_60");
    assert!(err.to_string().contains("too old for this NVRTC"), "{err}");
}

/// The NVRTC these tests compiled with is the one the script meant to load
/// (`ZERO_EXPECT_NVRTC`: `13.0`, or `13` for any 13): a library path that
/// let another one load would pass the other tests against the wrong
/// compiler.
#[test]
#[ignore = "needs NVRTC and ptxas: run scripts/check-nvrtc.sh"]
fn the_nvrtc_loaded_is_the_one_the_script_asked_for() {
    let want = std::env::var("ZERO_EXPECT_NVRTC").unwrap_or_else(|_| {
        panic!("ZERO_EXPECT_NVRTC names the NVRTC to test (13.0, or 13); {HOW}")
    });
    let loaded = nvrtc_version();
    assert!(
        loaded == want || loaded.starts_with(&format!("{want}.")),
        "NVRTC {loaded} was loaded where ZERO_EXPECT_NVRTC asks for {want}: check LD_LIBRARY_PATH"
    );
}
