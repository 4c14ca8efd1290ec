// Row softmax over the last axis: one block per row, fp32 accumulation for every storage type.
// Why our own kernel: softmax is memory-bound; one pass for max, one for sum, one to write, each a
// block-wide reduction. The attention variant also applies the score scale, an additive or boolean
// mask read through broadcast strides, and causal masking, so unfused attention costs one pass here.
#include "kiln_reduce.cuh"

struct KilnAttnMask {
    long long mb, mh, mq, mk;  // mask element strides over (batch, head, query, key); 0 = broadcast
    int heads, queries;
    int causal;                // 1: key k > query q + causal_offset is masked out
    int causal_offset;
};

template <typename T, typename M, int MASK>  // MASK: 0 none, 1 additive, 2 boolean (true = attend)
__device__ void softmax_rows(const T* __restrict__ x, T* __restrict__ y, long long cols, float scale,
                             const M* __restrict__ mask, KilnAttnMask g) {
    const long long r = blockIdx.x;
    const T* row = x + r * cols;
    T* out = y + r * cols;
    const int q = (int)(r % g.queries);
    const long long bh = r / g.queries;
    const M* mrow = MASK ? mask + (bh / g.heads) * g.mb + (bh % g.heads) * g.mh + q * g.mq : nullptr;
    auto value = [&](long long k) -> float {
        float v = kiln_f(row[k]) * scale;
        if (MASK == 1) v += kiln_f(mrow[k * g.mk]);
        if (MASK == 2 && !mrow[k * g.mk]) v = -CUDART_INF_F;
        if (g.causal && k > q + g.causal_offset) v = -CUDART_INF_F;
        return v;
    };
    float m = -CUDART_INF_F;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, value(i));
    m = kiln_block_reduce<true>(m);
    if (m == -CUDART_INF_F) m = 0.0f;  // a fully masked row: every weight becomes 0, not NaN
    float s = 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) s += __expf(value(i) - m);
    s = kiln_block_reduce<false>(s);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (long long i = threadIdx.x; i < cols; i += blockDim.x) out[i] = kiln_to<T>(__expf(value(i) - m) * inv);
}

#define KILN_SOFTMAX(T, SUFFIX)                                                                     \
    extern "C" __global__ void softmax_##SUFFIX(const T* x, T* y, long long cols) {                 \
        KilnAttnMask g = {0, 0, 0, 0, 1, 1, 0, 0};                                                  \
        softmax_rows<T, T, 0>(x, y, cols, 1.0f, nullptr, g);                                        \
    }                                                                                               \
    extern "C" __global__ void attn_softmax_##SUFFIX(const T* x, T* y, long long cols, float scale, \
                                                     KilnAttnMask g) {                              \
        softmax_rows<T, T, 0>(x, y, cols, scale, nullptr, g);                                       \
    }                                                                                               \
    extern "C" __global__ void attn_softmax_add_##SUFFIX(const T* x, T* y, long long cols, float scale, \
                                                         const T* mask, KilnAttnMask g) {           \
        softmax_rows<T, T, 1>(x, y, cols, scale, mask, g);                                          \
    }                                                                                               \
    extern "C" __global__ void attn_softmax_bool_##SUFFIX(const T* x, T* y, long long cols, float scale, \
                                                          const bool* mask, KilnAttnMask g) {       \
        softmax_rows<T, bool, 2>(x, y, cols, scale, mask, g);                                       \
    }

KILN_SOFTMAX(float, f32)
KILN_SOFTMAX(__half, f16)
KILN_SOFTMAX(__nv_bfloat16, bf16)
