//! The fused kernels through NVRTC and `ptxas`, without a GPU: compiles the
//! library's own `SOURCE` with its own options for the architecture it would
//! pick on an A100 and an H100, assembles the PTX for sm_80 and sm_90, and
//! checks that every kernel `FusedKernels::new` loads is an entry of it.
//!
//! `scripts/check-nvrtc.sh` installs NVRTC and `ptxas` from PyPI wheels and
//! runs these with `--ignored`; `ptxas` is `$PTXAS`, else the one on `PATH`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;
use zero_nccl::kernels::{compile_ptx_for, nvrtc_arch, nvrtc_supported_archs, KERNEL_NAMES};

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

/// Assembles `ptx` for `sm`, panicking with ptxas's output when it fails.
fn assemble(ptx: &str, sm: &str) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let input = dir.join(format!("fused-kernels-{sm}-{}.ptx", std::process::id()));
    let output = input.with_extension("cubin");
    std::fs::write(&input, ptx).expect("writing the PTX under CARGO_TARGET_TMPDIR");
    let run = Command::new(ptxas())
        .arg(format!("-arch={sm}"))
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
        assemble(&ptx, sm);
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
