// Fused kernels of zero-nccl, compiled at run time with NVRTC (no headers).
//
// Every kernel is a grid-stride loop, so one launch covers a whole bucket or
// shard whatever its size. Optimizer formulas follow torch.optim's
// single-tensor implementations operation by operation (including lerp's
// two-branch form), so that results agree to float rounding. The kernels
// need sm_60 or newer (double-precision atomicAdd in the norms).

typedef unsigned long long u64;

__device__ __forceinline__ float lerp_torch(float self, float end, float weight) {
    // torch's lerp: exact at both ends.
    return weight < 0.5f ? self + weight * (end - self)
                         : end - (end - self) * (1.0f - weight);
}

// ---- flatten / unflatten -------------------------------------------------
// `table` holds 3 u64 per piece: device address of the piece, element offset
// in the flat buffer, length in elements. It is passed by value, in the
// launch's parameters (no device copy of it to allocate, upload and free per
// launch), so a launch takes at most PIECES_PER_LAUNCH pieces.
// blockIdx.y walks pieces, x walks elements of a piece.
#define PIECES_PER_LAUNCH 64
struct Pieces {
    u64 e[3 * PIECES_PER_LAUNCH];
};
#define DEFINE_COPY(T, SUFFIX)                                                   \
extern "C" __global__ void gather_pieces_##SUFFIX(Pieces table, unsigned int n_pieces, T* flat) { \
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {            \
        const T* src = (const T*)table.e[3 * p];                                 \
        T* dst = flat + table.e[3 * p + 1];                                      \
        u64 len = table.e[3 * p + 2];                                            \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len;        \
             i += (u64)gridDim.x * blockDim.x) {                                 \
            dst[i] = src[i];                                                     \
        }                                                                        \
    }                                                                            \
}                                                                                \
extern "C" __global__ void scatter_pieces_##SUFFIX(Pieces table, unsigned int n_pieces, const T* flat) { \
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {            \
        T* dst = (T*)table.e[3 * p];                                             \
        const T* src = flat + table.e[3 * p + 1];                                \
        u64 len = table.e[3 * p + 2];                                            \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len;        \
             i += (u64)gridDim.x * blockDim.x) {                                 \
            dst[i] = src[i];                                                     \
        }                                                                        \
    }                                                                            \
}

DEFINE_COPY(unsigned short, b16)
DEFINE_COPY(unsigned int, b32)
DEFINE_COPY(u64, b64)

// Accumulating flatten for gradient accumulation: flat[offset + i] += src[i].
extern "C" __global__ void gather_add_pieces_f32(Pieces table, unsigned int n_pieces, float* flat) {
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {
        const float* src = (const float*)table.e[3 * p];
        float* dst = flat + table.e[3 * p + 1];
        u64 len = table.e[3 * p + 2];
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len;
             i += (u64)gridDim.x * blockDim.x) {
            dst[i] += src[i];
        }
    }
}

