//! Whether [`Linear`](super::Linear) runs its CUDA GEMMs through cuBLASLt:
//! one process-wide switch, set by a call or by `ZERO_LINEAR_CUBLASLT`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// Whether [`Linear`](super::Linear) runs its CUDA GEMMs through cuBLASLt: as
/// [`set_linear_cublaslt`] set it, else as `ZERO_LINEAR_CUBLASLT` says
/// (on unless it says `0`).
static CUBLASLT: AtomicU8 = AtomicU8::new(CUBLASLT_UNSET);
const CUBLASLT_UNSET: u8 = 0;
const CUBLASLT_OFF: u8 = 1;
const CUBLASLT_ON: u8 = 2;

/// Runs [`Linear`](super::Linear) on CUDA through cuBLASLt (`on`, the default): the
/// forward as one GEMM with the bias (and a tanh-GELU) in its epilogue,
/// instead of Candle's GEMM and a pass over the output, and the backward's
/// weight gradient as one GEMM with the bias gradient in its epilogue
/// (`BGRADB`), instead of a GEMM and the column sums. Shapes, layouts and
/// dtypes cuBLASLt does not take keep Candle's path; off, every Linear
/// does. On an H200 it gave the GPT 1.03-1.06x the tokens/s in bf16 and
/// 1.04x in f32. `ZERO_LINEAR_CUBLASLT=0` turns it off for a process that
/// does not call this. Process-wide, like Candle's
/// `set_gemm_reduced_precision_*`, whose settings it follows.
pub fn set_linear_cublaslt(on: bool) {
    let state = if on { CUBLASLT_ON } else { CUBLASLT_OFF };
    CUBLASLT.store(state, Ordering::Relaxed);
}

/// Whether [`set_linear_cublaslt`] (or else `ZERO_LINEAR_CUBLASLT`) has
/// cuBLASLt on.
pub fn linear_cublaslt() -> bool {
    match CUBLASLT.load(Ordering::Relaxed) {
        CUBLASLT_ON => true,
        CUBLASLT_OFF => false,
        _ => {
            static FROM_ENV: OnceLock<bool> = OnceLock::new();
            *FROM_ENV.get_or_init(|| {
                cublaslt_from_env(std::env::var("ZERO_LINEAR_CUBLASLT").ok().as_deref())
            })
        }
    }
}

/// `ZERO_LINEAR_CUBLASLT`'s value: `0` or `off` turns cuBLASLt off;
/// unset, empty, `1` or `on` leave it on, as does anything else, with a
/// warning.
fn cublaslt_from_env(value: Option<&str>) -> bool {
    match value {
        Some("0" | "off") => false,
        None | Some("" | "1" | "on") => true,
        Some(other) => {
            tracing::warn!(
                "ZERO_LINEAR_CUBLASLT={other:?} is neither 1 (on) nor 0 (off): \
                 the Linear layers keep cuBLASLt on"
            );
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::cublaslt_from_env;

    #[test]
    fn zero_linear_cublaslt_turns_cublaslt_off_only_when_it_says_so() {
        for off in ["0", "off"] {
            assert!(!cublaslt_from_env(Some(off)), "{off}");
        }
        for on in [None, Some(""), Some("1"), Some("on"), Some("no"), Some("2")] {
            assert!(cublaslt_from_env(on), "{on:?}");
        }
    }
}
