//! Fused CUDA kernels, compiled once at run time with NVRTC: flatten and
//! unflatten of gradient buckets (one launch per bucket of up to
//! [`PIECES_PER_LAUNCH`] pieces, their table passed in the launch's
//! parameters), gradient scaling and norms, and the built-in
//! optimizers' steps over a flat f32 shard (one launch per shard; see
//! [`optim`]); and, from a second source, the fused transformer layers of
//! zero-candle (attention, norms, activations, cross-entropy; see
//! [`layers`]); and a Linear layer's GEMM with its bias (and a tanh-GELU,
//! keeping the pre-activation) through cuBLASLt ([`gemm`]).
//!
//! NVRTC compiles for the device's architecture, or the newest one below it
//! that this NVRTC still targets ([`nvrtc_arch`]). `tests/nvrtc_ptx.rs`
//! compiles [`SOURCE`] with the same options and assembles the PTX with
//! `ptxas` on a machine without a GPU (`scripts/check-nvrtc.sh`).
//!
//! ```no_run
//! # fn main() -> zero_nccl::Result<()> {
//! use zero_nccl::cudarc::driver::CudaContext;
//! use zero_nccl::kernels::FusedKernels;
//! let ctx = CudaContext::new(0)?;
//! let kernels = FusedKernels::new(&ctx)?; // compile + load: once per process and device
//! # Ok(()) }
//! ```

pub mod gemm;
pub mod layers;
pub mod optim;

use crate::probe::{ensure_library, guarded, Library};
use crate::ptx_cache::PtxCache;
use crate::{Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg, SyncOnDrop,
};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use zero_core::{DType, Element, ReduceOp};

pub use optim::{
    AdagradHyper, AdagradState, AdamHyper, AdamState, DeviceState, RmspropHyper, RmspropState,
    SgdHyper, SgdState,
};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("source.cu");

/// The table entries `(address, offset, len)` of pieces `(offset, src,
/// range)`, each range inside its source, with the pointers' guards (held
/// until the launch is queued).
#[allow(clippy::type_complexity)]
fn range_entries<'a, T>(
    op: &'static str,
    stream: &'a Arc<CudaStream>,
    pieces: &'a [(usize, &'a dyn DevicePtr<T>, Range<usize>)],
) -> Result<(Vec<(u64, usize, usize)>, Vec<SyncOnDrop<'a>>)> {
    let mut guards = Vec::with_capacity(pieces.len());
    let mut entries = Vec::with_capacity(pieces.len());
    for (offset, src, range) in pieces {
        if range.end > src.len() {
            return Err(Error::from(zero_core::Error::BufferSize {
                op,
                what: "source piece",
                got: src.len(),
                expected: range.end,
            }));
        }
        let (ptr, guard) = src.device_ptr(stream);
        guards.push(guard);
        let start = ptr + (range.start * std::mem::size_of::<T>()) as u64;
        entries.push((start, *offset, range.len()));
    }
    Ok((entries, guards))
}

/// The most pieces one table-driven launch takes (`PIECES_PER_LAUNCH` in
/// [`SOURCE`]): the table travels by value in the launch's parameters
/// (1,536 bytes of CUDA's 4 KiB), so that a launch is one driver call with
/// no table to allocate, upload and free; more pieces take more launches.
pub const PIECES_PER_LAUNCH: usize = 64;

/// A launch's table of pieces `(address, element offset in the flat
/// buffer, length)`, passed by value (`Pieces` in [`SOURCE`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pieces([u64; 3 * PIECES_PER_LAUNCH]);

// SAFETY: plain data laid out as the kernel's `struct Pieces`.
unsafe impl cudarc::driver::DeviceRepr for Pieces {}

/// One table-driven launch: its pieces and its grid, x striding over the
/// longest piece, y over the pieces.
#[derive(Debug, PartialEq, Eq)]
struct PieceLaunch {
    table: Pieces,
    n_pieces: u32,
    grid: (u32, u32, u32),
}

/// The launches that cover the pieces `entries` `(address, offset, len)`
/// over a flat buffer of `flat_len` elements, in their order, at most
/// [`PIECES_PER_LAUNCH`] each; empty pieces are skipped. An error if a
/// piece reaches past the flat buffer (nothing is launched then).
fn piece_launches(
    op: &'static str,
    entries: &[(u64, usize, usize)],
    flat_len: usize,
) -> Result<Vec<PieceLaunch>> {
    if let Some(&(_, offset, len)) = entries.iter().find(|&&(_, o, l)| o + l > flat_len) {
        return Err(Error::from(zero_core::Error::BufferSize {
            op,
            what: "flat (offset + piece length)",
            got: flat_len,
            expected: offset + len,
        }));
    }
    let pieces: Vec<_> = entries.iter().filter(|&&(_, _, len)| len > 0).collect();
    Ok(pieces
        .chunks(PIECES_PER_LAUNCH)
        .map(|chunk| {
            let mut table = Pieces([0; 3 * PIECES_PER_LAUNCH]);
            for (slot, &&(ptr, offset, len)) in table.0.chunks_exact_mut(3).zip(chunk) {
                slot.copy_from_slice(&[ptr, offset as u64, len as u64]);
            }
            let longest = chunk.iter().map(|&&(_, _, len)| len).max().unwrap_or(1);
            let x = longest.div_ceil(BLOCK as usize).clamp(1, 1024) as u32;
            PieceLaunch {
                table,
                n_pieces: chunk.len() as u32,
                grid: (x, chunk.len() as u32, 1),
            }
        })
        .collect())
}

