// Fused transformer layers of zero-candle, compiled at run time with NVRTC
// (no headers): causal self-attention (FlashAttention-2 scheme, forward and
// backward), LayerNorm/RMSNorm (forward, also fused with the residual add
// before it, and backward), GELU/SiLU, the gated MLP's act(gate) * up
// (SwiGLU, GeGLU), rotary embeddings, and cross-entropy. Each kernel mirrors a CPU reference in zero-candle's
// `nn::ops` / `nn::layer_norm`, computes in f32 whatever the storage type,
// and rounds once when it stores (to nearest, ties to even).
//
// Storage types: `float`, and bf16/f16 carried as their 16 bits (structs
// `bf16`/`f16` below). Each family is a template instantiated per type by a
// macro into `extern "C"` kernels named `<family>_<type>`; LAYER_KERNEL_NAMES
// in layers.rs lists them all. Reductions are deterministic: fixed trees,
// no float atomics.

typedef unsigned short u16;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))
#define QNAN (__int_as_float(0x7fc00000))

// ---- 16-bit types ---------------------------------------------------------
// The same conversions as source.cu's (which this file cannot include):
// widening is exact; narrowing rounds to nearest, ties to even, as the `half`
// crate does on the host (a NaN stays a NaN: bf16 keeps its sign, f16's
// `cvt.rn.f16.f32` gives the canonical NaN).
struct bf16 { u16 bits; };
struct f16 { u16 bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
#ifdef ZERO_LAYERS_ON_CPU
    f = half_to_float(x.bits);
#else
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
#endif
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float f) {
    unsigned int x = __float_as_uint(f);
    bf16 r;
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        r.bits = (u16)((x >> 16) | 0x0040u);
        return r;
    }
    const unsigned int round_bit = 0x00008000u;
    if ((x & round_bit) != 0 && (x & (3 * round_bit - 1)) != 0) {
        r.bits = (u16)((x >> 16) + 1);
    } else {
        r.bits = (u16)(x >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float f) {
    f16 r;
#ifdef ZERO_LAYERS_ON_CPU
    r.bits = float_to_half(f);
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(f));
#endif
    return r;
}

// ---- 16-byte accesses ----------------------------------------------------
// 16 bytes of T: what one wide access of an element-wise kernel moves.
template <typename T>
union Pack16 {
    uint4 raw;
    T v[16 / sizeof(T)];
};
__device__ __forceinline__ bool aligned16(const void* p) { return (((u64)p) & 15) == 0; }

__device__ __forceinline__ bool all_aligned16() { return true; }
template <class... Rest>
__device__ __forceinline__ bool all_aligned16(const void* p, Rest... rest) {
    return aligned16(p) && all_aligned16(rest...);
}

// N consecutive elements from element j, in f32: one 16-byte
// access where N of T are 16 bytes (the caller checked the alignment),
// else N = 1, one element.
template <typename T, int N>
__device__ __forceinline__ void load_n(float (&out)[N], const T* p, long long j) {
    static_assert(N == 1 || N * sizeof(T) == 16, "one element or 16 bytes");
    if constexpr (N == 1) {
        out[0] = to_f32(p[j]);
    } else {
        Pack16<T> v;
        v.raw = *reinterpret_cast<const uint4*>(p + j);
#pragma unroll
        for (int k = 0; k < N; k++) out[k] = to_f32(v.v[k]);
    }
}
template <typename T, int N>
__device__ __forceinline__ void store_n(T* p, long long j, const float (&in)[N]) {
    if constexpr (N == 1) {
        p[j] = from_f32<T>(in[0]);
    } else {
        Pack16<T> v;
#pragma unroll
        for (int k = 0; k < N; k++) v.v[k] = from_f32<T>(in[k]);
        *reinterpret_cast<uint4*>(p + j) = v.raw;
    }
}

// Element-wise over n elements, grid-stride: f(Lanes<M>{}, i) for the M
// elements from i; M = N (16 bytes of each buffer) where `wide`, the
// elements after the last whole chunk and all of them otherwise one at a
// time (M = 1).
template <int V>
struct Lanes {
    static constexpr int value = V;
};
template <int N, class F>
__device__ __forceinline__ void elementwise(long long n, bool wide, F f) {
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (wide) {
        done = n / N * N;
        for (long long c = first; c < n / N; c += stride) f(Lanes<N>{}, c * N);
    }
    for (long long i = done + first; i < n; i += stride) f(Lanes<1>{}, i);
}

// ---- warp and block reductions -------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// ===========================================================================
// Causal self-attention, FlashAttention-2 scheme on CUDA cores.
//
// Query t sees keys (t - W, t] (attn_visible): the causal mask within a
// sliding window of W positions, itself included; W = T is plain causal
// attention (layers/attention.rs passes min(window, T)). Blocks stream only
// the tiles that hold keys (or queries, dK/dV) they see.
//
// q, k, v are row-major [B, T, *] with row strides q_stride (q) and
// kv_stride (k, v): the query of head h at columns h*D.., the key and value
// of K/V head h / (H / KVH) at kvh*D... A packed qkv [B, T, 3*C] (C = H*D,
// KVH = H) is q = qkv, k = qkv + C, v = qkv + 2*C, both strides 3*C;
// separate tensors are [B, T, H*D] and [B, T, KVH*D]. The gradients dq, dk,
// dv have their inputs' strides. y is [B, T, C]; lse is [B, H, T] f32,
// rowmax + ln(rowsum) of the scaled, masked scores.
//
// One block holds BQ = ATTN_WARPS * R query rows (forward, dQ) of one
// (batch, head), grid (H, B, tiles), or KB = ATTN_WARPS * R key rows
// (dK/dV) of one (batch, K/V head), grid (KVH, B, tiles), which sums over
// the K/V head's group of query heads in order (no atomics). The tiles go
// last, ordered by work (attn_query_tile, attn_key_tile).
// Within a warp the lanes take turns as the 32 keys (or queries) of the
// tile being streamed through shared memory, for the dot products, and as
// the head dimensions d = lane + 32*i of the accumulators (DPL = DMAX/32 per
// lane). DMAX is the head_dim rounded up to 64 or 128 (one variant less to
// compile: a head_dim of 32 runs the 64 kernels, whose accumulators for the
// columns d >= head_dim stay zero); columns d >= head_dim are zero in shared
// memory and never stored.
//
// Dot products over d read 4 columns at a time (16-byte shared loads): a
// lane its own row of the streamed tile, the whole warp one row of the
// block's (a broadcast), 1 + R loads for 4R multiply-adds where single
// columns took 1 + R for R. Tiles read lane-per-row (the streamed keys or
// queries) are swizzled by groups of 4 columns so that lane-per-row 16-byte
// reads and lane-per-column 4-byte reads are both free of bank conflicts
// without padding: element (j, d) sits at j*DMAX + 4 ((d/4 + j) mod
// DMAX/4) + d mod 4. Tiles read one row by the whole warp are plain.
// Sums over the streamed rows take each row's P (or dS) from shared memory,
// 4 rows' in one broadcast load, instead of a shuffle per row and query.
// Every sum adds in the order of d or of the rows, as one column at a time
// would: columns past D and rows past T are zero in shared memory, so
// rounding the loops up to 4 adds exact zeros.
//
// Every __syncthreads() sits in a loop whose bounds depend on the block
// index only; row and key bounds are handled in arithmetic (masks), never
// by skipping a barrier.
// ===========================================================================
#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_KT 32   // keys (forward, dQ) or queries (dK/dV) per streamed tile

// An attention block's place in its grid (heads, batch, tiles), for both
// families. CUDA starts a grid's blocks about in the order of their linear
// index (x fastest, z last), so with the tiles last, blockIdx.z ranks the
// blocks by causal work across the whole grid and the heaviest start
// first (longest-processing-time first: the last wave holds the lightest
// blocks). A forward or dQ block's work grows with its query tile, a dK/dV
// block's shrinks with its key tile.
__device__ __forceinline__ int attn_head() {
    return blockIdx.x;
}
__device__ __forceinline__ int attn_batch() {
    return blockIdx.y;
}
// The first query row of a forward or dQ block of `rows` rows: the last tile first.
__device__ __forceinline__ int attn_query_tile(int rows) {
    return (gridDim.z - 1 - blockIdx.z) * rows;
}
// The first key row of a dK/dV block of `rows` rows: the first tile first.
__device__ __forceinline__ int attn_key_tile(int rows) {
    return blockIdx.z * rows;
}

