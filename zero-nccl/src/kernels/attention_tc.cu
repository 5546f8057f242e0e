// ===========================================================================
// Causal attention on tensor cores (sm_80 and newer), bf16 and f16 in, f32
// accumulation: FlashAttention-2's scheme with `mma.sync.aligned.m16n8k16`.
// Appended to layers.cu (LAYER_SOURCE is the two files), whose types,
// conversions, layouts (q/k/v strides, grouped K/V heads: see the CUDA-core
// attention there) and kernel arguments (ATTN_*_PARAMS) it shares.
//
// A block is TC_WARPS warps; each warp owns MT m-tiles of 16 rows (queries
// in the forward, TC_MT: two at DMAX 64, one at 128; queries in dQ and keys
// in dK/dV, one) of the block's tile and streams tiles of the other side through
// shared memory, rows of DMAX + TC_PAD 16-bit elements (the padding puts
// the 8 rows a fragment load touches on distinct banks). The warp's own
// rows (Q, or K and V) are staged through the same buffers once and kept in
// registers as A fragments; each B fragment loaded from a streamed tile
// serves all of the warp's m-tiles (FlashAttention-2's 32 rows a warp in
// the forward), so two m-tiles read shared memory half as much per product.
// A warp skips a streamed tile that none of its rows sees (past its last
// row, or before its first row's window): the block's other warps may.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with g = lane / 4
// and t = lane % 4, A (16 x 16, row-major) register i holds the two
// elements (g + 8 * (i % 2), 2t + 8 * (i / 2) + {0, 1}); B (16 x 8, k x n)
// register i holds (2t + 8i + {0, 1}, g); C/D (16 x 8 f32) element i is
// (g + 8 * (i / 2), 2t + i % 2). The lower-indexed element sits in the low
// 16 bits. So a C fragment pair of n-tiles (2j, 2j + 1) is, rounded to 16
// bits, the A fragment of k-step j: P and dS go from one product to the
// next without leaving registers. B operands come from shared memory by
// ldmatrix, two mma's worth a load: plain where k runs along a shared row
// (K for Q K^T, two k-steps of one n-tile), transposed where it runs down a
// column (V for P V, one k-step of two n-tiles).
//
// Streamed tiles pass through two shared-memory stages, so the next tile's
// copies (cp.async, 16 bytes a thread) are in flight while this one is
// computed (FlashAttention-2's prefetch): 64 rows at DMAX 64, 32 at 128
// (two stages of 64 would pass the 48 KB of static shared memory). The
// block's own rows are staged through both stages at once.
//
// The causal, window and length masks (attn_visible in layers.cu) apply
// only on the tiles that need them (on the diagonal, at the window's far
// edge and at the end of the sequence; tc_tile_visible): the other tiles'
// scores go straight to the softmax, with the same values. Tiles wholly
// outside the window are not streamed.
//
// Deterministic: dK/dV per key tile (one block sums over its query tiles
// and its K/V head's query heads, in order), dQ per query tile, no atomics.
// Head widths up to DMAX (64 or 128); columns past D are zero in shared
// memory and never stored.
// ===========================================================================
#define TC_WARPS 4
#define TC_THREADS (TC_WARPS * 32)
#define TC_ROWS 64  // rows per dQ and dK/dV block: 16 per warp
// 16-row m-tiles per warp in the forward. Two at DMAX 64 (249 registers
// for sm_90, no spills); dQ's two m-tiles' P and dP as well take 255 and
// spill, dK/dV's and DMAX 128's do not fit.
#define TC_MT(DMAX) ((DMAX) <= 64 ? 2 : 1)
#define TC_QROWS(DMAX) (TC_WARPS * 16 * TC_MT(DMAX))  // query rows per forward block
#define TC_PAD 8    // 16-bit elements after each shared-memory row
#define TC_KROWS(DMAX) ((DMAX) <= 64 ? 64 : 32)  // rows per streamed tile

// D += A B for one warp: A 16 x 16 and B 16 x 8 of T (bf16 or f16), D f32.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned (&a)[4],
                                             const unsigned (&b)[2]);
