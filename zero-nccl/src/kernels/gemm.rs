//! A Linear layer's forward GEMM through cuBLASLt, its bias added in the
//! GEMM's epilogue (`CUBLASLT_EPILOGUE_BIAS`): one kernel where a plain GEMM
//! is followed by a broadcast add over the whole output. With
//! [`GemmEpilogue::GeluAux`] the epilogue also applies the tanh-GELU and
//! writes the pre-activation to an aux matrix for the backward
//! (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`, as llm.c's MLP does). In the
//! backward, [`LinearGemm::weight_grad`] computes the weight's gradient
//! with the bias's in the same GEMM's epilogue (`CUBLASLT_EPILOGUE_BGRADB`,
//! as Transformer Engine's weight-gradient GEMM does).
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
    /// What the epilogue does besides the product.
    pub epilogue: GemmEpilogue,
}

/// What a [`LinearGemm`]'s epilogue does besides the product.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GemmEpilogue {
    /// Nothing: `D = op(A)·op(B) (+ bias)` (`CUBLASLT_EPILOGUE_BIAS`, or
    /// `DEFAULT` without a bias).
    None,
    /// GELU, tanh form (`0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`), on
    /// `D`; the pre-activation `op(A)·op(B) (+ bias)` goes to an aux matrix
    /// of `D`'s type, column-major with leading dimension `aux_ld`
    /// (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`, or `GELU_AUX` without a bias).
    GeluAux {
        /// The aux matrix's leading dimension: cuBLASLt takes a multiple
        /// of 8, no less than `m`.
        aux_ld: i64,
    },
    /// `D = op(A)·op(B)`, and the bias's gradient written to the bias
    /// pointer: `op(B)`'s sums over `k`, one per column of `D`
    /// (`CUBLASLT_EPILOGUE_BGRADB`).
    BiasGradB,
}