// ---- 16-bit models: widening and narrowing copies ------------------------
// bf16 and f16 are carried as their 16 bits (NVRTC has no headers here).
// Widening is exact; narrowing rounds to nearest, ties to even, as the
// `half` crate does on the host (a NaN stays a quiet NaN of its sign).
__device__ __forceinline__ float widen_bf16(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short narrow_bf16(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (unsigned short)((x >> 16) | 0x0040u);
    }
    const unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) {
        return (unsigned short)((x >> 16) + 1);
    }
    return (unsigned short)(x >> 16);
}
__device__ __forceinline__ float widen_f16(unsigned short h) {
#ifdef ZERO_LAYERS_ON_CPU
    return half_to_float(h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}
__device__ __forceinline__ unsigned short narrow_f16(float f) {
#ifdef ZERO_LAYERS_ON_CPU
    return float_to_half(f);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// gather_widen_*: flat[offset + i] = widen(src[i]) (or += with _add);
// scatter_narrow_*: dst[i] = narrow(flat[offset + i]). Same table as above.
// Where both sides of a piece are aligned for 16-byte f32 and 8-byte 16-bit
// accesses (a whole fresh allocation is, and so is its part at a multiple
// of four elements) a thread converts four elements at a time, the rest
// one at a time: the same values either way, in fewer, wider accesses.
//
// convert_pieces calls quad(piece, at, q) for each four elements q of each piece of
// `table` where the piece (16-bit, at address `piece`) and its place in the
// flat buffer (f32, at address `at`) are aligned for it, and
// one(piece, at, i) for every other element i.
template <typename Quad, typename One>
__device__ __forceinline__ void convert_pieces(const Pieces& table, unsigned int n_pieces,
                                               const float* flat, Quad quad, One one) {
    const u64 first = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {
        const u64 piece = table.e[3 * p];
        const u64 at = (u64)(flat + table.e[3 * p + 1]);
        const u64 len = table.e[3 * p + 2];
        u64 done = 0;
        if ((at & 15) == 0 && (piece & 7) == 0) {
            done = len / 4 * 4;
            for (u64 q = first; q < len / 4; q += stride) quad(piece, at, q);
        }
        for (u64 i = done + first; i < len; i += stride) one(piece, at, i);
    }
}
#define WIDEN_QUAD(SUFFIX, h, f)                                                 \
    f.x = widen_##SUFFIX((unsigned short)(h.x & 0xFFFFu));                       \
    f.y = widen_##SUFFIX((unsigned short)(h.x >> 16));                           \
    f.z = widen_##SUFFIX((unsigned short)(h.y & 0xFFFFu));                       \
    f.w = widen_##SUFFIX((unsigned short)(h.y >> 16));
#define DEFINE_CONVERT(SUFFIX)                                                   \
extern "C" __global__ void gather_widen_##SUFFIX(Pieces table, unsigned int n_pieces, float* flat) { \
    convert_pieces(table, n_pieces, flat,                                        \
        [](u64 src, u64 dst, u64 q) {                                            \
            const uint2 h = ((const uint2*)src)[q];                              \
            float4 f;                                                            \
            WIDEN_QUAD(SUFFIX, h, f)                                             \
            ((float4*)dst)[q] = f;                                               \
        },                                                                       \
        [](u64 src, u64 dst, u64 i) {                                            \
            ((float*)dst)[i] = widen_##SUFFIX(((const unsigned short*)src)[i]);  \
        });                                                                      \
}                                                                                \
extern "C" __global__ void gather_add_widen_##SUFFIX(Pieces table, unsigned int n_pieces, float* flat) { \
    convert_pieces(table, n_pieces, flat,                                        \
        [](u64 src, u64 dst, u64 q) {                                            \
            const uint2 h = ((const uint2*)src)[q];                              \
            float4 f;                                                            \
            WIDEN_QUAD(SUFFIX, h, f)                                             \
            float4 sum = ((float4*)dst)[q];                                      \
            sum.x += f.x;                                                        \
            sum.y += f.y;                                                        \
            sum.z += f.z;                                                        \
            sum.w += f.w;                                                        \
            ((float4*)dst)[q] = sum;                                             \
        },                                                                       \
        [](u64 src, u64 dst, u64 i) {                                            \
            ((float*)dst)[i] += widen_##SUFFIX(((const unsigned short*)src)[i]); \
        });                                                                      \
}                                                                                \
extern "C" __global__ void scatter_narrow_##SUFFIX(Pieces table, unsigned int n_pieces, const float* flat) { \
    convert_pieces(table, n_pieces, flat,                                        \
        [](u64 dst, u64 src, u64 q) {                                            \
            const float4 f = ((const float4*)src)[q];                            \
            uint2 h;                                                             \
            h.x = (unsigned int)narrow_##SUFFIX(f.x) |                           \
                  ((unsigned int)narrow_##SUFFIX(f.y) << 16);                    \
            h.y = (unsigned int)narrow_##SUFFIX(f.z) |                           \
                  ((unsigned int)narrow_##SUFFIX(f.w) << 16);                    \
            ((uint2*)dst)[q] = h;                                                \
        },                                                                       \
        [](u64 dst, u64 src, u64 i) {                                            \
            ((unsigned short*)dst)[i] = narrow_##SUFFIX(((const float*)src)[i]); \
        });                                                                      \
}

DEFINE_CONVERT(bf16)
DEFINE_CONVERT(f16)

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// ---- optimizers -------------------------------------------------------------
// Scalars that torch derives from Python floats (1 - beta2, 1 - alpha,
// 1 - dampening, 1 - lr * weight_decay, bias corrections) arrive from the
// host, computed in double and rounded to float once, as they are when they
// meet torch's float tensors: computing them here in float rounds twice
// (1.0f - 0.999f is 1.3e-5 away from 0.001f). Products and quotients go in
// the order of torch's CPU kernels, as zero-core's host optimizers do:
// addcmul is self + (value * t1) * t2, addcdiv self + (value * t1) / t2.

// ---- SGD (torch.optim.SGD) -----------------------------------------------
// buf may be null when momentum == 0. first_step: torch's buffer is still
// None for these elements (no step with momentum has written them), so it
// becomes a copy of the gradient.
extern "C" __global__ void sgd_f32(float* p, const float* g, float* buf, u64 n,
                                   float lr, float momentum, float one_minus_dampening,
                                   float weight_decay, int nesterov, int maximize, int first_step) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) grad = grad + weight_decay * param;
        if (momentum != 0.0f) {
            float b = first_step ? grad : buf[i] * momentum + one_minus_dampening * grad;
            buf[i] = b;
            grad = nesterov ? grad + momentum * b : b;
        }
        p[i] = param + (-lr) * grad;
    }
}