// Whether query `query` sees key `key`: at or before it, fewer than W
// positions back, and below T.
__device__ __forceinline__ bool attn_visible(int key, int query, int T_, int W) {
    return key <= query && query - key < W && query < T_;
}
// The first key that query `query` sees.
__device__ __forceinline__ int attn_first_key(int query, int W) {
    return max(0, query - W + 1);
}
// The end (exclusive) of the queries that see any of the keys up to
// `last_key`.
__device__ __forceinline__ int attn_query_end(int last_key, int T_, int W) {
    return min(T_, last_key + W);
}

template <int DMAX>
__device__ __forceinline__ int swz(int j, int d) {
    return j * DMAX + ((((d >> 2) + j) & (DMAX / 4 - 1)) << 2) + (d & 3);
}

// Columns [d, d + 4) (d a multiple of 4) of row j of a swizzled tile, and
// of a plain row.
template <int DMAX>
__device__ __forceinline__ float4 swz4(const float* tile, int j, int d) {
    return *reinterpret_cast<const float4*>(tile + swz<DMAX>(j, d));
}
__device__ __forceinline__ float4 plain4(const float* at) {
    return *reinterpret_cast<const float4*>(at);
}

// acc + a . b, multiply-adds in the order of the columns.
__device__ __forceinline__ float dot4(float acc, float4 a, float4 b) {
    acc += a.x * b.x;
    acc += a.y * b.y;
    acc += a.z * b.z;
    return acc + a.w * b.w;
}

// D rounded up to the 4 columns a dot4 takes.
__device__ __forceinline__ int round4(int n) {
    return (n + 3) & ~3;
}

// acc[r] += w[r][j] x[j] for the 4 streamed rows j = j0.. j0 + 3 in turn:
// w is a warp's R rows of weights (P or dS, ATTN_KT a row in shared
// memory), x the 4 rows' values at this lane's columns.
template <int R, int DPL>
__device__ __forceinline__ void add_rows4(float (&acc)[R][DPL], const float* w, int j0,
                                          const float (&x)[4][DPL]) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float4 w4 = plain4(w + r * ATTN_KT + j0);
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            acc[r][i] += w4.x * x[0][i];
            acc[r][i] += w4.y * x[1][i];
            acc[r][i] += w4.z * x[2][i];
            acc[r][i] += w4.w * x[3][i];
        }
    }
}

// Loads rows [t0, t0 + ROWS) of one head's slice at column offset `col` of
// qkv-like rows (stride `row_stride`) into a ROWS x DMAX f32 tile, zero
// outside [0, T) x [0, D); swizzled or plain.
template <typename T, int DMAX, int ROWS, bool SWIZZLE>
__device__ __forceinline__ void load_tile(float* tile, const T* base, size_t row_stride,
                                          int t0, int T_, int D) {
    for (int i = threadIdx.x; i < ROWS * DMAX; i += ATTN_THREADS) {
        const int j = i / DMAX, d = i % DMAX;
        const int t = t0 + j;
        const float v = (t < T_ && d < D) ? to_f32(base[(size_t)t * row_stride + d]) : 0.f;
        tile[SWIZZLE ? swz<DMAX>(j, d) : i] = v;
    }
}

template <typename T, int DMAX, int R>
__device__ __forceinline__ void attention_forward(const T* __restrict__ q, const T* __restrict__ k,
                                                  const T* __restrict__ v, T* __restrict__ y,
                                                  float* __restrict__ lse, int q_stride,
                                                  int kv_stride, int T_, int H, int KVH, int D,
                                                  int W, float scale) {
    constexpr int BQ = ATTN_WARPS * R;
    constexpr int DPL = DMAX / 32;
    __shared__ __align__(16) float qs[BQ * DMAX];       // plain: read by broadcast
    __shared__ __align__(16) float ks[ATTN_KT * DMAX];  // swizzled: lane = key
    __shared__ __align__(16) float vs[ATTN_KT * DMAX];  // plain: lane = column
    __shared__ __align__(16) float ps[BQ * ATTN_KT];    // each row's P of the tile
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = attn_query_tile(BQ);
    const int h = attn_head(), b = attn_batch(), kvh = h / (H / KVH);
    const int C = H * D;
    // k and v are parameters (constant memory): one offset for both keeps
    // a register pair free.
    const size_t kv_at = (size_t)b * T_ * kv_stride + (size_t)kvh * D;

    load_tile<T, DMAX, BQ, false>(qs, q + (size_t)b * T_ * q_stride + (size_t)h * D, q_stride,
                                  q0, T_, D);

    float m[R], l[R], acc[R][DPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[r][i] = 0.f;
    }
    const int last = min(q0 + BQ, T_) - 1;  // the block's last query row
    // From the tile of the first key the block's first row sees.
    for (int k0 = attn_first_key(q0, W) / ATTN_KT * ATTN_KT; k0 <= last; k0 += ATTN_KT) {
        __syncthreads();  // the previous tile is consumed (and qs is written)
        load_tile<T, DMAX, ATTN_KT, true>(ks, k + kv_at, kv_stride, k0, T_, D);
        load_tile<T, DMAX, ATTN_KT, false>(vs, v + kv_at, kv_stride, k0, T_, D);
        __syncthreads();
        const int key = k0 + lane;
        float s[R];
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll 1
        for (int d = 0; d < D; d += 4) {
            const float4 kv = swz4<DMAX>(ks, lane, d);
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] = dot4(s[r], plain4(qs + (warp * R + r) * DMAX + d), kv);
        }
        float* pw = ps + warp * R * ATTN_KT;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int t = q0 + warp * R + r;
            const bool valid = attn_visible(key, t, T_, W);
            const float sc = valid ? s[r] * scale : NEG_INF;
            const float m_new = fmaxf(m[r], warp_max(sc));
            // m_new is -inf only on a row that sees no key yet (a padding
            // row, t >= T, which stays empty, or one whose window starts
            // past this tile): its p are 0 and its alpha 0.
            const float p = valid ? __expf(sc - m_new) : 0.f;
            pw[r * ATTN_KT + lane] = p;
            const float alpha = m[r] == NEG_INF ? 0.f : __expf(m[r] - m_new);
            l[r] = l[r] * alpha + warp_sum(p);
            m[r] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[r][i] *= alpha;
        }
        __syncwarp();  // the warp's P is written
        const int keys = round4(min(ATTN_KT, T_ - k0));
        for (int j = 0; j < keys; j += 4) {
            float v[4][DPL];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int i = 0; i < DPL; ++i) v[jj][i] = vs[(j + jj) * DMAX + lane + 32 * i];
            add_rows4<R, DPL>(acc, pw, j, v);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int t = q0 + warp * R + r;
        if (t < T_) {
            const float inv = 1.f / l[r];
            T* yr = y + ((size_t)b * T_ + t) * C + (size_t)h * D;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < D) yr[d] = from_f32<T>(acc[r][i] * inv);
            }
            if (lane == 0) lse[((size_t)b * H + h) * T_ + t] = m[r] + logf(l[r]);
        }
    }
}

