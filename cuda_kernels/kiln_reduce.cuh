// Shared pieces of the row kernels (softmax, layer_norm, reduce): fp32 block reductions and
// loads/stores of fp32, fp16 and bf16 storage.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

__device__ __forceinline__ float kiln_f(float v) { return v; }
__device__ __forceinline__ float kiln_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float kiln_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float kiln_f(bool v) { return v ? 1.0f : 0.0f; }
template <typename T> __device__ __forceinline__ T kiln_to(float v);
template <> __device__ __forceinline__ float kiln_to<float>(float v) { return v; }
template <> __device__ __forceinline__ __half kiln_to<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 kiln_to<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// Block-wide reduction of one float per thread: warp shuffles, then one warp. IS_MAX: max, else sum.
template <bool IS_MAX>
__device__ __forceinline__ float kiln_block_reduce(float v) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffff, v, offset);
        v = IS_MAX ? fmaxf(v, other) : v + other;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? partial[lane] : (IS_MAX ? -CUDART_INF_F : 0.0f);
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other = __shfl_xor_sync(0xffffffff, v, offset);
        v = IS_MAX ? fmaxf(v, other) : v + other;
    }
    __syncthreads();
    return v;
}

__device__ __forceinline__ float kiln_block_sum(float v) { return kiln_block_reduce<false>(v); }

__device__ __forceinline__ float kiln_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
    return v;
}

// v / d rounded to nearest from d's correctly rounded reciprocal: the quotient, then one correction step with the
// exact residual (fma) -- the correctly rounded quotient whenever nothing over- or underflows (Markstein), which
// quantization's bounded values and scales guarantee. Why not `/`: IEEE division costs ~10-20 instructions an
// element with its slow path, as much as the rest of a LayerNorm (the quantizing SkipLayerNorm ran 31 us against 20)
__device__ __forceinline__ float kiln_div_rn(float v, float d, float recip) {
    const float q = __fmul_rn(v, recip);
    return __fmaf_rn(__fmaf_rn(-q, d, v), recip, q);
}

// QuantizeLinear of v to int8 with zero point 0: v / scale rounded half to even, saturated (recip = 1 / scale,
// IEEE). Equals the generated QuantizeLinear kernel's `/`, so fused and unfused quantizers agree bit for bit.
// Saturating first and then adding 1.5 * 2^23 rounds half to even in the FP32 add and leaves the integer's two's
// complement in the sum's low byte: FMA-pipe instructions only, where rintf + the int8 conversion (FRND, F2I) run
// at a quarter of that rate (the GELU -> int8 GEMM epilogue's bottleneck). NaN saturates to -128 either way.
// kiln_s8_rint: that last step, for a q already saturated to [-128, 127].
__device__ __forceinline__ signed char kiln_s8_rint(float q) {
    return (signed char)__float_as_int(__fadd_rn(q, 12582912.0f));
}

__device__ __forceinline__ signed char kiln_quantize_s8(float v, float scale, float recip) {
    return kiln_s8_rint(fminf(fmaxf(kiln_div_rn(v, scale, recip), -128.0f), 127.0f));
}

__device__ __forceinline__ bool kiln_aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// One warp per row of at most KILN_WARP_ROW elements, held in registers (KILN_WARP_ROW / 32 floats a lane):
// a 16-byte vector per load when every pointer is 16-byte aligned and cols is a multiple of the vector, else
// one element per lane per load. Slot (j, e) of a lane is column (j * 32 + lane) * V + e (vectors), or
// (j * V + e) * 32 + lane (elements). Why: the block-per-row kernels re-read each row from memory for every
// pass and launch 256 threads for a 768-wide row; here a row is read once (BERT's LayerNorms, session 5:
// ~1.1 TB/s on the H100).
#define KILN_WARP_ROW 1024
template <typename T> struct alignas(16) KilnRowVec { T v[16 / sizeof(T)]; };

