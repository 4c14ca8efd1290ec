// Row reductions over the trailing `cols` elements (ReduceMean/ReduceSum/ReduceMax/ReduceMin over
// trailing axes, GlobalAveragePool of linear tensors): one block per row, fp32 accumulation.
#include "kiln_reduce.cuh"

template <typename T, int KIND>  // KIND: 0 sum (times scale), 1 max, 2 min
__device__ void reduce_rows(const T* __restrict__ x, T* __restrict__ y, long long cols, float scale) {
    const T* row = x + blockIdx.x * cols;
    float s = KIND == 0 ? 0.0f : (KIND == 1 ? -CUDART_INF_F : CUDART_INF_F);
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = kiln_f(row[i]);
        s = KIND == 0 ? s + v : (KIND == 1 ? fmaxf(s, v) : fminf(s, v));
    }
    if (KIND == 2) s = -kiln_block_reduce<true>(-s);
    else s = kiln_block_reduce<KIND == 1>(s);
    if (threadIdx.x == 0) y[blockIdx.x] = kiln_to<T>(KIND == 0 ? s * scale : s);
}

#define KILN_REDUCE(T, SUFFIX)                                                                      \
    extern "C" __global__ void reduce_rows_##SUFFIX(const T* x, T* y, long long cols, float scale) { \
        reduce_rows<T, 0>(x, y, cols, scale);                                                      \
    }                                                                                               \
    extern "C" __global__ void reduce_max_rows_##SUFFIX(const T* x, T* y, long long cols, float scale) { \
        reduce_rows<T, 1>(x, y, cols, scale);                                                      \
    }                                                                                               \
    extern "C" __global__ void reduce_min_rows_##SUFFIX(const T* x, T* y, long long cols, float scale) { \
        reduce_rows<T, 2>(x, y, cols, scale);                                                      \
    }

KILN_REDUCE(float, f32)
KILN_REDUCE(__half, f16)
KILN_REDUCE(__nv_bfloat16, bf16)
