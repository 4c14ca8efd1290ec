// Block-wide fp32 sum shared by the row kernels (layer_norm, reduce): warp shuffles, then one warp.
#pragma once

__device__ __forceinline__ float kiln_block_sum(float v) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? partial[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    __syncthreads();
    return v;
}
