// Row reductions over the trailing `cols` elements (ReduceMean/ReduceSum over trailing axes):
// one block per row, fp32 accumulation.
#include "kiln_reduce.cuh"

extern "C" __global__ void reduce_rows_f32(const float* __restrict__ x, float* __restrict__ y, long long cols,
                                           float scale) {
    const float* row = x + blockIdx.x * cols;
    float s = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) s += row[i];
    s = kiln_block_sum(s);
    if (threadIdx.x == 0) y[blockIdx.x] = s * scale;
}