/// A 16-bit float type of model weights and gradients (`bf16`, `f16`): the
/// engine keeps them in f32 and converts on the way in and out.
pub trait Half: cudarc::driver::DeviceRepr + Copy + 'static {
    /// Its kernels' index in the conversion tables.
    const INDEX: usize;
}

impl Half for half::bf16 {
    const INDEX: usize = 0;
}

impl Half for half::f16 {
    const INDEX: usize = 1;
}

/// Which norm [`FusedKernels::norm_partial`] accumulates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// Sum of absolute values.
    L1 = 0,
    /// Sum of squares (the caller takes the square root).
    L2 = 1,
    /// Largest absolute value.
    Inf = 2,
}

/// Device accumulators of [`FusedKernels::norm_partial`].
#[derive(Debug)]
pub struct NormAccumulator {
    sum: CudaSlice<f64>,
    max: CudaSlice<u32>,
}

impl NormAccumulator {
    /// Zeroed accumulators.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            sum: stream.alloc_zeros(1)?,
            max: stream.alloc_zeros(1)?,
        })
    }

    /// Zeroes both accumulators (asynchronously).
    pub fn reset(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.memset_zeros(&mut self.sum)?;
        stream.memset_zeros(&mut self.max)?;
        Ok(())
    }

    /// The accumulated value of `kind` (waits for the stream: a host sync).
    /// A NaN anywhere in the inputs reads as NaN for every kind, an infinity
    /// (and no NaN) as +inf, so a caller can refuse a non-finite norm.
    pub fn read(&self, stream: &Arc<CudaStream>, kind: NormKind) -> Result<f64> {
        Ok(match kind {
            NormKind::Inf => f32::from_bits(stream.clone_dtoh(&self.max)?[0]) as f64,
            _ => stream.clone_dtoh(&self.sum)?[0],
        })
    }
}

/// Every kernel [`FusedKernels::new`] loads from [`SOURCE`], in the order it
/// loads them.
pub const KERNEL_NAMES: [&str; 23] = [
    "gather_pieces_b16",
    "gather_pieces_b32",
    "gather_pieces_b64",
    "scatter_pieces_b16",
    "scatter_pieces_b32",
    "scatter_pieces_b64",
    "gather_add_pieces_f32",
    "gather_widen_bf16",
    "gather_widen_f16",
    "gather_add_widen_bf16",
    "gather_add_widen_f16",
    "scatter_narrow_bf16",
    "scatter_narrow_f16",
    "scale_f32",
    "norm_partial_f32",
    "sgd_f32",
    "adam_f32",
    "adagrad_f32",
    "rmsprop_f32",
    "reduce_ranks_f32",
    "reduce_ranks_f64",
    "reduce_ranks_bf16",
    "reduce_ranks_f16",
];

/// The most sources or destinations [`FusedKernels::reduce_ranks`] takes
/// in one launch (`MAX_LOCAL_RANKS` in [`SOURCE`]): the largest world of a
/// [`CudaThreadGroup`](crate::CudaThreadGroup).
pub const MAX_LOCAL_RANKS: usize = 16;

/// The device addresses of a reduction's sources or destinations, passed by
/// value (`RankPtrs` in [`SOURCE`]).
#[repr(C)]
#[derive(Clone, Copy)]
struct RankPtrs([u64; MAX_LOCAL_RANKS]);

// SAFETY: plain data laid out as the kernel's `struct RankPtrs`.
unsafe impl cudarc::driver::DeviceRepr for RankPtrs {}

/// The oldest compute capability the kernels run on, as `10 * major + minor`:
/// the norms use `atomicAdd` on `double`, which arrived with sm_60.
pub const MIN_COMPUTE_CAPABILITY: i32 = 60;

/// The virtual architecture (`compute_XY`) to compile the kernels for, on a
/// device of compute capability `device` = `(major, minor)`, given the real
/// architectures NVRTC reports (`supported`, as `10 * major + minor`; see
/// [`nvrtc_supported_archs`]).
///
/// The highest supported architecture not above the device's: its PTX runs
/// on the device (the driver compiles it for newer ones), and each CUDA
/// release drops old targets (NVRTC 13 rejects everything below
/// `compute_75`). Without a list, the device's own architecture. An error
/// when the device is older than [`MIN_COMPUTE_CAPABILITY`] or than every
/// architecture this NVRTC supports.
///
/// ```
/// use zero_nccl::kernels::nvrtc_arch;
/// assert_eq!(nvrtc_arch((9, 0), Some(&[75, 80, 90, 100])).unwrap(), "compute_90");
/// assert_eq!(nvrtc_arch((8, 6), Some(&[75, 80, 90])).unwrap(), "compute_80");
/// assert!(nvrtc_arch((6, 0), Some(&[75, 80, 90])).is_err());
/// ```
pub fn nvrtc_arch(device: (i32, i32), supported: Option<&[i32]>) -> Result<String> {
    const OP: &str = "compiling the fused kernels";
    let (major, minor) = device;
    let capability = 10 * major + minor;
    if capability < MIN_COMPUTE_CAPABILITY {
        return Err(Error::from(zero_core::Error::Unsupported {
            op: OP,
            detail: format!(
                "the GPU has compute capability {major}.{minor}; the fused kernels need 6.0 \
                 or newer (double-precision atomicAdd). Use a newer GPU"
            ),
        }));
    }
    let Some(supported) = supported else {
        return Ok(format!("compute_{capability}"));
    };
    let best = supported
        .iter()
        .copied()
        .filter(|&arch| (MIN_COMPUTE_CAPABILITY..=capability).contains(&arch))
        .max();
    match best {
        Some(arch) => Ok(format!("compute_{arch}")),
        None => Err(Error::from(zero_core::Error::Unsupported {
            op: OP,
            detail: format!(
                "the GPU has compute capability {major}.{minor}, too old for this NVRTC, which \
                 compiles for sm_{} and newer (it supports {supported:?}). Put an older CUDA \
                 toolkit's libnvrtc first on LD_LIBRARY_PATH (CUDA 12 still targets sm_60 and \
                 up: pip install nvidia-cuda-nvrtc-cu12), or use a newer GPU",
                supported.iter().min().copied().unwrap_or_default()
            ),
        })),
    }
}

