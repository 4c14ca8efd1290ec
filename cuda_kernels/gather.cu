// Gather along one axis: y[o, j, r] = x[o, idx[j], r], data viewed as [outer, axis_len, inner] of
// fixed-width words. Why words: the host picks the widest word (up to 16 bytes) dividing a row of
// `inner` elements, so embedding lookups move 16-byte vectors whatever the element type.
template <typename W, typename I>
__device__ void gather_words(W* __restrict__ y, const W* __restrict__ x, const I* __restrict__ idx,
                             long long outer, long long nidx, long long axis_len, long long inner) {
    const long long total = outer * nidx * inner;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i % inner, t = i / inner;
        const long long j = t % nidx, o = t / nidx;
        long long k = (long long)idx[j];
        if (k < 0) k += axis_len;
        y[i] = x[(o * axis_len + k) * inner + r];
    }
}

#define KILN_GATHER(W, NAME)                                                                        \
    extern "C" __global__ void gather_##NAME##_i64(W* y, const W* x, const long long* idx, long long outer, \
                                                   long long nidx, long long axis_len, long long inner) { \
        gather_words(y, x, idx, outer, nidx, axis_len, inner);                                     \
    }                                                                                               \
    extern "C" __global__ void gather_##NAME##_i32(W* y, const W* x, const int* idx, long long outer, \
                                                   long long nidx, long long axis_len, long long inner) { \
        gather_words(y, x, idx, outer, nidx, axis_len, inner);                                     \
    }

KILN_GATHER(unsigned char, w1)
KILN_GATHER(unsigned short, w2)
KILN_GATHER(unsigned int, w4)
KILN_GATHER(unsigned long long, w8)
KILN_GATHER(uint4, w16)
