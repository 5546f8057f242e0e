//! A Linear layer's forward GEMM through cuBLASLt, its bias added in the
//! GEMM's epilogue (`CUBLASLT_EPILOGUE_BIAS`): one kernel where a plain GEMM
//! is followed by a broadcast add over the whole output.
//!
//! [`LinearGemm`] maps the layer's row-major `y[rows, out] = x[rows, in] ·
//! W[out, in]ᵀ + b[out]` onto cuBLASLt's column-major `D = op(A)·op(B) +
//! bias`, and [`LinearGemm::reference`] computes what cuBLASLt computes for
//! a plan, so that the host tests check the mapping without a GPU.
//! [`Gemm`] holds a cuBLASLt handle and its workspace for one stream and
//! runs a plan on it, choosing the algorithm once per shape.

use crate::probe::guarded;
use crate::{Error, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

/// `y = x·Wᵀ (+ b)` as cuBLASLt's column-major GEMM. A row-major `[r, c]`
/// matrix is the column-major `[c, r]` one, so `yᵀ[out, rows] = W·xᵀ`:
/// `A` is `W` (stored as the column-major `[in, out]` matrix `Wᵀ`, used
/// transposed), `B` is `x` (the column-major `[in, rows]` matrix `xᵀ`, used
/// as it is), `D` is `y` (the column-major `[out, rows]` matrix `yᵀ`), and
/// the epilogue adds `bias[i]` to `D`'s row `i`, the output feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinearGemm {
    /// Rows of `op(A)` and `D`: the output features.
    pub m: u64,
    /// Columns of `op(B)` and `D`: the input's rows.
    pub n: u64,
    /// The inner dimension: the input features.
    pub k: u64,
    /// `A` is used transposed.
    pub transa: bool,
    /// `B` is used transposed.
    pub transb: bool,
    /// Leading dimensions of `A`, `B` and `D` (column-major).
    pub lda: i64,
    /// See `lda`.
    pub ldb: i64,
    /// See `lda`.
    pub ldd: i64,
}

impl LinearGemm {
    /// The plan of a Linear layer over `rows` rows, `in_dim` input and
    /// `out_dim` output features, its operands contiguous and row-major;
    /// `None` where cuBLASLt cannot take it (an empty dimension, or one
    /// past its 32-bit limits), which keeps the GEMM and add of old.
    pub fn new(rows: usize, in_dim: usize, out_dim: usize) -> Option<Self> {
        let fits = |d: usize| d > 0 && d <= i32::MAX as usize;
        if !(fits(rows) && fits(in_dim) && fits(out_dim)) {
            return None;
        }
        Some(Self {
            m: out_dim as u64,
            n: rows as u64,
            k: in_dim as u64,
            transa: true,
            transb: false,
            lda: in_dim as i64,
            ldb: in_dim as i64,
            ldd: out_dim as i64,
        })
    }

    /// Elements each operand spans: `A`, `B` and `D`.
    pub fn lens(&self) -> (usize, usize, usize) {
        let (a_cols, b_cols) = (
            if self.transa { self.m } else { self.k },
            if self.transb { self.k } else { self.n },
        );
        (
            (self.lda as u64 * a_cols) as usize,
            (self.ldb as u64 * b_cols) as usize,
            (self.ldd as u64 * self.n) as usize,
        )
    }

    /// What cuBLASLt computes for this plan, in f64, on host copies of the
    /// operands as it reads them (column-major, through the leading
    /// dimensions and transposes): `D = op(A)·op(B) (+ bias per row)`.
    pub fn reference(&self, a: &[f64], b: &[f64], bias: Option<&[f64]>) -> Vec<f64> {
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        let (lda, ldb, ldd) = (self.lda as usize, self.ldb as usize, self.ldd as usize);
        let op_a = |i: usize, l: usize| match self.transa {
            true => a[l + i * lda],
            false => a[i + l * lda],
        };
        let op_b = |l: usize, j: usize| match self.transb {
            true => b[j + l * ldb],
            false => b[l + j * ldb],
        };
        let mut d = vec![0.0; ldd * n];
        for j in 0..n {
            for i in 0..m {
                let dot: f64 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                d[i + j * ldd] = dot + bias.map_or(0.0, |bias| bias[i]);
            }
        }
        d
    }
}

