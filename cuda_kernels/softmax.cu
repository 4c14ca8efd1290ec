// Row softmax over the last axis: one block per row, fp32 accumulation for every input type.
// Why our own kernel: softmax is memory-bound; one pass for max, one for sum, one to write, all in a
// block-wide reduction, beats a chain of library calls and later fuses with scale/mask (attention).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

template <typename T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }

template <bool IS_MAX>
__device__ float block_reduce(float v) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, v, offset);
        v = IS_MAX ? fmaxf(v, other) : v + other;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? partial[lane] : (IS_MAX ? -CUDART_INF_F : 0.0f);
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other = __shfl_xor_sync(0xffffffff, v, offset);
        v = IS_MAX ? fmaxf(v, other) : v + other;
    }
    __syncthreads();
    return v;
}

template <typename T>
__device__ void softmax_rows(const T* __restrict__ x, T* __restrict__ y, long long cols) {
    const T* row = x + blockIdx.x * cols;
    T* out = y + blockIdx.x * cols;
    float m = -CUDART_INF_F;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, to_float(row[i]));
    m = block_reduce<true>(m);
    float s = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) s += __expf(to_float(row[i]) - m);
    s = block_reduce<false>(s);
    const float inv = 1.0f / s;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) out[i] = from_float<T>(__expf(to_float(row[i]) - m) * inv);
}

extern "C" __global__ void softmax_f32(const float* x, float* y, long long cols) { softmax_rows(x, y, cols); }
extern "C" __global__ void softmax_f16(const __half* x, __half* y, long long cols) { softmax_rows(x, y, cols); }
extern "C" __global__ void softmax_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, long long cols) { softmax_rows(x, y, cols); }