// ---- Adam / AdamW (torch.optim.Adam, torch.optim.AdamW) -------------------
// weight_decay is the L2 penalty (Adam; 0 for AdamW). param_decay is AdamW's
// 1 - lr * weight_decay, exactly 1 otherwise (and multiplying by 1 is exact).
// neg_step_size = -lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t).
// vmax may be null unless amsgrad.
extern "C" __global__ void adam_f32(float* p, const float* g, float* m, float* v, float* vmax, u64 n,
                                    float weight_decay, float param_decay, float one_minus_beta1,
                                    float beta2, float one_minus_beta2, float eps,
                                    float neg_step_size, float bc2_sqrt, int amsgrad, int maximize) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) grad = grad + weight_decay * param;
        param = param * param_decay;
        float mi = lerp_torch(m[i], grad, one_minus_beta1);
        float vi = v[i] * beta2 + one_minus_beta2 * grad * grad;
        m[i] = mi;
        v[i] = vi;
        float second = vi;
        if (amsgrad) {
            second = fmaxf(vmax[i], vi);
            vmax[i] = second;
        }
        float denom = sqrtf(second) / bc2_sqrt + eps;
        p[i] = param + neg_step_size * mi / denom;
    }
}

// ---- Adagrad (torch.optim.Adagrad) ---------------------------------------
// clr = lr / (1 + (t - 1) * lr_decay) from the host.
extern "C" __global__ void adagrad_f32(float* p, const float* g, float* sum, u64 n,
                                       float clr, float weight_decay, float eps, int maximize) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) grad = grad + weight_decay * param;
        float s = sum[i] + grad * grad;
        sum[i] = s;
        float std_ = sqrtf(s) + eps;
        p[i] = param + (-clr) * grad / std_;
    }
}

// ---- RMSprop (torch.optim.RMSprop) ---------------------------------------
// grad_avg may be null unless centered, buf unless momentum > 0.
extern "C" __global__ void rmsprop_f32(float* p, const float* g, float* square_avg, float* grad_avg,
                                       float* buf, u64 n, float lr, float alpha, float one_minus_alpha,
                                       float eps, float weight_decay, float momentum, int centered,
                                       int maximize) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) grad = grad + weight_decay * param;
        float sq = square_avg[i] * alpha + one_minus_alpha * grad * grad;
        square_avg[i] = sq;
        float avg;
        if (centered) {
            float ga = lerp_torch(grad_avg[i], grad, one_minus_alpha);
            grad_avg[i] = ga;
            avg = sqrtf(sq + (-1.0f) * ga * ga);
        } else {
            avg = sqrtf(sq);
        }
        avg = avg + eps;
        if (momentum > 0.0f) {
            float b = buf[i] * momentum + grad / avg;
            buf[i] = b;
            p[i] = param + (-lr) * b;
        } else {
            p[i] = param + (-lr) * grad / avg;
        }
    }
}

// ---- gradient scaling and norms --------------------------------------------
// x *= factor (micro-step averaging, clipping).
extern "C" __global__ void scale_f32(float* x, u64 n, float factor) {
    GRID_STRIDE(i, n) { x[i] = x[i] * factor; }
}