template <>
__device__ __forceinline__ void mma_m16n8k16<bf16>(float (&d)[4], const unsigned (&a)[4],
                                                   const unsigned (&b)[2]) {
#ifdef ZERO_LAYERS_ON_CPU
    shim_mma_m16n8k16(d, a, b, true);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // LayerKernels launches these kernels on sm_80 and newer only
#endif
}
template <>
__device__ __forceinline__ void mma_m16n8k16<f16>(float (&d)[4], const unsigned (&a)[4],
                                                  const unsigned (&b)[2]) {
#ifdef ZERO_LAYERS_ON_CPU
    shim_mma_m16n8k16(d, a, b, false);
#elif __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}

__device__ __forceinline__ unsigned pack16(u16 lo, u16 hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}
// `cvt.rn.{bf16x2,f16x2}.f32 d, a, b`: a and b rounded to nearest even, a
// in the upper half of d, b in the lower (PTX ISA, cvt). One instruction for
// what from_f32 does in several; the CPU shim models it with from_f32.
template <typename T>
__device__ __forceinline__ unsigned cvt_rn_x2(float a, float b);
template <>
__device__ __forceinline__ unsigned cvt_rn_x2<bf16>(float a, float b) {
    unsigned d;
#if defined(ZERO_LAYERS_ON_CPU) || __CUDA_ARCH__ < 800
    d = pack16(from_f32<bf16>(b).bits, from_f32<bf16>(a).bits);
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(a), "f"(b));
#endif
    return d;
}
template <>
__device__ __forceinline__ unsigned cvt_rn_x2<f16>(float a, float b) {
    unsigned d;
#if defined(ZERO_LAYERS_ON_CPU) || __CUDA_ARCH__ < 800
    d = pack16(from_f32<f16>(b).bits, from_f32<f16>(a).bits);
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(a), "f"(b));
#endif
    return d;
}
// Two f32 rounded to T, packed as one fragment register (lo in the low half).
template <typename T>
__device__ __forceinline__ unsigned pack_f32(float lo, float hi) {
    return cvt_rn_x2<T>(hi, lo);
}
// The pair at an even column of a shared row (4-byte aligned: the pitch is even).
__device__ __forceinline__ unsigned pair_at(const u16* p) {
    return *(const unsigned*)p;
}

#ifndef ZERO_LAYERS_ON_CPU
// The shared-memory window address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned at;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(at) : "l"(p));
    return at;
}
#endif

// Four 8 x 8 matrices of 16-bit elements from shared memory in one
// instruction (ldmatrix): lane l gives the address of row l % 8 of matrix
// l / 8 (8 elements, 16-byte aligned), and register j of lane (g, t) gets
// matrix j's elements (g, 2t) and (g, 2t + 1), or with TRANS (2t, g) and
// (2t + 1, g), the first in the low 16 bits: B fragments of mma.m16n8k16
// whose k runs along shared rows (plain) or down a column (TRANS).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const u16* row) {
#ifdef ZERO_LAYERS_ON_CPU
    shim_ldmatrix_x4(r, row, TRANS);
#elif __CUDA_ARCH__ >= 800
    const unsigned at = shared_address(row);
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    }
#else
    __trap();
#endif
}

// 16 bytes from global to shared memory without passing through registers
// (cp.async, completed by cp_async_wait): the first `bytes` (0 to 16) from
// `src`, zeros after them (nothing is read past them). The CPU harness
// copies at once. Both addresses 16-byte aligned.
__device__ __forceinline__ void cp_async16_bytes(void* dst, const void* src, int bytes) {
#ifdef ZERO_LAYERS_ON_CPU
    memcpy(dst, src, bytes);
    memset((char*)dst + bytes, 0, 16 - bytes);
#elif __CUDA_ARCH__ >= 800
    const unsigned at = shared_address(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
                 "r"(bytes)
                 : "memory");
#else
    __trap();
#endif
}
// The same, all 16 bytes or (when !valid) zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    cp_async16_bytes(dst, src, valid ? 16 : 0);
}
// Closes this thread's group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if !defined(ZERO_LAYERS_ON_CPU) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
// Waits until at most N of this thread's committed groups are pending.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(ZERO_LAYERS_ON_CPU) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Rows [t0, t0 + ROWS) of one head (columns [0, D) from `base`, rows
// `stride` apart) into a shared tile, zero outside [0, T) x [0, D): 16-byte
// copies (cp.async, pending until cp_async_wait) when D, the stride and the
// base allow, else 16-bit loads and stores.
template <typename T, int DMAX, int ROWS>
__device__ __forceinline__ void tc_load_rows(u16* tile, const T* base, int stride, int t0,
                                             int T_, int D) {
    constexpr int P = DMAX + TC_PAD;
    const bool wide = D % 8 == 0 && stride % 8 == 0 && ((size_t)base & 15) == 0;
    if (wide) {
        constexpr int CHUNKS = DMAX / 8;
        for (int i = threadIdx.x; i < ROWS * CHUNKS; i += TC_THREADS) {
            const int j = i / CHUNKS, c = (i % CHUNKS) * 8, t = t0 + j;
            const bool in = t < T_ && c < D;
            cp_async16(tile + j * P + c, in ? base + (size_t)t * stride + c : base, in);
        }
    } else {
        for (int i = threadIdx.x; i < ROWS * DMAX; i += TC_THREADS) {
            const int j = i / DMAX, d = i % DMAX, t = t0 + j;
            tile[j * P + d] = (t < T_ && d < D) ? base[(size_t)t * stride + d].bits : (u16)0;
        }
    }
}

