//! Finding the CUDA libraries before cudarc does.
//!
//! With dynamic loading, cudarc panics when a library or a symbol is missing.
//! We try to open the library ourselves first and return
//! [`Error::LibraryNotFound`]; as a last resort the first calls into cudarc
//! run under `catch_unwind` (see [`guarded`]).

use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, Ordering};

/// A CUDA library the crate loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// The driver, `libcuda.so` (comes with the NVIDIA driver).
    Cuda,
    /// The run-time compiler, `libnvrtc.so` (CUDA toolkit or the
    /// `nvidia-cuda-nvrtc-cu12` wheel).
    Nvrtc,
    /// NCCL, `libnccl.so` (the `libnccl2` package or the `nvidia-nccl-cu12` wheel).
    Nccl,
}

impl Library {
    fn name(self) -> &'static str {
        match self {
            Library::Cuda => "libcuda.so",
            Library::Nvrtc => "libnvrtc.so",
            Library::Nccl => "libnccl.so",
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Library::Cuda => "install the NVIDIA driver or run on a GPU machine",
            Library::Nvrtc => {
                "install the CUDA toolkit (or pip install nvidia-cuda-nvrtc-cu12) and add its lib directory to LD_LIBRARY_PATH"
            }
            Library::Nccl => {
                "install NCCL (libnccl2, or pip install nvidia-nccl-cu12) and add its lib directory to LD_LIBRARY_PATH"
            }
        }
    }

    /// File names to try: a superset of what cudarc tries, so that a failed
    /// probe means cudarc would fail too.
    fn candidates(self) -> Vec<String> {
        let stem = match self {
            Library::Cuda => "cuda",
            Library::Nvrtc => "nvrtc",
            Library::Nccl => "nccl",
        };
        let mut names = Vec::new();
        if cfg!(windows) {
            let stem = if self == Library::Cuda {
                "nvcuda"
            } else {
                stem
            };
            names.push(format!("{stem}.dll"));
            for v in ["", "_13", "_12", "_11", "_130_0", "_120_0", "_112_0"] {
                names.push(format!("{stem}64{v}.dll"));
            }
        } else if cfg!(target_os = "macos") {
            names.push(format!("lib{stem}.dylib"));
        } else {
            names.push(format!("lib{stem}.so"));
            for v in ["1", "2", "13", "12", "11.2", "11", "10", "9"] {
                names.push(format!("lib{stem}.so.{v}"));
            }
        }
        names
    }

    fn flag(self) -> &'static AtomicBool {
        static CUDA: AtomicBool = AtomicBool::new(false);
        static NVRTC: AtomicBool = AtomicBool::new(false);
        static NCCL: AtomicBool = AtomicBool::new(false);
        match self {
            Library::Cuda => &CUDA,
            Library::Nvrtc => &NVRTC,
            Library::Nccl => &NCCL,
        }
    }
}

/// Returns `Ok` when `library` can be loaded, else [`Error::LibraryNotFound`]
/// saying what to install. Success is remembered.
pub fn ensure_library(library: Library) -> Result<()> {
    if library.flag().load(Ordering::Acquire) {
        return Ok(());
    }
    let tried = library.candidates();
    for name in &tried {
        // SAFETY: loading a CUDA library runs its initializers, which have no
        // preconditions; the handle is dropped (refcount decremented) at once
        // and cudarc loads it again for its own use.
        if unsafe { libloading::Library::new(name) }.is_ok() {
            library.flag().store(true, Ordering::Release);
            return Ok(());
        }
    }
    Err(Error::LibraryNotFound {
        library: library.name(),
        tried,
        hint: library.hint(),
    })
}

/// Runs `f`, turning a panic inside cudarc (a missing library or symbol)
/// into [`Error::Panicked`].
pub fn guarded<T>(during: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => {
            let message = if let Some(s) = payload.downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "unknown panic payload".to_string()
            };
            Err(Error::Panicked { during, message })
        }
    }
}

/// The number of CUDA devices, or why there are none usable: the probe used
/// by tests and benchmarks to skip without a GPU.
pub fn cuda_device_count() -> Result<usize> {
    ensure_library(Library::Cuda)?;
    guarded("cuInit", || {
        let n = cudarc::driver::CudaContext::device_count()?;
        Ok(n.max(0) as usize)
    })
}