/// The most bytes a pointer is aligned to, up to 256 (cuBLASLt's default
/// assumption, which an offset view may not meet).
pub fn alignment(address: u64) -> u32 {
    if address == 0 {
        return 256;
    }
    (1u64 << address.trailing_zeros()).min(256) as u32
}

/// How the GEMM accumulates, as Candle's GEMMs do for the same dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmCompute {
    /// f32 accumulation.
    F32,
    /// f32 accumulation on TF32 tensor cores (f32 operands; Candle's
    /// `set_gemm_reduced_precision_f32`).
    Tf32,
    /// f32 accumulation with bf16 products (f32 operands, reduced).
    Bf16,
}

impl GemmCompute {
    fn sys(self) -> sys::cublasComputeType_t {
        match self {
            GemmCompute::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            GemmCompute::Tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            GemmCompute::Bf16 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
        }
    }
}

/// An element type of the GEMM's operands.
pub trait GemmElement: cudarc::driver::DeviceRepr + Copy + 'static {
    /// Its cuBLASLt data type.
    const DATA: sys::cudaDataType_t;
}

impl GemmElement for f32 {
    const DATA: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_32F;
}

impl GemmElement for half::bf16 {
    const DATA: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_16BF;
}

impl GemmElement for half::f16 {
    const DATA: sys::cudaDataType_t = sys::cudaDataType_t::CUDA_R_16F;
}

/// What the algorithm was chosen for.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct AlgoKey {
    plan: LinearGemm,
    data: i32,
    compute: GemmCompute,
    bias: bool,
    /// The operands' alignments: A, B, bias, D.
    align: [u32; 4],
}

/// A cuBLASLt handle and its workspace, for one stream.
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    /// The heuristic's choice per key (`None`: it had none).
    algos: Mutex<HashMap<AlgoKey, Option<sys::cublasLtMatmulAlgo_t>>>,
}

// SAFETY: the handle is used only under `&self` calls that enqueue on the
// one stream, as cudarc's own `CudaBlasLT` is shared; cuBLASLt handles are
// thread-safe for concurrent use with distinct descriptors.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

/// The workspace: NVIDIA's recommendation for Hopper (32 MiB), which also
/// covers older GPUs.
const WORKSPACE_BYTES: usize = 32 << 20;