// Rows staged by tc_load_rows, complete and visible to the whole block.
__device__ __forceinline__ void tc_staged() {
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
}

// Streams `tiles` tiles through two stages of shared memory: `load(stage,
// i)` stages tile i (with tc_load_rows; plain stores too), and
// `compute(stage, i)` reads it while tile i + 1's copies are in flight. A
// stage is filled again only after the barrier that every thread passes
// once done reading it.
template <class Load, class Compute>
__device__ __forceinline__ void tc_stream(int tiles, Load load, Compute compute) {
    __syncthreads();  // what the block staged before (or streamed last) is consumed
    if (tiles > 0) {
        load(0, 0);
        cp_async_commit();
    }
    for (int i = 0; i < tiles; ++i) {
        const int stage = i % 2;
        if (i > 0) __syncthreads();  // tile i - 1 is consumed: its stage is free
        if (i + 1 < tiles) load(stage ^ 1, i + 1);
        cp_async_commit();
        cp_async_wait<1>();  // this thread's copies of tile i are in (not i + 1's)
        __syncthreads();     // and everyone's
        compute(stage, i);
    }
}

// tc_stream over the key tiles [first, first + tiles) of one K/V head (KR
// rows from `kb` and `vb`, `kv_stride` apart) into the two stages of `ks`
// and `vs`, `compute(stage, tile)` given the tile's own index: the
// forward's and dQ's stream.
template <typename T, int DMAX, int KR, class Compute>
__device__ __forceinline__ void tc_stream_kv(u16* ks, u16* vs, const T* kb, const T* vb,
                                             int kv_stride, int first, int tiles, int T_, int D,
                                             Compute compute) {
    constexpr int TILE = KR * (DMAX + TC_PAD);
    auto load = [&](int stage, int i) {
        const int t0 = (first + i) * KR;
        tc_load_rows<T, DMAX, KR>(ks + stage * TILE, kb, kv_stride, t0, T_, D);
        tc_load_rows<T, DMAX, KR>(vs + stage * TILE, vb, kv_stride, t0, T_, D);
    };
    tc_stream(tiles, load, [&](int stage, int i) { compute(stage, first + i); });
}

// The A fragments of MT m-tiles of 16 rows of a staged tile, from its row
// `first` on, over DMAX columns.
template <int DMAX, int MT>
__device__ __forceinline__ void a_fragments(unsigned (&a)[MT][DMAX / 16][4], const u16* tile,
                                            int first, int lane) {
    constexpr int P = DMAX + TC_PAD;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const u16* row = tile + (first + 16 * mt + lane / 4) * P + 2 * (lane % 4);
#pragma unroll
        for (int kk = 0; kk < DMAX / 16; ++kk) {
            a[mt][kk][0] = pair_at(row + kk * 16);
            a[mt][kk][1] = pair_at(row + 8 * P + kk * 16);
            a[mt][kk][2] = pair_at(row + kk * 16 + 8);
            a[mt][kk][3] = pair_at(row + 8 * P + kk * 16 + 8);
        }
    }
}

// s[mt][n] = A_mt B for the n-tiles of 8 rows of `tile`, B[k][n] =
// tile[n][k]: the warp's MT m-tiles (A) against the tile's KR rows, over
// DMAX columns, k-steps in order. With two m-tiles, each ldmatrix holds
// two k-steps of one n-tile for both; with one, 4-byte loads keep the
// registers (and the dQ and dK/dV blocks per SM) where they were.
template <typename T, int DMAX, int KR, int MT>
__device__ __forceinline__ void rows_times_tile(float (&s)[MT][KR / 8][4],
                                                const unsigned (&a)[MT][DMAX / 16][4],
                                                const u16* tile, int lane) {
    constexpr int P = DMAX + TC_PAD;
    static_assert(DMAX % 32 == 0, "k-steps go in pairs");
    // Matrix j = lane / 8 of an ldmatrix: the n-tile's 8 rows, columns 8j
    // on from the pair's first k-step (registers 0, 1 its B fragment, 2, 3
    // the next one's).
    const u16* rows = tile + (lane % 8) * P + (lane / 8) * 8;
#pragma unroll
    for (int n = 0; n < KR / 8; ++n) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
        if constexpr (MT == 1) {
            const u16* row = tile + (n * 8 + lane / 4) * P + 2 * (lane % 4);
#pragma unroll
            for (int kk = 0; kk < DMAX / 16; ++kk) {
                const unsigned b[2] = {pair_at(row + kk * 16), pair_at(row + kk * 16 + 8)};
                mma_m16n8k16<T>(s[0][n], a[0][kk], b);
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < DMAX / 16; kk += 2) {
                unsigned b[4];
                ldmatrix_x4<false>(b, rows + n * 8 * P + kk * 16);
                const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(s[mt][n], a[mt][kk], b0);
                    mma_m16n8k16<T>(s[mt][n], a[mt][kk + 1], b1);
                }
            }
        }
    }
}