// D_i = sum_d dO[i, d] * O[i, d] per (b, t, h), into delta [B, H, T] f32,
// rows in memory order (b, t, h). L lanes of a warp per row (the fewest
// that cover its N-element pieces, a power of two up to 32), each piece 16
// bytes of each buffer where D and the buffers allow, else one element;
// the L lanes' sums are added by a butterfly.
template <typename T, int N>
__device__ __forceinline__ void attention_backward_delta_n(const T* __restrict__ out,
                                                           const T* __restrict__ dout,
                                                           float* __restrict__ delta, int B,
                                                           int T_, int H, int D) {
    int L = 1;
    while (L < 32 && L * N < D) L *= 2;
    const int lane = threadIdx.x % 32, sub = lane % L, per_warp = 32 / L;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    const long long rows = (long long)B * T_ * H;
    for (long long first = ((long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * per_warp;
         first < rows; first += warps * per_warp) {
        const long long row = first + lane / L;
        float sum = 0.f;
        if (row < rows) {
            for (int d = sub * N; d < D; d += L * N) {
                float o[N], g[N];
                load_n<T, N>(o, out, row * D + d);
                load_n<T, N>(g, dout, row * D + d);
#pragma unroll
                for (int k = 0; k < N; k++) sum += o[k] * g[k];
            }
        }
        for (int o = L / 2; o > 0; o /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, o);
        if (sub == 0 && row < rows) {
            const long long h = row % H, bt = row / H;
            const long long t = bt % T_, b = bt / T_;
            delta[(b * H + h) * T_ + t] = sum;
        }
    }
}
template <typename T>
__device__ __forceinline__ void attention_backward_delta(const T* __restrict__ out,
                                                         const T* __restrict__ dout,
                                                         float* __restrict__ delta, int B, int T_,
                                                         int H, int D) {
    constexpr int N = 16 / sizeof(T);
    if (D % N == 0 && all_aligned16(out, dout)) {
        attention_backward_delta_n<T, N>(out, dout, delta, B, T_, H, D);
    } else {
        attention_backward_delta_n<T, 1>(out, dout, delta, B, T_, H, D);
    }
}

// dQ of BQ query rows: stream key tiles, recompute P from lse, dS = P (dP - D).
template <typename T, int DMAX, int R>
__device__ __forceinline__ void attention_backward_dq(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    T* __restrict__ dq_out, int q_stride, int kv_stride, int T_, int H, int KVH, int D, int W,
    float scale) {
    constexpr int BQ = ATTN_WARPS * R;
    constexpr int DPL = DMAX / 32;
    __shared__ __align__(16) float qs[BQ * DMAX];       // plain: broadcast
    __shared__ __align__(16) float dos[BQ * DMAX];      // plain: broadcast
    __shared__ __align__(16) float ks[ATTN_KT * DMAX];  // swizzled: lane = key, then lane = column
    // Swizzled: lane = key; then each row's dS of the tile (48 KiB of static
    // shared memory hold no buffer of its own at DMAX 128).
    __shared__ __align__(16) float vs[ATTN_KT * DMAX];
    static_assert(BQ * ATTN_KT <= ATTN_KT * DMAX, "dS fits where V was");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = attn_query_tile(BQ);
    const int h = attn_head(), b = attn_batch(), kvh = h / (H / KVH);
    const int C = H * D;
    const T* qb = q + (size_t)b * T_ * q_stride + (size_t)h * D;
    const T* kb = k + (size_t)b * T_ * kv_stride + (size_t)kvh * D;
    const T* vb = v + (size_t)b * T_ * kv_stride + (size_t)kvh * D;
    const T* dobase = dout + (size_t)b * T_ * C + (size_t)h * D;
    const float* lse_bh = lse + ((size_t)b * H + h) * T_;
    const float* delta_bh = delta + ((size_t)b * H + h) * T_;

    load_tile<T, DMAX, BQ, false>(qs, qb, q_stride, q0, T_, D);
    load_tile<T, DMAX, BQ, false>(dos, dobase, (size_t)C, q0, T_, D);

    float row_lse[R], row_delta[R], dq[R][DPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int t = q0 + warp * R + r;
        row_lse[r] = t < T_ ? lse_bh[t] : 0.f;
        row_delta[r] = t < T_ ? delta_bh[t] : 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dq[r][i] = 0.f;
    }
    const int last = min(q0 + BQ, T_) - 1;
    for (int k0 = attn_first_key(q0, W) / ATTN_KT * ATTN_KT; k0 <= last; k0 += ATTN_KT) {
        __syncthreads();
        load_tile<T, DMAX, ATTN_KT, true>(ks, kb, kv_stride, k0, T_, D);
        load_tile<T, DMAX, ATTN_KT, true>(vs, vb, kv_stride, k0, T_, D);
        __syncthreads();
        const int key = k0 + lane;
        float s[R], dp[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            s[r] = 0.f;
            dp[r] = 0.f;
        }
#pragma unroll 2
        for (int d = 0; d < D; d += 4) {
            const float4 kv = swz4<DMAX>(ks, lane, d);
            const float4 vv = swz4<DMAX>(vs, lane, d);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                s[r] = dot4(s[r], plain4(qs + (warp * R + r) * DMAX + d), kv);
                dp[r] = dot4(dp[r], plain4(dos + (warp * R + r) * DMAX + d), vv);
            }
        }
        __syncthreads();  // every warp is done with V: its dS goes there
        float* dsw = vs + warp * R * ATTN_KT;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int t = q0 + warp * R + r;
            const bool valid = attn_visible(key, t, T_, W);
            const float pr = valid ? __expf(s[r] * scale - row_lse[r]) : 0.f;
            dsw[r * ATTN_KT + lane] = pr * (dp[r] - row_delta[r]);
        }
        __syncwarp();  // the warp's dS is written
        const int keys = round4(min(ATTN_KT, T_ - k0));
        for (int j = 0; j < keys; j += 4) {
            float kj[4][DPL];
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int i = 0; i < DPL; ++i) kj[jj][i] = ks[swz<DMAX>(j + jj, lane + 32 * i)];
            add_rows4<R, DPL>(dq, dsw, j, kj);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int t = q0 + warp * R + r;
        if (t < T_) {
            T* out = dq_out + ((size_t)b * T_ + t) * q_stride + (size_t)h * D;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < D) out[d] = from_f32<T>(dq[r][i] * scale);
            }
        }
    }
}

// dK and dV of KB key rows of one K/V head: for each query head of its
// group in turn, stream the query tiles at or after the keys that see them.
template <typename T, int DMAX, int R>
__device__ __forceinline__ void attention_backward_dkdv(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    T* __restrict__ dk_out, T* __restrict__ dv_out, int q_stride, int kv_stride, int T_, int H,
    int KVH, int D, int W, float scale) {
    constexpr int KB = ATTN_WARPS * R;
    constexpr int DPL = DMAX / 32;
    __shared__ __align__(16) float ks[KB * DMAX];        // plain: broadcast
    __shared__ __align__(16) float vs[KB * DMAX];        // plain: broadcast
    __shared__ __align__(16) float qs[ATTN_KT * DMAX];   // swizzled: lane = query, then lane = column
    __shared__ __align__(16) float dos[ATTN_KT * DMAX];  // swizzled: lane = query, then lane = column
    // Each key row's P and dS of a query tile pass through shared memory
    // where the 48 KiB of static shared memory hold them (DMAX 64), by
    // shuffles where not.
    constexpr bool P_SHARED = DMAX <= 64;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k_first = attn_key_tile(KB);
    const int kvh = attn_head(), b = attn_batch(), group = H / KVH;
    const int C = H * D;
    const size_t kv_at = (size_t)b * T_ * kv_stride + (size_t)kvh * D;

    load_tile<T, DMAX, KB, false>(ks, k + kv_at, kv_stride, k_first, T_, D);
    load_tile<T, DMAX, KB, false>(vs, v + kv_at, kv_stride, k_first, T_, D);

    float dk[R][DPL], dv[R][DPL];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            dk[r][i] = 0.f;
            dv[r][i] = 0.f;
        }
    }
    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        const T* qb = q + (size_t)b * T_ * q_stride + (size_t)h * D;
        const T* dobase = dout + (size_t)b * T_ * C + (size_t)h * D;
        const float* lse_bh = lse + ((size_t)b * H + h) * T_;
        const float* delta_bh = delta + ((size_t)b * H + h) * T_;
        const int q_end = attn_query_end(k_first + KB - 1, T_, W);
        for (int q0 = (k_first / ATTN_KT) * ATTN_KT; q0 < q_end; q0 += ATTN_KT) {
            __syncthreads();
            load_tile<T, DMAX, ATTN_KT, true>(qs, qb, q_stride, q0, T_, D);
            load_tile<T, DMAX, ATTN_KT, true>(dos, dobase, (size_t)C, q0, T_, D);
            __syncthreads();
            const int query = q0 + lane;
            const float q_lse = query < T_ ? lse_bh[query] : 0.f;
            const float q_delta = query < T_ ? delta_bh[query] : 0.f;
            float s[R], dp[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                s[r] = 0.f;
                dp[r] = 0.f;
            }
#pragma unroll 1
            for (int d = 0; d < D; d += 4) {
                const float4 qv = swz4<DMAX>(qs, lane, d);
                const float4 ov = swz4<DMAX>(dos, lane, d);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    s[r] = dot4(s[r], qv, plain4(ks + (warp * R + r) * DMAX + d));
                    dp[r] = dot4(dp[r], ov, plain4(vs + (warp * R + r) * DMAX + d));
                }
            }
            float p[R], ds[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int key = k_first + warp * R + r;
                const bool valid = attn_visible(key, query, T_, W);
                p[r] = valid ? __expf(s[r] * scale - q_lse) : 0.f;
                ds[r] = p[r] * (dp[r] - q_delta);
            }
            if constexpr (P_SHARED) {
                __shared__ __align__(16) float pds[2 * KB * ATTN_KT];
                float* pw = pds + warp * 2 * R * ATTN_KT;
                float* dsw = pw + R * ATTN_KT;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    pw[r * ATTN_KT + lane] = p[r];
                    dsw[r * ATTN_KT + lane] = ds[r];
                }
                __syncwarp();  // the warp's P and dS are written
                const int queries = round4(min(ATTN_KT, T_ - q0));
                for (int j = 0; j < queries; j += 4) {
                    float qj[4][DPL], oj[4][DPL];
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                        for (int i = 0; i < DPL; ++i) {
                            qj[jj][i] = qs[swz<DMAX>(j + jj, lane + 32 * i)];
                            oj[jj][i] = dos[swz<DMAX>(j + jj, lane + 32 * i)];
                        }
                    add_rows4<R, DPL>(dv, pw, j, oj);
                    add_rows4<R, DPL>(dk, dsw, j, qj);
                }
            } else {
                const int queries = min(ATTN_KT, T_ - q0);
                for (int j = 0; j < queries; ++j) {
                    float qj[DPL], oj[DPL];
#pragma unroll
                    for (int i = 0; i < DPL; ++i) {
                        qj[i] = qs[swz<DMAX>(j, lane + 32 * i)];
                        oj[i] = dos[swz<DMAX>(j, lane + 32 * i)];
                    }
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        const float pj = __shfl_sync(FULL_MASK, p[r], j);
                        const float dsj = __shfl_sync(FULL_MASK, ds[r], j);
#pragma unroll
                        for (int i = 0; i < DPL; ++i) {
                            dv[r][i] += pj * oj[i];
                            dk[r][i] += dsj * qj[i];
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int key = k_first + warp * R + r;
        if (key < T_) {
            const size_t at = ((size_t)b * T_ + key) * kv_stride + (size_t)kvh * D;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                if (d < D) {
                    dk_out[at + d] = from_f32<T>(dk[r][i] * scale);
                    dv_out[at + d] = from_f32<T>(dv[r][i]);
                }
            }
        }
    }
}

