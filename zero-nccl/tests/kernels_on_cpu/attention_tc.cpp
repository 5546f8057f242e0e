// The tensor-core attention kernels of src/kernels/attention_tc.cu on the
// CPU (see shim.h: mma.sync as a warp-wide product over the lanes'
// fragment registers, laid out as the PTX ISA documents; and
// attention_check.h): bf16 and f16, head widths 64 and 128 and narrower
// ones (zero columns, 16-bit loads), T within one tile, across several and
// odd, packed qkv and separate q, k, v with 4 query heads on 2 and on 1 K/V
// heads, batch > 1, causal and within sliding windows; tiles streamed
// through two shared-memory stages (32 rows at width 128 against the
// block's 64); forward blocks of 128 queries at width 64 (two m-tiles a
// warp), whose warps skip the tiles none of their rows sees. Exits non-zero
// on any failure.
#include "shim.h"
#include "layers.cu"
#include "attention_tc.cu"
#include "attention_check.h"

// Launches as layers/attention.rs does: TC_THREADS threads, TC_QROWS(DMAX)
// query rows per forward block, TC_ROWS rows per dK/dV and dQ block.
template <class E, int DMAX> struct TensorCores {
    static unsigned tiles(const AttentionCall<E>& c, int rows) { return (c.T + rows - 1) / rows; }
    static void forward(const AttentionCall<E>& c) {
        launch({(unsigned)c.H, (unsigned)c.B, tiles(c, TC_QROWS(DMAX))}, {TC_THREADS, 1, 1}, [&] {
            attention_tc_forward<E, DMAX>(c.q, c.k, c.v, c.y, c.lse, c.q_stride, c.kv_stride, c.T, c.H, c.KVH,
                                          c.D, c.W, c.scale);
        });
    }
    static void backward_kv_q(const AttentionCall<E>& c) {
        launch({(unsigned)c.KVH, (unsigned)c.B, tiles(c, TC_ROWS)}, {TC_THREADS, 1, 1}, [&] {
            attention_tc_backward_dkdv<E, DMAX>(c.q, c.k, c.v, c.dout, c.lse, c.delta, c.dk, c.dv, c.q_stride,
                                                c.kv_stride, c.T, c.H, c.KVH, c.D, c.W, c.scale);
        });
        launch({(unsigned)c.H, (unsigned)c.B, tiles(c, TC_ROWS)}, {TC_THREADS, 1, 1}, [&] {
            attention_tc_backward_dq<E, DMAX>(c.q, c.k, c.v, c.dout, c.lse, c.delta, c.dq, c.q_stride,
                                              c.kv_stride, c.T, c.H, c.KVH, c.D, c.W, c.scale);
        });
    }
};

// P and dS enter the products rounded to 16 bits (as in FlashAttention-2),
// on top of the rounding of the stored results: bf16 keeps 8 bits.
constexpr double BF16_TOL = 1e-2, F16_TOL = 2e-3;

template <class E, int DMAX>
void cases(const char* what, double tol) {
    // (batch, T, heads, K/V heads, head width, packed)
    expect_attention<E, TensorCores<E, DMAX>>(what, 1, 1, 2, 2, DMAX, true, tol);
    expect_attention<E, TensorCores<E, DMAX>>(what, 2, 64, 2, 2, DMAX, true, tol);
    expect_attention<E, TensorCores<E, DMAX>>(what, 1, 139, 2, 2, DMAX, true, tol);
    expect_attention<E, TensorCores<E, DMAX>>(what, 2, 77, 4, 2, DMAX, false, tol);
    expect_attention<E, TensorCores<E, DMAX>>(what, 1, 130, 4, 1, DMAX, false, tol);
    expect_attention<E, TensorCores<E, DMAX>>(what, 1, 45, 2, 2, DMAX - 27, true, tol);
}

int main() {
    cases<bf16, 64>("bf16 d64", BF16_TOL);
    cases<f16, 64>("f16 d64", F16_TOL);
    cases<bf16, 128>("bf16 d128", BF16_TOL);
    cases<f16, 128>("f16 d128", F16_TOL);
    // T a multiple of 4 (the per-row values' 16-byte copies) over four
    // tiles, two query heads per K/V head: a dK/dV block streams eight
    // tiles through the stages, across its heads.
    expect_attention<bf16, TensorCores<bf16, 64>>("bf16 d64", 1, 196, 4, 2, 64, false, BF16_TOL);
    expect_attention<bf16, TensorCores<bf16, 128>>("bf16 d128", 1, 196, 4, 2, 128, false, BF16_TOL);
    expect_attention<f16, TensorCores<f16, 64>>("f16 d64", 1, 9, 3, 1, 5, false, F16_TOL);
    // Sliding windows: only itself, within a tile, a streamed tile's rows
    // (64 at width 64, 32 at 128) and one more, across tiles, past T;
    // blocks whose first tiles are skipped and whose tiles are masked at
    // the window's far edge; 66: a d64 forward warp (32 rows) whose first
    // row's window starts on a tile's last key, which it must not skip.
    for (int window : {1, 17, 32, 64, 65, 66, 100, 300}) {
        expect_attention<bf16, TensorCores<bf16, 64>>("bf16 d64", 1, 196, 4, 2, 64, false, BF16_TOL, window);
        expect_attention<bf16, TensorCores<bf16, 128>>("bf16 d128", 2, 139, 2, 2, 128, true, BF16_TOL, window);
    }
    expect_attention<f16, TensorCores<f16, 64>>("f16 d64", 1, 150, 4, 1, 40, false, F16_TOL, 70);
    printf("attention (tensor cores) on the CPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
