// Token choice on the device for the generator (engine_core/generate/device_argmax.py): each selected row's argmax,
// so a greedy decode step sends back one int32 per sequence instead of its logits (64 rows of a 128k vocabulary are
// 33 MB). numpy's rule, which the host path uses: the first index of the largest value, a NaN counting as larger
// than any number (then the first NaN).
// Grid: one block per row (`offsets` [rows] int64: the element where the row starts); threads stride over the
// vocabulary, then a warp-shuffle and a shared-memory reduction of (value, index) pairs. blockDim.x: a multiple of
// 32, at most KILN_ARGMAX_THREADS.

#define KILN_ARGMAX_THREADS 256

// whether (a, ia) goes before (b, ib): a NaN first, then the larger value, then the lower index
__device__ __forceinline__ bool kiln_argmax_before(float a, int ia, float b, int ib) {
    const bool nan_a = a != a, nan_b = b != b;
    if (nan_a != nan_b) return nan_a;
    if (!nan_a && a != b) return a > b;
    return ia < ib;
}

extern "C" __global__ void rows_argmax_f32(const float* __restrict__ logits, const long long* __restrict__ offsets,
                                           int vocab, int* __restrict__ out) {
    const float* row = logits + offsets[blockIdx.x];
    float best = __int_as_float(0xff800000);  // -inf: any element, -inf included (lower index), goes before it
    int index = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (kiln_argmax_before(v, i, best, index)) {
            best = v;
            index = i;
        }
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float v = __shfl_down_sync(0xffffffffu, best, offset);
        const int i = __shfl_down_sync(0xffffffffu, index, offset);
        if (kiln_argmax_before(v, i, best, index)) {
            best = v;
            index = i;
        }
    }
    __shared__ float values[KILN_ARGMAX_THREADS / 32];
    __shared__ int indices[KILN_ARGMAX_THREADS / 32];
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        values[warp] = best;
        indices[warp] = index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // holds warp 0's pair already
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            if (kiln_argmax_before(values[w], indices[w], best, index)) {
                best = values[w];
                index = indices[w];
            }
        }
        out[blockIdx.x] = index;
    }
}