// acc[mt] += X_mt tile, X_mt the warp's m-tile mt of 16 x KR values in
// C-fragment layout (rounded to T here), over the tile's rows in order:
// acc[mt][n] covers columns 8n..8n + 7 of the result, B[k][n] = tile[k][n].
template <typename T, int DMAX, int KR, int MT>
__device__ __forceinline__ void scores_times_tile(float (&acc)[MT][DMAX / 8][4],
                                                  const float (&x)[MT][KR / 8][4],
                                                  const u16* tile, int lane) {
    constexpr int P = DMAX + TC_PAD;
    // Matrix m = lane / 8 of an ldmatrix: rows 8 (m % 2) on of a k-step's
    // 16, columns 8 (m / 2) on of a pair of n-tiles (registers 0, 1 for the
    // first, 2, 3).
    const u16* rows = tile + ((lane / 8) % 2 * 8 + lane % 8) * P + (lane / 16) * 8;
#pragma unroll
    for (int kk = 0; kk < KR / 16; ++kk) {
        unsigned a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack_f32<T>(x[mt][2 * kk][0], x[mt][2 * kk][1]);
            a[mt][1] = pack_f32<T>(x[mt][2 * kk][2], x[mt][2 * kk][3]);
            a[mt][2] = pack_f32<T>(x[mt][2 * kk + 1][0], x[mt][2 * kk + 1][1]);
            a[mt][3] = pack_f32<T>(x[mt][2 * kk + 1][2], x[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < DMAX / 8; n += 2) {
            unsigned b[4];
            ldmatrix_x4<true>(b, rows + kk * 16 * P + n * 8);
            const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma_m16n8k16<T>(acc[mt][n], a[mt], b0);
                mma_m16n8k16<T>(acc[mt][n + 1], a[mt], b1);
            }
        }
    }
}

// Whether every key of [first_key, last_key] is visible to every query of
// [first_query, end_query): no mask to apply (all but the tiles on the
// diagonal, at the window's far edge and at the end of the sequence).
__device__ __forceinline__ bool tc_tile_visible(int first_key, int last_key, int first_query,
                                                int end_query, int T_, int W) {
    return last_key <= first_query && end_query <= T_ && end_query - 1 - first_key < W;
}

// Sets the C-fragment elements of x that the masks hide (attn_visible) to
// `fill`: element (n, i) of this lane is row row0 + 8 (i / 2), column
// col0 + 8n + 2 (lane % 4) + i % 2, the rows queries and the columns keys
// (forward, dQ) or, with KEY_ROWS, the rows keys and the columns queries
// (dK/dV).
template <bool KEY_ROWS, int NT>
__device__ __forceinline__ void tc_mask(float (&x)[NT][4], float fill, int row0, int col0,
                                        int T_, int W, int lane) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + 8 * (i / 2);
            const int col = col0 + n * 8 + 2 * (lane % 4) + i % 2;
            const int query = KEY_ROWS ? col : row, key = KEY_ROWS ? row : col;
            if (!attn_visible(key, query, T_, W)) x[n][i] = fill;
        }
    }
}

// The sum (or max) over the 4 lanes that share a fragment row.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

// Whether a warp whose query rows are [first_row, last_row] skips the key
// tile [k0, k0 + KR): every key after its last row, or before the window of
// its first (a row's window starts later the later the row). Warp-uniform.
__device__ __forceinline__ bool tc_warp_skips(int k0, int KR, int first_row, int last_row, int W) {
    return k0 > last_row || k0 + KR - 1 < attn_first_key(first_row, W);
}

