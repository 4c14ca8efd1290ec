// Pointwise kernel family: engine_core/backends/cuda/pointwise.py appends one generated kernel per
// pointwise *program* (one ONNX op, or a fused chain of them) after this template.
// Why strides: numpy broadcasting, Transpose, Expand, Slice, Concat and channels-last layouts are all
// "read input i at sum(coord * in_stride)"; one indexer covers them, and the host merges contiguous dims
// first so the common same-shape case runs at rank 1 (one multiply per operand per element).
// Why programs: a chain of pointwise ops (bias + GELU, residual add + activation, the precision casts
// at a boundary) becomes one kernel that reads each input once and keeps intermediates in registers.
// fp16/bf16 values are loaded into float and computed in float; only stores round.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define KILN_MAX_RANK 6
#define KILN_MAX_INPUTS 8

struct KilnIndexer {
    long long shape[KILN_MAX_RANK];
    long long out[KILN_MAX_RANK];
    long long in[KILN_MAX_INPUTS][KILN_MAX_RANK];
};

// Loads: reduced-precision floats compute in float; every other type computes as itself.
__device__ __forceinline__ float kiln_load(__half v) { return __half2float(v); }
__device__ __forceinline__ float kiln_load(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float kiln_load(__nv_fp8_e4m3 v) { return (float)v; }
template <typename S> __device__ __forceinline__ S kiln_load(S v) { return v; }

// Stores (and explicit Casts): to fp16/bf16 through float, everything else by C conversion.
template <typename D> struct KilnConvert {
    template <typename S> __device__ __forceinline__ static D of(S v) { return (D)v; }
};
template <> struct KilnConvert<__half> {
    template <typename S> __device__ __forceinline__ static __half of(S v) { return __float2half((float)v); }
};
template <> struct KilnConvert<__nv_bfloat16> {
    template <typename S> __device__ __forceinline__ static __nv_bfloat16 of(S v) { return __float2bfloat16((float)v); }
};
// E4M3 (QuantizeLinear's default saturate=1): round to nearest even, saturate to +-448, NaN stays NaN
template <> struct KilnConvert<__nv_fp8_e4m3> {
    template <typename S> __device__ __forceinline__ static __nv_fp8_e4m3 of(S v) {
        __nv_fp8_e4m3 r;
        r.__x = __nv_cvt_float_to_fp8((float)v, __NV_SATFINITE, __NV_E4M3);
        return r;
    }
};
#define KILN_CONVERT(D, v) KilnConvert<D>::of(v)

// V consecutive elements moved as one aligned access (the vector path of generated kernels).
template <typename T, int V> struct alignas(sizeof(T) * V) KilnVec { T v[V]; };
__device__ __forceinline__ bool kiln_aligned(const void* p, unsigned long long bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}
// Every vector start stays aligned when each dim but the innermost steps a multiple of V elements.
__device__ __forceinline__ bool kiln_outer_strides_ok(const long long* strides, int rank, int v) {
    for (int d = 0; d < rank - 1; ++d)
        if (strides[d] % v != 0) return false;
    return true;
}

// Offsets of output element i for NIN inputs (general rank).
template <int NIN>
__device__ __forceinline__ void kiln_offsets(long long i, long long n, int rank, const KilnIndexer& ix,
                                             long long& oy, long long* o) {
    oy = 0;
#pragma unroll
    for (int k = 0; k < NIN; ++k) o[k] = 0;
    if (n <= 0xffffffffLL) {  // every dim fits 32 bits: 32-bit div/mod cost a fraction of 64-bit ones
        unsigned int r = (unsigned int)i;
        for (int d = rank - 1; d >= 0; --d) {
            const unsigned int len = (unsigned int)ix.shape[d];
            const long long c = r % len;
            r /= len;
            oy += c * ix.out[d];
#pragma unroll
            for (int k = 0; k < NIN; ++k) o[k] += c * ix.in[k][d];
        }
        return;
    }
    for (int d = rank - 1; d >= 0; --d) {
        const long long c = i % ix.shape[d];
        i /= ix.shape[d];
        oy += c * ix.out[d];
#pragma unroll
        for (int k = 0; k < NIN; ++k) o[k] += c * ix.in[k][d];
    }
}

// KILN_FOR_EACH(NIN, STMT) runs STMT for every output element with its offsets oy and o[0..NIN).
// Rank <= 1 (same-shape or scalar-broadcast operands after dim merging, the common case): offsets are
// one multiply each, and the grid-stride loop is unrolled 4 ways (the host launches a quarter as many
// threads) so each thread has four independent loads in flight. Higher ranks: the general indexer.
#define KILN_FOR_EACH(NIN, STMT)                                                                      \
    const long long kiln_step = (long long)gridDim.x * blockDim.x;                                    \
    const long long kiln_first = blockIdx.x * (long long)blockDim.x + threadIdx.x;                    \
    if (rank <= 1) {                                                                                  \
        for (long long kiln_base = kiln_first; kiln_base < n; kiln_base += 4 * kiln_step) {          \
            _Pragma("unroll") for (int kiln_u = 0; kiln_u < 4; ++kiln_u) {                           \
                const long long i = kiln_base + kiln_u * kiln_step;                                   \
                if (i < n) {                                                                          \
                    long long o[NIN > 0 ? NIN : 1];                                                   \
                    const long long oy = i * ix.out[0];                                               \
                    _Pragma("unroll") for (int k = 0; k < NIN; ++k) o[k] = i * ix.in[k][0];           \
                    STMT                                                                              \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    } else {                                                                                          \
        for (long long i = kiln_first; i < n; i += kiln_step) {                                       \
            long long oy, o[NIN > 0 ? NIN : 1];                                                       \
            kiln_offsets<NIN>(i, n, rank, ix, oy, o);                                                 \
            STMT                                                                                      \
        }                                                                                             \
    }

#ifndef KILN_GENERATED
// The template alone (CI compiles every .cu file) instantiates one kernel of each kind.
extern "C" __global__ void pw_relu_f32_f32(float* __restrict__ y, const float* __restrict__ x0, long long n,
                                           int rank, KilnIndexer ix) {
    KILN_FOR_EACH(1, { const float v0 = kiln_load(x0[o[0]]); y[oy] = KILN_CONVERT(float, v0 > 0.0f ? v0 : 0.0f); })
}
extern "C" __global__ void pw_add_f16_f16_f16(__half* __restrict__ y, const __half* __restrict__ x0,
                                              const __half* __restrict__ x1, long long n, int rank, KilnIndexer ix) {
    KILN_FOR_EACH(2, {
        const float v0 = kiln_load(x0[o[0]]);
        const float v1 = kiln_load(x1[o[1]]);
        y[oy] = KILN_CONVERT(__half, v0 + v1);
    })
}
#endif
