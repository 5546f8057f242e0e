// The attention kernels of src/kernels/ on a real GPU without Rust: nvcc
// compiles layers.cu and attention_tc.cu with this driver, which launches
// them as layers/attention.rs does (grids, blocks, packed and split
// operands) and
//  1. compares the tensor-core kernels (bf16, f16; widths 64 and 128;
//     packed, grouped 4/2, 4/1 and 32/8 heads; causal and within sliding
//     windows) against a double-precision reference of the inputs as
//     stored: output, log-sum-exp, dQ, dK, dV;
//  2. times forward + backward (4 launches) with CUDA events at the bench's
//     shapes: the GPT's (batch 16, T 256, 12 heads of 64) on both kernel
//     families, grouped 32/8 heads of 128, and the 1.1B Llama's (batch 4,
//     T 2048, 32/4 heads of 64) beside the same with 32 K/V heads and
//     within a window of 512 positions.
// scripts/check-attention-on-gpu.sh builds and runs it (sm_90 by default).
// Exits non-zero when a comparison fails. zero-candle/tests/gpu_layers.rs
// checks the same kernels through the Candle ops.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "layers.cu"
#include "attention_tc.cu"

#define CHECK(call)                                                                      \
    do {                                                                                 \
        cudaError_t e = (call);                                                          \
        if (e != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                \
                    cudaGetErrorString(e));                                              \
            exit(2);                                                                     \
        }                                                                                \
    } while (0)

static float host_f32(bf16 x) { return __bfloat162float(__ushort_as_bfloat16(x.bits)); }
static float host_f32(f16 x) { return __half2float(__ushort_as_half(x.bits)); }
template <class E> E host_from(float f);
template <> bf16 host_from<bf16>(float f) { return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(f))}; }
template <> f16 host_from<f16>(float f) { return f16{__half_as_ushort(__float2half_rn(f))}; }
template <> float host_from<float>(float f) { return f; }

template <class E> struct Kernels {
    void (*forward)(ATTN_FORWARD_PARAMS(E));
    void (*dq)(ATTN_DQ_PARAMS(E));
    void (*dkdv)(ATTN_DKDV_PARAMS(E));
    void (*delta)(const E*, const E*, float*, int, int, int, int);
    int rows;  // per block
};

template <class E> Kernels<E> tensor_cores(int dmax);
template <> Kernels<bf16> tensor_cores<bf16>(int dmax) {
    if (dmax == 64)
        return {attention_tc_forward_d64_bf16, attention_tc_backward_dq_d64_bf16,
                attention_tc_backward_dkdv_d64_bf16, attention_backward_delta_bf16, TC_ROWS};
    return {attention_tc_forward_d128_bf16, attention_tc_backward_dq_d128_bf16,
            attention_tc_backward_dkdv_d128_bf16, attention_backward_delta_bf16, TC_ROWS};
}
template <> Kernels<f16> tensor_cores<f16>(int dmax) {
    if (dmax == 64)
        return {attention_tc_forward_d64_f16, attention_tc_backward_dq_d64_f16,
                attention_tc_backward_dkdv_d64_f16, attention_backward_delta_f16, TC_ROWS};
    return {attention_tc_forward_d128_f16, attention_tc_backward_dq_d128_f16,
            attention_tc_backward_dkdv_d128_f16, attention_backward_delta_f16, TC_ROWS};
}
// The CUDA-core family at width 64 (the GPT's), for timing.
static Kernels<float> cuda_cores_f32() {
    return {attention_forward_d64_f32, attention_backward_dq_d64_f32,
            attention_backward_dkdv_d64_f32, attention_backward_delta_f32,
            ATTN_WARPS * ATTN_R_64};
}
static Kernels<bf16> cuda_cores_bf16() {
    return {attention_forward_d64_bf16, attention_backward_dq_d64_bf16,
            attention_backward_dkdv_d64_bf16, attention_backward_delta_bf16,
            ATTN_WARPS * ATTN_R_64};
}