// Rows per warp (R) per DMAX: 4 at 128 keeps every attention kernel's static
// shared memory within 48 KiB ((BQ + 2*32) * 128 * 4 bytes at most).
#define ATTN_R_64 8
#define ATTN_R_128 4

// The arguments every attention kernel of both families takes (the
// tensor-core ones in attention_tc.cu too), so that one launch serves both.
#define ATTN_FORWARD_PARAMS(T)                                                            \
    const T *q, const T *k, const T *v, T *y, float *lse, int q_stride, int kv_stride,    \
        int T_, int H, int KVH, int D, int W, float scale
#define ATTN_FORWARD_ARGS q, k, v, y, lse, q_stride, kv_stride, T_, H, KVH, D, W, scale
#define ATTN_DQ_PARAMS(T)                                                                 \
    const T *q, const T *k, const T *v, const T *dout, const float *lse,                  \
        const float *delta, T *dq, int q_stride, int kv_stride, int T_, int H, int KVH,   \
        int D, int W, float scale
#define ATTN_DQ_ARGS q, k, v, dout, lse, delta, dq, q_stride, kv_stride, T_, H, KVH, D, W, scale
#define ATTN_DKDV_PARAMS(T)                                                               \
    const T *q, const T *k, const T *v, const T *dout, const float *lse,                  \
        const float *delta, T *dk, T *dv, int q_stride, int kv_stride, int T_, int H,     \
        int KVH, int D, int W, float scale
#define ATTN_DKDV_ARGS                                                                    \
    q, k, v, dout, lse, delta, dk, dv, q_stride, kv_stride, T_, H, KVH, D, W, scale

// The forward's bound says one block per SM suffices: without it, ptxas
// caps the d=64 forward at 96 registers and spills (114 fit).
#define DEFINE_ATTENTION_DMAX(T, SUFFIX, DMAX)                                            \
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1)                            \
attention_forward_d##DMAX##_##SUFFIX(ATTN_FORWARD_PARAMS(T)) {                           \
    attention_forward<T, DMAX, ATTN_R_##DMAX>(ATTN_FORWARD_ARGS);                        \
}                                                                                        \
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                               \
attention_backward_dq_d##DMAX##_##SUFFIX(ATTN_DQ_PARAMS(T)) {                            \
    attention_backward_dq<T, DMAX, ATTN_R_##DMAX>(ATTN_DQ_ARGS);                         \
}                                                                                        \
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                               \
attention_backward_dkdv_d##DMAX##_##SUFFIX(ATTN_DKDV_PARAMS(T)) {                        \
    attention_backward_dkdv<T, DMAX, ATTN_R_##DMAX>(ATTN_DKDV_ARGS);                     \
}

#define DEFINE_ATTENTION(T, SUFFIX)                                                       \
DEFINE_ATTENTION_DMAX(T, SUFFIX, 64)                                                      \
DEFINE_ATTENTION_DMAX(T, SUFFIX, 128)                                                     \
extern "C" __global__ void attention_backward_delta_##SUFFIX(const T* out, const T* dout, \
                                                             float* delta, int B, int T_, \
                                                             int H, int D) {              \
    attention_backward_delta<T>(out, dout, delta, B, T_, H, D);                           \
}

DEFINE_ATTENTION(float, f32)
DEFINE_ATTENTION(bf16, bf16)
DEFINE_ATTENTION(f16, f16)

// ===========================================================================
// LayerNorm (remove_mean = 1) and RMSNorm (remove_mean = 0) over the last
// dimension n of [rows, n]: one warp per row, statistics in f32, variance
// around the mean in a second pass over the row (never E[x^2] - mean^2).
// The row passes move 16 bytes of each buffer a lane where n and the
// buffers allow (the Llama's H200 profile: one element a lane ran at about
// a quarter of the memory's bandwidth), else one element.
// The output is scaled by w_offset + w, summed in f32: Gemma's RMSNorm
// takes 1 + w (its checkpoints store w centred on zero); -0.f adds nothing
// to any w, not even the sign of a zero.
// ===========================================================================
// The norms' row passes take N elements of each buffer at a time: 16 bytes
// (NORM_WIDE) where n and every buffer allow it, else one. A lane's
// elements are j = N lane + 32 N i + k, its sums add them in that order.
#define NORM_WIDE(T) (16 / (int)sizeof(T))
template <typename T, class... Buffers>
__device__ __forceinline__ bool norm_wide(int n, Buffers... buffers) {
    return n % NORM_WIDE(T) == 0 && all_aligned16(buffers...);
}
#define NORM_ROW_LOOP(j, N) for (int j = (N) * (threadIdx.x % 32); j < n; j += 32 * (N))

template <typename T, int N>
__device__ __forceinline__ void row_stats(const T* xr, int n, float eps, int remove_mean,
                                          float* mean_out, float* rstd_out) {
    float mean = 0.f;
    if (remove_mean) {
        float sum = 0.f;
        NORM_ROW_LOOP(j, N) {
            float v[N];
            load_n<T, N>(v, xr, j);
#pragma unroll
            for (int k = 0; k < N; k++) sum += v[k];
        }
        mean = warp_sum(sum) / (float)n;
    }
    float sq = 0.f;
    NORM_ROW_LOOP(j, N) {
        float v[N];
        load_n<T, N>(v, xr, j);
#pragma unroll
        for (int k = 0; k < N; k++) {
            const float c = v[k] - mean;
            sq += c * c;
        }
    }
    const float var = warp_sum(sq) / (float)n;
    *mean_out = mean;
    *rstd_out = 1.f / sqrtf(var + eps);
}

// One row by one warp: yr = (xr - mean) * rstd * (w_offset + w) (+ b when
// has_bias; `b` is then read, else not).
template <typename T, int N>
__device__ __forceinline__ void norm_row(const T* xr, const T* __restrict__ w, float w_offset,
                                         const T* __restrict__ bias, int has_bias,
                                         T* __restrict__ yr, int n, float eps, int remove_mean) {
    float mean, rstd;
    row_stats<T, N>(xr, n, eps, remove_mean, &mean, &rstd);
    NORM_ROW_LOOP(j, N) {
        float x[N], wv[N], b[N];
        load_n<T, N>(x, xr, j);
        load_n<T, N>(wv, w, j);
        if (has_bias) load_n<T, N>(b, bias, j);
#pragma unroll
        for (int k = 0; k < N; k++) {
            x[k] = (x[k] - mean) * rstd * (wv[k] + w_offset);
            if (has_bias) x[k] += b[k];
        }
        store_n<T, N>(yr, j, x);
    }
}

template <typename T, int N>
__device__ __forceinline__ void norm_forward_n(const T* __restrict__ x, const T* __restrict__ w,
                                               float w_offset, const T* __restrict__ bias,
                                               int has_bias, T* __restrict__ y, long long rows,
                                               int n, float eps, int remove_mean) {
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
         row < rows; row += warps) {
        norm_row<T, N>(x + row * n, w, w_offset, bias, has_bias, y + row * n, n, eps,
                       remove_mean);
    }
}
template <typename T>
__device__ __forceinline__ void norm_forward(const T* __restrict__ x, const T* __restrict__ w,
                                             float w_offset, const T* __restrict__ bias,
                                             int has_bias, T* __restrict__ y, long long rows,
                                             int n, float eps, int remove_mean) {
    if (norm_wide<T>(n, x, w, has_bias ? bias : w, y)) {
        norm_forward_n<T, NORM_WIDE(T)>(x, w, w_offset, bias, has_bias, y, rows, n, eps,
                                        remove_mean);
    } else {
        norm_forward_n<T, 1>(x, w, w_offset, bias, has_bias, y, rows, n, eps, remove_mean);
    }
}