template <typename T, bool VEC>
struct KilnWarpRow {
    static constexpr int V = 16 / sizeof(T);
    static constexpr int SLOTS = KILN_WARP_ROW / 32 / V;  // vectors (or element groups) per lane
    int cols, lane;
    __device__ KilnWarpRow(int cols_) : cols(cols_), lane(threadIdx.x & 31) {}
    __device__ __forceinline__ int col(int j, int e) const { return VEC ? (j * 32 + lane) * V + e : (j * V + e) * 32 + lane; }
    // whether slot (j, e) is inside the row; VEC: a whole vector is in or out (cols % V == 0), one compare a slot
    __device__ __forceinline__ bool in(int j, int e) const { return col(j, VEC ? 0 : e) < cols; }
    // v[e] = row[col(j, e)] as float, 0 past the row's end
    __device__ __forceinline__ void load(const T* row, int j, float (&v)[V]) const {
        if constexpr (VEC) {
            KilnRowVec<T> a;
            const bool inside = in(j, 0);
            if (inside) a = *reinterpret_cast<const KilnRowVec<T>*>(row + col(j, 0));
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = inside ? kiln_f(a.v[e]) : 0.0f;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = in(j, e) ? kiln_f(row[col(j, e)]) : 0.0f;
        }
    }
    // v[e] = DequantizeLinear(row[col(j, e)], scale) as stored in T (int8 * scale in fp32, rounded to T; exactly
    // the unfused DequantizeLinear), 0 past the row's end. Vectors of V bytes: the same slots as T's 16-byte vectors.
    __device__ __forceinline__ void load(const signed char* row, int j, float (&v)[V], float scale) const {
        struct alignas(V) Bytes { signed char b[V]; };
        if constexpr (VEC) {
            Bytes a;
            const bool inside = in(j, 0);
            if (inside) a = *reinterpret_cast<const Bytes*>(row + col(j, 0));
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = inside ? kiln_f(kiln_to<T>(__fmul_rn((float)a.b[e], scale))) : 0.0f;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = in(j, e) ? kiln_f(kiln_to<T>(__fmul_rn((float)row[col(j, e)], scale))) : 0.0f;
        }
    }
    __device__ __forceinline__ void store(T* row, int j, const float (&v)[V]) const {
        if constexpr (VEC) {
            if (!in(j, 0)) return;
            KilnRowVec<T> a;
#pragma unroll
            for (int e = 0; e < V; ++e) a.v[e] = kiln_to<T>(v[e]);
            *reinterpret_cast<KilnRowVec<T>*>(row + col(j, 0)) = a;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (in(j, e)) row[col(j, e)] = kiln_to<T>(v[e]);
        }
    }
    // QuantizeLinear of v as stored in T (int8, zero point 0): one V-byte store a vector (VEC), else bytes
    __device__ __forceinline__ void store_s8(signed char* row, int j, const float (&v)[V], float scale, float recip) const {
        struct alignas(V) { signed char b[V]; } q;
#pragma unroll
        for (int e = 0; e < V; ++e) q.b[e] = kiln_quantize_s8(kiln_f(kiln_to<T>(v[e])), scale, recip);
        if constexpr (VEC) {
            if (in(j, 0)) *reinterpret_cast<decltype(q)*>(row + col(j, 0)) = q;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (in(j, e)) row[col(j, e)] = q.b[e];
        }
    }
};

// Launch bounds of the warp-per-row kernels: 256 threads (lowering.py THREADS), 4 blocks an SM, so 64 registers. The
// vector path needs 60-64; the element-wise fallback (unaligned or odd-width rows) would take ~128 and, as the
// kernel's register count, halve every launch's occupancy: it spills instead.
#define KILN_WARP_NORM_BOUNDS __launch_bounds__(256, 4)

template <typename U> struct KilnSame { using type = U; };  // a parameter type left out of template deduction

// The row kernels' body for one row (pointers at the row's start): VEC, the 16-byte-vector layout, is a template
// parameter so each layout is straight-line code (as a run-time flag, both layouts' index math and checks ran for
// every element: ~60 instructions an element in the int8-input SkipLayerNorm, which was issue-bound, session 11).
template <typename T, bool RMS, bool SKIP, typename TI, bool VEC>
__device__ __forceinline__ void kiln_warp_norm_row(const TI* __restrict__ x, const TI* __restrict__ skip,
                                                   const T* __restrict__ gamma, const T* __restrict__ beta,
                                                   T* __restrict__ y, signed char* __restrict__ yq, int cols,
                                                   float epsilon, const float* __restrict__ q_scale,
                                                   const float* __restrict__ x_scale,
                                                   const float* __restrict__ skip_scale) {
    using Row = KilnWarpRow<T, VEC>;
    constexpr bool DQ = sizeof(TI) == 1;  // int8 x and skip, dequantized by *x_scale / *skip_scale
    const Row row(cols);
    float v[Row::SLOTS][Row::V];
#pragma unroll
    for (int j = 0; j < Row::SLOTS; ++j) {
        if constexpr (DQ) row.load(x, j, v[j], *x_scale);
        else row.load(x, j, v[j]);
    }
    if constexpr (SKIP) {
#pragma unroll
        for (int j = 0; j < Row::SLOTS; ++j) {
            float s[Row::V];
            if constexpr (DQ) row.load(skip, j, s, *skip_scale);
            else row.load(skip, j, s);
#pragma unroll
            for (int e = 0; e < Row::V; ++e) v[j][e] = kiln_f(kiln_to<T>(v[j][e] + s[e]));
        }
    }
    float mean = 0.0f;
    if constexpr (!RMS) {
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < Row::SLOTS; ++j)
#pragma unroll
            for (int e = 0; e < Row::V; ++e) t += v[j][e];
        mean = kiln_warp_sum(t) / (float)cols;
    }
    float q = 0.0f;