template <typename T, int DMAX>
__device__ __forceinline__ void attention_tc_forward(ATTN_FORWARD_PARAMS(T)) {
    constexpr int P = DMAX + TC_PAD, MT = TC_MT(DMAX), ROWS = TC_QROWS(DMAX);
    constexpr int KR = TC_KROWS(DMAX), NT = KR / 8, DT = DMAX / 8, TILE = KR * P;
    static_assert(2 * KR >= ROWS, "the two stages stage the block's own rows");
    __shared__ __align__(16) u16 ks[2 * TILE];
    __shared__ __align__(16) u16 vs[2 * TILE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = attn_query_tile(ROWS);
    const int h = attn_head(), b = attn_batch(), kvh = h / (H / KVH);
    const T* qb = q + (size_t)b * T_ * q_stride + (size_t)h * D;
    const T* kb = k + (size_t)b * T_ * kv_stride + (size_t)kvh * D;
    const T* vb = v + (size_t)b * T_ * kv_stride + (size_t)kvh * D;

    tc_load_rows<T, DMAX, ROWS>(ks, qb, q_stride, q0, T_, D);
    tc_staged();
    unsigned qa[MT][DMAX / 16][4];
    a_fragments<DMAX, MT>(qa, ks, warp * 16 * MT, lane);

    // The warp's rows, and this lane's: row0 + 16 mt (fragment elements 0,
    // 1 of m-tile mt) and row0 + 16 mt + 8 (2, 3).
    const int warp_first = q0 + warp * 16 * MT, warp_last = warp_first + 16 * MT - 1;
    const int row0 = warp_first + lane / 4;
    float o[MT][DT][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = NEG_INF;
        l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
        for (int n = 0; n < DT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    }
    // Key tiles from the first key the block's first row sees up to its
    // last row.
    const int first = attn_first_key(q0, W) / KR;
    const int tiles = (min(q0 + ROWS, T_) - 1) / KR + 1 - first;
    tc_stream_kv<T, DMAX, KR>(ks, vs, kb, vb, kv_stride, first, tiles, T_, D, [&](int stage, int tile) {
        const int k0 = tile * KR;
        // A tile no row of the warp sees changes none of its rows.
        if (tc_warp_skips(k0, KR, warp_first, warp_last, W)) return;
        float s[MT][NT][4];
        rows_times_tile<T, DMAX, KR, MT>(s, qa, ks + stage * TILE, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][n][i] *= scale;
        // The masks, on the tiles that need them.
        if (!tc_tile_visible(k0, k0 + KR - 1, warp_first, warp_last + 1, T_, W)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) tc_mask<false>(s[mt], NEG_INF, row0 + 16 * mt, k0, T_, W, lane);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = NEG_INF;
#pragma unroll
                for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
                const float m_new = fmaxf(m[mt][r], quad_max(mx));
                // m_new is -inf only on a row with no visible key yet (a
                // padding row, row >= T, which stays empty, or one whose
                // window starts past this tile): its exponents are taken from
                // 0, so that a masked score still gives exp(-inf) = 0.
                const float alpha = m[mt][r] == NEG_INF ? 0.f : __expf(m[mt][r] - m_new);
                const float m_use = m_new == NEG_INF ? 0.f : m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NT; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = __expf(s[mt][n][2 * r + e] - m_use);
                        s[mt][n][2 * r + e] = p;
                        sum += p;
                    }
                }
                l[mt][r] = l[mt][r] * alpha + quad_sum(sum);
                m[mt][r] = m_new;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
                    o[mt][n][2 * r] *= alpha;
                    o[mt][n][2 * r + 1] *= alpha;
                }
            }
        }
        scores_times_tile<T, DMAX, KR, MT>(o, s, vs + stage * TILE, lane);
    });
    const int C = H * D;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 16 * mt + 8 * r;
            if (row < T_) {
                const float inv = 1.f / l[mt][r];
                T* yr = y + ((size_t)b * T_ + row) * C + (size_t)h * D;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int d = n * 8 + 2 * (lane % 4) + e;
                        if (d < D) yr[d] = from_f32<T>(o[mt][n][2 * r + e] * inv);
                    }
                }
                if (lane % 4 == 0) lse[((size_t)b * H + h) * T_ + row] = m[mt][r] + logf(l[mt][r]);
            }
        }
    }
}