// One call's device buffers; packed: q holds qkv (dq dqkv), k and v point in.
template <class E> struct Call {
    int B, T, H, KVH, D;
    int W;  // the window as the kernels take it: min(window, T)
    bool packed;
    int q_stride, kv_stride;
    size_t q_len, kv_len, out_len, lse_len;
    E *q, *k, *v, *dout, *y, *dq, *dk, *dv;
    float *lse, *delta;
    std::vector<E> hq, hk, hv, hdout;

    // `window` 0: plain causal attention.
    Call(int B_, int T_, int H_, int KVH_, int D_, bool packed_, unsigned seed, int window = 0)
        : B(B_), T(T_), H(H_), KVH(KVH_), D(D_), W(window > 0 ? std::min(window, T_) : T_),
          packed(packed_) {
        const int C = H * D, KC = KVH * D;
        q_stride = packed ? C + 2 * KC : C;
        kv_stride = packed ? q_stride : KC;
        const size_t rows = (size_t)B * T;
        q_len = rows * q_stride;
        kv_len = packed ? 0 : rows * KC;
        out_len = rows * C;
        lse_len = (size_t)B * H * T;
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd(0, 1);
        auto fill = [&](std::vector<E>& h, size_t n) {
            h.resize(n);
            for (auto& x : h) x = host_from<E>(nd(rng));
        };
        fill(hq, q_len), fill(hk, kv_len), fill(hv, kv_len), fill(hdout, out_len);
        auto upload = [&](E** d, const std::vector<E>& h) {
            CHECK(cudaMalloc(d, std::max<size_t>(h.size(), 1) * sizeof(E)));
            if (!h.empty()) CHECK(cudaMemcpy(*d, h.data(), h.size() * sizeof(E), cudaMemcpyHostToDevice));
        };
        upload(&q, hq), upload(&k, hk), upload(&v, hv), upload(&dout, hdout);
        CHECK(cudaMalloc(&y, out_len * sizeof(E)));
        CHECK(cudaMalloc(&dq, q_len * sizeof(E)));
        CHECK(cudaMalloc(&dk, std::max<size_t>(kv_len, 1) * sizeof(E)));
        CHECK(cudaMalloc(&dv, std::max<size_t>(kv_len, 1) * sizeof(E)));
        CHECK(cudaMalloc(&lse, lse_len * sizeof(float)));
        CHECK(cudaMalloc(&delta, lse_len * sizeof(float)));
        if (packed) {
            k = q + C, v = q + C + KC, dk = dq + C, dv = dq + C + KC;
            hk = hq, hv = hq;  // the reference reads them at their offsets
        }
    }

    // The forward and the backward's three launches; `only` in 0..4 runs
    // that one alone (for timing each), -1 all four.
    void run(const Kernels<E>& kern, int only = -1) const {
        const float scale = 1.f / sqrtf((float)D);
        const unsigned tiles = (T + kern.rows - 1) / kern.rows;
        if (only < 0 || only == 0)
            kern.forward<<<dim3(H, B, tiles), 128>>>(q, k, v, y, lse, q_stride, kv_stride, T, H, KVH, D, W, scale);
        const unsigned rows = B * T * H;
        if (only < 0 || only == 1) kern.delta<<<(rows + 7) / 8, 256>>>(y, dout, delta, B, T, H, D);
        if (only < 0 || only == 2)
            kern.dkdv<<<dim3(KVH, B, tiles), 128>>>(q, k, v, dout, lse, delta, dk, dv, q_stride, kv_stride, T,
                                                     H, KVH, D, W, scale);
        if (only < 0 || only == 3)
            kern.dq<<<dim3(H, B, tiles), 128>>>(q, k, v, dout, lse, delta, dq, q_stride, kv_stride, T, H, KVH,
                                                 D, W, scale);
    }

    // The largest error of y, dq, dk, dv relative to the reference's largest
    // magnitude, and of lse absolute.
    double compare() const {
        const int C = H * D, KC = KVH * D;
        const size_t rows = (size_t)B * T;
        std::vector<E> gy(out_len), gq(q_len), gk(packed ? 0 : kv_len), gv(packed ? 0 : kv_len);
        std::vector<float> glse(lse_len);
        CHECK(cudaMemcpy(gy.data(), y, out_len * sizeof(E), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(gq.data(), dq, q_len * sizeof(E), cudaMemcpyDeviceToHost));
        if (!packed) {
            CHECK(cudaMemcpy(gk.data(), dk, kv_len * sizeof(E), cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(gv.data(), dv, kv_len * sizeof(E), cudaMemcpyDeviceToHost));
        }
        CHECK(cudaMemcpy(glse.data(), lse, lse_len * sizeof(float), cudaMemcpyDeviceToHost));
        const size_t k_at = packed ? C : 0, v_at = packed ? C + KC : 0;
        auto Q = [&](int b, int t, int h, int d) { return (double)host_f32(hq[((size_t)b * T + t) * q_stride + h * D + d]); };
        auto K = [&](int b, int t, int g, int d) { return (double)host_f32(hk[((size_t)b * T + t) * kv_stride + k_at + g * D + d]); };
        auto V = [&](int b, int t, int g, int d) { return (double)host_f32(hv[((size_t)b * T + t) * kv_stride + v_at + g * D + d]); };
        auto G = [&](int b, int t, int h, int d) { return (double)host_f32(hdout[((size_t)b * T + t) * C + h * D + d]); };
        auto O = [&](int b, int t, int h, int d) { return (double)host_f32(gy[((size_t)b * T + t) * C + h * D + d]); };
        std::vector<double> ry(rows * C), rdq(rows * C, 0), rdk(rows * KC, 0), rdv(rows * KC, 0);
        double lse_err = 0;
        const double scale = 1.0 / sqrt((double)D);
        std::vector<double> s(T), p(T);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++) {
                const int g = h / (H / KVH);
                for (int i = 0; i < T; i++) {
                    const int j0 = std::max(0, i - W + 1);  // the keys (i - W, i]
                    double m = -1e300;
                    for (int j = j0; j <= i; j++) {
                        double a = 0;
                        for (int d = 0; d < D; d++) a += Q(b, i, h, d) * K(b, j, g, d);
                        s[j] = a * scale;
                        m = std::max(m, s[j]);
                    }
                    double l = 0;
                    for (int j = j0; j <= i; j++) l += exp(s[j] - m);
                    const double L = m + log(l);
                    lse_err = std::max(lse_err, fabs(L - glse[((size_t)b * H + h) * T + i]));
                    for (int j = j0; j <= i; j++) p[j] = exp(s[j] - L);
                    double Di = 0;
                    for (int d = 0; d < D; d++) Di += G(b, i, h, d) * O(b, i, h, d);
                    for (int d = 0; d < D; d++) {
                        double a = 0;
                        for (int j = j0; j <= i; j++) a += p[j] * V(b, j, g, d);
                        ry[((size_t)b * T + i) * C + h * D + d] = a;
                    }
                    for (int j = j0; j <= i; j++) {
                        double dp = 0;
                        for (int d = 0; d < D; d++) dp += G(b, i, h, d) * V(b, j, g, d);
                        const double ds = p[j] * (dp - Di);
                        for (int d = 0; d < D; d++) {
                            rdq[((size_t)b * T + i) * C + h * D + d] += scale * ds * K(b, j, g, d);
                            rdk[((size_t)b * T + j) * KC + g * D + d] += scale * ds * Q(b, i, h, d);
                            rdv[((size_t)b * T + j) * KC + g * D + d] += p[j] * G(b, i, h, d);
                        }
                    }
                }
            }
        auto rel = [&](const std::vector<double>& ref, auto got_at) {
            double m = 1, e = 0;
            for (double r : ref) m = std::max(m, fabs(r));
            for (size_t i = 0; i < ref.size(); i++) e = std::max(e, fabs(ref[i] - got_at(i)));
            return e / m;
        };
        const double ey = rel(ry, [&](size_t i) { return (double)host_f32(gy[i]); });
        const double eq = rel(rdq, [&](size_t i) { return (double)host_f32(gq[(i / C) * q_stride + i % C]); });
        const double ek = rel(rdk, [&](size_t i) {
            return packed ? (double)host_f32(gq[(i / KC) * q_stride + C + i % KC]) : (double)host_f32(gk[i]);
        });
        const double ev = rel(rdv, [&](size_t i) {
            return packed ? (double)host_f32(gq[(i / KC) * q_stride + C + KC + i % KC]) : (double)host_f32(gv[i]);
        });
        printf("    errors: y %.2g lse %.2g dq %.2g dk %.2g dv %.2g\n", ey, lse_err, eq, ek, ev);
        return std::max({ey, lse_err, eq, ek, ev});
    }

    float time_ms(const Kernels<E>& kern, int iters, int only = -1) const {
        for (int i = 0; i < 3; i++) run(kern);
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        CHECK(cudaEventRecord(a));
        for (int i = 0; i < iters; i++) run(kern, only);
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        CHECK(cudaGetLastError());
        return ms / iters;
    }
};

static int failures = 0;

template <class E>
static void check(const char* dtype, int dmax, int B, int T, int H, int KVH, int D, bool packed, double tol,
                  int window = 0) {
    printf("%s d%d: batch %d, T %d, %d heads / %d K/V heads of %d, %s, window %d\n", dtype, dmax, B, T, H, KVH,
           D, packed ? "packed" : "split", window);
    Call<E> call(B, T, H, KVH, D, packed, T * 7 + D + H + window, window);
    call.run(tensor_cores<E>(dmax));
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());
    const double err = call.compare();
    if (!(err <= tol)) {
        printf("    FAIL: error %g > %g\n", err, tol);
        failures++;
    }
}

