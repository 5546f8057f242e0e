// One attention call of either kernel family of src/kernels/ (layers.cu's
// CUDA-core kernels, attention_tc.cu's tensor-core ones) on the CPU (see
// shim.h), against a double-precision reference of the same function:
// packed qkv or separate q, k, v with grouped K/V heads, causal or within
// a sliding window, forward output, log-sum-exp and the three gradients. Canaries after every output catch
// writes out of bounds. Used by attention.cpp and attention_tc.cpp.
#pragma once
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

template <class E> float tof(E e) { return to_f32(e); }
template <class E> E fromf(float f) { return from_f32<E>(f); }

// What a family's launches see: device-style pointers and the kernels'
// int arguments, as layers/attention.rs passes them.
template <class E> struct AttentionCall {
    const E *q, *k, *v, *dout;
    E *y, *dq, *dk, *dv;
    float *lse, *delta;
    int q_stride, kv_stride, B, T, H, KVH, D;
    int W;  // the window, min(window, T) as layers/attention.rs passes it
    float scale;
};

// The largest error of each result, relative to the reference's largest
// magnitude (at least 1); lse absolute.
struct AttentionErrors {
    double y = 0, lse = 0, dq = 0, dk = 0, dv = 0;
    bool out_of_bounds = false;
    double worst() const { return out_of_bounds ? 1e9 : std::max({y, lse, dq, dk, dv}); }
};

static double relative(const std::vector<double>& ref, const std::vector<double>& got) {
    double scale = 1, err = 0;
    for (double r : ref) scale = std::max(scale, fabs(r));
    for (size_t i = 0; i < ref.size(); i++) err = std::max(err, fabs(ref[i] - got[i]));
    return err / scale;
}