#pragma unroll
    for (int j = 0; j < Row::SLOTS; ++j)
#pragma unroll
        for (int e = 0; e < Row::V; ++e) {
            const float d = row.in(j, e) ? v[j][e] - mean : 0.0f;
            q += d * d;
        }
    const float inv = rsqrtf(kiln_warp_sum(q) / (float)cols + epsilon);
    const float scale = yq != nullptr ? *q_scale : 1.0f, recip = 1.0f / scale;  // IEEE: kiln_div_rn's reciprocal
#pragma unroll
    for (int j = 0; j < Row::SLOTS; ++j) {
        if (VEC && !row.in(j, 0)) continue;  // the whole vector is past the row's end
        float g[Row::V], b[Row::V];
        row.load(gamma, j, g);
        if (beta != nullptr) row.load(beta, j, b);
#pragma unroll
        for (int e = 0; e < Row::V; ++e) {
            v[j][e] = (v[j][e] - mean) * inv * g[e];
            if (beta != nullptr) v[j][e] += b[e];
        }
        if (y != nullptr) row.store(y, j, v[j]);
        if (yq != nullptr) row.store_s8(yq, j, v[j], scale, recip);
    }
}

// LayerNormalization (RMS: RMSNormalization; SKIP: of x + skip, the sum rounded to T as the unfused Add stores
// it) of row blockIdx.x * warps + warp, in registers; fp32 statistics, two passes over the registers (the
// block kernels' order of operations).
//
// yq (not null): also QuantizeLinear(y as stored, *q_scale) to int8 (round half to even, saturate; zero point 0),
// as the unfused QuantizeLinear computes it from y (kiln.SkipLayerNorm's output 1, passes/fuse_norm_quantize.py);
// y may then be null (nothing reads the float output). TI = signed char: x and skip are int8, dequantized to T by
// *x_scale and *skip_scale as DequantizeLinear stores them (passes/fuse_norm_dequantize.py).
template <typename T, bool RMS, bool SKIP, typename TI = T>
__device__ void kiln_warp_norm(const TI* __restrict__ x, const typename KilnSame<TI>::type* __restrict__ skip,
                               const T* __restrict__ gamma,
                               const T* __restrict__ beta, T* __restrict__ y, int cols, float epsilon, long long rows,
                               signed char* __restrict__ yq = nullptr, const float* __restrict__ q_scale = nullptr,
                               const float* __restrict__ x_scale = nullptr, const float* __restrict__ skip_scale = nullptr) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // the whole warp: every lane has the same row
    const bool vec = kiln_aligned16(x) && (!SKIP || kiln_aligned16(skip)) && kiln_aligned16(gamma)
                     && (beta == nullptr || kiln_aligned16(beta)) && (y == nullptr || kiln_aligned16(y))
                     && (yq == nullptr || kiln_aligned16(yq)) && cols % KilnWarpRow<T, true>::V == 0;
    const long long at = r * cols;
    const TI* skip_row = SKIP ? skip + at : nullptr;
    T* y_row = y != nullptr ? y + at : nullptr;
    signed char* yq_row = yq != nullptr ? yq + at : nullptr;
    if (vec)
        kiln_warp_norm_row<T, RMS, SKIP, TI, true>(x + at, skip_row, gamma, beta, y_row, yq_row, cols, epsilon, q_scale,
                                                   x_scale, skip_scale);
    else
        kiln_warp_norm_row<T, RMS, SKIP, TI, false>(x + at, skip_row, gamma, beta, y_row, yq_row, cols, epsilon, q_scale,
                                                    x_scale, skip_scale);
}
