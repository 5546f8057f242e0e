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

/// Threads per block of every launch.
const BLOCK: u32 = 256;

/// The compiled kernels, loaded into one device's context.
#[derive(Debug)]
pub struct FusedKernels {
    ctx: Arc<CudaContext>,
    gather: [CudaFunction; 3],
    scatter: [CudaFunction; 3],
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
            let ptx = cudarc::nvrtc::compile_ptx(SOURCE)?;
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
        flat: &mut CudaSlice<T>,
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