impl Gemm {
    /// A handle and a workspace for `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        // cuBLASLt sets itself up on the current context: the stream's.
        stream.context().bind_to_thread()?;
        let handle = guarded("cublasLtCreate", || Ok(result::create_handle()?))?;
        let workspace = match stream.alloc_zeros::<u8>(WORKSPACE_BYTES) {
            Ok(workspace) => workspace,
            Err(e) => {
                // SAFETY: created above, not used since.
                let _ = unsafe { result::destroy_handle(handle) };
                return Err(e.into());
            }
        };
        Ok(Self {
            handle,
            workspace,
            stream,
            algos: Mutex::new(HashMap::new()),
        })
    }

    /// The stream it runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Queues `y = x·Wᵀ (+ bias)` on the stream as `plan` lays it out:
    /// `w` is `A`, `x` is `B`, `y` is `D`, and returns `true`; `false`
    /// (nothing queued) where cuBLASLt has no algorithm for the shape,
    /// dtype and alignments, for the caller to take its own path. Checks
    /// every operand's length.
    pub fn linear<E: GemmElement>(
        &self,
        plan: &LinearGemm,
        compute: GemmCompute,
        x: &CudaView<'_, E>,
        w: &CudaView<'_, E>,
        bias: Option<&CudaView<'_, E>>,
        y: &mut CudaViewMut<'_, E>,
    ) -> Result<bool> {
        let (a_len, b_len, d_len) = plan.lens();
        let short = |what: &'static str, got: usize, expected: usize| {
            Error::from(zero_core::Error::BufferSize {
                op: "linear_gemm",
                what,
                got,
                expected,
            })
        };
        if w.len() < a_len {
            return Err(short("weight", w.len(), a_len));
        }
        if x.len() < b_len {
            return Err(short("input", x.len(), b_len));
        }
        if y.len() < d_len {
            return Err(short("output", y.len(), d_len));
        }
        if let Some(bias) = bias {
            if bias.len() < plan.m as usize {
                return Err(short("bias", bias.len(), plan.m as usize));
            }
        }
        let stream = &self.stream;
        let (a, _a) = w.device_ptr(stream);
        let (b, _b) = x.device_ptr(stream);
        let bias_ptr = bias.map(|bias| bias.device_ptr(stream));
        let (d, _d) = y.device_ptr_mut(stream);
        let (work, _work) = self.workspace.device_ptr(stream);
        let key = AlgoKey {
            plan: *plan,
            data: E::DATA as i32,
            compute,
            bias: bias.is_some(),
            align: [
                alignment(a),
                alignment(b),
                bias_ptr.as_ref().map_or(256, |(p, _)| alignment(*p)),
                alignment(d),
            ],
        };
        let described = Described::new::<E>(&key, bias_ptr.as_ref().map(|(p, _)| *p))?;
        let Some(algo) = self.algo(&key, &described)? else {
            return Ok(false);
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the descriptors are live (`described`), the pointers are
        // the operands' on this stream, held by their guards until the
        // GEMM is queued, and each spans what the plan reads or writes
        // (checked above); the workspace is the size announced.
        unsafe {
            result::matmul(
                self.handle,
                described.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                a as *const c_void,
                described.a,
                b as *const c_void,
                described.b,
                d as *const c_void,
                described.d,
                d as *mut c_void,
                described.d,
                &algo,
                work as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as sys::cudaStream_t,
            )?;
        }
        Ok(true)
    }

    /// The algorithm for `key`, chosen by cuBLASLt's heuristic the first
    /// time (the alignments are part of the key: an algorithm chosen for
    /// aligned operands may not run on others); `None` where it has none.
    fn algo(
        &self,
        key: &AlgoKey,
        described: &Described,
    ) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
        let mut algos = self.algos.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(algo) = algos.get(key) {
            return Ok(*algo);
        }
        let pref = Preference::new(&key.align)?;
        // SAFETY: the descriptors and the preference are live.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(
                self.handle,
                described.desc,
                described.a,
                described.b,
                described.d,
                described.d,
                pref.0,
            )
        };
        let algo = match heuristic {
            Ok(heuristic) => Some(heuristic.algo),
            Err(result::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) => None,
            Err(e) => return Err(e.into()),
        };
        algos.insert(*key, algo);
        Ok(algo)
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; the stream's work that
        // used it is ordered before the workspace's free on the stream.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// The GEMM's descriptor and its operands' layouts, destroyed on drop.
struct Described {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
}

impl Described {
    fn new<E: GemmElement>(key: &AlgoKey, bias: Option<u64>) -> Result<Self> {
        let plan = &key.plan;
        let desc = result::create_matmul_desc(key.compute.sys(), sys::cudaDataType_t::CUDA_R_32F)?;
        let mut described = Self {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
        };
        let (a_rows, a_cols) = match plan.transa {
            true => (plan.k, plan.m),
            false => (plan.m, plan.k),
        };
        let (b_rows, b_cols) = match plan.transb {
            true => (plan.n, plan.k),
            false => (plan.k, plan.n),
        };
        described.a = result::create_matrix_layout(E::DATA, a_rows, a_cols, plan.lda)?;
        described.b = result::create_matrix_layout(E::DATA, b_rows, b_cols, plan.ldb)?;
        described.d = result::create_matrix_layout(E::DATA, plan.m, plan.n, plan.ldd)?;
        // `cublasOperation_t`, an int32: CUBLAS_OP_N 0, CUBLAS_OP_T 1.
        let op = |t: bool| i32::from(t);
        let epilogue = match bias {
            Some(_) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            None => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
        };
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        // SAFETY: the descriptor is live; each value is the attribute's
        // documented type, passed with its size.
        unsafe {
            set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &op(plan.transa))?;
            set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &op(plan.transb))?;
            set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            if let Some(bias) = bias {
                set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
                set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &E::DATA)?;
            }
        }
        Ok(described)
    }
}

