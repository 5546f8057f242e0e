// The sum of two gradients of one tensor (grad_sum.rs): contiguous f32,
// bf16 and f16, sm_80 and newer. Its own file so that zero-nccl's NVRTC and
// ptxas check (tests/nvrtc_ptx.rs) compiles it as this crate does.
// One 16-byte vector of each operand a thread (grid-stride); each pair of
// 16-bit values is summed with one rounding (fma by 1.0 for bf16: add.bf16x2
// needs sm_90).
__device__ __forceinline__ unsigned add_bf16x2(unsigned x, unsigned y) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(0x3f803f80u), "r"(y));
    return d;
}
__device__ __forceinline__ unsigned add_f16x2(unsigned x, unsigned y) {
    unsigned d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(x), "r"(y));
    return d;
}
#define GRID_STRIDE(n) \
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (n); \
         i += (unsigned long long)gridDim.x * blockDim.x)
#define GRAD_SUM_16(NAME, ADD)                                                              \
    extern "C" __global__ void NAME(const uint4* a, const uint4* b, uint4* out,             \
                                    unsigned long long n) {                                 \
        GRID_STRIDE(n) {                                                                    \
            const uint4 x = a[i], y = b[i];                                                 \
            out[i] = make_uint4(ADD(x.x, y.x), ADD(x.y, y.y), ADD(x.z, y.z), ADD(x.w, y.w)); \
        }                                                                                   \
    }
GRAD_SUM_16(grad_sum_bf16, add_bf16x2)
GRAD_SUM_16(grad_sum_f16, add_f16x2)
extern "C" __global__ void grad_sum_f32(const float4* a, const float4* b, float4* out,
                                        unsigned long long n) {
    GRID_STRIDE(n) {
        const float4 x = a[i], y = b[i];
        out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
}