// `Family` has static forward(call) and backward_kv_q(call) (dK/dV then dQ).
// `window` 0: plain causal attention.
template <class E, class Family>
AttentionErrors check_attention(int B, int T, int H, int KVH, int D, bool packed, int window,
                                unsigned seed) {
    const int C = H * D, KC = KVH * D;
    const size_t rows = (size_t)B * T;
    const int q_stride = packed ? 3 * C : C, kv_stride = packed ? 3 * C : KC;
    const size_t q_len = rows * q_stride, kv_len = packed ? 0 : rows * KC, canary = 256;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0, 1);
    const E mark = fromf<E>(777.f);
    // packed: q holds qkv (and dq dqkv); k, v point into it.
    std::vector<E> qbuf(q_len), kbuf(kv_len), vbuf(kv_len), dout(rows * C);
    std::vector<E> y(rows * C + canary, mark), dq(q_len + canary, mark), dk(kv_len + canary, mark),
        dv(kv_len + canary, mark);
    std::vector<float> lse((size_t)B * H * T + canary, 1e30f), delta((size_t)B * H * T);
    for (auto* buf : {&qbuf, &kbuf, &vbuf, &dout})
        for (auto& x : *buf) x = fromf<E>(nd(rng));
    AttentionCall<E> call;
    call.q = qbuf.data();
    call.k = packed ? qbuf.data() + C : kbuf.data();
    call.v = packed ? qbuf.data() + 2 * C : vbuf.data();
    call.dout = dout.data();
    call.y = y.data();
    call.dq = dq.data();
    call.dk = packed ? dq.data() + C : dk.data();
    call.dv = packed ? dq.data() + 2 * C : dv.data();
    call.lse = lse.data();
    call.delta = delta.data();
    call.q_stride = q_stride;
    call.kv_stride = kv_stride;
    call.B = B, call.T = T, call.H = H, call.KVH = KVH, call.D = D;
    const int W = window > 0 ? std::min(window, T) : T;
    call.W = W;
    call.scale = 1.f / sqrtf((float)D);
    Family::forward(call);
    const unsigned delta_rows = B * T * H;
    launch({(delta_rows + 7) / 8, 1, 1}, {256, 1, 1}, [&] {
        attention_backward_delta<E>(y.data(), dout.data(), delta.data(), B, T, H, D);
    });
    Family::backward_kv_q(call);

    AttentionErrors err;
    auto canaries_hold = [&](const std::vector<E>& buf, size_t len) {
        for (size_t i = len; i < len + canary; i++)
            if (tof(buf[i]) != tof(mark)) return false;
        return true;
    };
    err.out_of_bounds = !canaries_hold(y, rows * C) || !canaries_hold(dq, q_len) ||
                        !canaries_hold(dk, kv_len) || !canaries_hold(dv, kv_len);
    for (size_t i = (size_t)B * H * T; i < lse.size(); i++) err.out_of_bounds |= lse[i] != 1e30f;

    // The reference, in double from the inputs as stored; D_i from the
    // kernel's y as stored (as the CPU op does).
    const double scale = 1.0 / sqrt((double)D);
    auto Q = [&](int b, int t, int h, int d) { return (double)tof(call.q[((size_t)b * T + t) * q_stride + h * D + d]); };
    auto K = [&](int b, int t, int g, int d) { return (double)tof(call.k[((size_t)b * T + t) * kv_stride + g * D + d]); };
    auto V = [&](int b, int t, int g, int d) { return (double)tof(call.v[((size_t)b * T + t) * kv_stride + g * D + d]); };
    auto G = [&](int b, int t, int h, int d) { return (double)tof(dout[((size_t)b * T + t) * C + h * D + d]); };
    auto O = [&](int b, int t, int h, int d) { return (double)tof(y[((size_t)b * T + t) * C + h * D + d]); };
    std::vector<double> ry(rows * C), gy(rows * C), rlse((size_t)B * H * T), glse(rlse.size());
    std::vector<double> rdq(rows * C, 0), gdq(rows * C), rdk(rows * KC, 0), gdk(rows * KC), rdv(rows * KC, 0),
        gdv(rows * KC);
    std::vector<double> s(T), p(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            const int g = h / (H / KVH);
            for (int i = 0; i < T; i++) {
                // The keys query i sees: (i - W, i].
                const int j0 = std::max(0, i - W + 1);
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
                rlse[((size_t)b * H + h) * T + i] = L;
                glse[((size_t)b * H + h) * T + i] = lse[((size_t)b * H + h) * T + i];
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
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            for (int c = 0; c < C; c++) {
                const size_t at = ((size_t)b * T + t) * C + c;
                gy[at] = tof(y[at]);
                gdq[at] = tof(call.dq[((size_t)b * T + t) * q_stride + c]);
            }
            for (int c = 0; c < KC; c++) {
                const size_t at = ((size_t)b * T + t) * KC + c;
                gdk[at] = tof(call.dk[((size_t)b * T + t) * kv_stride + c]);
                gdv[at] = tof(call.dv[((size_t)b * T + t) * kv_stride + c]);
            }
        }
    err.y = relative(ry, gy);
    err.dq = relative(rdq, gdq);
    err.dk = relative(rdk, gdk);
    err.dv = relative(rdv, gdv);
    for (size_t i = 0; i < rlse.size(); i++) err.lse = std::max(err.lse, fabs(rlse[i] - glse[i]));
    return err;
}

static int failures = 0;

template <class E, class Family>
void expect_attention(const char* what, int B, int T, int H, int KVH, int D, bool packed, double tol,
                      int window = 0) {
    const AttentionErrors e =
        check_attention<E, Family>(B, T, H, KVH, D, packed, window, T * 7 + D + H * 3 + KVH + window);
    const bool ok = e.worst() <= tol;
    printf("%s %s: batch %d, T %d, %d heads / %d K/V heads of %d, %s, window %d: errors y %.2g lse %.2g dq %.2g "
           "dk %.2g dv %.2g%s (tolerance %g)\n",
           ok ? "ok  " : "FAIL", what, B, T, H, KVH, D, packed ? "packed" : "separate", window, e.y, e.lse, e.dq,
           e.dk, e.dv, e.out_of_bounds ? ", WRITE OUT OF BOUNDS" : "", tol);
    fflush(stdout);
    if (!ok) failures++;
}
