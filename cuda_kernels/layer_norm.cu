// LayerNormalization over the trailing `cols` elements of each row: one block per row, fp32 statistics.
// Why our own kernel: memory-bound; mean and variance in block-wide reductions, then one write pass,
// instead of the five elementwise/reduce layers the op decomposes into.
#include "kiln_reduce.cuh"

extern "C" __global__ void layer_norm_f32(const float* __restrict__ x, const float* __restrict__ gamma,
                                          const float* __restrict__ beta, float* __restrict__ y,
                                          long long cols, float epsilon) {
    const float* row = x + blockIdx.x * cols;
    float* out = y + blockIdx.x * cols;
    float s = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) s += row[i];
    const float mean = kiln_block_sum(s) / (float)cols;
    float q = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        const float d = row[i] - mean;
        q += d * d;
    }
    const float inv = rsqrtf(kiln_block_sum(q) / (float)cols + epsilon);
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = (row[i] - mean) * inv * gamma[i];
        out[i] = beta != nullptr ? v + beta[i] : v;
    }
}