// The residual add and the norm after it in one pass: h = x + residual,
// rounded to T as a separate add would round it, then y = norm(h) from
// those rounded values, so both equal the unfused pair's. Each lane reads
// back only the elements of h it wrote itself (no barrier), from cache.
template <typename T, int N>
__device__ __forceinline__ void residual_norm_forward_n(
    const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ w,
    float w_offset, const T* __restrict__ bias, int has_bias, T* __restrict__ h,
    T* __restrict__ y, long long rows, int n, float eps, int remove_mean) {
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
         row < rows; row += warps) {
        const T* xr = x + row * n;
        const T* rr = residual + row * n;
        T* hr = h + row * n;
        NORM_ROW_LOOP(j, N) {
            float a[N], b[N];
            load_n<T, N>(a, xr, j);
            load_n<T, N>(b, rr, j);
#pragma unroll
            for (int k = 0; k < N; k++) a[k] += b[k];
            store_n<T, N>(hr, j, a);
        }
        norm_row<T, N>(hr, w, w_offset, bias, has_bias, y + row * n, n, eps, remove_mean);
    }
}
template <typename T>
__device__ __forceinline__ void residual_norm_forward(const T* __restrict__ x,
                                                      const T* __restrict__ residual,
                                                      const T* __restrict__ w, float w_offset,
                                                      const T* __restrict__ bias, int has_bias,
                                                      T* __restrict__ h, T* __restrict__ y,
                                                      long long rows, int n, float eps,
                                                      int remove_mean) {
    if (norm_wide<T>(n, x, residual, w, has_bias ? bias : w, h, y)) {
        residual_norm_forward_n<T, NORM_WIDE(T)>(x, residual, w, w_offset, bias, has_bias, h,
                                                 y, rows, n, eps, remove_mean);
    } else {
        residual_norm_forward_n<T, 1>(x, residual, w, w_offset, bias, has_bias, h, y, rows, n,
                                      eps, remove_mean);
    }
}

// Backward, pass 1 (one warp per row): recomputes mean and rstd, keeps them
// in stats ([rows] means, then [rows] rstds, f32) for the column pass, and
// with want_dx writes dx = rstd (g^ - mean(g^) - x^ mean(g^ x^)),
// g^ = g (w_offset + w), x^ = (x - mean) rstd (no mean(g^) term for
// RMSNorm).
template <typename T, int N>
__device__ __forceinline__ void norm_backward_rows_n(const T* __restrict__ x,
                                                     const T* __restrict__ w, float w_offset,
                                                     const T* __restrict__ g, T* __restrict__ dx,
                                                     float* __restrict__ stats, long long rows,
                                                     int n, float eps, int remove_mean,
                                                     int want_dx) {
    const int lane = threadIdx.x % 32;
    const long long warps = (long long)gridDim.x * (blockDim.x / 32);
    for (long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
         row < rows; row += warps) {
        const T* xr = x + row * n;
        const T* gr = g + row * n;
        float mean, rstd;
        row_stats<T, N>(xr, n, eps, remove_mean, &mean, &rstd);
        if (lane == 0) {
            stats[row] = mean;
            stats[rows + row] = rstd;
        }
        if (!want_dx) continue;
        // g^ and x^ of this lane's N elements from j.
        auto hats = [&](int j, float (&gh)[N], float (&xh)[N]) {
            float wv[N];
            load_n<T, N>(gh, gr, j);
            load_n<T, N>(wv, w, j);
            load_n<T, N>(xh, xr, j);
#pragma unroll
            for (int k = 0; k < N; k++) {
                gh[k] *= wv[k] + w_offset;
                xh[k] = (xh[k] - mean) * rstd;
            }
        };
        float sum_g = 0.f, sum_gx = 0.f;
        NORM_ROW_LOOP(j, N) {
            float gh[N], xh[N];
            hats(j, gh, xh);
#pragma unroll
            for (int k = 0; k < N; k++) {
                sum_g += gh[k];
                sum_gx += gh[k] * xh[k];
            }
        }
        const float mean_g = remove_mean ? warp_sum(sum_g) / (float)n : 0.f;
        const float mean_gx = warp_sum(sum_gx) / (float)n;
        T* dxr = dx + row * n;
        NORM_ROW_LOOP(j, N) {
            float gh[N], xh[N];
            hats(j, gh, xh);
#pragma unroll
            for (int k = 0; k < N; k++) gh[k] = rstd * (gh[k] - mean_g - xh[k] * mean_gx);
            store_n<T, N>(dxr, j, gh);
        }
    }
}
template <typename T>
__device__ __forceinline__ void norm_backward_rows(const T* __restrict__ x,
                                                   const T* __restrict__ w, float w_offset,
                                                   const T* __restrict__ g, T* __restrict__ dx,
                                                   float* __restrict__ stats, long long rows,
                                                   int n, float eps, int remove_mean,
                                                   int want_dx) {
    if (norm_wide<T>(n, x, w, g, want_dx ? (const T*)dx : x)) {
        norm_backward_rows_n<T, NORM_WIDE(T)>(x, w, w_offset, g, dx, stats, rows, n, eps,
                                              remove_mean, want_dx);
    } else {
        norm_backward_rows_n<T, 1>(x, w, w_offset, g, dx, stats, rows, n, eps, remove_mean,
                                   want_dx);
    }
}

// Backward, pass 2: block (32, 8) sums g x^ and g over its chunk of rows for
// 32 columns; grid (ceil(n / 32), chunks). Partials [chunks, n] for dw, then
// [chunks, n] for db, f32, summed in a fixed order. dw does not depend on
// w (nor on w_offset): this pass never reads it.
#define NORM_COL_ROWS 8
template <typename T>
__device__ __forceinline__ void norm_backward_columns(const T* __restrict__ x,
                                                      const T* __restrict__ g,
                                                      const float* __restrict__ stats,
                                                      float* __restrict__ partial, long long rows,
                                                      int n, long long rows_per_chunk) {
    __shared__ float sdw[NORM_COL_ROWS][32];
    __shared__ float sdb[NORM_COL_ROWS][32];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * 32 + tx;
    const long long chunk = blockIdx.y, chunks = gridDim.y;
    const long long r0 = chunk * rows_per_chunk;
    const long long r1 = min(rows, r0 + rows_per_chunk);
    float dw = 0.f, db = 0.f;
    if (c < n) {
        for (long long r = r0 + ty; r < r1; r += NORM_COL_ROWS) {
            const float gv = to_f32(g[r * n + c]);
            const float xh = (to_f32(x[r * n + c]) - stats[r]) * stats[rows + r];
            dw += gv * xh;
            db += gv;
        }
    }
    sdw[ty][tx] = dw;
    sdb[ty][tx] = db;
    __syncthreads();
    if (ty == 0 && c < n) {
        for (int k = 1; k < NORM_COL_ROWS; ++k) {
            dw += sdw[k][tx];
            db += sdb[k][tx];
        }
        partial[chunk * n + c] = dw;
        partial[(chunks + chunk) * n + c] = db;
    }
}

// Column c of partials [chunks, n] summed in chunk order: the one order
// every column pass's result is added in, so it is deterministic.
__device__ __forceinline__ float chunk_sum(const float* __restrict__ partial, long long c, int n,
                                           int chunks) {
    float s = 0.f;
    for (int k = 0; k < chunks; ++k) s += partial[(long long)k * n + c];
    return s;
}

// Backward, pass 3: dw[c] and db[c] from the chunks' partials, in order.
template <typename T>
__device__ __forceinline__ void norm_backward_finish(const float* __restrict__ partial,
                                                     T* __restrict__ dw, T* __restrict__ db,
                                                     int n, int chunks) {
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < n;
         c += (long long)gridDim.x * blockDim.x) {
        dw[c] = from_f32<T>(chunk_sum(partial, c, n, chunks));
        db[c] = from_f32<T>(chunk_sum(partial + (long long)chunks * n, c, n, chunks));
    }
}