/// GELU's tanh form, as cuBLASLt's epilogue computes it.
fn gelu_tanh(x: f64) -> f64 {
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// What [`LinearGemm::reference`] computes: `D`, and the aux matrix when
/// the epilogue writes one.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmReference {
    /// `D`, column-major with the plan's `ldd`.
    pub d: Vec<f64>,
    /// The pre-activation, column-major with its `aux_ld`
    /// ([`GemmEpilogue::GeluAux`] only).
    pub aux: Option<Vec<f64>>,
    /// The bias gradient, `n` sums ([`GemmEpilogue::BiasGradB`] only).
    pub bias_grad: Option<Vec<f64>>,
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
            epilogue: GemmEpilogue::None,
        })
    }

    /// The plan of a Linear layer's weight gradient over `rows` rows,
    /// `∂W[out, in] = gᵀ·x` for its contiguous row-major output gradient
    /// `g[rows, out]` and input `x[rows, in]`, with the bias gradient
    /// `Σ_rows g` in the epilogue. Row-major `∂W` is the column-major
    /// `[in, out]` matrix `xᵀ·g`: `A` is `x` (the column-major
    /// `[in, rows]` matrix, used as it is), `B` is `g` (the column-major
    /// `[out, rows]` matrix, used transposed), `k` runs over the rows, so
    /// the bias gradient, one sum per column of `D`, is one per output
    /// feature. `None` where [`LinearGemm::new`] would be.
    pub fn weight_grad(rows: usize, in_dim: usize, out_dim: usize) -> Option<Self> {
        Self::new(rows, in_dim, out_dim)?;
        Some(Self {
            m: in_dim as u64,
            n: out_dim as u64,
            k: rows as u64,
            transa: false,
            transb: true,
            lda: in_dim as i64,
            ldb: out_dim as i64,
            ldd: in_dim as i64,
            epilogue: GemmEpilogue::BiasGradB,
        })
    }

    /// This plan with the tanh-GELU in its epilogue, the pre-activation
    /// written to an aux matrix laid out as `D` (so a row-major
    /// `[rows, out]` tensor, as the output is); `None` where cuBLASLt's aux
    /// matrix cannot take `D`'s layout (a leading dimension that is not a
    /// multiple of 8), which keeps the GELU out of the GEMM.
    pub fn with_gelu_aux(self) -> Option<Self> {
        if self.ldd % 8 != 0 {
            return None;
        }
        Some(Self {
            epilogue: GemmEpilogue::GeluAux { aux_ld: self.ldd },
            ..self
        })
    }

    /// Elements the aux matrix spans (0 without one).
    pub fn aux_len(&self) -> usize {
        match self.epilogue {
            GemmEpilogue::None | GemmEpilogue::BiasGradB => 0,
            GemmEpilogue::GeluAux { aux_ld } => (aux_ld as u64 * self.n) as usize,
        }
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
    /// dimensions and transposes): `pre = op(A)·op(B) (+ bias per row)`,
    /// `D = pre`, or `D = gelu(pre)` with `pre` as the aux matrix; with
    /// [`GemmEpilogue::BiasGradB`] `D = op(A)·op(B)` (no bias read) and
    /// the sums of `op(B)` over `k`.
    pub fn reference(&self, a: &[f64], b: &[f64], bias: Option<&[f64]>) -> GemmReference {
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
        let mut aux = match self.epilogue {
            GemmEpilogue::None | GemmEpilogue::BiasGradB => None,
            GemmEpilogue::GeluAux { aux_ld } => Some((vec![0.0; aux_ld as usize * n], aux_ld)),
        };
        let (bias, bias_grad) = match self.epilogue {
            GemmEpilogue::BiasGradB => {
                let sums = (0..n).map(|j| (0..k).map(|l| op_b(l, j)).sum()).collect();
                (None, Some(sums))
            }
            _ => (bias, None),
        };
        for j in 0..n {
            for i in 0..m {
                let dot: f64 = (0..k).map(|l| op_a(i, l) * op_b(l, j)).sum();
                let pre = dot + bias.map_or(0.0, |bias| bias[i]);
                d[i + j * ldd] = match &mut aux {
                    None => pre,
                    Some((aux, aux_ld)) => {
                        aux[i + j * *aux_ld as usize] = pre;
                        gelu_tanh(pre)
                    }
                };
            }
        }
        GemmReference {
            d,
            aux: aux.map(|(aux, _)| aux),
            bias_grad,
        }
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
    /// The operands' alignments: A, B, bias, D, aux.
    align: [u32; 5],
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
    /// dtype and alignments (or a bias or pre-activation pointer is aligned
    /// to less than 16 bytes), for the caller to take its own path. With
    /// [`GemmEpilogue::GeluAux`], `y` gets the GELU of it and `pre` (the
    /// aux matrix, required then and only then) the pre-activation. Checks
    /// every operand's length.
    #[allow(clippy::too_many_arguments)]
    pub fn linear<E: GemmElement>(
        &self,
        plan: &LinearGemm,
        compute: GemmCompute,
        x: &CudaView<'_, E>,
        w: &CudaView<'_, E>,
        bias: Option<&CudaView<'_, E>>,
        y: &mut CudaViewMut<'_, E>,
        pre: Option<&mut CudaViewMut<'_, E>>,
    ) -> Result<bool> {
        check_lens(
            plan,
            [("weight", w.len()), ("input", x.len()), ("output", y.len())],
        )?;
        if let Some(bias) = bias {
            check_len("bias", bias.len(), plan.m as usize)?;
        }
        match (plan.epilogue, &pre) {
            (GemmEpilogue::None, None) => {}
            (GemmEpilogue::GeluAux { .. }, Some(pre)) => {
                check_len("pre-activation", pre.len(), plan.aux_len())?;
            }
            (epilogue, pre) => {
                return Err(unsupported(format!(
                    "the plan's epilogue is {epilogue:?} but {} pre-activation buffer was \
                     given; pass one exactly for GemmEpilogue::GeluAux, and run \
                     GemmEpilogue::BiasGradB with Gemm::weight_grad",
                    if pre.is_some() { "a" } else { "no" }
                )))
            }
        }
        let stream = &self.stream;
        let (a, _a) = w.device_ptr(stream);
        let (b, _b) = x.device_ptr(stream);
        let bias = bias.map(|bias| bias.device_ptr(stream));
        let (d, _d) = y.device_ptr_mut(stream);
        let aux = pre.map(|pre| pre.device_ptr_mut(stream));
        // The guards (`_a`, ..) hold the operands until the GEMM is queued.
        self.queue::<E>(
            plan,
            compute,
            [a, b, d],
            bias.as_ref().map(|(p, _)| *p),
            aux.as_ref().map(|(p, _)| *p),
        )
    }

    /// Queues a Linear layer's weight and bias gradients as
    /// [`LinearGemm::weight_grad`]'s `plan` lays them out, `∂W = gᵀ·x`
    /// into `grad_w` (`D`) and `Σ_rows g` into `grad_b` (the epilogue's
    /// bias gradient), from the output gradient `g` (`B`) and the input `x`
    /// (`A`), and returns `true`; `false` (nothing queued) where cuBLASLt
    /// has no algorithm for them, for the caller to compute both apart.
    /// Checks every operand's length.
    pub fn weight_grad<E: GemmElement>(
        &self,
        plan: &LinearGemm,
        compute: GemmCompute,
        x: &CudaView<'_, E>,
        g: &CudaView<'_, E>,
        grad_w: &mut CudaViewMut<'_, E>,
        grad_b: &mut CudaViewMut<'_, E>,
    ) -> Result<bool> {
        if plan.epilogue != GemmEpilogue::BiasGradB {
            return Err(unsupported(format!(
                "Gemm::weight_grad runs GemmEpilogue::BiasGradB, not {:?}; make the plan with \
                 LinearGemm::weight_grad",
                plan.epilogue
            )));
        }
        check_lens(
            plan,
            [
                ("input", x.len()),
                ("output gradient", g.len()),
                ("weight gradient", grad_w.len()),
            ],
        )?;
        check_len("bias gradient", grad_b.len(), plan.n as usize)?;
        let stream = &self.stream;
        let (a, _a) = x.device_ptr(stream);
        let (b, _b) = g.device_ptr(stream);
        let (d, _d) = grad_w.device_ptr_mut(stream);
        let (bias, _bias) = grad_b.device_ptr_mut(stream);
        self.queue::<E>(plan, compute, [a, b, d], Some(bias), None)
    }

    /// Queues `plan` on the stream over the device pointers `a`, `b`, `d`
    /// and the epilogue's `bias` and `aux` (the callers checked their
    /// lengths and hold them until this returns): `false` where their
    /// alignments or cuBLASLt's heuristic rule it out.
    fn queue<E: GemmElement>(
        &self,
        plan: &LinearGemm,
        compute: GemmCompute,
        [a, b, d]: [u64; 3],
        bias: Option<u64>,
        aux: Option<u64>,
    ) -> Result<bool> {
        let stream = &self.stream;
        let (work, _work) = self.workspace.device_ptr(stream);
        let key = AlgoKey {
            plan: *plan,
            data: E::DATA as i32,
            compute,
            bias: bias.is_some(),
            align: [
                alignment(a),
                alignment(b),
                bias.map_or(256, alignment),
                alignment(d),
                aux.map_or(256, alignment),
            ],
        };
        if !epilogue_aligned(&key.align) {
            return Ok(false);
        }
        let described = Described::new::<E>(&key, bias, aux)?;
        let Some(algo) = self.algo(&key, &described)? else {
            return Ok(false);
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the descriptors are live (`described`), the pointers are
        // the operands' on this stream (the bias and aux pointers are in
        // the descriptor), held by the callers until the GEMM is queued,
        // and each spans what the plan reads or writes (the callers
        // checked); the workspace is the size announced.
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
    fn new<E: GemmElement>(key: &AlgoKey, bias: Option<u64>, aux: Option<u64>) -> Result<Self> {
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
        use sys::cublasLtEpilogue_t as Epilogue;
        let epilogue = match (plan.epilogue, bias.is_some()) {
            (GemmEpilogue::None, true) => Epilogue::CUBLASLT_EPILOGUE_BIAS,
            (GemmEpilogue::None, false) => Epilogue::CUBLASLT_EPILOGUE_DEFAULT,
            (GemmEpilogue::GeluAux { .. }, true) => Epilogue::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            (GemmEpilogue::GeluAux { .. }, false) => Epilogue::CUBLASLT_EPILOGUE_GELU_AUX,
            (GemmEpilogue::BiasGradB, _) => Epilogue::CUBLASLT_EPILOGUE_BGRADB,
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
            // The aux matrix's type is left at its default, `D`'s (its
            // alignment checked by `epilogue_aligned`).
            if let (GemmEpilogue::GeluAux { aux_ld }, Some(aux)) = (plan.epilogue, aux) {
                set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
                set_desc(desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld)?;
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

/// The fewest bytes the bias and aux pointers may be aligned to. The
/// heuristic takes no alignment preference for them and may pick a kernel
/// that assumes 16 (a misaligned-address fault, which poisons the
/// context, as PyTorch found with a bias sliced out of a larger buffer):
/// [`Gemm::linear`] refuses less, and the caller takes its own path.
const EPILOGUE_ALIGN: u32 = 16;

/// Whether the bias and aux operands of alignments `align` (A, B, bias,
/// D, aux) are aligned as [`EPILOGUE_ALIGN`] asks.
fn epilogue_aligned(align: &[u32; 5]) -> bool {
    align[2] >= EPILOGUE_ALIGN && align[4] >= EPILOGUE_ALIGN
}

/// An error unless the operands of `plan` (`A`, `B`, `D`, each named and
/// with its length) have at least the elements it spans.
fn check_lens(plan: &LinearGemm, operands: [(&'static str, usize); 3]) -> Result<()> {
    let (a, b, d) = plan.lens();
    for ((what, got), expected) in operands.into_iter().zip([a, b, d]) {
        check_len(what, got, expected)?;
    }
    Ok(())
}

/// An error unless `what` has at least `expected` elements.
fn check_len(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got < expected {
        return Err(Error::from(zero_core::Error::BufferSize {
            op: "linear_gemm",
            what,
            got,
            expected,
        }));
    }
    Ok(())
}

fn unsupported(detail: String) -> Error {
    Error::from(zero_core::Error::Unsupported {
        op: "linear_gemm",
        detail,
    })
}

/// The heuristic's preferences: the workspace it may use and the operands'
/// alignments (A, B, C and D; it takes none for the bias and aux pointers,
/// see [`EPILOGUE_ALIGN`]).
struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    fn new(align: &[u32; 5]) -> Result<Self> {
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
            assert_eq!(y.aux, None);
            let expected = linear(&x, &w, &b, rows, in_dim);
            for (got, want) in y.d.iter().zip(&expected) {
                assert!((got - want).abs() < 1e-12, "{rows}x{in_dim}->{out_dim}");
            }
            let no_bias = plan.reference(&w, &x, None);
            let zeros = vec![0.0; out_dim];
            assert_eq!(no_bias.d, linear(&x, &w, &zeros, rows, in_dim));
        }
    }

    /// GELU, tanh form, written out as PyTorch's `gelu(approximate="tanh")`
    /// documents it.
    fn gelu(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    }

    #[test]
    fn the_gelu_plan_computes_the_activated_layer_and_keeps_its_pre_activation() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (rows, in_dim, out_dim) in [(1, 1, 8), (3, 5, 16), (7, 9, 24), (2, 64, 8)] {
            let mut values = |n: usize| (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let (x, w, b): (Vec<f64>, Vec<f64>, Vec<f64>) = (
                values(rows * in_dim),
                values(out_dim * in_dim),
                values(out_dim),
            );
            let plan = LinearGemm::new(rows, in_dim, out_dim)
                .and_then(LinearGemm::with_gelu_aux)
                .unwrap();
            assert_eq!(
                plan.epilogue,
                GemmEpilogue::GeluAux {
                    aux_ld: out_dim as i64
                }
            );
            // The aux matrix is laid out as the output: a row-major
            // `[rows, out]` tensor.
            assert_eq!(plan.aux_len(), rows * out_dim);
            let zeros = vec![0.0; out_dim];
            for bias in [&b, &zeros] {
                let got = plan.reference(&w, &x, Some(bias));
                let pre = linear(&x, &w, bias, rows, in_dim);
                let aux = got.aux.expect("the pre-activation");
                for (i, &want) in pre.iter().enumerate() {
                    assert!((aux[i] - want).abs() < 1e-12, "aux [{i}]");
                    assert!((got.d[i] - gelu(want)).abs() < 1e-12, "D [{i}]");
                }
            }
            assert_eq!(
                plan.reference(&w, &x, None),
                plan.reference(&w, &x, Some(&zeros))
            );
        }
    }

    #[test]
    fn the_weight_gradient_plan_computes_both_parameter_gradients() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        for (rows, in_dim, out_dim) in [(1, 1, 1), (3, 5, 7), (8, 16, 4), (5, 3, 9), (64, 2, 1)] {
            let mut values = |n: usize| (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let (x, g): (Vec<f64>, Vec<f64>) = (values(rows * in_dim), values(rows * out_dim));
            let plan = LinearGemm::weight_grad(rows, in_dim, out_dim).unwrap();
            assert_eq!(plan.epilogue, GemmEpilogue::BiasGradB);
            assert_eq!(plan.aux_len(), 0);
            // cuBLASLt reads the row-major buffers as they are: x as A, g
            // as B, and writes the row-major `[out, in]` ∂W as D.
            assert_eq!(plan.lens(), (x.len(), g.len(), out_dim * in_dim));
            let got = plan.reference(&x, &g, None);
            assert_eq!(got.aux, None);
            for o in 0..out_dim {
                for i in 0..in_dim {
                    let want: f64 = (0..rows)
                        .map(|r| g[r * out_dim + o] * x[r * in_dim + i])
                        .sum();
                    let at = o * in_dim + i;
                    assert!((got.d[at] - want).abs() < 1e-12, "∂W [{o}, {i}]");
                }
            }
            let sums = got.bias_grad.as_ref().expect("the bias gradient");
            assert_eq!(sums.len(), out_dim);
            for (o, sum) in sums.iter().enumerate() {
                let want: f64 = (0..rows).map(|r| g[r * out_dim + o]).sum();
                assert!((sum - want).abs() < 1e-12, "∂b [{o}]");
            }
            // No bias is read: the epilogue writes one.
            let zeros = vec![0.0; out_dim];
            assert_eq!(plan.reference(&x, &g, Some(&zeros)), got);
        }
        assert_eq!(LinearGemm::weight_grad(0, 4, 4), None);
        assert_eq!(LinearGemm::weight_grad(4, 4, 1 << 31), None);
    }

    #[test]
    fn an_aux_matrix_cublaslt_cannot_lay_out_keeps_the_gelu_out_of_the_gemm() {
        for out_dim in [1, 7, 12, 33] {
            let plan = LinearGemm::new(4, 4, out_dim).unwrap();
            assert_eq!(plan.with_gelu_aux(), None, "out {out_dim}");
            assert_eq!(plan.aux_len(), 0);
        }
        assert!(LinearGemm::new(4, 4, 3072)
            .unwrap()
            .with_gelu_aux()
            .is_some());
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
    fn a_bias_or_aux_aligned_to_less_than_16_bytes_is_refused() {
        assert!(epilogue_aligned(&[2, 2, 16, 2, 256]));
        assert!(!epilogue_aligned(&[256, 256, 8, 256, 256]));
        assert!(!epilogue_aligned(&[256, 256, 256, 256, 4]));
        // A bias of bf16 sliced at an odd element.
        assert!(!epilogue_aligned(&[
            256,
            256,
            alignment(0x7f00_0000_0102),
            256,
            256
        ]));
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
