// kiln.SkipLayerNorm: LayerNormalization(x + skip) over the trailing `cols` elements of each row, one block per
// row. Why: a transformer's residual Add before its LayerNorm (post-LN BERT) otherwise reads two tensors and
// writes one whole activation only for the LayerNorm to read it back; here the sum never leaves the block.
// The sum is rounded to the storage type first, as the unfused Add stores it; statistics are fp32 (layer_norm.cu).
// skip_layer_norm_warp_*: one warp per row of at most KILN_WARP_ROW elements, in registers (kiln_reduce.cuh);
// skip_layer_norm_q_warp_*: also the output quantized to int8 (kiln.SkipLayerNorm's output 1);
// skip_layer_norm_dq_warp_*: x and skip are int8 (inputs 6, 7 their scales), y and yq each optional (null).
#include "kiln_reduce.cuh"

template <typename T>
__device__ __forceinline__ float kiln_skip_sum(const T* x, const T* skip, long long i) {
    return kiln_f(kiln_to<T>(kiln_f(x[i]) + kiln_f(skip[i])));
}

template <typename T>
__device__ void skip_norm_rows(const T* __restrict__ x, const T* __restrict__ skip, const T* __restrict__ gamma,
                               const T* __restrict__ beta, T* __restrict__ y, long long cols, float epsilon) {
    const T* row = x + blockIdx.x * cols;
    const T* srow = skip + blockIdx.x * cols;
    T* out = y + blockIdx.x * cols;
    float s = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) s += kiln_skip_sum(row, srow, i);
    const float mean = kiln_block_sum(s) / (float)cols;
    float q = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        const float d = kiln_skip_sum(row, srow, i) - mean;
        q += d * d;
    }
    const float inv = rsqrtf(kiln_block_sum(q) / (float)cols + epsilon);
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = (kiln_skip_sum(row, srow, i) - mean) * inv * kiln_f(gamma[i]);
        if (beta != nullptr) v += kiln_f(beta[i]);
        out[i] = kiln_to<T>(v);
    }
}

#define KILN_SKIP_NORM(T, SUFFIX)                                                                            \
    extern "C" __global__ void skip_layer_norm_##SUFFIX(const T* x, const T* skip, const T* gamma, const T* beta, \
                                                        T* y, long long cols, float epsilon) {                 \
        skip_norm_rows<T>(x, skip, gamma, beta, y, cols, epsilon);                                             \
    }                                                                                                          \
    extern "C" __global__ void KILN_WARP_NORM_BOUNDS skip_layer_norm_warp_##SUFFIX(const T* x, const T* skip, const T* gamma,        \
                                                             const T* beta, T* y, int cols, float epsilon,      \
                                                             long long rows) {                                 \
        kiln_warp_norm<T, false, true>(x, skip, gamma, beta, y, cols, epsilon, rows);                          \
    }                                                                                                          \
    extern "C" __global__ void KILN_WARP_NORM_BOUNDS skip_layer_norm_q_warp_##SUFFIX(const T* x, const T* skip, const T* gamma,      \
                                                               const T* beta, T* y, signed char* yq,           \
                                                               const float* q_scale, int cols, float epsilon,  \
                                                               long long rows) {                               \
        kiln_warp_norm<T, false, true>(x, skip, gamma, beta, y, cols, epsilon, rows, yq, q_scale);             \
    }                                                                                                          \
    extern "C" __global__ void KILN_WARP_NORM_BOUNDS skip_layer_norm_dq_warp_##SUFFIX(                                               \
        const signed char* x, const signed char* skip, const float* x_scale, const float* skip_scale,         \
        const T* gamma, const T* beta, T* y, signed char* yq, const float* q_scale, int cols, float epsilon,   \
        long long rows) {                                                                                      \
        kiln_warp_norm<T, false, true, signed char>(x, skip, gamma, beta, y, cols, epsilon, rows, yq, q_scale,  \
                                                    x_scale, skip_scale);                                      \
    }

KILN_SKIP_NORM(float, f32)
KILN_SKIP_NORM(__half, f16)
KILN_SKIP_NORM(__nv_bfloat16, bf16)
