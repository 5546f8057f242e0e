// Runs zero-nccl's CUDA C (src/kernels/layers.cu) on the CPU, for
// scripts/check-kernels-on-cpu.sh: every CUDA thread of a block is a host
// thread, __syncthreads() is a barrier of the block's threads, a warp
// shuffle a barrier of its 32. A barrier that some thread never reaches
// hangs the run (the script bounds it in time). What this cannot show:
// races between threads that a barrier should have ordered but the host's
// scheduling happened to, the GPU's approximate __expf, f16 NaN bits.
#pragma once
#define ZERO_LAYERS_ON_CPU 1
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <functional>
#include <memory>
struct dim3 { unsigned x=1, y=1, z=1; };
thread_local dim3 threadIdx, blockIdx;
dim3 gridDim, blockDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)
#define __expf cuda_expf
static inline float cuda_expf(float x){return expf(x);}
static inline float __int_as_float(int i){float f; memcpy(&f,&i,4); return f;}
static inline float __uint_as_float(unsigned i){float f; memcpy(&f,&i,4); return f;}
static inline unsigned __float_as_uint(float f){unsigned i; memcpy(&i,&f,4); return i;}
static inline int min(int a,int b){return a<b?a:b;}
static inline long long min(long long a,long long b){return a<b?a:b;}
static inline float half_to_float(unsigned short b){_Float16 h; memcpy(&h,&b,2); return (float)h;}
static inline unsigned short float_to_half(float f){_Float16 h=(_Float16)f; unsigned short b; memcpy(&b,&h,2); return b;}
struct Warp { std::barrier<> bar{32}; double buf[32]; };
std::vector<std::unique_ptr<Warp>> g_warps;
std::barrier<>* g_block = nullptr;
thread_local int g_tid;
static inline void __syncthreads(){ g_block->arrive_and_wait(); }
template<class V> static inline V shfl_idx(V v, int src){
  int lane = g_tid % 32; Warp& w = *g_warps[g_tid/32];
  w.buf[lane] = (double)v; w.bar.arrive_and_wait(); V r = (V)w.buf[src]; w.bar.arrive_and_wait(); return r;
}
static inline float __shfl_sync(unsigned, float v, int src){ return shfl_idx(v, src & 31); }
static inline float __shfl_xor_sync(unsigned, float v, int o){ return shfl_idx(v, (g_tid%32) ^ o); }
template<class F> void launch(dim3 grid, dim3 block, F f){
  gridDim = grid; blockDim = block; int n = block.x*block.y*block.z;
  for (unsigned bz=0;bz<grid.z;bz++) for (unsigned by=0;by<grid.y;by++) for (unsigned bx=0;bx<grid.x;bx++){
    std::barrier<> bb(n); g_block=&bb; g_warps.clear(); for(int w=0;w<(n+31)/32;w++) g_warps.emplace_back(new Warp);
    std::vector<std::thread> ts;
    for (int t=0;t<n;t++) ts.emplace_back([&,t]{ g_tid=t; threadIdx.x=t%block.x; threadIdx.y=(t/block.x)%block.y; threadIdx.z=0; blockIdx.x=bx; blockIdx.y=by; blockIdx.z=bz; f(); g_block->arrive_and_drop(); });
    for (auto& th: ts) th.join();
  }
}
