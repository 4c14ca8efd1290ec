// Shared pieces of the row kernels (softmax, layer_norm, reduce): fp32 block reductions and
// loads/stores of fp32, fp16 and bf16 storage.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

__device__ __forceinline__ float kiln_f(float v) { return v; }
__device__ __forceinline__ float kiln_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float kiln_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float kiln_f(bool v) { return v ? 1.0f : 0.0f; }
template <typename T> __device__ __forceinline__ T kiln_to(float v);
template <> __device__ __forceinline__ float kiln_to<float>(float v) { return v; }
template <> __device__ __forceinline__ __half kiln_to<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 kiln_to<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// Block-wide reduction of one float per thread: warp shuffles, then one warp. IS_MAX: max, else sum.
template <bool IS_MAX>
__device__ __forceinline__ float kiln_block_reduce(float v) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffff, v, offset);
        v = IS_MAX ? fmaxf(v, other) : v + other;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? partial[lane] : (IS_MAX ? -CUDART_INF_F : 0.0f);
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffff, v, offset);
        v = IS_MAX ? fmaxf(v, other) : v + other;
    }
    __syncthreads();
    return v;
}

__device__ __forceinline__ float kiln_block_sum(float v) { return kiln_block_reduce<false>(v); }