// dQ of a query tile: stream the key tiles up to it, recompute P from lse,
// dS = P (dP - D), dQ += dS K.
template <typename T, int DMAX>
__device__ __forceinline__ void attention_tc_backward_dq(ATTN_DQ_PARAMS(T)) {
    constexpr int P = DMAX + TC_PAD, MT = 1, ROWS = TC_ROWS;
    constexpr int KR = TC_KROWS(DMAX), NT = KR / 8, DT = DMAX / 8, TILE = KR * P;
    static_assert(2 * KR >= ROWS, "the two stages stage the block's own rows");
    __shared__ __align__(16) u16 ks[2 * TILE];
    __shared__ __align__(16) u16 vs[2 * TILE];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q0 = attn_query_tile(ROWS);
    const int h = attn_head(), b = attn_batch(), kvh = h / (H / KVH);
    const int C = H * D;
    const T* qb = q + (size_t)b * T_ * q_stride + (size_t)h * D;
    const T* kb = k + (size_t)b * T_ * kv_stride + (size_t)kvh * D;
    const T* vb = v + (size_t)b * T_ * kv_stride + (size_t)kvh * D;
    const T* dob = dout + (size_t)b * T_ * C + (size_t)h * D;
    const float* lse_bh = lse + ((size_t)b * H + h) * T_;
    const float* delta_bh = delta + ((size_t)b * H + h) * T_;

    tc_load_rows<T, DMAX, ROWS>(ks, qb, q_stride, q0, T_, D);
    tc_load_rows<T, DMAX, ROWS>(vs, dob, C, q0, T_, D);
    tc_staged();
    unsigned qa[MT][DMAX / 16][4], da[MT][DMAX / 16][4];
    a_fragments<DMAX, MT>(qa, ks, warp * 16 * MT, lane);
    a_fragments<DMAX, MT>(da, vs, warp * 16 * MT, lane);

    const int warp_first = q0 + warp * 16 * MT, warp_last = warp_first + 16 * MT - 1;
    const int row0 = warp_first + lane / 4;
    float row_lse[MT][2], row_delta[MT][2], dq_acc[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 16 * mt + 8 * r;
            row_lse[mt][r] = row < T_ ? lse_bh[row] : 0.f;
            row_delta[mt][r] = row < T_ ? delta_bh[row] : 0.f;
        }
#pragma unroll
        for (int n = 0; n < DT; ++n)
            dq_acc[mt][n][0] = dq_acc[mt][n][1] = dq_acc[mt][n][2] = dq_acc[mt][n][3] = 0.f;
    }
    const int first = attn_first_key(q0, W) / KR;
    const int tiles = (min(q0 + ROWS, T_) - 1) / KR + 1 - first;
    tc_stream_kv<T, DMAX, KR>(ks, vs, kb, vb, kv_stride, first, tiles, T_, D, [&](int stage, int tile) {
        const int k0 = tile * KR;
        // A tile no row of the warp sees adds nothing to its rows.
        if (tc_warp_skips(k0, KR, warp_first, warp_last, W)) return;
        float s[MT][NT][4], dp[MT][NT][4];
        rows_times_tile<T, DMAX, KR, MT>(s, qa, ks + stage * TILE, lane);
        rows_times_tile<T, DMAX, KR, MT>(dp, da, vs + stage * TILE, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    s[mt][n][i] = __expf(s[mt][n][i] * scale - row_lse[mt][i / 2]);  // P
        // The masks, on the tiles that need them.
        if (!tc_tile_visible(k0, k0 + KR - 1, warp_first, warp_last + 1, T_, W)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) tc_mask<false>(s[mt], 0.f, row0 + 16 * mt, k0, T_, W, lane);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[mt][n][i] *= dp[mt][n][i] - row_delta[mt][i / 2];  // dS
        scores_times_tile<T, DMAX, KR, MT>(dq_acc, s, ks + stage * TILE, lane);
    });
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 16 * mt + 8 * r;
            if (row < T_) {
                T* out = dq + ((size_t)b * T_ + row) * q_stride + (size_t)h * D;
#pragma unroll
                for (int n = 0; n < DT; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int d = n * 8 + 2 * (lane % 4) + e;
                        if (d < D) out[d] = from_f32<T>(dq_acc[mt][n][2 * r + e] * scale);
                    }
                }
            }
        }
    }
}

// Entries [t0, t0 + ROWS) of a per-row f32 vector into shared memory, 0
// past T: 16-byte copies (pending until cp_async_wait) when aligned.
template <int ROWS>
__device__ __forceinline__ void tc_load_row_values(float* dst, const float* src, int t0, int T_) {
    if (T_ % 4 == 0 && ((size_t)src & 15) == 0) {
        for (int i = threadIdx.x; i < ROWS / 4; i += TC_THREADS) {
            const int t = t0 + 4 * i, left = t >= T_ ? 0 : min(4, T_ - t);
            cp_async16_bytes(dst + 4 * i, left > 0 ? src + t : src, 4 * left);
        }
    } else {
        for (int i = threadIdx.x; i < ROWS; i += TC_THREADS) {
            const int t = t0 + i;
            dst[i] = t < T_ ? src[t] : 0.f;
        }
    }
}

