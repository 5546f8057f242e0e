//! Fused CUDA kernels, compiled once at run time with NVRTC: flatten and
//! unflatten of gradient buckets (one launch per bucket, driven by a table of
//! pieces in device memory) and the built-in optimizers' steps over a flat
//! f32 shard (one launch per shard; see [`optim`]).
//!
//! ```no_run
//! # fn main() -> zero_nccl::Result<()> {
//! use zero_nccl::cudarc::driver::CudaContext;
//! use zero_nccl::kernels::FusedKernels;
//! let ctx = CudaContext::new(0)?;
//! let kernels = FusedKernels::new(&ctx)?; // compile + load: once per process and device
//! # Ok(()) }
//! ```

pub mod optim;

use crate::probe::{ensure_library, guarded, Library};
use crate::{Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    PushKernelArg, SyncOnDrop,
};
use std::ops::Range;
use std::sync::Arc;
use zero_core::Element;

pub use optim::{
    AdagradHyper, AdagradState, AdamHyper, AdamState, DeviceState, RmspropHyper, RmspropState,
    SgdHyper, SgdState,
};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("source.cu");

/// The pieces of a flatten/unflatten, uploaded, with the launch grid.
struct PieceTable {
    table: CudaSlice<u64>,
    n_pieces: u32,
    grid: (u32, u32, u32),
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
    pub fn read(&self, stream: &Arc<CudaStream>, kind: NormKind) -> Result<f64> {
        Ok(match kind {
            NormKind::Inf => f32::from_bits(stream.clone_dtoh(&self.max)?[0]) as f64,
            _ => stream.clone_dtoh(&self.sum)?[0],
        })
    }
}

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// The compiled kernels, loaded into one device's context.
#[derive(Debug)]
pub struct FusedKernels {
    ctx: Arc<CudaContext>,
    gather: [CudaFunction; 3],
    scatter: [CudaFunction; 3],
    gather_add: CudaFunction,
    scale: CudaFunction,
    norm: CudaFunction,
    sgd: CudaFunction,
    adam: CudaFunction,
    adagrad: CudaFunction,
    rmsprop: CudaFunction,
    /// Enough blocks to fill the device a few times over.
    max_blocks: u32,
}