/// The real architectures the loaded NVRTC compiles for, ascending, as
/// `10 * major + minor` (`nvrtcGetSupportedArchs`), or `None` when this NVRTC
/// cannot say (releases before CUDA 11.2 lack the call).
pub fn nvrtc_supported_archs() -> Result<Option<Vec<i32>>> {
    use cudarc::nvrtc::sys::{self, nvrtcResult};
    ensure_library(Library::Nvrtc)?;
    let asked = guarded("asking NVRTC for its architectures", || {
        let mut count: std::ffi::c_int = 0;
        // SAFETY: the call writes one int through the pointer.
        let status = unsafe { sys::nvrtcGetNumSupportedArchs(&mut count) };
        if status != nvrtcResult::NVRTC_SUCCESS || count <= 0 {
            return Ok(None);
        }
        let mut archs: Vec<std::ffi::c_int> = vec![0; count as usize];
        // SAFETY: the call writes `count` ints, the length of `archs`.
        let status = unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) };
        if status != nvrtcResult::NVRTC_SUCCESS {
            return Ok(None);
        }
        archs.sort_unstable();
        Ok(Some(archs))
    });
    match asked {
        // cudarc panics on a symbol the library lacks: an NVRTC too old to
        // list its targets, which then gets the device's own.
        Err(Error::Panicked { .. }) => Ok(None),
        other => other,
    }
}

/// NVRTC's options for the kernels on virtual architecture `arch`
/// (`compute_90`, ...): what [`FusedKernels::new`] passes, and what the PTX
/// check in `tests/nvrtc_ptx.rs` passes.
pub fn compile_options(arch: &str) -> cudarc::nvrtc::CompileOptions {
    cudarc::nvrtc::CompileOptions {
        // `arch` only takes a &'static str; the option is the same.
        // Every function of the sources is device code: NVRTC 13.0 (the
        // GPU machines' CUDA) takes an unannotated function, the generic
        // lambdas of `elementwise` included, for a host one without
        // `--device-as-default-execution-space`; NVRTC 13.5 infers it.
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--device-as-default-execution-space".into(),
        ],
        ..Default::default()
    }
}

/// Compiles [`SOURCE`] to PTX for `arch` with [`compile_options`], as
/// [`FusedKernels::new`] does (which picks `arch` with [`nvrtc_arch`]).
/// Needs libnvrtc, not a GPU.
pub fn compile_ptx_for(arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    compile_source(SOURCE, arch)
}

/// Compiles a kernel source of this crate ([`SOURCE`],
/// [`layers::LAYER_SOURCE`]) to PTX for `arch` with [`compile_options`],
/// once per process: every later call for the same source and
/// architecture (another rank of a `CudaThreadGroup`, another engine)
/// gets the same PTX without compiling again. Across processes the PTX is
/// kept on disk ([`crate::ptx_cache`], keyed by the source, the
/// architecture, the options and NVRTC's version).
pub(crate) fn compile_source(source: &'static str, arch: &str) -> Result<cudarc::nvrtc::Ptx> {
    type Key = (usize, usize, String);
    static COMPILED: OnceLock<Mutex<HashMap<Key, cudarc::nvrtc::Ptx>>> = OnceLock::new();
    ensure_library(Library::Nvrtc)?;
    let key = (source.as_ptr() as usize, source.len(), arch.to_string());
    // Held while compiling, so that ranks starting together compile once.
    let mut compiled = COMPILED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    if let Some(ptx) = compiled.get(&key) {
        return Ok(ptx.clone());
    }
    let options = compile_options(arch);
    let disk = PtxCache::from_env().map(|cache| {
        let flags = options.options.join(" ");
        let key = PtxCache::key(&[source, arch, &flags, &nvrtc_version()]);
        (cache, key)
    });
    let cached = disk.as_ref().and_then(|(cache, key)| cache.load(key));
    let ptx = match cached {
        Some(ptx) => cudarc::nvrtc::Ptx::from_src(ptx),
        None => {
            let ptx = guarded("compiling the fused kernels", || {
                Ok(cudarc::nvrtc::compile_ptx_with_opts(source, options)?)
            })?;
            if let Some((cache, key)) = &disk {
                cache.store(key, &ptx.to_src());
            }
            ptx
        }
    };
    compiled.insert(key, ptx.clone());
    Ok(ptx)
}