// max that keeps NaN: fmax(NaN, x) is x, which would hide a NaN gradient
// from the inf-norm (and so from clipping and the engine's finite check).
__device__ __forceinline__ double max_keep_nan(double a, double b) {
    return (a > b || a != a) ? a : b;
}

// Partial norms of x: kind 0 adds sum |x| to *out_sum, kind 1 adds sum x^2;
// kind 2 takes max |x| into *out_max as float bits (non-negative floats order
// like their bit patterns). Each block reduces in shared memory first, so
// there is one atomic per block. Launched with 256 threads per block.
// Non-finite values propagate: a NaN makes the sums NaN, and the maximum
// NaN too, since fabs clears its sign and a positive NaN's bits lie above
// +inf's under the unsigned atomicMax; an infinity makes each kind +inf.
extern "C" __global__ void norm_partial_f32(const float* x, u64 n, int kind, double* out_sum,
                                            unsigned int* out_max) {
    __shared__ double partial[256];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = fabs((double)x[i]);
        if (kind == 0) acc += v;
        else if (kind == 1) acc += v * v;
        else acc = max_keep_nan(acc, v);
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            double other = partial[threadIdx.x + s];
            partial[threadIdx.x] = kind == 2 ? max_keep_nan(partial[threadIdx.x], other)
                                             : partial[threadIdx.x] + other;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (kind == 2) atomicMax(out_max, __float_as_uint((float)partial[0]));
        else atomicAdd(out_sum, partial[0]);
    }
}

// ---- in-process collectives (CudaThreadComm) -------------------------------
// reduce_ranks_*: for every element i, the sources' values combined in the
// order given (rank order) in a float accumulator (double for f64), divided
// by `divide_by` when it is not 0 (an average), rounded once and written to
// every destination, as zero-core's thread backend does on the host. A
// source may be the same memory as a destination (in place): each thread
// reads element i of every source before it writes element i.
#define MAX_LOCAL_RANKS 16
struct RankPtrs {
    u64 p[MAX_LOCAL_RANKS];
};

// op: 0 sum, 1 avg (summed), 2 max, 3 min (both keep NaN), 4 product.
#define DEFINE_COMBINE(A)                                                        \
__device__ __forceinline__ A combine_##A(int op, A a, A b) {                     \
    switch (op) {                                                                \
    case 2: return (a >= b || a != a) ? a : b;                                   \
    case 3: return (a <= b || a != a) ? a : b;                                   \
    case 4: return a * b;                                                        \
    default: return a + b;                                                       \
    }                                                                            \
}
DEFINE_COMBINE(float)
DEFINE_COMBINE(double)

__device__ __forceinline__ float up_f32(float x) { return x; }
__device__ __forceinline__ float down_f32(float a) { return a; }
__device__ __forceinline__ double up_f64(double x) { return x; }
__device__ __forceinline__ double down_f64(double a) { return a; }

#define DEFINE_REDUCE_RANKS(SUFFIX, T, A, UP, DOWN)                              \
extern "C" __global__ void reduce_ranks_##SUFFIX(RankPtrs srcs, RankPtrs dsts,   \
        unsigned int n_srcs, unsigned int n_dsts, u64 len, int op,              \
        unsigned int divide_by) {                                                \
    GRID_STRIDE(i, len) {                                                        \
        A acc = UP(((const T*)srcs.p[0])[i]);                                    \
        for (unsigned int k = 1; k < n_srcs; ++k) {                              \
            acc = combine_##A(op, acc, UP(((const T*)srcs.p[k])[i]));            \
        }                                                                        \
        if (divide_by != 0) acc = acc / (A)divide_by;                            \
        T out = DOWN(acc);                                                       \
        for (unsigned int k = 0; k < n_dsts; ++k) ((T*)dsts.p[k])[i] = out;      \
    }                                                                            \
}
DEFINE_REDUCE_RANKS(f32, float, float, up_f32, down_f32)
DEFINE_REDUCE_RANKS(f64, double, double, up_f64, down_f64)
DEFINE_REDUCE_RANKS(bf16, unsigned short, float, widen_bf16, narrow_bf16)
DEFINE_REDUCE_RANKS(f16, unsigned short, float, widen_f16, narrow_f16)