// Forward + backward, and each launch alone: forward, delta, dK/dV, dQ.
template <class E>
static void report(const char* what, const Call<E>& call, const Kernels<E>& kern, int iters) {
    printf("time %s: %.4f ms (forward %.4f, delta %.4f, dk/dv %.4f, dq %.4f)\n", what,
           call.time_ms(kern, iters), call.time_ms(kern, iters, 0), call.time_ms(kern, iters, 1),
           call.time_ms(kern, iters, 2), call.time_ms(kern, iters, 3));
}

// `attention check` compares only (for compute-sanitizer), `attention
// profile` launches the 1.1B Llama's forward + backward once (for ncu),
// `attention` compares and times.
int main(int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    const bool timing = mode != "check";
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, sm_%d%d\n", prop.name, prop.major, prop.minor);
    if (mode == "profile") {
        Call<bf16> llama(4, 2048, 32, 4, 64, false, 3);
        llama.run(tensor_cores<bf16>(64));
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaGetLastError());
        return 0;
    }
    // The CPU harness's tolerances (attention_tc.cpp).
    for (int dmax : {64, 128}) {
        check<bf16>("bf16", dmax, 1, 1, 2, 2, dmax, true, 1e-2);
        check<bf16>("bf16", dmax, 2, 139, 2, 2, dmax, true, 1e-2);
        check<bf16>("bf16", dmax, 2, 77, 4, 2, dmax, false, 1e-2);
        check<bf16>("bf16", dmax, 1, 130, 4, 1, dmax, false, 1e-2);
        check<bf16>("bf16", dmax, 1, 45, 2, 2, dmax - 27, true, 1e-2);
        check<f16>("f16", dmax, 2, 139, 2, 2, dmax, true, 2e-3);
        check<f16>("f16", dmax, 2, 77, 4, 2, dmax, false, 2e-3);
        check<f16>("f16", dmax, 1, 45, 2, 2, dmax - 27, true, 2e-3);
        for (int window : {1, 17, 65, 100}) check<bf16>("bf16", dmax, 1, 196, 4, 2, dmax, false, 1e-2, window);
    }
    check<bf16>("bf16", 128, 1, 200, 32, 8, 128, false, 1e-2);
    if (!timing) {
        printf("attention on the GPU: %s\n", failures ? "FAILED" : "ok");
        return failures ? 1 : 0;
    }

    // Forward + backward, as the bench's attention figures (4 launches; the
    // Candle op adds its allocations).
    const int iters = 20;
    Call<float> gpt_f32(16, 256, 12, 12, 64, true, 1);
    Call<bf16> gpt_bf16(16, 256, 12, 12, 64, true, 1);
    Call<bf16> gqa(16, 256, 32, 8, 128, false, 2);
    report("gpt f32 cuda-cores", gpt_f32, cuda_cores_f32(), iters);
    report("gpt bf16 cuda-cores", gpt_bf16, cuda_cores_bf16(), iters);
    report("gpt bf16 tensor-cores", gpt_bf16, tensor_cores<bf16>(64), iters);
    report("gqa 32/8x128 bf16 tensor-cores", gqa, tensor_cores<bf16>(128), iters);
    Call<bf16> llama(4, 2048, 32, 4, 64, false, 3);
    report("llama 32/4x64 T2048 bf16 tensor-cores", llama, tensor_cores<bf16>(64), iters);
    Call<bf16> llama_mha(4, 2048, 32, 32, 64, false, 4);
    report("llama-mha 32/32x64 T2048 bf16 tensor-cores", llama_mha, tensor_cores<bf16>(64), iters);
    Call<bf16> llama_window(4, 2048, 32, 4, 64, false, 3, 512);
    report("llama 32/4x64 T2048 window 512 bf16 tensor-cores", llama_window, tensor_cores<bf16>(64), iters);
    printf("attention on the GPU: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
