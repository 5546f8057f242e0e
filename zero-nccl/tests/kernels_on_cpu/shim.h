// Runs zero-nccl's CUDA C (src/kernels/*.cu) on the CPU, for
// scripts/check-kernels-on-cpu.sh: every CUDA thread of a block is a host
// thread, __syncthreads() is a barrier of the block's threads, a warp
// shuffle or __syncwarp() a barrier of its 32, a warp's mma.sync (shim_mma_m16n8k16) a
// barrier of its 32 around a product computed from every lane's fragment
// registers, laid out as the PTX ISA documents, and ldmatrix
// (shim_ldmatrix_x4) the same around the lanes' row addresses; cp.async
// copies at once. A barrier that some thread never reaches
// hangs the run (the script bounds it in time). What this cannot show:
// races between threads that a barrier should have ordered but the host's
// scheduling happened to, the GPU's approximate __expf, f16 NaN bits.
#pragma once
#define ZERO_LAYERS_ON_CPU 1
#include <atomic>
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <cstdlib>
struct dim3 { unsigned x=1, y=1, z=1; };
thread_local dim3 threadIdx, blockIdx;
dim3 gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
[[noreturn]] static inline void __trap(){ abort(); }
#define __expf cuda_expf
static inline float cuda_expf(float x){return expf(x);}
static inline float __int_as_float(int i){float f; memcpy(&f,&i,4); return f;}
static inline float __uint_as_float(unsigned i){float f; memcpy(&f,&i,4); return f;}
static inline unsigned __float_as_uint(float f){unsigned i; memcpy(&i,&f,4); return i;}
static inline int min(int a,int b){return a<b?a:b;}
static inline long long min(long long a,long long b){return a<b?a:b;}
static inline int max(int a,int b){return a>b?a:b;}
static inline float half_to_float(unsigned short b){_Float16 h; memcpy(&h,&b,2); return (float)h;}
static inline unsigned short float_to_half(float f){_Float16 h=(_Float16)f; unsigned short b; memcpy(&b,&h,2); return b;}
// Fragment registers of one mma.m16n8k16 per lane; two sets, used in turn.
struct MmaSlots { unsigned a[32][4]; unsigned b[32][2]; };
// Row addresses of one ldmatrix per lane; two sets, used in turn.
struct LdSlots { const unsigned short* row[32]; };
struct Warp { std::barrier<> bar{32}; double buf[32]; MmaSlots mma[2]; LdSlots ld[2]; };
std::vector<std::unique_ptr<Warp>> g_warps;
std::barrier<>* g_block = nullptr;
thread_local int g_tid;
static inline void __syncthreads(){ g_block->arrive_and_wait(); }
static inline double atomicAdd(double* at, double v){ return std::atomic_ref<double>(*at).fetch_add(v); }
static inline unsigned atomicMax(unsigned* at, unsigned v){
  std::atomic_ref<unsigned> a(*at); unsigned old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
  return old;
}
static inline void __syncwarp(unsigned = 0xffffffffu){ g_warps[g_tid/32]->bar.arrive_and_wait(); }
template<class V> static inline V shfl_idx(V v, int src){
  int lane = g_tid % 32; Warp& w = *g_warps[g_tid/32];
  w.buf[lane] = (double)v; w.bar.arrive_and_wait(); V r = (V)w.buf[src]; w.bar.arrive_and_wait(); return r;
}
static inline float __shfl_sync(unsigned, float v, int src){ return shfl_idx(v, src & 31); }
static inline float __shfl_xor_sync(unsigned, float v, int o){ return shfl_idx(v, (g_tid%32) ^ o); }
// One host thread per CUDA thread of a block, for the whole launch: the
// blocks run one after another (x fastest), each with a fresh block barrier
// (a thread that returns drops out of it, as an exited CUDA thread leaves
// __syncthreads) and fresh warps, made while every thread waits at the
// boundary between blocks (shared memory is static: one block at a time).
template<class F> void launch(dim3 grid, dim3 block, F f){
  gridDim = grid; blockDim = block; const int n = block.x*block.y*block.z;
  const unsigned blocks = grid.x*grid.y*grid.z;
  std::optional<std::barrier<>> bb;
  auto fresh = [&]() noexcept {
    bb.emplace(n); g_block = &*bb;
    g_warps.clear(); for(int w=0;w<(n+31)/32;w++) g_warps.emplace_back(new Warp);
  };
  fresh();
  std::barrier boundary(n, fresh);
  std::vector<std::thread> ts;
  for (int t=0;t<n;t++) ts.emplace_back([&,t]{
    g_tid=t; threadIdx.x=t%block.x; threadIdx.y=(t/block.x)%block.y; threadIdx.z=0;
    for (unsigned i=0;i<blocks;i++){
      blockIdx.x=i%grid.x; blockIdx.y=(i/grid.x)%grid.y; blockIdx.z=i/(grid.x*grid.y);
      f(); g_block->arrive_and_drop(); boundary.arrive_and_wait();
    }
  });
  for (auto& th: ts) th.join();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with
// D = C (in d): each lane posts its A and B registers, then computes its
// own four D elements from the whole warp's. Layouts (PTX ISA, "Matrix
// Fragments for mma.m16n8k16", g = lane / 4, t = lane % 4): A register i of
// lane (g, t) holds A[g + 8 (i % 2)][2t + 8 (i / 2) + {0, 1}], B register i
// holds B[2t + 8i + {0, 1}][g], D element i is D[g + 8 (i / 2)][2t + i % 2];
// the lower index in the low 16 bits. The two slot sets alternate, so one
// barrier per product suffices: a lane writes a set again only after
// every lane has passed the next product's barrier, hence finished reading.
// Products accumulate in f32, k in order (the hardware's order and
// intermediate precision are unspecified; the tolerances allow for it).
static inline float shim_widen16(unsigned bits, bool bf) {
  return bf ? __uint_as_float(bits << 16) : half_to_float((unsigned short)bits);
}
static inline void shim_mma_m16n8k16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool bf) {
  thread_local unsigned round = 0;
  const int lane = g_tid % 32; Warp& w = *g_warps[g_tid / 32];
  MmaSlots& s = w.mma[round++ & 1];
  for (int i = 0; i < 4; i++) s.a[lane][i] = a[i];
  for (int i = 0; i < 2; i++) s.b[lane][i] = b[i];
  w.bar.arrive_and_wait();
  auto half_of = [&](unsigned reg, int index) { return shim_widen16(index % 2 ? reg >> 16 : reg & 0xffff, bf); };
  auto A = [&](int row, int col) { return half_of(s.a[(row % 8) * 4 + (col % 8) / 2][row / 8 + 2 * (col / 8)], col); };
  auto B = [&](int k, int n) { return half_of(s.b[n * 4 + (k % 8) / 2][k / 8], k); };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; i++) {
    const int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float acc = d[i];
    for (int k = 0; k < 16; k++) acc += A(row, k) * B(k, col);
    d[i] = acc;
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l posts the
// address of row l % 8 of matrix l / 8; register j of lane (g, t) = (lane
// / 4, lane % 4) gets matrix j's elements (g, 2t) and (g, 2t + 1), or with
// .trans (2t, g) and (2t + 1, g), the first in the low 16 bits. The two
// address sets alternate as the mma's slots do.
static inline void shim_ldmatrix_x4(unsigned (&r)[4], const unsigned short* row, bool trans) {
  thread_local unsigned round = 0;
  const int lane = g_tid % 32; Warp& w = *g_warps[g_tid / 32];
  LdSlots& s = w.ld[round++ & 1];
  s.row[lane] = row;
  w.bar.arrive_and_wait();
  const int g = lane / 4, t = lane % 4;
  for (int j = 0; j < 4; j++) {
    const unsigned short* const* m = s.row + 8 * j;
    const unsigned lo = trans ? m[2 * t][g] : m[g][2 * t];
    const unsigned hi = trans ? m[2 * t + 1][g] : m[g][2 * t + 1];
    r[j] = lo | (hi << 16);
  }
}