/// The loaded NVRTC's version as `major.minor` (`unknown` where it cannot
/// say): part of the disk cache's key, since another NVRTC may compile
/// otherwise.
pub fn nvrtc_version() -> String {
    let asked = guarded("asking NVRTC for its version", || {
        let (mut major, mut minor): (std::ffi::c_int, std::ffi::c_int) = (0, 0);
        // SAFETY: the call writes one int through each pointer.
        let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
        Ok((status == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS)
            .then(|| format!("{major}.{minor}")))
    });
    match asked {
        Ok(Some(version)) => version,
        _ => "unknown".to_string(),
    }
}

/// Compiles `source` with NVRTC for `ctx`'s device (see [`nvrtc_arch`]) and
/// loads it into `ctx`: the module and the `compute_XY` it was compiled for.
/// `what` names the kernels in errors ("loading the fused kernels").
pub(crate) fn compile_and_load(
    ctx: &Arc<CudaContext>,
    source: &'static str,
    what: &'static str,
) -> Result<(Arc<CudaModule>, String)> {
    ensure_library(Library::Cuda)?;
    ensure_library(Library::Nvrtc)?;
    use cudarc::driver::sys::{CUdevice_attribute as Attribute, CUresult};
    let major = ctx.attribute(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = ctx.attribute(Attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let supported = nvrtc_supported_archs()?;
    let arch = nvrtc_arch((major, minor), supported.as_deref())?;
    let ptx = compile_source(source, &arch)?;
    let module = guarded(what, || {
        ctx.load_module(ptx).map_err(|e| match e.0 {
            // PTX carries the ISA version of the NVRTC that wrote it.
            CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
                Error::from(zero_core::Error::Unsupported {
                    op: what,
                    detail: format!(
                        "the driver cannot read the PTX NVRTC wrote for {arch}: libnvrtc is \
                     newer than the NVIDIA driver. Update the driver, or put an NVRTC no \
                     newer than the driver's CUDA version first on LD_LIBRARY_PATH"
                    ),
                })
            }
            _ => Error::from(e),
        })
    })?;
    Ok((module, arch))
}

/// Enough blocks to fill `ctx`'s device a few times over (16 per SM): the
/// cap of grid-stride launches.
pub(crate) fn max_blocks(ctx: &Arc<CudaContext>) -> Result<u32> {
    use cudarc::driver::sys::CUdevice_attribute as Attribute;
    let sms = ctx.attribute(Attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    Ok((sms.max(1) as u32).saturating_mul(16))
}

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// A launch of `grid` blocks of [`BLOCK`] threads.
fn blocks(grid: (u32, u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The compiled kernels, loaded into one device's context.
#[derive(Debug)]
pub struct FusedKernels {
    ctx: Arc<CudaContext>,
    /// The `compute_XY` NVRTC compiled for.
    arch: String,
    gather: [CudaFunction; 3],
    scatter: [CudaFunction; 3],
    gather_add: CudaFunction,
    /// Per [`Half::INDEX`]: 16-bit pieces widened into an f32 flat buffer
    /// (written, or added), and f32 narrowed into 16-bit pieces.
    widen: [CudaFunction; 2],
    widen_add: [CudaFunction; 2],
    narrow: [CudaFunction; 2],
    scale: CudaFunction,
    norm: CudaFunction,
    sgd: CudaFunction,
    adam: CudaFunction,
    adagrad: CudaFunction,
    rmsprop: CudaFunction,
    /// Per dtype (f32, f64, bf16, f16): the in-process collectives' reduction.
    reduce_ranks: [CudaFunction; 4],
    /// Enough blocks to fill the device a few times over.
    max_blocks: u32,
}

impl FusedKernels {
    /// Compiles [`SOURCE`] with NVRTC for `ctx`'s device (see [`nvrtc_arch`])
    /// and loads it into `ctx`. Do it once and share the result: compilation
    /// takes a few hundred milliseconds.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let (module, arch) = compile_and_load(ctx, SOURCE, "loading the fused kernels")?;
        guarded("loading the fused kernels", || {
            // In KERNEL_NAMES order.
            let loaded = KERNEL_NAMES.map(|name| module.load_function(name));
            let [g16, g32, g64, s16, s32, s64, rest @ ..] = loaded;
            let [gather_add, wb, wh, wab, wah, nb, nh, rest @ ..] = rest;
            let [scale, norm, sgd, adam, adagrad, rmsprop, rest @ ..] = rest;
            let [r32, r64, rb16, rf16] = rest;
            Ok(Self {
                ctx: ctx.clone(),
                arch,
                gather: [g16?, g32?, g64?],
                scatter: [s16?, s32?, s64?],
                gather_add: gather_add?,
                widen: [wb?, wh?],
                widen_add: [wab?, wah?],
                narrow: [nb?, nh?],
                scale: scale?,
                norm: norm?,
                sgd: sgd?,
                adam: adam?,
                adagrad: adagrad?,
                rmsprop: rmsprop?,
                reduce_ranks: [r32?, r64?, rb16?, rf16?],
                max_blocks: max_blocks(ctx)?,
            })
        })
    }

    /// The virtual architecture the kernels were compiled for (`compute_90`, ...).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A 1-D grid-stride launch over `n` elements.
    pub(crate) fn config(&self, n: usize) -> LaunchConfig {
        let x = n
            .div_ceil(BLOCK as usize)
            .clamp(1, self.max_blocks as usize) as u32;
        blocks((x, 1, 1))
    }

    fn copy_kernel<T: Element>(table: &[CudaFunction; 3]) -> &CudaFunction {
        match std::mem::size_of::<T>() {
            2 => &table[0],
            4 => &table[1],
            _ => &table[2],
        }
    }

    /// Copies each piece `(offset, src)` into `flat[offset..offset + src.len()]`,
    /// in one launch on `stream`. Pieces may be slices or views.
    pub fn flatten<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        pieces: &[(usize, &dyn DevicePtr<T>)],
        flat: &mut CudaSlice<T>,
    ) -> Result<()> {
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::with_capacity(pieces.len());
        let mut entries = Vec::with_capacity(pieces.len());
        for &(offset, piece) in pieces {
            let (ptr, guard) = piece.device_ptr(stream);
            guards.push(guard);
            entries.push((ptr, offset, piece.len()));
        }
        let kernel = Self::copy_kernel::<T>(&self.gather);
        self.launch_table("flatten", stream, kernel, &entries, flat.len(), || {
            flat.device_ptr_mut(stream)
        })?;
        drop(guards);
        Ok(())
    }

    /// Copies (or with `add`, adds) element range `range` of each `src` into
    /// `flat[offset..offset + range.len()]`, for pieces `(offset, src, range)`,
    /// in one launch on `stream`: the engine's gradient flatten (and
    /// accumulation) of one bucket.
    pub fn flatten_ranges(
        &self,
        stream: &Arc<CudaStream>,
        pieces: &[(usize, &dyn DevicePtr<f32>, Range<usize>)],
        flat: &mut (impl DevicePtrMut<f32> + ?Sized),
        add: bool,
    ) -> Result<()> {
        let (entries, guards) = range_entries("flatten_ranges", stream, pieces)?;
        let kernel = if add {
            &self.gather_add
        } else {
            Self::copy_kernel::<f32>(&self.gather)
        };
        self.launch_table(
            "flatten_ranges",
            stream,
            kernel,
            &entries,
            flat.len(),
            || flat.device_ptr_mut(stream),
        )?;
        drop(guards);
        Ok(())
    }

    /// Combines `len` elements from each address of `srcs` with `op`, in the
    /// order given, in an f32 accumulator (f64 for f64; `Avg` divides by
    /// the number of sources there), and writes the result to each address
    /// of `dsts`: one launch on `stream`. A source may be a destination.
    ///
    /// # Safety
    ///
    /// Every address holds `len` live elements of `dtype` that `stream`'s
    /// device can read (sources) and write (destinations) while the launch
    /// runs; destinations do not overlap each other, and a source overlaps a
    /// destination only where both are the same memory.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_ranks(
        &self,
        stream: &Arc<CudaStream>,
        dtype: DType,
        srcs: &[u64],
        dsts: &[u64],
        len: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let too_many = |what: &str, n: usize| {
            Error::from(zero_core::Error::Unsupported {
                op: "reduce_ranks",
                detail: format!("{n} {what}: at most {MAX_LOCAL_RANKS} ranks share one process"),
            })
        };
        if srcs.is_empty() || srcs.len() > MAX_LOCAL_RANKS {
            return Err(too_many("sources", srcs.len()));
        }
        if dsts.len() > MAX_LOCAL_RANKS {
            return Err(too_many("destinations", dsts.len()));
        }
        if len == 0 || dsts.is_empty() {
            return Ok(());
        }
        let table = |addrs: &[u64]| {
            let mut ptrs = RankPtrs([0; MAX_LOCAL_RANKS]);
            ptrs.0[..addrs.len()].copy_from_slice(addrs);
            ptrs
        };
        let (src_table, dst_table) = (table(srcs), table(dsts));
        let (n_srcs, n_dsts) = (srcs.len() as u32, dsts.len() as u32);
        let len64 = len as u64;
        let op_code: i32 = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Avg => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Product => 4,
        };
        let divide_by: u32 = if op == ReduceOp::Avg { n_srcs } else { 0 };
        let kernel = &self.reduce_ranks[match dtype {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::BF16 => 2,
            DType::F16 => 3,
        }];
        let mut launch = stream.launch_builder(kernel);
        launch
            .arg(&src_table)
            .arg(&dst_table)
            .arg(&n_srcs)
            .arg(&n_dsts)
            .arg(&len64)
            .arg(&op_code)
            .arg(&divide_by);
        // SAFETY: the arguments match `reduce_ranks_*`; the addresses are
        // as this function's contract requires.
        unsafe { launch.launch(self.config(len)) }?;
        Ok(())
    }

    /// Multiplies every element of `buf` by `factor`.
    pub fn scale(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut dyn DevicePtrMut<f32>,
        factor: f32,
    ) -> Result<()> {
        let n = buf.len();
        if n == 0 {
            return Ok(());
        }
        let (x, _guard) = buf.device_ptr_mut(stream);
        let n64 = n as u64;
        let mut launch = stream.launch_builder(&self.scale);
        launch.arg(&x).arg(&n64).arg(&factor);
        // SAFETY: x addresses n f32; the arguments match `scale_f32`.
        unsafe { launch.launch(self.config(n)) }?;
        Ok(())
    }

    /// Adds the partial norm of `buf` into `out` without synchronizing:
    /// [`NormKind::L1`] adds `sum |x|` and [`NormKind::L2`] `sum x^2` to
    /// `out.sum[0]`; [`NormKind::Inf`] raises `out.max[0]` (float bits) to
    /// `max |x|`.
    ///
    /// Non-finite values propagate as `torch.linalg.vector_norm` does: a NaN
    /// makes every kind NaN (the inf-norm included: its maximum keeps NaN
    /// instead of skipping it as `fmax` would), an infinity makes it +inf.
    pub fn norm_partial(
        &self,
        stream: &Arc<CudaStream>,
        buf: &dyn DevicePtr<f32>,
        kind: NormKind,
        out: &mut NormAccumulator,
    ) -> Result<()> {
        let n = buf.len();
        if n == 0 {
            return Ok(());
        }
        let (x, _gx) = buf.device_ptr(stream);
        let (sum, _gs) = out.sum.device_ptr_mut(stream);
        let (max, _gm) = out.max.device_ptr_mut(stream);
        let n64 = n as u64;
        let kind = kind as i32;
        let mut launch = stream.launch_builder(&self.norm);
        launch.arg(&x).arg(&n64).arg(&kind).arg(&sum).arg(&max);
        // SAFETY: x addresses n f32, sum one f64 and max one u32; the block
        // size is the 256 the kernel's shared array assumes; the arguments
        // match `norm_partial_f32`.
        unsafe { launch.launch(self.config(n)) }?;
        Ok(())
    }

    /// [`FusedKernels::flatten_ranges`] from 16-bit pieces: widens (or with
    /// `add`, adds) element range `range` of each `src` into
    /// `flat[offset..offset + range.len()]`, in one launch on `stream`.
    pub fn widen_ranges<H: Half>(
        &self,
        stream: &Arc<CudaStream>,
        pieces: &[(usize, &dyn DevicePtr<H>, Range<usize>)],
        flat: &mut (impl DevicePtrMut<f32> + ?Sized),
        add: bool,
    ) -> Result<()> {
        let (entries, guards) = range_entries("widen_ranges", stream, pieces)?;
        let kernel = if add {
            &self.widen_add[H::INDEX]
        } else {
            &self.widen[H::INDEX]
        };
        self.launch_table("widen_ranges", stream, kernel, &entries, flat.len(), || {
            flat.device_ptr_mut(stream)
        })?;
        drop(guards);
        Ok(())
    }

    /// Narrows `flat[offset..offset + range.len()]` into element range
    /// `range` of each piece `(offset, dst, range)`, rounding to nearest
    /// even, in one launch on `stream` (a table's worth at a time): the
    /// write-back of 16-bit weights from f32 values.
    pub fn narrow_ranges<H: Half>(
        &self,
        stream: &Arc<CudaStream>,
        flat: &(impl DevicePtr<f32> + ?Sized),
        pieces: &mut [(usize, &mut dyn DevicePtrMut<H>, Range<usize>)],
    ) -> Result<()> {
        self.write_ranges(
            "narrow_ranges",
            &self.narrow[H::INDEX],
            stream,
            flat,
            pieces,
        )
    }

    /// Copies `flat[offset..offset + range.len()]` into element range
    /// `range` of each piece `(offset, dst, range)`, in one launch on
    /// `stream` (a table's worth at a time): the write-back of f32 weights.
    pub fn scatter_ranges(
        &self,
        stream: &Arc<CudaStream>,
        flat: &(impl DevicePtr<f32> + ?Sized),
        pieces: &mut [(usize, &mut dyn DevicePtrMut<f32>, Range<usize>)],
    ) -> Result<()> {
        let kernel = Self::copy_kernel::<f32>(&self.scatter);
        self.write_ranges("scatter_ranges", kernel, stream, flat, pieces)
    }

    /// Launches the table-driven `kernel`, which reads f32 from `flat` and
    /// writes `T`, over pieces `(offset, dst, range)`, each range inside
    /// its destination.
    fn write_ranges<T>(
        &self,
        op: &'static str,
        kernel: &CudaFunction,
        stream: &Arc<CudaStream>,
        flat: &(impl DevicePtr<f32> + ?Sized),
        pieces: &mut [(usize, &mut dyn DevicePtrMut<T>, Range<usize>)],
    ) -> Result<()> {
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::with_capacity(pieces.len());
        let mut entries = Vec::with_capacity(pieces.len());
        for (offset, dst, range) in pieces.iter_mut() {
            if range.end > dst.len() || range.start > range.end {
                return Err(Error::from(zero_core::Error::BufferSize {
                    op,
                    what: "destination piece",
                    got: dst.len(),
                    expected: range.end,
                }));
            }
            let (ptr, guard) = dst.device_ptr_mut(stream);
            guards.push(guard);
            let start = ptr + (range.start * std::mem::size_of::<T>()) as u64;
            entries.push((start, *offset, range.len()));
        }
        self.launch_table(op, stream, kernel, &entries, flat.len(), || {
            flat.device_ptr(stream)
        })?;
        drop(guards);
        Ok(())
    }

    /// Narrows `flat[offset..offset + at.len()]` into `dst[at]` for each
    /// `(offset, at)`, rounding to nearest even, in one launch on `stream`
    /// (a table's worth at a time): stage 3's chunks rounded into their
    /// slots of one 16-bit gather buffer.
    pub fn narrow_into<H: Half>(
        &self,
        stream: &Arc<CudaStream>,
        flat: &(impl DevicePtr<f32> + ?Sized),
        dst: &mut (impl DevicePtrMut<H> + ?Sized),
        pieces: &[(usize, Range<usize>)],
    ) -> Result<()> {
        if let Some((_, at)) = pieces.iter().find(|(_, at)| at.end > dst.len()) {
            return Err(Error::from(zero_core::Error::BufferSize {
                op: "narrow_into",
                what: "destination buffer",
                got: dst.len(),
                expected: at.end,
            }));
        }
        let (ptr, guard) = dst.device_ptr_mut(stream);
        let entries: Vec<(u64, usize, usize)> = pieces
            .iter()
            .map(|(offset, at)| {
                let start = ptr + (at.start * std::mem::size_of::<H>()) as u64;
                (start, *offset, at.len())
            })
            .collect();
        self.launch_table(
            "narrow_into",
            stream,
            &self.narrow[H::INDEX],
            &entries,
            flat.len(),
            || flat.device_ptr(stream),
        )?;
        drop(guard);
        Ok(())
    }

    /// Copies `flat[offset..offset + dst.len()]` into each piece `(offset, dst)`,
    /// in one launch on `stream`.
    pub fn unflatten<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        flat: &CudaSlice<T>,
        pieces: &mut [(usize, &mut dyn DevicePtrMut<T>)],
    ) -> Result<()> {
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::with_capacity(pieces.len());
        let mut entries = Vec::with_capacity(pieces.len());
        for (offset, piece) in pieces.iter_mut() {
            let len = piece.len();
            let (ptr, guard) = piece.device_ptr_mut(stream);
            guards.push(guard);
            entries.push((ptr, *offset, len));
        }
        let kernel = Self::copy_kernel::<T>(&self.scatter);
        self.launch_table("unflatten", stream, kernel, &entries, flat.len(), || {
            flat.device_ptr(stream)
        })?;
        drop(guards);
        Ok(())
    }

    /// Launches the table-driven `kernel` over the pieces `entries` and the
    /// flat buffer of `flat_len` elements at the address `flat` returns
    /// (called only when there is something to launch): `(table, n_pieces,
    /// flat)`, the signature of every gather, scatter, widen and narrow
    /// kernel; one launch per [`PIECES_PER_LAUNCH`] pieces, in order on
    /// `stream`.
    fn launch_table<'a>(
        &self,
        op: &'static str,
        stream: &'a Arc<CudaStream>,
        kernel: &CudaFunction,
        entries: &[(u64, usize, usize)],
        flat_len: usize,
        flat: impl FnOnce() -> (u64, SyncOnDrop<'a>),
    ) -> Result<()> {
        let launches = piece_launches(op, entries, flat_len)?;
        if launches.is_empty() {
            return Ok(());
        }
        let (flat_ptr, _flat_guard) = flat();
        for PieceLaunch {
            table,
            n_pieces,
            grid,
        } in &launches
        {
            let mut launch = stream.launch_builder(kernel);
            launch.arg(table).arg(n_pieces).arg(&flat_ptr);
            // SAFETY: the table's pointers and lengths come from live device
            // buffers whose guards the caller holds across this launch, and
            // the flat buffer's guard lives to the end of this function;
            // offsets + lengths were checked against `flat_len`; the caller
            // picks a kernel whose element types are those of the pieces and
            // of `flat`; the table is the kernel's `Pieces`, by value.
            unsafe { launch.launch(blocks(*grid)) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `#define NAME VALUE` in [`SOURCE`].
    fn source_define(name: &str) -> usize {
        let line = SOURCE
            .lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("no #define {name} in source.cu"));
        line.trim().parse().unwrap()
    }

    #[test]
    fn the_kernels_tables_are_the_size_rust_passes() {
        assert_eq!(source_define("PIECES_PER_LAUNCH"), PIECES_PER_LAUNCH);
        assert_eq!(source_define("MAX_LOCAL_RANKS"), MAX_LOCAL_RANKS);
        // CUDA's launch parameters hold 4 KiB before Volta-era extensions.
        assert!(std::mem::size_of::<Pieces>() + 16 <= 4096);
    }

    #[test]
    fn pieces_are_launched_in_order_at_most_a_table_at_a_time() {
        // 130 pieces, every fifth empty: 104 to launch, 64 + 40.
        let entries: Vec<(u64, usize, usize)> = (0..130)
            .map(|i| {
                (
                    0x1000 + 8 * i as u64,
                    10 * i,
                    if i % 5 == 4 { 0 } else { i % 7 + 1 },
                )
            })
            .collect();
        let launches = piece_launches("test", &entries, 10 * 130).unwrap();
        let counts: Vec<u32> = launches.iter().map(|l| l.n_pieces).collect();
        assert_eq!(counts, [64, 40]);
        let launched: Vec<(u64, usize, usize)> = launches
            .iter()
            .flat_map(|l| {
                l.table.0[..3 * l.n_pieces as usize]
                    .chunks(3)
                    .map(|e| (e[0], e[1] as usize, e[2] as usize))
            })
            .collect();
        let expected: Vec<_> = entries.iter().copied().filter(|e| e.2 > 0).collect();
        assert_eq!(launched, expected);
        for l in &launches {
            // Unused slots stay zero; y walks the pieces.
            assert!(l.table.0[3 * l.n_pieces as usize..].iter().all(|&v| v == 0));
            assert_eq!(l.grid, (1, l.n_pieces, 1));
        }
    }

    #[test]
    fn a_launch_strides_over_its_longest_piece() {
        let block = BLOCK as usize;
        let entries = [(1, 0, 3), (2, 3, 5 * block + 1), (3, 5 * block + 4, 7)];
        let launches = piece_launches("test", &entries, 1 << 20).unwrap();
        assert_eq!(launches.len(), 1);
        assert_eq!(launches[0].grid, (6, 3, 1));
        // Grids stop at 1,024 blocks along x; the kernels stride past it.
        let launches = piece_launches("test", &[(1, 0, 4096 * block)], 1 << 30).unwrap();
        assert_eq!(launches[0].grid, (1024, 1, 1));
    }

    #[test]
    fn nothing_to_copy_is_no_launch_and_a_piece_past_the_buffer_an_error() {
        assert!(piece_launches("test", &[], 0).unwrap().is_empty());
        assert!(piece_launches("test", &[(1, 4, 0), (2, 0, 0)], 4)
            .unwrap()
            .is_empty());
        // The bad piece comes after 64 good ones: nothing is launched.
        let mut entries: Vec<_> = (0..64).map(|i| (1, i, 1)).collect();
        entries.push((2, 60, 5));
        let e = piece_launches("flatten", &entries, 64)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("flatten") && e.contains("65") && e.contains("64"),
            "{e}"
        );
    }

    /// What NVRTC 13.5 (the nvidia-cuda-nvrtc wheel) lists.
    const NVRTC_13: [i32; 13] = [75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121];

    #[test]
    fn arch_is_the_device_s_when_nvrtc_supports_it() {
        assert_eq!(
            nvrtc_arch((9, 0), Some(&[75, 80, 90, 100])).unwrap(),
            "compute_90"
        );
        assert_eq!(nvrtc_arch((8, 9), Some(&NVRTC_13)).unwrap(), "compute_89");
        assert_eq!(nvrtc_arch((7, 5), Some(&NVRTC_13)).unwrap(), "compute_75");
    }

    #[test]
    fn arch_falls_back_to_the_newest_supported_below_the_device() {
        // A device newer than the toolkit runs older PTX through the driver's JIT.
        assert_eq!(
            nvrtc_arch((12, 1), Some(&[75, 80, 90])).unwrap(),
            "compute_90"
        );
        assert_eq!(
            nvrtc_arch((8, 6), Some(&[75, 80, 90, 100])).unwrap(),
            "compute_80"
        );
        // The list need not be sorted.
        assert_eq!(
            nvrtc_arch((9, 0), Some(&[100, 90, 75, 80])).unwrap(),
            "compute_90"
        );
    }

    #[test]
    fn arch_without_a_list_is_the_device_s() {
        assert_eq!(nvrtc_arch((9, 0), None).unwrap(), "compute_90");
        assert_eq!(nvrtc_arch((6, 1), None).unwrap(), "compute_61");
    }

    #[test]
    fn a_gpu_older_than_the_toolkit_is_a_clear_error() {
        let err = nvrtc_arch((6, 0), Some(&NVRTC_13)).unwrap_err().to_string();
        assert!(err.contains("compute capability 6.0"), "{err}");
        assert!(err.contains("too old for this NVRTC"), "{err}");
        assert!(err.contains("sm_75 and newer"), "{err}");
        assert!(err.contains("nvidia-cuda-nvrtc-cu12"), "{err}");
        let err = nvrtc_arch((7, 0), Some(&[])).unwrap_err().to_string();
        assert!(err.contains("too old for this NVRTC"), "{err}");
    }

    #[test]
    fn a_gpu_older_than_the_kernels_is_a_clear_error() {
        // Even when the toolkit still compiles for it: double atomicAdd needs sm_60.
        for supported in [None, Some(&[35, 50, 52, 60, 70][..])] {
            let err = nvrtc_arch((5, 2), supported).unwrap_err().to_string();
            assert!(err.contains("need 6.0 or newer"), "{err}");
        }
        // An old arch in the list is never picked below sm_60.
        assert_eq!(
            nvrtc_arch((6, 1), Some(&[35, 50, 60, 70])).unwrap(),
            "compute_60"
        );
    }

    #[test]
    fn compile_options_name_the_arch() {
        let options = compile_options("compute_90");
        assert_eq!(
            options.options,
            [
                "--gpu-architecture=compute_90",
                "--device-as-default-execution-space"
            ]
        );
        assert_eq!(options.arch, None);
    }

    #[test]
    fn nan_outranks_every_magnitude_as_bits() {
        // The inf-norm keeps max |x| as float bits under an unsigned atomicMax:
        // non-negative floats order like their bits, and a NaN with the sign
        // cleared (fabs) sits above +inf, so it survives the maximum.
        let nan = f32::NAN.abs().to_bits();
        for x in [0.0f32, 1e-30, 1.0, f32::MAX, f32::INFINITY] {
            assert!(nan > x.to_bits(), "{x}");
        }
        assert!(f32::from_bits(nan).is_nan());
        assert!(f32::INFINITY.to_bits() > f32::MAX.to_bits());
    }
}
