// LayerNormalization and RMSNormalization over the trailing `cols` elements of each row: one block per
// row, fp32 statistics for every storage type. Why our own kernel: memory-bound; the statistics in
// block-wide reductions, then one write pass, instead of the five to nine layers the ops decompose into.
#include "kiln_reduce.cuh"

template <typename T, bool RMS>
__device__ void norm_rows(const T* __restrict__ x, const T* __restrict__ gamma, const T* __restrict__ beta,
                          T* __restrict__ y, long long cols, float epsilon) {
    const T* row = x + blockIdx.x * cols;
    T* out = y + blockIdx.x * cols;
    float mean = 0.0f;
    if (!RMS) {
        float s = 0.0f;
        for (long long i = threadIdx.x; i < cols; i += blockDim.x) s += kiln_f(row[i]);
        mean = kiln_block_sum(s) / (float)cols;
    }
    float q = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        const float d = kiln_f(row[i]) - mean;
        q += d * d;
    }
    const float inv = rsqrtf(kiln_block_sum(q) / (float)cols + epsilon);
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = (kiln_f(row[i]) - mean) * inv * kiln_f(gamma[i]);
        if (beta != nullptr) v += kiln_f(beta[i]);
        out[i] = kiln_to<T>(v);
    }
}

// *_warp_*: one warp per row of at most KILN_WARP_ROW elements, read once into registers (kiln_reduce.cuh)
#define KILN_NORM(T, SUFFIX)                                                                        \
    extern "C" __global__ void layer_norm_##SUFFIX(const T* x, const T* gamma, const T* beta, T* y, \
                                                   long long cols, float epsilon) {                 \
        norm_rows<T, false>(x, gamma, beta, y, cols, epsilon);                                     \
    }                                                                                               \
    extern "C" __global__ void rms_norm_##SUFFIX(const T* x, const T* gamma, const T* beta, T* y,   \
                                                 long long cols, float epsilon) {                   \
        norm_rows<T, true>(x, gamma, beta, y, cols, epsilon);                                      \
    }                                                                                               \
    extern "C" __global__ void KILN_WARP_NORM_BOUNDS layer_norm_warp_##SUFFIX(const T* x, const T* gamma, const T* beta, T* y, \
                                                        int cols, float epsilon, long long rows) {       \
        kiln_warp_norm<T, false, false>(x, nullptr, gamma, beta, y, cols, epsilon, rows);              \
    }                                                                                               \
    extern "C" __global__ void KILN_WARP_NORM_BOUNDS rms_norm_warp_##SUFFIX(const T* x, const T* gamma, const T* beta, T* y, \
                                                      int cols, float epsilon, long long rows) {       \
        kiln_warp_norm<T, true, false>(x, nullptr, gamma, beta, y, cols, epsilon, rows);               \
    }

KILN_NORM(float, f32)
KILN_NORM(__half, f16)
KILN_NORM(__nv_bfloat16, bf16)