// One sweep of a dK/dV block over its K/V head's query heads and their
// query tiles from the keys' own tile up to the last query that sees one of
// the keys, accumulating dV (WANT_DV) and dK (WANT_DK). The warp's rows are
// keys, so its products are the transposed ones: S^T = K Q^T, dP^T = V
// dO^T, dV += P^T dO, dK += dS^T Q. Tiles stream (TC_KROWS rows) through the
// two stages of `qs`, `dos`, `lse_s`, `delta_s`. One m-tile a warp (its
// accumulators for both gradients leave no registers for a second).
template <typename T, int DMAX, bool WANT_DK, bool WANT_DV>
__device__ __forceinline__ void dkdv_sweep(float (&dk_acc)[1][DMAX / 8][4],
                                           float (&dv_acc)[1][DMAX / 8][4],
                                           const unsigned (&ka)[1][DMAX / 16][4],
                                           const unsigned (&va)[1][DMAX / 16][4], u16* qs,
                                           u16* dos, float* lse_s, float* delta_s,
                                           ATTN_DKDV_PARAMS(T)) {
    constexpr int KR = TC_KROWS(DMAX), NT = KR / 8, TILE = KR * (DMAX + TC_PAD);
    const int lane = threadIdx.x % 32;
    const int k_first = attn_key_tile(TC_ROWS);
    const int kvh = attn_head(), b = attn_batch(), group = H / KVH;
    const int C = H * D;
    // This lane's keys: key0 (fragment elements 0, 1) and key0 + 8 (2, 3).
    const int key0 = k_first + (threadIdx.x / 32) * 16 + lane / 4;
    // Tile i: query head kvh * group + i / per_head (in order), query rows
    // from k_first + (i % per_head) * KR.
    const int q_end = attn_query_end(k_first + TC_ROWS - 1, T_, W);
    const int per_head = (q_end - k_first + KR - 1) / KR;
    auto load = [&](int stage, int tile) {
        const int h = kvh * group + tile / per_head;
        const int q0 = k_first + (tile % per_head) * KR;
        const T* qh = q + (size_t)b * T_ * q_stride + (size_t)h * D;
        const T* doh = dout + (size_t)b * T_ * C + (size_t)h * D;
        tc_load_rows<T, DMAX, KR>(qs + stage * TILE, qh, q_stride, q0, T_, D);
        tc_load_rows<T, DMAX, KR>(dos + stage * TILE, doh, C, q0, T_, D);
        tc_load_row_values<KR>(lse_s + stage * KR, lse + ((size_t)b * H + h) * T_, q0, T_);
        tc_load_row_values<KR>(delta_s + stage * KR, delta + ((size_t)b * H + h) * T_, q0, T_);
    };
    tc_stream(group * per_head, load, [&](int stage, int tile) {
        const int q0 = k_first + (tile % per_head) * KR;
        const u16* qt = qs + stage * TILE;
        const u16* dot = dos + stage * TILE;
        const float* lse_t = lse_s + stage * KR;
        const float* delta_t = delta_s + stage * KR;
        float s[1][NT][4], dp[1][NT][4];
        rows_times_tile<T, DMAX, KR, 1>(s, ka, qt, lane);
        if (WANT_DK) rows_times_tile<T, DMAX, KR, 1>(dp, va, dot, lane);
        // Column j of the tile is query q0 + j: 2t + 8n + {0, 1}.
        const float* lse_c = lse_t + 2 * (lane % 4);
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                s[0][n][i] = __expf(s[0][n][i] * scale - lse_c[n * 8 + i % 2]);  // P^T
        // The masks, on the tiles that need them: the block's keys
        // [k_first, k_first + TC_ROWS) against the tile's queries [q0, q0 +
        // KR).
        if (!tc_tile_visible(k_first, k_first + TC_ROWS - 1, q0, q0 + KR, T_, W)) {
            tc_mask<true>(s[0], 0.f, key0, q0, T_, W, lane);
        }
        if (WANT_DK) {
            const float* delta_c = delta_t + 2 * (lane % 4);
#pragma unroll
            for (int n = 0; n < NT; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    dp[0][n][i] = s[0][n][i] * (dp[0][n][i] - delta_c[n * 8 + i % 2]);  // dS^T
        }
        if (WANT_DV) scores_times_tile<T, DMAX, KR, 1>(dv_acc, s, dot, lane);
        if (WANT_DK) scores_times_tile<T, DMAX, KR, 1>(dk_acc, dp, qt, lane);
    });
}

// Rows [key0, key0 + 8) and [key0 + 8, key0 + 16) of dK (times the scale)
// or dV from the C-fragment accumulators.
template <typename T, int DMAX>
__device__ __forceinline__ void store_key_rows(T* out, const float (&acc)[DMAX / 8][4],
                                               float factor, int key0, int T_, int D,
                                               size_t row_at, int kv_stride) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        if (key < T_) {
            T* row = out + row_at + (size_t)key * kv_stride;
#pragma unroll
            for (int n = 0; n < DMAX / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int d = n * 8 + 2 * (lane % 4) + e;
                    if (d < D) row[d] = from_f32<T>(acc[n][2 * r + e] * factor);
                }
            }
        }
    }
}