#define DEFINE_NORM(T, SUFFIX)                                                             \
extern "C" __global__ void norm_forward_##SUFFIX(const T* x, const T* w, float w_offset,   \
                                                 const T* b, int has_bias, T* y,           \
                                                 long long rows, int n, float eps,         \
                                                 int remove_mean) {                        \
    norm_forward<T>(x, w, w_offset, b, has_bias, y, rows, n, eps, remove_mean);            \
}                                                                                          \
extern "C" __global__ void residual_norm_forward_##SUFFIX(                                \
    const T* x, const T* residual, const T* w, float w_offset, const T* b, int has_bias,   \
    T* h, T* y, long long rows, int n, float eps, int remove_mean) {                       \
    residual_norm_forward<T>(x, residual, w, w_offset, b, has_bias, h, y, rows, n, eps,    \
                             remove_mean);                                                 \
}                                                                                          \
extern "C" __global__ void norm_backward_rows_##SUFFIX(const T* x, const T* w,            \
                                                       float w_offset, const T* g, T* dx,  \
                                                       float* stats, long long rows, int n, \
                                                       float eps, int remove_mean,         \
                                                       int want_dx) {                      \
    norm_backward_rows<T>(x, w, w_offset, g, dx, stats, rows, n, eps, remove_mean,         \
                          want_dx);                                                        \
}                                                                                          \
extern "C" __global__ void norm_backward_columns_##SUFFIX(const T* x, const T* g,          \
                                                          const float* stats,              \
                                                          float* partial, long long rows,  \
                                                          int n,                           \
                                                          long long rows_per_chunk) {      \
    norm_backward_columns<T>(x, g, stats, partial, rows, n, rows_per_chunk);               \
}                                                                                          \
extern "C" __global__ void norm_backward_finish_##SUFFIX(const float* partial, T* dw,     \
                                                         T* db, int n, int chunks) {       \
    norm_backward_finish<T>(partial, dw, db, n, chunks);                                   \
}

DEFINE_NORM(float, f32)
DEFINE_NORM(bf16, bf16)
DEFINE_NORM(f16, f16)

// ===========================================================================
// Column sums of a row-major [rows, n] (a Linear's bias gradient), in f32,
// deterministic: the norm backward's column pass and finish without the
// normalized input. Candle's sum(0) reads each column with a stride of n
// (and adds f16 in f16); here a warp reads 32 adjacent columns of a row.
// ===========================================================================
// Pass 1: block (32, NORM_COL_ROWS) sums its chunk of rows for 32 columns;
// grid (ceil(n / 32), chunks). Partials [chunks, n], f32.
template <typename T>
__device__ __forceinline__ void column_sums_partial(const T* __restrict__ g,
                                                    float* __restrict__ partial, long long rows,
                                                    int n, long long rows_per_chunk) {
    __shared__ float ssum[NORM_COL_ROWS][32];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int c = blockIdx.x * 32 + tx;
    const long long chunk = blockIdx.y;
    const long long r0 = chunk * rows_per_chunk;
    const long long r1 = min(rows, r0 + rows_per_chunk);
    float s = 0.f;
    if (c < n) {
        for (long long r = r0 + ty; r < r1; r += NORM_COL_ROWS) s += to_f32(g[r * n + c]);
    }
    ssum[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && c < n) {
        for (int k = 1; k < NORM_COL_ROWS; ++k) s += ssum[k][tx];
        partial[chunk * n + c] = s;
    }
}

// Pass 2: sums[c] from the chunks' partials, in order, rounded once to T.
template <typename T>
__device__ __forceinline__ void column_sums_finish(const float* __restrict__ partial,
                                                   T* __restrict__ sums, int n, int chunks) {
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < n;
         c += (long long)gridDim.x * blockDim.x) {
        sums[c] = from_f32<T>(chunk_sum(partial, c, n, chunks));
    }
}

#define DEFINE_COLUMN_SUMS(T, SUFFIX)                                                     \
extern "C" __global__ void column_sums_partial_##SUFFIX(const T* g, float* partial,        \
                                                        long long rows, int n,             \
                                                        long long rows_per_chunk) {        \
    column_sums_partial<T>(g, partial, rows, n, rows_per_chunk);                          \
}                                                                                         \
extern "C" __global__ void column_sums_finish_##SUFFIX(const float* partial, T* sums,     \
                                                       int n, int chunks) {               \
    column_sums_finish<T>(partial, sums, n, chunks);                                      \
}

DEFINE_COLUMN_SUMS(float, f32)
DEFINE_COLUMN_SUMS(bf16, bf16)
DEFINE_COLUMN_SUMS(f16, f16)

// ===========================================================================
// Activations: kind 0 = GELU (tanh approximation), 1 = GELU (erf), 2 = SiLU,
// 3 = squared ReLU.
// ===========================================================================
#define GELU_K 0.7978845608f  // sqrt(2 / pi)
#define GELU_C 0.044715f

__device__ __forceinline__ float activation(int kind, float x) {
    if (kind == 0) {
        const float t = tanhf(GELU_K * (x + GELU_C * x * x * x));
        return 0.5f * x * (1.f + t);
    } else if (kind == 1) {
        return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    } else if (kind == 2) {
        return x / (1.f + expf(-x));
    } else {
        const float r = fmaxf(x, 0.f);
        return r * r;
    }
}

__device__ __forceinline__ float activation_derivative(int kind, float x) {
    if (kind == 0) {
        const float t = tanhf(GELU_K * (x + GELU_C * x * x * x));
        return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_K * (1.f + 3.f * GELU_C * x * x);
    } else if (kind == 1) {
        // 1 / sqrt(2 pi)
        return 0.5f * (1.f + erff(x * 0.70710678118654752f)) +
               x * expf(-0.5f * x * x) * 0.3989422804014327f;
    } else if (kind == 2) {
        const float s = 1.f / (1.f + expf(-x));
        return s * (1.f + x * (1.f - s));
    } else {
        return 2.f * fmaxf(x, 0.f);
    }
}

// act(x) and act'(x) from one evaluation of the transcendental (the same
// values as activation() and activation_derivative(), bit for bit).
__device__ __forceinline__ void activation_both(int kind, float x, float& y, float& slope) {
    if (kind == 0) {
        const float t = tanhf(GELU_K * (x + GELU_C * x * x * x));
        y = 0.5f * x * (1.f + t);
        slope = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * GELU_K * (1.f + 3.f * GELU_C * x * x);
    } else if (kind == 1) {
        const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
        y = x * cdf;
        slope = cdf + x * expf(-0.5f * x * x) * 0.3989422804014327f;
    } else if (kind == 3) {
        const float r = fmaxf(x, 0.f);
        y = r * r;
        slope = 2.f * r;
    } else {
        const float e = expf(-x);
        const float s = 1.f / (1.f + e);
        y = x / (1.f + e);
        slope = s * (1.f + x * (1.f - s));
    }
}

// y = act(x) and dx = g act'(x), 16 bytes of each buffer a thread where
// they allow.
template <typename T>
__device__ __forceinline__ void activation_forward(const T* x, T* y, long long n, int kind) {
    elementwise<16 / sizeof(T)>(n, all_aligned16(x, y), [&](auto lanes, long long i) {
        constexpr int M = decltype(lanes)::value;
        float v[M];
        load_n<T, M>(v, x, i);
#pragma unroll
        for (int k = 0; k < M; k++) v[k] = activation(kind, v[k]);
        store_n<T, M>(y, i, v);
    });
}
template <typename T>
__device__ __forceinline__ void activation_backward(const T* x, const T* g, T* dx, long long n,
                                                    int kind) {
    elementwise<16 / sizeof(T)>(n, all_aligned16(x, g, dx), [&](auto lanes, long long i) {
        constexpr int M = decltype(lanes)::value;
        float xv[M], gv[M];
        load_n<T, M>(xv, x, i);
        load_n<T, M>(gv, g, i);
#pragma unroll
        for (int k = 0; k < M; k++) gv[k] *= activation_derivative(kind, xv[k]);
        store_n<T, M>(dx, i, gv);
    });
}

// A layer's backward with the activation on its input (the forward kept x
// alone): y = act(x), recomputed for the weight's gradient, and g = g act'(x)
// in place, the input's gradient, in one pass over x.
template <typename T>
__device__ __forceinline__ void activation_recompute_backward(const T* x, T* g, T* y,
                                                              long long n, int kind) {
    elementwise<16 / sizeof(T)>(n, all_aligned16(x, g, y), [&](auto lanes, long long i) {
        constexpr int M = decltype(lanes)::value;
        float xv[M], gv[M], yv[M];
        load_n<T, M>(xv, x, i);
        load_n<T, M>(gv, g, i);
#pragma unroll
        for (int k = 0; k < M; k++) {
            float slope;
            activation_both(kind, xv[k], yv[k], slope);
            gv[k] *= slope;
        }
        store_n<T, M>(y, i, yv);
        store_n<T, M>(g, i, gv);
    });
}

