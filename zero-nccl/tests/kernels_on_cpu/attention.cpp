// The CUDA-core attention kernels of src/kernels/layers.cu on the CPU (see
// shim.h and attention_check.h): T around and across the tiles, head widths
// below the compiled width (zero lanes), f32 and 16-bit, packed qkv and
// grouped K/V heads, causal and within sliding windows. Exits non-zero on any failure.
#include "shim.h"
#include "layers.cu"
#include "attention_check.h"

// Launches as layers/attention.rs does: 128 threads, ATTN_WARPS * R rows per block.
template <class E, int DMAX> struct CudaCores {
    static constexpr int R = DMAX == 64 ? ATTN_R_64 : ATTN_R_128, ROWS = ATTN_WARPS * R;
    static unsigned tiles(const AttentionCall<E>& c) { return (c.T + ROWS - 1) / ROWS; }
    static void forward(const AttentionCall<E>& c) {
        launch({(unsigned)c.H, (unsigned)c.B, tiles(c)}, {ATTN_THREADS, 1, 1}, [&] {
            attention_forward<E, DMAX, R>(c.q, c.k, c.v, c.y, c.lse, c.q_stride, c.kv_stride, c.T, c.H, c.KVH,
                                          c.D, c.W, c.scale);
        });
    }
    static void backward_kv_q(const AttentionCall<E>& c) {
        launch({(unsigned)c.KVH, (unsigned)c.B, tiles(c)}, {ATTN_THREADS, 1, 1}, [&] {
            attention_backward_dkdv<E, DMAX, R>(c.q, c.k, c.v, c.dout, c.lse, c.delta, c.dk, c.dv, c.q_stride,
                                                c.kv_stride, c.T, c.H, c.KVH, c.D, c.W, c.scale);
        });
        launch({(unsigned)c.H, (unsigned)c.B, tiles(c)}, {ATTN_THREADS, 1, 1}, [&] {
            attention_backward_dq<E, DMAX, R>(c.q, c.k, c.v, c.dout, c.lse, c.delta, c.dq, c.q_stride,
                                              c.kv_stride, c.T, c.H, c.KVH, c.D, c.W, c.scale);
        });
    }
};

int main() {
    for (int T : {1, 5, 33, 70})
        for (int D : {1, 7, 48, 64}) expect_attention<float, CudaCores<float, 64>>("f32 d64", 2, T, 2, 2, D, true, 1e-5);
    for (int T : {1, 40})
        for (int D : {80, 128}) expect_attention<float, CudaCores<float, 128>>("f32 d128", 1, T, 2, 2, D, true, 1e-5);
    expect_attention<float, CudaCores<float, 64>>("f32 d64", 2, 37, 4, 2, 64, false, 1e-5);
    expect_attention<float, CudaCores<float, 128>>("f32 d128", 1, 45, 4, 1, 96, false, 1e-5);
    expect_attention<float, CudaCores<float, 64>>("f32 d64", 1, 20, 3, 3, 16, false, 1e-5);
    for (int T : {33, 70}) {
        expect_attention<bf16, CudaCores<bf16, 64>>("bf16 d64", 1, T, 2, 2, 48, true, 2e-2);
        expect_attention<f16, CudaCores<f16, 64>>("f16 d64", 1, T, 2, 2, 48, true, 3e-3);
    }
    expect_attention<bf16, CudaCores<bf16, 128>>("bf16 d128", 1, 17, 2, 2, 128, true, 2e-2);
    expect_attention<bf16, CudaCores<bf16, 64>>("bf16 d64", 2, 29, 4, 2, 64, false, 2e-2);
    // Sliding windows: only itself, within a tile, across tiles, all but
    // one key, T, past T.
    for (int window : {1, 5, 33, 40, 69, 70, 200}) {
        expect_attention<float, CudaCores<float, 64>>("f32 d64", 2, 70, 2, 2, 48, true, 1e-5, window);
        expect_attention<float, CudaCores<float, 128>>("f32 d128", 1, 45, 4, 1, 96, false, 1e-5, window);
    }
    expect_attention<float, CudaCores<float, 64>>("f32 d64", 2, 97, 4, 2, 64, false, 1e-5, 17);
    expect_attention<bf16, CudaCores<bf16, 64>>("bf16 d64", 1, 70, 4, 2, 64, false, 2e-2, 20);
    printf("attention (CUDA cores) on the CPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