// dK and dV of a key tile of one K/V head, summed over the head's group of
// query heads in order. At DMAX 128 both accumulators, the K and V
// fragments and a tile's scores do not fit in 255 registers: dV takes a
// sweep of its own (recomputing S^T once more) before dK's.
template <typename T, int DMAX>
__device__ __forceinline__ void attention_tc_backward_dkdv(ATTN_DKDV_PARAMS(T)) {
    constexpr int P = DMAX + TC_PAD, DT = DMAX / 8, KR = TC_KROWS(DMAX);
    constexpr bool TWO_SWEEPS = DMAX > 64;
    static_assert(2 * KR >= TC_ROWS, "the two stages stage the block's own rows");
    // Two stages of streamed tiles each; together at least the block's rows.
    __shared__ __align__(16) u16 qs[2 * KR * P];
    __shared__ __align__(16) u16 dos[2 * KR * P];
    __shared__ __align__(16) float lse_s[2 * KR], delta_s[2 * KR];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k_first = attn_key_tile(TC_ROWS);
    const int kvh = attn_head(), b = attn_batch();
    const size_t kv_at = (size_t)b * T_ * kv_stride + (size_t)kvh * D;
    const int key0 = k_first + warp * 16 + lane / 4;

    tc_load_rows<T, DMAX, TC_ROWS>(qs, k + kv_at, kv_stride, k_first, T_, D);
    tc_load_rows<T, DMAX, TC_ROWS>(dos, v + kv_at, kv_stride, k_first, T_, D);
    tc_staged();
    unsigned ka[1][DMAX / 16][4], va[1][DMAX / 16][4];
    a_fragments<DMAX, 1>(ka, qs, warp * 16, lane);
    a_fragments<DMAX, 1>(va, dos, warp * 16, lane);

    float dk_acc[1][DT][4], dv_acc[1][DT][4];
#pragma unroll
    for (int n = 0; n < DT; ++n) {
        dk_acc[0][n][0] = dk_acc[0][n][1] = dk_acc[0][n][2] = dk_acc[0][n][3] = 0.f;
        dv_acc[0][n][0] = dv_acc[0][n][1] = dv_acc[0][n][2] = dv_acc[0][n][3] = 0.f;
    }
    if (TWO_SWEEPS) {
        dkdv_sweep<T, DMAX, false, true>(dk_acc, dv_acc, ka, va, qs, dos, lse_s, delta_s,
                                         ATTN_DKDV_ARGS);
        store_key_rows<T, DMAX>(dv, dv_acc[0], 1.f, key0, T_, D, kv_at, kv_stride);
        dkdv_sweep<T, DMAX, true, false>(dk_acc, dv_acc, ka, va, qs, dos, lse_s, delta_s,
                                         ATTN_DKDV_ARGS);
    } else {
        dkdv_sweep<T, DMAX, true, true>(dk_acc, dv_acc, ka, va, qs, dos, lse_s, delta_s,
                                        ATTN_DKDV_ARGS);
        store_key_rows<T, DMAX>(dv, dv_acc[0], 1.f, key0, T_, D, kv_at, kv_stride);
    }
    store_key_rows<T, DMAX>(dk, dk_acc[0], scale, key0, T_, D, kv_at, kv_stride);
}

#define DEFINE_ATTENTION_TC_DMAX(T, SUFFIX, DMAX)                                         \
extern "C" __global__ void __launch_bounds__(TC_THREADS)                                 \
attention_tc_forward_d##DMAX##_##SUFFIX(ATTN_FORWARD_PARAMS(T)) {                        \
    attention_tc_forward<T, DMAX>(ATTN_FORWARD_ARGS);                                    \
}                                                                                        \
extern "C" __global__ void __launch_bounds__(TC_THREADS)                                 \
attention_tc_backward_dq_d##DMAX##_##SUFFIX(ATTN_DQ_PARAMS(T)) {                         \
    attention_tc_backward_dq<T, DMAX>(ATTN_DQ_ARGS);                                     \
}                                                                                        \
extern "C" __global__ void __launch_bounds__(TC_THREADS)                                 \
attention_tc_backward_dkdv_d##DMAX##_##SUFFIX(ATTN_DKDV_PARAMS(T)) {                     \
    attention_tc_backward_dkdv<T, DMAX>(ATTN_DKDV_ARGS);                                 \
}

DEFINE_ATTENTION_TC_DMAX(bf16, bf16, 64)
DEFINE_ATTENTION_TC_DMAX(bf16, bf16, 128)
DEFINE_ATTENTION_TC_DMAX(f16, f16, 64)
DEFINE_ATTENTION_TC_DMAX(f16, f16, 128)