impl FusedKernels {
    /// Compiles [`SOURCE`] with NVRTC and loads it into `ctx`. Do it once and
    /// share the result: compilation takes a few hundred milliseconds.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        ensure_library(Library::Cuda)?;
        ensure_library(Library::Nvrtc)?;
        guarded("compiling the fused kernels", || {
            // compute_60: double-precision atomicAdd (norms); the driver
            // JIT-compiles the PTX for newer devices.
            let options = cudarc::nvrtc::CompileOptions {
                arch: Some("compute_60"),
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options)?;
            let module = ctx.load_module(ptx)?;
            let f = |name: &str| module.load_function(name);
            let sms = ctx.attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )?;
            Ok(Self {
                ctx: ctx.clone(),
                gather: [
                    f("gather_pieces_b16")?,
                    f("gather_pieces_b32")?,
                    f("gather_pieces_b64")?,
                ],
                scatter: [
                    f("scatter_pieces_b16")?,
                    f("scatter_pieces_b32")?,
                    f("scatter_pieces_b64")?,
                ],
                gather_add: f("gather_add_pieces_f32")?,
                scale: f("scale_f32")?,
                norm: f("norm_partial_f32")?,
                sgd: f("sgd_f32")?,
                adam: f("adam_f32")?,
                adagrad: f("adagrad_f32")?,
                rmsprop: f("rmsprop_f32")?,
                max_blocks: (sms.max(1) as u32).saturating_mul(16),
            })
        })
    }

    /// The context the kernels are loaded in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A 1-D launch over `n` elements.
    pub(crate) fn config(&self, n: usize) -> LaunchConfig {
        let blocks = n
            .div_ceil(BLOCK as usize)
            .clamp(1, self.max_blocks as usize) as u32;
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
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
        self.launch_copy("flatten", stream, kernel, &entries, flat)?;
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
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::with_capacity(pieces.len());
        let mut entries = Vec::with_capacity(pieces.len());
        for (offset, src, range) in pieces {
            if range.end > src.len() {
                return Err(Error::BufferSize {
                    op: "flatten_ranges",
                    what: "source piece",
                    got: src.len(),
                    expected: range.end,
                });
            }
            let (ptr, guard) = src.device_ptr(stream);
            guards.push(guard);
            let start = ptr + (range.start * std::mem::size_of::<f32>()) as u64;
            entries.push((start, *offset, range.len()));
        }
        let kernel = if add {
            &self.gather_add
        } else {
            Self::copy_kernel::<f32>(&self.gather)
        };
        self.launch_copy("flatten_ranges", stream, kernel, &entries, flat)?;
        drop(guards);
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
        self.launch_copy_read("unflatten", stream, kernel, &entries, flat)?;
        drop(guards);
        Ok(())
    }

    fn table(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        entries: &[(u64, usize, usize)],
        flat_len: usize,
    ) -> Result<Option<PieceTable>> {
        let mut table = Vec::with_capacity(3 * entries.len());
        let mut longest = 0;
        for &(ptr, offset, len) in entries {
            if offset + len > flat_len {
                return Err(Error::BufferSize {
                    op,
                    what: "flat (offset + piece length)",
                    got: flat_len,
                    expected: offset + len,
                });
            }
            if len == 0 {
                continue;
            }
            longest = longest.max(len);
            table.extend_from_slice(&[ptr, offset as u64, len as u64]);
        }
        let n_pieces = table.len() / 3;
        if n_pieces == 0 {
            return Ok(None);
        }
        // SAFETY: every element is written by the copy right below before
        // any kernel reads it (same stream).
        let mut device_table = unsafe { stream.alloc::<u64>(table.len()) }?;
        {
            let (dst, _record) = device_table.device_ptr_mut(stream);
            // SAFETY: `dst` holds table.len() u64. From pageable memory the
            // driver stages `table` before returning, so dropping it after is
            // fine, and no host synchronization happens.
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, &table, stream.cu_stream()) }?;
        }
        let x = longest.div_ceil(BLOCK as usize).clamp(1, 1024) as u32;
        let y = n_pieces.min(65535) as u32;
        Ok(Some(PieceTable {
            table: device_table,
            n_pieces: n_pieces as u32,
            grid: (x, y, 1),
        }))
    }

    fn launch_copy<T: Element>(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        kernel: &CudaFunction,
        entries: &[(u64, usize, usize)],
        flat: &mut (impl DevicePtrMut<T> + ?Sized),
    ) -> Result<()> {
        let Some(PieceTable {
            table,
            n_pieces,
            grid,
        }) = self.table(op, stream, entries, flat.len())?
        else {
            return Ok(());
        };
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let (flat_ptr, _flat_guard) = flat.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&table).arg(&n_pieces).arg(&flat_ptr);
        // SAFETY: the table's pointers and lengths come from live device
        // buffers of `T` whose guards the caller holds across this launch;
        // offsets + lengths were checked against `flat`; the kernel's element
        // type has the size of `T`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    fn launch_copy_read<T: Element>(
        &self,
        op: &'static str,
        stream: &Arc<CudaStream>,
        kernel: &CudaFunction,
        entries: &[(u64, usize, usize)],
        flat: &CudaSlice<T>,
    ) -> Result<()> {
        let Some(PieceTable {
            table,
            n_pieces,
            grid,
        }) = self.table(op, stream, entries, flat.len())?
        else {
            return Ok(());
        };
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(kernel);
        launch.arg(&table).arg(&n_pieces).arg(flat);
        // SAFETY: as in `launch_copy`, with the roles of flat and pieces swapped.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
