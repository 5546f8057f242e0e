// ===========================================================================
// An embedding lookup and its table's gradient. Appended to layers.cu
// (LAYER_SOURCE), whose types and conversions they use.
//
// The lookup, out[i] = table[ids[i]], reads the table a stretch at a time:
// `part` holds elements [first, first + len) of the row-major table (the
// whole table: first 0), and each launch writes the elements of `out` that
// come from it, so that a table gathered in pieces is looked up piece by
// piece with the ids on the device. The rows of ids outside [0, vocab) are
// NaN (written by every launch), as cross-entropy's losses of bad targets,
// where an index_select would trap and poison the context.
//
// The gradient: table[ids[i]] += grad[i] for every row i of the lookup,
// every id's rows summed in f32 in the order they come (so f32 is bitwise
// the CPU's sequential sum) and rounded once.
//
// Deterministic, no atomics, and parallel over the distinct ids, where a
// thread per column walking every id in turn (Candle's index_add) runs a
// step's thousands of rows one after the other on a few warps:
// 1. embedding_order: the rows sorted by (id, row), order[rank] = row, each
//    row's rank counted against every other row through shared-memory
//    tiles: n^2 comparisons (17 million for a step's 4,096 ids; not timed
//    on a GPU yet).
// 2. embedding_backward: a block per position of the order and per
//    EMB_THREADS columns; at the first position of each id, each thread sums
//    that id's rows of one column into the table. Rows of ids that do not
//    occur are not written (the launch zeroes the table first).
// An id outside [0, vocab) sorts last and is skipped (its lookup was NaN).
// ===========================================================================
#define EMB_THREADS 256

// The row of the table that row i of the lookup adds to; vocab when none.
template <typename I>
__device__ __forceinline__ unsigned int emb_row(const I* __restrict__ ids, long long i,
                                                unsigned int vocab) {
    const long long id = (long long)ids[i];
    return id >= 0 && id < (long long)vocab ? (unsigned int)id : vocab;
}

// The lookup, grid (rows i of the lookup, grid-stride; columns /
// EMB_THREADS), blocks of EMB_THREADS.
template <typename T, typename I>
__device__ __forceinline__ void embedding_lookup(const I* __restrict__ ids,
                                                 const T* __restrict__ part,
                                                 T* __restrict__ out, long long n, int dim,
                                                 long long first, long long len,
                                                 unsigned int vocab) {
    const long long c = (long long)blockIdx.y * EMB_THREADS + threadIdx.x;
    if (c >= dim) return;
    for (long long i = blockIdx.x; i < n; i += gridDim.x) {
        const unsigned int row = emb_row(ids, i, vocab);
        T* const o = out + i * dim + c;
        if (row == vocab) {
            *o = from_f32<T>(QNAN);
            continue;
        }
        const long long at = (long long)row * dim + c - first;
        if (at >= 0 && at < len) *o = part[at];
    }
}

// Pass 1, blocks of EMB_THREADS, grid-stride over blocks of rows.
template <typename I>
__device__ __forceinline__ void embedding_order(const I* __restrict__ ids,
                                                unsigned int* __restrict__ order, long long n,
                                                unsigned int vocab) {
    __shared__ unsigned int tile[EMB_THREADS];
    for (long long base = (long long)blockIdx.x * EMB_THREADS; base < n;
         base += (long long)gridDim.x * EMB_THREADS) {
        const long long i = base + threadIdx.x;
        const unsigned int mine = i < n ? emb_row(ids, i, vocab) : vocab;
        long long rank = 0;
        for (long long j0 = 0; j0 < n; j0 += EMB_THREADS) {
            __syncthreads();  // the previous tile is read
            const long long j = j0 + threadIdx.x;
            tile[threadIdx.x] = j < n ? emb_row(ids, j, vocab) : vocab;
            __syncthreads();
            const int m = (int)min((long long)EMB_THREADS, n - j0);
            for (int k = 0; k < m; ++k) {
                const unsigned int row = tile[k];
                rank += row < mine || (row == mine && j0 + k < i);
            }
        }
        if (i < n) order[rank] = (unsigned int)i;
    }
}

// Pass 2, grid (positions s of the order, grid-stride; columns / EMB_THREADS),
// blocks of EMB_THREADS: at the first position of an id, each thread sums
// the id's rows (positions s, s + 1, ... while the id holds) of its column.
template <typename T, typename I>
__device__ __forceinline__ void embedding_backward(const I* __restrict__ ids,
                                                   const unsigned int* __restrict__ order,
                                                   const T* __restrict__ grad,
                                                   T* __restrict__ table, long long n, int dim,
                                                   unsigned int vocab) {
    const long long c = (long long)blockIdx.y * EMB_THREADS + threadIdx.x;
    if (c >= dim) return;
    for (long long s = blockIdx.x; s < n; s += gridDim.x) {
        const unsigned int row = emb_row(ids, order[s], vocab);
        if (row == vocab) continue;
        if (s > 0 && emb_row(ids, order[s - 1], vocab) == row) continue;
        float sum = 0.f;
        for (long long t = s; t < n; ++t) {
            const unsigned int i = order[t];
            if (emb_row(ids, i, vocab) != row) break;
            sum += to_f32(grad[(long long)i * dim + c]);
        }
        table[(long long)row * dim + c] = from_f32<T>(sum);
    }
}

#define DEFINE_EMBEDDING_ORDER(I, ISUFFIX)                                                 \
extern "C" __global__ void __launch_bounds__(EMB_THREADS)                                  \
embedding_order_##ISUFFIX(const I* ids, unsigned int* order, long long n,                  \
                          unsigned int vocab) {                                            \
    embedding_order<I>(ids, order, n, vocab);                                              \
}

#define DEFINE_EMBEDDING_BACKWARD(T, SUFFIX, I, ISUFFIX)                                   \
extern "C" __global__ void __launch_bounds__(EMB_THREADS)                                  \
embedding_backward_##SUFFIX##_##ISUFFIX(const I* ids, const unsigned int* order,           \
                                        const T* grad, T* table, long long n, int dim,     \
                                        unsigned int vocab) {                              \
    embedding_backward<T, I>(ids, order, grad, table, n, dim, vocab);                      \
}

#define DEFINE_EMBEDDING_LOOKUP(T, SUFFIX, I, ISUFFIX)                                     \
extern "C" __global__ void __launch_bounds__(EMB_THREADS)                                  \
embedding_lookup_##SUFFIX##_##ISUFFIX(const I* ids, const T* part, T* out, long long n,    \
                                      int dim, long long first, long long len,             \
                                      unsigned int vocab) {                                \
    embedding_lookup<T, I>(ids, part, out, n, dim, first, len, vocab);                     \
}

#define DEFINE_EMBEDDING(T, SUFFIX)                                                        \
DEFINE_EMBEDDING_LOOKUP(T, SUFFIX, unsigned int, u32)                                      \
DEFINE_EMBEDDING_LOOKUP(T, SUFFIX, long long, i64)                                         \
DEFINE_EMBEDDING_BACKWARD(T, SUFFIX, unsigned int, u32)                                    \
DEFINE_EMBEDDING_BACKWARD(T, SUFFIX, long long, i64)

DEFINE_EMBEDDING_ORDER(unsigned int, u32)
DEFINE_EMBEDDING_ORDER(long long, i64)
DEFINE_EMBEDDING(float, f32)
DEFINE_EMBEDDING(bf16, bf16)
DEFINE_EMBEDDING(f16, f16)
