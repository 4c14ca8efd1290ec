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

// Rows of at most 1024 (attention scores, classifier outputs): one warp per row, 8 rows per block, warp
// shuffles only (no block barriers); the row's values stay in registers between the three passes.
template <typename T, typename M, int MASK>
__device__ void softmax_rows_warp(const T* __restrict__ x, T* __restrict__ y, long long cols, float scale,
                                  const M* __restrict__ mask, KilnAttnMask g, long long rows) {
    constexpr int PER_LANE = 32;  // 32 lanes x 32 values = rows of up to 1024
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int lane = threadIdx.x & 31;
    const T* row = x + r * cols;
    T* out = y + r * cols;
    const int q = (int)(r % g.queries);
    const long long bh = r / g.queries;
    const M* mrow = MASK ? mask + (bh / g.heads) * g.mb + (bh % g.heads) * g.mh + q * g.mq : nullptr;
    float v[PER_LANE];
    float m = -CUDART_INF_F;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const long long k = lane + 32LL * j;
        float value = -CUDART_INF_F;
        if (k < cols) {
            value = kiln_f(row[k]) * scale;
            if (MASK == 1) value += kiln_f(mrow[k * g.mk]);
            if (MASK == 2 && !mrow[k * g.mk]) value = -CUDART_INF_F;
            if (g.causal && k > q + g.causal_offset) value = -CUDART_INF_F;
        }
        v[j] = value;
        m = fmaxf(m, value);
    }
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (m == -CUDART_INF_F) m = 0.0f;  // a fully masked row: every weight becomes 0, not NaN
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        v[j] = __expf(v[j] - m);
        s += v[j];
    }
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const long long k = lane + 32LL * j;
        if (k < cols) out[k] = kiln_to<T>(v[j] * inv);
    }
}

#define KILN_SOFTMAX_WARP(T, SUFFIX)                                                                \
    extern "C" __global__ void softmax_warp_##SUFFIX(const T* x, T* y, long long cols, long long rows) { \
        KilnAttnMask g = {0, 0, 0, 0, 1, 1, 0, 0};                                                  \
        softmax_rows_warp<T, T, 0>(x, y, cols, 1.0f, nullptr, g, rows);                             \
    }                                                                                               \
    extern "C" __global__ void attn_softmax_warp_##SUFFIX(const T* x, T* y, long long cols, float scale, \
                                                          KilnAttnMask g, long long rows) {         \
        softmax_rows_warp<T, T, 0>(x, y, cols, scale, nullptr, g, rows);                            \
    }                                                                                               \
    extern "C" __global__ void attn_softmax_add_warp_##SUFFIX(const T* x, T* y, long long cols, float scale, \
                                                              const T* mask, KilnAttnMask g, long long rows) { \
        softmax_rows_warp<T, T, 1>(x, y, cols, scale, mask, g, rows);                               \
    }                                                                                               \
    extern "C" __global__ void attn_softmax_bool_warp_##SUFFIX(const T* x, T* y, long long cols, float scale, \
                                                               const bool* mask, KilnAttnMask g, long long rows) { \
        softmax_rows_warp<T, bool, 2>(x, y, cols, scale, mask, g, rows);                            \
    }

KILN_SOFTMAX_WARP(float, f32)
KILN_SOFTMAX_WARP(__half, f16)
KILN_SOFTMAX_WARP(__nv_bfloat16, bf16)

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