/// Sets one attribute of a matmul descriptor.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<()> {
    result::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )?;
    Ok(())
}

impl Drop for Described {
    fn drop(&mut self) {
        // SAFETY: each handle was created in `new` (null ones were not) and
        // is destroyed once.
        unsafe {
            for layout in [self.a, self.b, self.d] {
                if !layout.is_null() {
                    let _ = result::destroy_matrix_layout(layout);
                }
            }
            let _ = result::destroy_matmul_desc(self.desc);
        }
    }
}

/// The heuristic's preferences: the workspace it may use and the operands'
/// alignments (A, B, bias, D).
struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    fn new(align: &[u32; 4]) -> Result<Self> {
        let pref = Self(result::create_matmul_pref()?);
        use sys::cublasLtMatmulPreferenceAttributes_t as Attr;
        let workspace = WORKSPACE_BYTES as u64;
        let attrs = [
            (Attr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align[0]),
            (Attr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align[1]),
            (Attr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align[3]),
            (Attr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align[3]),
        ];
        // SAFETY: the preference is live; the workspace size is a u64 and
        // the alignments u32s, as documented.
        unsafe {
            result::set_matmul_pref_attribute(
                pref.0,
                Attr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )?;
            for (attr, bytes) in attrs {
                result::set_matmul_pref_attribute(
                    pref.0,
                    attr,
                    &bytes as *const u32 as *const c_void,
                    std::mem::size_of::<u32>(),
                )?;
            }
        }
        Ok(pref)
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The row-major `x·Wᵀ + b` a Linear layer computes.
    fn linear(x: &[f64], w: &[f64], b: &[f64], rows: usize, in_dim: usize) -> Vec<f64> {
        let out_dim = b.len();
        let mut y = vec![0.0; rows * out_dim];
        for r in 0..rows {
            for o in 0..out_dim {
                let dot: f64 = (0..in_dim)
                    .map(|i| x[r * in_dim + i] * w[o * in_dim + i])
                    .sum();
                y[r * out_dim + o] = dot + b[o];
            }
        }
        y
    }

    #[test]
    fn the_plan_computes_the_row_major_linear_layer() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for (rows, in_dim, out_dim) in [(1, 1, 1), (3, 5, 7), (8, 16, 4), (5, 3, 9), (2, 64, 1)] {
            let mut values = |n: usize| (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (x, w, b): (Vec<f64>, Vec<f64>, Vec<f64>) = (
                values(rows * in_dim),
                values(out_dim * in_dim),
                values(out_dim),
            );
            let plan = LinearGemm::new(rows, in_dim, out_dim).unwrap();
            assert_eq!(plan.lens(), (w.len(), x.len(), rows * out_dim));
            // cuBLASLt reads the row-major buffers as they are: W as A,
            // x as B, and writes y as D.
            let y = plan.reference(&w, &x, Some(&b));
            let expected = linear(&x, &w, &b, rows, in_dim);
            for (got, want) in y.iter().zip(&expected) {
                assert!((got - want).abs() < 1e-12, "{rows}x{in_dim}->{out_dim}");
            }
            let no_bias = plan.reference(&w, &x, None);
            let zeros = vec![0.0; out_dim];
            assert_eq!(no_bias, linear(&x, &w, &zeros, rows, in_dim));
        }
    }

    #[test]
    fn shapes_cublaslt_cannot_take_keep_the_old_path() {
        assert!(LinearGemm::new(0, 4, 4).is_none());
        assert!(LinearGemm::new(4, 0, 4).is_none());
        assert!(LinearGemm::new(4, 4, 0).is_none());
        assert!(LinearGemm::new(1 << 31, 4, 4).is_none());
        assert!(LinearGemm::new((1 << 31) - 1, 4, 4).is_some());
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0100 + 2), 2);
        assert_eq!(alignment(0x7f00_0000_0100 + 16), 16);
        assert_eq!(alignment(0x7f00_0000_0100 + 128), 128);
        assert_eq!(alignment(4), 4);
        assert_eq!(alignment(0), 256);
    }
}
