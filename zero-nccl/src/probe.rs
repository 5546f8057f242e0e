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

    /// The stem cudarc names the library by.
    fn stem(self) -> &'static str {
        match self {
            Library::Cuda => "cuda",
            Library::Nvrtc => "nvrtc",
            Library::Nccl => "nccl",
        }
    }

    /// File names to try: a superset of what cudarc tries, so that a failed
    /// probe means cudarc would fail too.
    fn candidates(self) -> Vec<String> {
        let stem = self.stem();
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

/// Returns `Ok` when `library` can be loaded under a name cudarc loads,
/// else [`Error::LibraryNotFound`] saying what to install, or
/// [`Error::LibraryNeedsLink`] when it is there only under a versioned name
/// cudarc does not try (unless the binary already links it: Candle's
/// `cuda` feature links the libraries by their sonames). Success is
/// remembered.
pub fn ensure_library(library: Library) -> Result<()> {
    if library.flag().load(Ordering::Acquire) {
        return Ok(());
    }
    let tried = library.candidates();
    let cudarc_loads = cudarc_names(library.stem());
    // SAFETY: loading a CUDA library runs its initializers, which have no
    // preconditions; the handle is dropped (refcount decremented) at once
    // and cudarc loads it again for its own use.
    let loads = |name: &str| unsafe { libloading::Library::new(name) }.is_ok();
    match find(&tried, &cudarc_loads, loads, already_loaded) {
        Found::Usable => {
            library.flag().store(true, Ordering::Release);
            Ok(())
        }
        Found::NeedsLink(found) => Err(Error::LibraryNeedsLink {
            found,
            wanted: library.name(),
        }),
        Found::Nothing => Err(Error::LibraryNotFound {
            library: library.name(),
            tried,
            hint: library.hint(),
        }),
    }
}

/// The file names cudarc's dynamic loading tries for `stem` on Linux: its
/// `get_lib_name_candidates`, which is not there when another crate (Candle)
/// makes cudarc link the libraries instead. The versioned names follow the
/// CUDA version of the bindings.
fn cudarc_names(stem: &str) -> Vec<String> {
    let major = cudarc::driver::sys::CUDA_VERSION / 1000;
    let mut names = vec![format!("lib{stem}.so")];
    for version in [
        major.to_string(),
        "12".into(),
        "11".into(),
        "10".into(),
        "9".into(),
    ] {
        names.push(format!("lib{stem}.so.{version}"));
    }
    names.push(format!("lib{stem}.so.1"));
    names
}

/// What [`find`] found.
#[derive(Debug, PartialEq, Eq)]
enum Found {
    /// A name cudarc loads, or a library the binary already links.
    Usable,
    /// Only this versioned file, which cudarc does not load by that name.
    NeedsLink(String),
    Nothing,
}

/// Tries `tried` in order: a name cudarc also tries (`cudarc_loads`) that
/// `loads` is usable; another one is usable only if `already_loaded` says
/// the process links it, else it needs a link under cudarc's name.
fn find(
    tried: &[String],
    cudarc_loads: &[String],
    loads: impl Fn(&str) -> bool,
    already_loaded: impl Fn(&str) -> bool,
) -> Found {
    let (by_cudarc, others): (Vec<&String>, Vec<&String>) =
        tried.iter().partition(|name| cudarc_loads.contains(name));
    if by_cudarc.iter().any(|name| loads(name)) {
        return Found::Usable;
    }
    for name in others {
        if already_loaded(name) {
            return Found::Usable;
        }
        if loads(name) {
            return Found::NeedsLink(name.clone());
        }
    }
    Found::Nothing
}

/// Whether the library `name` is loaded into this process already (linked
/// at build time), without loading it.
#[cfg(target_os = "linux")]
fn already_loaded(name: &str) -> bool {
    use libloading::os::unix::{Library as UnixLibrary, RTLD_LAZY};
    // glibc's and musl's value (libloading does not export it).
    const RTLD_NOLOAD: std::os::raw::c_int = 0x4;
    // SAFETY: RTLD_NOLOAD opens nothing new, so no initializer runs.
    unsafe { UnixLibrary::open(Some(name), RTLD_LAZY | RTLD_NOLOAD) }.is_ok()
}

#[cfg(not(target_os = "linux"))]
fn already_loaded(_name: &str) -> bool {
    false
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

#[cfg(test)]
mod tests {
    use super::{find, Found};

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_versioned_file_cudarc_does_not_load_needs_a_link_unless_linked() {
        let tried = names(&["libnccl.so", "libnccl.so.2", "libnccl.so.1"]);
        let cudarc = names(&["libnccl.so", "libnccl.so.1"]);
        let none = |_: &str| false;
        // cudarc's own name is there.
        let only = |want: &'static str| move |name: &str| name == want;
        assert_eq!(
            find(&tried, &cudarc, only("libnccl.so"), none),
            Found::Usable
        );
        assert_eq!(
            find(&tried, &cudarc, only("libnccl.so.1"), none),
            Found::Usable
        );
        // Only libnccl.so.2 (pip's wheel, Debian's libnccl2): a link is needed...
        assert_eq!(
            find(&tried, &cudarc, only("libnccl.so.2"), none),
            Found::NeedsLink("libnccl.so.2".into())
        );
        // ...unless the binary links it already (Candle's `cuda` feature).
        assert_eq!(
            find(&tried, &cudarc, only("libnccl.so.2"), only("libnccl.so.2")),
            Found::Usable
        );
        assert_eq!(find(&tried, &cudarc, none, none), Found::Nothing);
    }
}