#define DEFINE_ACTIVATION(T, SUFFIX)                                                      \
extern "C" __global__ void activation_forward_##SUFFIX(const T* x, T* y, long long n,     \
                                                       int kind) {                        \
    activation_forward<T>(x, y, n, kind);                                                 \
}                                                                                         \
extern "C" __global__ void activation_backward_##SUFFIX(const T* x, const T* g, T* dx,    \
                                                        long long n, int kind) {          \
    activation_backward<T>(x, g, dx, n, kind);                                            \
}                                                                                         \
extern "C" __global__ void activation_recompute_backward_##SUFFIX(const T* x, T* g, T* y, \
                                                                  long long n, int kind) { \
    activation_recompute_backward<T>(x, g, y, n, kind);                                   \
}

DEFINE_ACTIVATION(float, f32)
DEFINE_ACTIVATION(bf16, bf16)
DEFINE_ACTIVATION(f16, f16)

// A Linear layer's epilogue after a plain GEMM, in one pass over its
// row-major [rows, width] output: pre += bias (per column), rounded to T as
// a bias add rounds it, and y = act(pre). pre stays for the backward. With
// kind < 0 there is no activation: the bias is added in place and y is not
// written. Each thread takes N elements of a row at a time (16 bytes of
// each buffer where the width and the buffers allow, else one) and steps
// its column along with its index (no division per element).
template <typename T, int N>
__device__ __forceinline__ void bias_activation_n(T* pre, const T* bias, T* y, long long n,
                                                  int width, int kind) {
    const int per_row = width / N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int step = (int)(stride % per_row);
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int col = (int)(c % per_row);
    for (; c < n / N; c += stride) {
        float v[N], b[N];
        load_n<T, N>(v, pre, c * N);
        load_n<T, N>(b, bias, (long long)col * N);
#pragma unroll
        for (int k = 0; k < N; k++) v[k] = to_f32(from_f32<T>(v[k] + b[k]));
        store_n<T, N>(pre, c * N, v);
        if (kind >= 0) {
#pragma unroll
            for (int k = 0; k < N; k++) v[k] = activation(kind, v[k]);
            store_n<T, N>(y, c * N, v);
        }
        col += step;
        if (col >= per_row) col -= per_row;
    }
}
template <typename T>
__device__ __forceinline__ void bias_activation(T* pre, const T* bias, T* y, long long n,
                                                int width, int kind) {
    constexpr int N = 16 / sizeof(T);
    if (width % N == 0 && all_aligned16(pre, bias, kind >= 0 ? y : pre)) {
        bias_activation_n<T, N>(pre, bias, y, n, width, kind);
    } else {
        bias_activation_n<T, 1>(pre, bias, y, n, width, kind);
    }
}

#define DEFINE_BIAS_ACTIVATION(T, SUFFIX)                                                 \
extern "C" __global__ void bias_activation_forward_##SUFFIX(T* pre, const T* bias, T* y,  \
                                                            long long n, int width,       \
                                                            int kind) {                   \
    bias_activation<T>(pre, bias, y, n, width, kind);                                     \
}

DEFINE_BIAS_ACTIVATION(float, f32)
DEFINE_BIAS_ACTIVATION(bf16, bf16)
DEFINE_BIAS_ACTIVATION(f16, f16)

// ===========================================================================
// A gated MLP's gate, y = act(gate) * up (SwiGLU: kind 2, SiLU; GeGLU: kind
// 0, GELU's tanh form), and its backward in one pass:
// dgate = dy * up * act'(gate), dup = dy * act(gate). Grid-stride.
// ===========================================================================

// Where every buffer is 16-byte aligned (whole fresh allocations are), each
// thread takes 16 bytes of each at a time (8 bf16 or f16, 4 f32), the last
// elements one at a time; the same values either way.
template <typename T>
__device__ __forceinline__ void gated_forward(const T* gate, const T* up, T* y, long long n,
                                              int kind) {
    elementwise<16 / sizeof(T)>(n, all_aligned16(gate, up, y), [&](auto lanes, long long i) {
        constexpr int M = decltype(lanes)::value;
        float g[M], u[M];
        load_n<T, M>(g, gate, i);
        load_n<T, M>(u, up, i);
#pragma unroll
        for (int k = 0; k < M; k++) g[k] = activation(kind, g[k]) * u[k];
        store_n<T, M>(y, i, g);
    });
}

template <typename T>
__device__ __forceinline__ void gated_backward(const T* gate, const T* up, const T* grad,
                                               T* dgate, T* dup, long long n, int kind) {
    elementwise<16 / sizeof(T)>(
        n, all_aligned16(gate, up, grad, dgate, dup), [&](auto lanes, long long i) {
            constexpr int M = decltype(lanes)::value;
            float g[M], u[M], dy[M];
            load_n<T, M>(g, gate, i);
            load_n<T, M>(u, up, i);
            load_n<T, M>(dy, grad, i);
#pragma unroll
            for (int k = 0; k < M; k++) {
                const float act = activation(kind, g[k]);
                g[k] = dy[k] * u[k] * activation_derivative(kind, g[k]);
                u[k] = dy[k] * act;
            }
            store_n<T, M>(dgate, i, g);
            store_n<T, M>(dup, i, u);
        });
}

#define DEFINE_GATED(T, SUFFIX)                                                           \
extern "C" __global__ void gated_forward_##SUFFIX(const T* gate, const T* up, T* y,       \
                                                  long long n, int kind) {                \
    gated_forward<T>(gate, up, y, n, kind);                                               \
}                                                                                         \
extern "C" __global__ void gated_backward_##SUFFIX(const T* gate, const T* up,            \
                                                   const T* grad, T* dgate, T* dup,       \
                                                   long long n, int kind) {               \
    gated_backward<T>(gate, up, grad, dgate, dup, n, kind);                               \
}

DEFINE_GATED(float, f32)
DEFINE_GATED(bf16, bf16)
DEFINE_GATED(f16, f16)

// ===========================================================================
// Rotary embeddings in `rotate_half`'s convention: x is [B, T, H, D], the
// tables cos and sin [T, D/2]. The pair (d, d + D/2) of each head at
// position t turns by the angle of (t, d):
//   y[d] = x[d] cos - x[d + D/2] sin,  y[d + D/2] = x[d + D/2] cos + x[d] sin.
// The backward is the same kernel on the output gradient with sign = -1 (a
// rotation's transpose is the rotation by the opposite angle). One thread
// per N pairs (d..d + N - 1 with their partners; 16 bytes of each buffer
// where half and the buffers allow, else one pair), grid-stride over rows *
// D/2 pairs (a row is one head of one position). Each element is computed
// alike either way.
// ===========================================================================
template <typename T, int N>
__device__ __forceinline__ void rotary_n(const T* __restrict__ x,
                                         const T* __restrict__ cos_table,
                                         const T* __restrict__ sin_table, T* __restrict__ y,
                                         long long pairs, int half, int heads, int time,
                                         float sign) {
    const int per_row = half / N;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pairs / N;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / per_row;
        const int d = (int)(i - row * per_row) * N;
        const int t = (int)((row / heads) % time);
        const long long at = row * 2 * half + d;
        const long long angle = (long long)t * half + d;
        float a[N], b[N], c[N], s[N];
        load_n<T, N>(a, x, at);
        load_n<T, N>(b, x + half, at);
        load_n<T, N>(c, cos_table, angle);
        load_n<T, N>(s, sin_table, angle);
#pragma unroll
        for (int k = 0; k < N; k++) {
            const float sk = sign * s[k];
            const float lo = a[k] * c[k] - b[k] * sk, hi = b[k] * c[k] + a[k] * sk;
            a[k] = lo;
            b[k] = hi;
        }
        store_n<T, N>(y, at, a);
        store_n<T, N>(y + half, at, b);
    }
}
template <typename T>
__device__ __forceinline__ void rotary(const T* __restrict__ x, const T* __restrict__ cos_table,
                                       const T* __restrict__ sin_table, T* __restrict__ y,
                                       long long pairs, int half, int heads, int time,
                                       float sign) {
    constexpr int N = 16 / sizeof(T);
    if (half % N == 0 && all_aligned16(x, x + half, cos_table, sin_table, y, y + half)) {
        rotary_n<T, N>(x, cos_table, sin_table, y, pairs, half, heads, time, sign);
    } else {
        rotary_n<T, 1>(x, cos_table, sin_table, y, pairs, half, heads, time, sign);
    }
}

#define DEFINE_ROTARY(T, SUFFIX)                                                          \
extern "C" __global__ void rotary_##SUFFIX(const T* x, const T* cos_table,                \
                                           const T* sin_table, T* y, long long pairs,     \
                                           int half, int heads, int time, float sign) {   \
    rotary<T>(x, cos_table, sin_table, y, pairs, half, heads, time, sign);                \
}

DEFINE_ROTARY(float, f32)
DEFINE_ROTARY(bf16, bf16)
DEFINE_ROTARY(f16, f16)

