//! Compares two safetensors weight files tensor by tensor.
//!
//! `weights-diff A.safetensors B.safetensors [--tol 1e-5]` prints the largest
//! absolute difference and exits 1 if it exceeds the tolerance or the files
//! hold different tensors (names, shapes).

use candle_core::Device;
use clap::Parser;
use std::path::PathBuf;

/// Compare two weight files.
#[derive(Parser)]
#[command(name = "weights-diff", version, about)]
struct Args {
    /// First file.
    a: PathBuf,
    /// Second file.
    b: PathBuf,
    /// Largest allowed absolute difference.
    #[arg(long, default_value_t = 0.0)]
    tol: f64,
}

fn run(args: &Args) -> Result<f64, String> {
    let load = |p: &PathBuf| {
        candle_core::safetensors::load(p, &Device::Cpu).map_err(|e| format!("{}: {e}", p.display()))
    };
    let (a, b) = (load(&args.a)?, load(&args.b)?);
    let mut names: Vec<&String> = a.keys().collect();
    names.sort();
    if names.len() != b.len() {
        return Err(format!(
            "{} holds {} tensors, {} holds {}",
            args.a.display(),
            a.len(),
            args.b.display(),
            b.len()
        ));
    }
    let mut worst = 0.0f64;
    for name in names {
        let ta = &a[name];
        let tb = b
            .get(name)
            .ok_or_else(|| format!("{} has no tensor {name:?}", args.b.display()))?;
        if ta.dims() != tb.dims() {
            return Err(format!(
                "{name:?}: shape {:?} vs {:?}",
                ta.dims(),
                tb.dims()
            ));
        }
        let diff = (|| {
            ta.to_dtype(candle_core::DType::F64)?
                .sub(&tb.to_dtype(candle_core::DType::F64)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f64>()
        })()
        .map_err(|e| format!("{name:?}: {e}"))?;
        worst = worst.max(diff);
    }
    Ok(worst)
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(worst) if worst <= args.tol => {
            println!("max abs difference {worst:e} <= {:e}", args.tol)
        }
        Ok(worst) => {
            eprintln!("max abs difference {worst:e} exceeds {:e}", args.tol);
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
