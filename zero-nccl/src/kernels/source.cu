// Fused kernels of zero-nccl, compiled at run time with NVRTC (no headers).
//
// Every kernel is a grid-stride loop, so one launch covers a whole bucket or
// shard whatever its size. Optimizer formulas follow torch.optim's
// single-tensor implementations operation by operation (including lerp's
// two-branch form), so that results agree to float rounding.

typedef unsigned long long u64;

__device__ __forceinline__ float lerp_torch(float self, float end, float weight) {
    // torch's lerp: exact at both ends.
    return weight < 0.5f ? self + weight * (end - self)
                         : end - (end - self) * (1.0f - weight);
}

// ---- flatten / unflatten -------------------------------------------------
// `table` holds 3 u64 per piece: device address of the piece, element offset
// in the flat buffer, length in elements. blockIdx.y walks pieces, x walks
// elements of a piece.
#define DEFINE_COPY(T, SUFFIX)                                                   \
extern "C" __global__ void gather_pieces_##SUFFIX(const u64* table, unsigned int n_pieces, T* flat) { \
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {            \
        const T* src = (const T*)table[3 * p];                                   \
        T* dst = flat + table[3 * p + 1];                                        \
        u64 len = table[3 * p + 2];                                              \
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len;        \
             i += (u64)gridDim.x * blockDim.x) {                                 \
            dst[i] = src[i];                                                     \
        }                                                                        \
    }                                                                            \
}                                                                                \
extern "C" __global__ void scatter_pieces_##SUFFIX(const u64* table, unsigned int n_pieces, const T* flat) { \
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {            \
        T* dst = (T*)table[3 * p];                                               \
        const T* src = flat + table[3 * p + 1];                                  \
        u64 len = table[3 * p + 2];                                              \
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
extern "C" __global__ void gather_add_pieces_f32(const u64* table, unsigned int n_pieces, float* flat) {
    for (unsigned int p = blockIdx.y; p < n_pieces; p += gridDim.y) {
        const float* src = (const float*)table[3 * p];
        float* dst = flat + table[3 * p + 1];
        u64 len = table[3 * p + 2];
        for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < len;
             i += (u64)gridDim.x * blockDim.x) {
            dst[i] += src[i];
        }
    }
}

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// ---- SGD (torch.optim.SGD) -----------------------------------------------
// buf may be null when momentum == 0. first_step: the buffer is still None in
// torch, so it becomes a copy of the gradient.
extern "C" __global__ void sgd_f32(float* p, const float* g, float* buf, u64 n,
                                   float lr, float momentum, float dampening, float weight_decay,
                                   int nesterov, int maximize, int first_step) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) grad = grad + weight_decay * param;
        if (momentum != 0.0f) {
            float b = first_step ? grad : buf[i] * momentum + (1.0f - dampening) * grad;
            buf[i] = b;
            grad = nesterov ? grad + momentum * b : b;
        }
        p[i] = param + (-lr) * grad;
    }
}

// ---- Adam / AdamW (torch.optim.Adam, torch.optim.AdamW) -------------------
// step_size = lr / (1 - beta1^t) and bc2_sqrt = sqrt(1 - beta2^t) come from the
// host in double precision, as torch computes them in Python floats.
// vmax may be null unless amsgrad.
extern "C" __global__ void adam_f32(float* p, const float* g, float* m, float* v, float* vmax, u64 n,
                                    float lr, float beta1, float beta2, float eps, float weight_decay,
                                    float step_size, float bc2_sqrt,
                                    int decoupled, int amsgrad, int maximize) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) {
            if (decoupled) param = param * (1.0f - lr * weight_decay);
            else grad = grad + weight_decay * param;
        }
        float mi = lerp_torch(m[i], grad, 1.0f - beta1);
        float vi = v[i] * beta2 + (1.0f - beta2) * (grad * grad);
        m[i] = mi;
        v[i] = vi;
        float second = vi;
        if (amsgrad) {
            second = fmaxf(vmax[i], vi);
            vmax[i] = second;
        }
        float denom = sqrtf(second) / bc2_sqrt + eps;
        p[i] = param + (-step_size) * (mi / denom);
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
        p[i] = param + (-clr) * (grad / std_);
    }
}

// ---- RMSprop (torch.optim.RMSprop) ---------------------------------------
// grad_avg may be null unless centered, buf unless momentum > 0.
extern "C" __global__ void rmsprop_f32(float* p, const float* g, float* square_avg, float* grad_avg,
                                       float* buf, u64 n, float lr, float alpha, float eps,
                                       float weight_decay, float momentum, int centered, int maximize) {
    GRID_STRIDE(i, n) {
        float grad = maximize ? -g[i] : g[i];
        float param = p[i];
        if (weight_decay != 0.0f) grad = grad + weight_decay * param;
        float sq = square_avg[i] * alpha + (1.0f - alpha) * (grad * grad);
        square_avg[i] = sq;
        float avg;
        if (centered) {
            float ga = lerp_torch(grad_avg[i], grad, 1.0f - alpha);
            grad_avg[i] = ga;
            avg = sqrtf(sq + (-1.0f) * (ga * ga));
        } else {
            avg = sqrtf(sq);
        }
        avg = avg + eps;
        if (momentum > 0.0f) {
            float b = buf[i] * momentum + grad / avg;
            buf[i] = b;
            p[i] = param + (-lr) * b;
        } else {
            p[i] = param + (-lr) * (grad / avg);
        }
    }
}

// ---- gradient scaling and norms --------------------------------------------
// x *= factor (micro-step averaging, clipping).
extern "C" __global__ void scale_f32(float* x, u64 n, float factor) {
    GRID_STRIDE(i, n) { x[i] = x[i] * factor; }
}

// Partial norms of x: kind 0 adds sum |x| to *out_sum, kind 1 adds sum x^2;
// kind 2 takes max |x| into *out_max as float bits (non-negative floats order
// like their bit patterns). Each block reduces in shared memory first, so
// there is one atomic per block. Launched with 256 threads per block.
extern "C" __global__ void norm_partial_f32(const float* x, u64 n, int kind, double* out_sum,
                                            unsigned int* out_max) {
    __shared__ double partial[256];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = fabs((double)x[i]);
        if (kind == 0) acc += v;
        else if (kind == 1) acc += v * v;
        else acc = fmax(acc, v);
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            double other = partial[threadIdx.x + s];
            partial[threadIdx.x] = kind == 2 ? fmax(partial[threadIdx.x], other)
                                             : partial[threadIdx.x] + other;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (kind == 2) atomicMax(out_max, __float_as_uint((float)partial[0]));
        else atomicAdd(out_sum, partial[0]);
    }
}
