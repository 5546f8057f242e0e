//! Benchmark suites, one file each; `main` dispatches on the first argument.

mod checkpoint;
mod comm;
mod gpt;
#[cfg(feature = "nccl")]
mod gpu;
#[cfg(feature = "nccl")]
mod gpu_gpt;
#[cfg(feature = "nccl")]
mod gpu_layers;
mod hf;
mod hybrid;
pub mod largest;
mod layers;
mod memory;
#[cfg(feature = "mpi")]
mod mpi;
mod optim;
mod overlap;
mod precision;
mod report;
mod stage3;
mod step;
pub mod torch_peer;
pub use report::{Figure, Report};

/// `rows` random inputs in [-1, 1) of `width` and class labels below
/// `classes`, on the CPU (benchmarks whose data does not matter).
fn random_batch(
    rng: &mut impl rand::Rng,
    rows: usize,
    width: usize,
    classes: i64,
) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
    use candle_core::{Device, Tensor};
    let x: Vec<f32> = (0..rows * width)
        .map(|_| rng.gen_range(-1.0..1.0))
        .collect();
    let y: Vec<i64> = (0..rows).map(|_| rng.gen_range(0..classes)).collect();
    Ok((
        Tensor::from_vec(x, (rows, width), &Device::Cpu)?,
        Tensor::from_vec(y, rows, &Device::Cpu)?,
    ))
}

/// The median of `values` (the upper one of an even count; NaN if empty).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Measures each of `names` `rounds` times with `measure(case)`, the cases
/// alternating so that drift in the machine's load affects each alike, and
/// returns each case's median; on a failure, the failing case's name and
/// error.
fn interleaved_medians(
    names: &[&str],
    rounds: usize,
    mut measure: impl FnMut(usize) -> Result<f64, String>,
) -> Result<Vec<f64>, String> {
    let mut values: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..rounds {
        for (case, name) in names.iter().enumerate() {
            values[case].push(measure(case).map_err(|e| format!("{name} failed: {e}"))?);
        }
    }
    Ok(values.into_iter().map(median).collect())
}

/// Runs the suite named by the first command-line argument (all if none).
pub fn main() {
    let which: Vec<String> = std::env::args().skip(1).collect();
    if which.first().map(String::as_str) == Some("gpu-largest-trial") {
        // One size of `bench gpu-largest`, in a process of its own.
        #[cfg(feature = "nccl")]
        std::process::exit(gpu_gpt::largest_trial(&which[1..]));
        #[cfg(not(feature = "nccl"))]
        {
            eprintln!("gpu benchmarks need --features nccl");
            std::process::exit(2);
        }
    }
    let all = [
        "comm",
        "optim",
        "step",
        "overlap",
        "memory",
        "precision",
        "stage3",
        "hybrid",
        "checkpoint",
        "gpt",
        "hf",
        "gpu",
    ];
    let selected: Vec<&str> = if which.is_empty() {
        all.to_vec()
    } else {
        which.iter().map(String::as_str).collect()
    };
    #[cfg(feature = "mpi")]
    let under_mpirun = zero_mpi_gloo::launched_by_mpirun();
    #[cfg(not(feature = "mpi"))]
    let under_mpirun = false;
    let mut report = Report::default();
    for name in selected {
        match name {
            "comm" => {
                // Under mpirun every process runs the suite; the thread
                // backend's figures would only compete for the same cores.
                if !under_mpirun {
                    comm::run(&mut report);
                }
                #[cfg(feature = "mpi")]
                mpi::run_if_launched(&mut report);
            }
            "optim" if !under_mpirun => optim::run(&mut report),
            "step" if !under_mpirun => {
                step::run(&mut report);
                layers::run(&mut report);
            }
            "overlap" if !under_mpirun => overlap::run(&mut report),
            "memory" if !under_mpirun => memory::run(&mut report),
            "gpt" if !under_mpirun => gpt::run(&mut report),
            "hf" if !under_mpirun => hf::run(&mut report),
            "precision" if !under_mpirun => precision::run(&mut report),
            "stage3" if !under_mpirun => stage3::run(&mut report),
            "hybrid" if !under_mpirun => hybrid::run(&mut report),
            "checkpoint" if !under_mpirun => checkpoint::run(&mut report),
            "gpu" | "gpu-zero" | "gpu-headline" | "gpu-largest" | "gpu-hub" | "gpu-hub-profile"
            | "gpu-checkpoint" | "gpu-stage3" => gpu_suite(name, &mut report),
            "optim" | "step" | "overlap" | "memory" | "precision" | "stage3" | "hybrid"
            | "checkpoint" | "gpt" | "hf" => {}
            other => {
                eprintln!(
                    "unknown benchmark suite {other:?}; expected one of {all:?}, or gpu-zero, \
                     gpu-headline, gpu-largest, gpu-hub, gpu-hub-profile, gpu-checkpoint or \
                     gpu-stage3"
                );
                std::process::exit(2);
            }
        }
    }
    // Under mpirun every rank runs the suites; one report is enough.
    #[cfg(feature = "mpi")]
    if !mpi::is_printing_rank() {
        return;
    }
    report.print();
    if !report.failures().is_empty() {
        std::process::exit(1);
    }
}

/// The GPU suites, where a CUDA device is present: `gpu` every GPU figure;
/// `gpu-zero` (not among `all`) only `gpu`'s offload, stage-3 and
/// shared-GPU figures (no kernel timings, composed ops, checkpointing or
/// PyTorch peers); `gpu-headline` (not among `all`: it builds a model of a
/// fifth of the GPU's memory) stage 3's headline; `gpu-largest` (not among
/// `all`: minutes of models that fill the GPU) the largest model trained
/// with offload and without; `gpu-hub` only `gpu`'s hub models against
/// `transformers`; `gpu-hub-profile` one hub model's few steps, ours only,
/// for a profiler; `gpu-checkpoint` (not among `all`: it writes gigabytes)
/// background checkpoint saves of the GPT over blocking ones; `gpu-stage3`
/// (not among `all`) where a stage-3 step's time goes beside stage 2's.
#[cfg(feature = "nccl")]
fn gpu_suite(name: &str, report: &mut Report) {
    if !gpu::device_present() {
        return;
    }
    match name {
        "gpu-zero" => gpu_gpt::run(report, gpu_gpt::Part::Zero),
        "gpu-headline" => gpu_gpt::headline(report),
        "gpu-largest" => gpu_gpt::largest(report),
        "gpu-hub" => gpu_gpt::hub(report),
        "gpu-hub-profile" => gpu_gpt::hub_profile(report),
        "gpu-checkpoint" => gpu_gpt::saves(report),
        "gpu-stage3" => gpu_gpt::stage3(report),
        _ => {
            gpu::run(report);
            gpu_layers::run(report);
            gpu_gpt::run(report, gpu_gpt::Part::All);
        }
    }
}

#[cfg(not(feature = "nccl"))]
fn gpu_suite(_name: &str, _report: &mut Report) {
    println!("gpu benchmarks need --features nccl");
}