// ===========================================================================
// Cross-entropy over logits [N, V] with targets [N] (u32 or i64).
//
// `saved` is f32 [N + 1]: the log-sum-exp of each row, then the number of
// counted rows (target != ignore index). A target outside [0, V) that is not
// the ignore index is never read through: it counts, and makes the loss NaN
// and its row's gradient NaN. With every row ignored the loss is NaN (0/0,
// as PyTorch) and the gradient zero.
// ===========================================================================
#define CE_THREADS 256

// (m, s) pairs of an online log-sum-exp: s = sum exp(x - m).
__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
    if (m2 == NEG_INF) return;
    if (m == NEG_INF) {
        m = m2;
        s = s2;
        return;
    }
    const float mx = fmaxf(m, m2);
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

// Whether every row of logits [rows, V] (and of `other`, its gradient,
// when given) starts on 16 bytes and holds whole 16-byte chunks: then a
// thread reads 16 bytes at a time, else one element.
template <typename T>
__device__ __forceinline__ bool ce_wide(long long V, const T* logits, const T* other) {
    return V % (16 / sizeof(T)) == 0 && all_aligned16(logits, other);
}

// Pass 1, one block (CE_THREADS) per row: saved[row] = logsumexp(row),
// N elements a read (16 bytes, or one).
template <typename T, int N>
__device__ __forceinline__ void cross_entropy_lse_n(const T* __restrict__ logits,
                                                    float* __restrict__ saved, long long rows,
                                                    long long V) {
    __shared__ float sm[CE_THREADS / 32], ss[CE_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = logits + row * V;
        float m = NEG_INF, s = 0.f;
        for (long long v = (long long)threadIdx.x * N; v < V; v += (long long)CE_THREADS * N) {
            float xs[N];
            load_n<T, N>(xs, xr, v);
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float x = xs[k];
                if (x == NEG_INF) continue;  // contributes exp(-inf) = 0
                // A NaN x takes the max too: (m, s) = (NaN, NaN), never the
                // (-inf, NaN) that lse_combine would drop as empty; from then
                // on s stays NaN and so does the row's log-sum-exp (and the
                // loss).
                if (x > m || x != x) {
                    s = s * expf(m - x) + 1.f;  // m = -inf: s = 0 * 0 + 1
                    m = x;
                } else {
                    s += expf(x - m);  // a NaN m makes s NaN
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(FULL_MASK, m, o);
            const float s2 = __shfl_xor_sync(FULL_MASK, s, o);
            lse_combine(m, s, m2, s2);
        }
        __syncthreads();  // the previous row's sm/ss are read
        if (lane == 0) {
            sm[warp] = m;
            ss[warp] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float mt = sm[0], st = ss[0];
            for (int w = 1; w < CE_THREADS / 32; ++w) lse_combine(mt, st, sm[w], ss[w]);
            saved[row] = mt + logf(st);
        }
    }
}

template <typename T>
__device__ __forceinline__ void cross_entropy_lse(const T* __restrict__ logits,
                                                  float* __restrict__ saved, long long rows,
                                                  long long V) {
    if (ce_wide(V, logits, logits)) {
        cross_entropy_lse_n<T, 16 / sizeof(T)>(logits, saved, rows, V);
    } else {
        cross_entropy_lse_n<T, 1>(logits, saved, rows, V);
    }
}

template <typename I>
__device__ __forceinline__ bool ce_target(const I* targets, long long row, long long V,
                                          int has_ignore, long long ignore_index,
                                          long long* target, bool* in_range) {
    const long long t = (long long)targets[row];
    *target = t;
    *in_range = t >= 0 && t < V;
    return !(has_ignore && t == ignore_index);  // counted
}

// Pass 2, one block of CE_THREADS: the mean over counted rows of
// lse - logit[target], in a fixed order (f64 partials); saved[rows] = count.
template <typename T, typename I>
__device__ __forceinline__ void cross_entropy_loss(const T* __restrict__ logits,
                                                   const I* __restrict__ targets,
                                                   float* __restrict__ saved,
                                                   float* __restrict__ loss, long long rows,
                                                   long long V, int has_ignore,
                                                   long long ignore_index) {
    __shared__ double sums[CE_THREADS];
    __shared__ long long counts[CE_THREADS];
    double sum = 0.0;
    long long count = 0;
    for (long long row = threadIdx.x; row < rows; row += CE_THREADS) {
        long long t;
        bool in_range;
        if (!ce_target(targets, row, V, has_ignore, ignore_index, &t, &in_range)) continue;
        count += 1;
        sum += in_range ? (double)(saved[row] - to_f32(logits[row * V + t])) : (double)QNAN;
    }
    sums[threadIdx.x] = sum;
    counts[threadIdx.x] = count;
    __syncthreads();
    for (int stride = CE_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            sums[threadIdx.x] += sums[threadIdx.x + stride];
            counts[threadIdx.x] += counts[threadIdx.x + stride];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const long long total = counts[0];
        saved[rows] = (float)total;
        loss[0] = total == 0 ? QNAN : (float)(sums[0] / (double)total);
    }
}

// Backward, one block per row: dlogits = grad / count (softmax - onehot),
// zero on ignored rows, NaN on rows whose target is out of range. grad is
// read on the device (one f32). N elements a read and a write (16 bytes, or
// one).
template <typename T, typename I, int N>
__device__ __forceinline__ void cross_entropy_backward_n(const T* __restrict__ logits,
                                                         const I* __restrict__ targets,
                                                         const float* __restrict__ saved,
                                                         const float* __restrict__ grad,
                                                         T* __restrict__ dlogits, long long rows,
                                                         long long V, int has_ignore,
                                                         long long ignore_index) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        long long t;
        bool in_range;
        const bool counted = ce_target(targets, row, V, has_ignore, ignore_index, &t, &in_range);
        const T* xr = logits + row * V;
        T* dr = dlogits + row * V;
        const float factor = counted ? grad[0] / saved[rows] : 0.f;
        const float row_lse = saved[row];
        for (long long v = (long long)threadIdx.x * N; v < V; v += (long long)blockDim.x * N) {
            float d[N];
            if (!counted) {
#pragma unroll
                for (int k = 0; k < N; ++k) d[k] = 0.f;
            } else {
                load_n<T, N>(d, xr, v);
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    const float sm = expf(d[k] - row_lse);
                    d[k] = in_range ? factor * (sm - (v + k == t ? 1.f : 0.f)) : QNAN;
                }
            }
            store_n<T, N>(dr, v, d);
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void cross_entropy_backward(const T* __restrict__ logits,
                                                       const I* __restrict__ targets,
                                                       const float* __restrict__ saved,
                                                       const float* __restrict__ grad,
                                                       T* __restrict__ dlogits, long long rows,
                                                       long long V, int has_ignore,
                                                       long long ignore_index) {
    if (ce_wide(V, logits, (const T*)dlogits)) {
        cross_entropy_backward_n<T, I, 16 / sizeof(T)>(logits, targets, saved, grad, dlogits,
                                                       rows, V, has_ignore, ignore_index);
    } else {
        cross_entropy_backward_n<T, I, 1>(logits, targets, saved, grad, dlogits, rows, V,
                                          has_ignore, ignore_index);
    }
}

#define DEFINE_CE_TARGET(T, SUFFIX, I, ISUFFIX)                                            \
extern "C" __global__ void cross_entropy_loss_##SUFFIX##_##ISUFFIX(                        \
    const T* logits, const I* targets, float* saved, float* loss, long long rows,          \
    long long V, int has_ignore, long long ignore_index) {                                 \
    cross_entropy_loss<T, I>(logits, targets, saved, loss, rows, V, has_ignore,            \
                             ignore_index);                                                \
}                                                                                          \
extern "C" __global__ void cross_entropy_backward_##SUFFIX##_##ISUFFIX(                    \
    const T* logits, const I* targets, const float* saved, const float* grad, T* dlogits,  \
    long long rows, long long V, int has_ignore, long long ignore_index) {                 \
    cross_entropy_backward<T, I>(logits, targets, saved, grad, dlogits, rows, V,           \
                                 has_ignore, ignore_index);                                \
}

#define DEFINE_CE(T, SUFFIX)                                                               \
extern "C" __global__ void __launch_bounds__(CE_THREADS)                                   \
cross_entropy_lse_##SUFFIX(const T* logits, float* saved, long long rows, long long V) {   \
    cross_entropy_lse<T>(logits, saved, rows, V);                                          \
}                                                                                          \
DEFINE_CE_TARGET(T, SUFFIX, unsigned int, u32)                                             \
DEFINE_CE_TARGET(T, SUFFIX, long long, i64)

DEFINE_CE(float, f32)
DEFINE_CE(bf16, bf16)
DEFINE_CE(f16, f16)
