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

// One warp per row of at most KILN_WARP_ROW elements, held in registers (KILN_WARP_ROW / 32 floats a lane):
// a 16-byte vector per load when every pointer is 16-byte aligned and cols is a multiple of the vector, else
// one element per lane per load. Slot (j, e) of a lane is column (j * 32 + lane) * V + e (vectors), or
// (j * V + e) * 32 + lane (elements). Why: the block-per-row kernels re-read each row from memory for every
// pass and launch 256 threads for a 768-wide row; here a row is read once (BERT's LayerNorms, session 5:
// ~1.1 TB/s on the H100).
#define KILN_WARP_ROW 1024
template <typename T> struct alignas(16) KilnRowVec { T v[16 / sizeof(T)]; };

template <typename T>
struct KilnWarpRow {
    static constexpr int V = 16 / sizeof(T);
    static constexpr int SLOTS = KILN_WARP_ROW / 32 / V;  // vectors (or element groups) per lane
    bool vec;
    int cols, lane;
    __device__ KilnWarpRow(int cols_, bool aligned) : vec(aligned && cols_ % V == 0), cols(cols_), lane(threadIdx.x & 31) {}
    __device__ __forceinline__ int col(int j, int e) const { return vec ? (j * 32 + lane) * V + e : (j * V + e) * 32 + lane; }
    // v[e] = row[col(j, e)] as float, 0 past the row's end
    __device__ __forceinline__ void load(const T* row, int j, float (&v)[V]) const {
        if (vec) {
            KilnRowVec<T> a;
            const bool in = col(j, 0) < cols;
            if (in) a = *reinterpret_cast<const KilnRowVec<T>*>(row + col(j, 0));
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = in ? kiln_f(a.v[e]) : 0.0f;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = col(j, e) < cols ? kiln_f(row[col(j, e)]) : 0.0f;
        }
    }
    // v[e] = DequantizeLinear(row[col(j, e)], scale) as stored in T (int8 * scale in fp32, rounded to T; exactly
    // the unfused DequantizeLinear), 0 past the row's end. Vectors of V bytes: the same slots as T's 16-byte vectors.
    __device__ __forceinline__ void load(const signed char* row, int j, float (&v)[V], float scale) const {
        struct alignas(V) Bytes { signed char b[V]; };
        if (vec) {
            Bytes a;
            const bool in = col(j, 0) < cols;
            if (in) a = *reinterpret_cast<const Bytes*>(row + col(j, 0));
#pragma unroll
            for (int e = 0; e < V; ++e) v[e] = in ? kiln_f(kiln_to<T>(__fmul_rn((float)a.b[e], scale))) : 0.0f;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                v[e] = col(j, e) < cols ? kiln_f(kiln_to<T>(__fmul_rn((float)row[col(j, e)], scale))) : 0.0f;
        }
    }
    __device__ __forceinline__ void store(T* row, int j, const float (&v)[V]) const {
        if (vec) {
            if (col(j, 0) >= cols) return;
            KilnRowVec<T> a;
#pragma unroll
            for (int e = 0; e < V; ++e) a.v[e] = kiln_to<T>(v[e]);
            *reinterpret_cast<KilnRowVec<T>*>(row + col(j, 0)) = a;
        } else {
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (col(j, e) < cols) row[col(j, e)] = kiln_to<T>(v[e]);
        }
    }
};

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
__device__ __forceinline__ signed char kiln_quantize_s8(float v, float scale, float recip) {
    const float q = fminf(fmaxf(kiln_div_rn(v, scale, recip), -128.0f), 127.0f);
    return (signed char)__float_as_int(__fadd_rn(q, 12582912.0f));
}

__device__ __forceinline__ bool kiln_aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// LayerNormalization (RMS: RMSNormalization; SKIP: of x + skip, the sum rounded to T as the unfused Add stores
// it) of row blockIdx.x * warps + warp, in registers; fp32 statistics, two passes over the registers (the
// block kernels' order of operations).
//
// yq (not null): also QuantizeLinear(y as stored, *q_scale) to int8 (round half to even, saturate; zero point 0),
// as the unfused QuantizeLinear computes it from y (kiln.SkipLayerNorm's output 1, passes/fuse_norm_quantize.py);
// y may then be null (nothing reads the float output). TI = signed char: x and skip are int8, dequantized to T by
// *x_scale and *skip_scale as DequantizeLinear stores them (passes/fuse_norm_dequantize.py).
template <typename U> struct KilnSame { using type = U; };  // a parameter type left out of template deduction
template <typename T, bool RMS, bool SKIP, typename TI = T>
__device__ void kiln_warp_norm(const TI* __restrict__ x, const typename KilnSame<TI>::type* __restrict__ skip,
                               const T* __restrict__ gamma,
                               const T* __restrict__ beta, T* __restrict__ y, int cols, float epsilon, long long rows,
                               signed char* __restrict__ yq = nullptr, const float* __restrict__ q_scale = nullptr,
                               const float* __restrict__ x_scale = nullptr, const float* __restrict__ skip_scale = nullptr) {
    using Row = KilnWarpRow<T>;
    constexpr bool DQ = sizeof(TI) == 1;  // int8 x and skip, dequantized by *x_scale / *skip_scale
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // the whole warp: every lane has the same row
    const bool aligned = kiln_aligned16(x) && (!SKIP || kiln_aligned16(skip)) && kiln_aligned16(gamma)
                         && (beta == nullptr || kiln_aligned16(beta)) && (y == nullptr || kiln_aligned16(y));
    const Row row(cols, aligned);
    float v[Row::SLOTS][Row::V];
#pragma unroll
    for (int j = 0; j < Row::SLOTS; ++j) {
        if constexpr (DQ) row.load(x + r * cols, j, v[j], *x_scale);
        else row.load(x + r * cols, j, v[j]);
    }
    if (SKIP) {
#pragma unroll
        for (int j = 0; j < Row::SLOTS; ++j) {
            float s[Row::V];
            if constexpr (DQ) row.load(skip + r * cols, j, s, *skip_scale);
            else row.load(skip + r * cols, j, s);
#pragma unroll
            for (int e = 0; e < Row::V; ++e) v[j][e] = kiln_f(kiln_to<T>(v[j][e] + s[e]));
        }
    }
    float mean = 0.0f;
    if (!RMS) {
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
            const float d = row.col(j, e) < cols ? v[j][e] - mean : 0.0f;
            q += d * d;
        }
    const float inv = rsqrtf(kiln_warp_sum(q) / (float)cols + epsilon);
    const float scale = yq != nullptr ? *q_scale : 1.0f, recip = 1.0f / scale;  // IEEE: kiln_div_rn's reciprocal
#pragma unroll
    for (int j = 0; j < Row::SLOTS; ++j) {
        float g[Row::V], b[Row::V];
        row.load(gamma, j, g);
        if (beta != nullptr) row.load(beta, j, b);
#pragma unroll
        for (int e = 0; e < Row::V; ++e) {
            v[j][e] = (v[j][e] - mean) * inv * g[e];
            if (beta != nullptr) v[j][e] += b[e];
        }
        if (y != nullptr) row.store(y + r * cols, j, v[j]);
        if (yq != nullptr) {
            struct alignas(Row::V) { signed char b[Row::V]; } q;  // one V-byte store a vector
#pragma unroll
            for (int e = 0; e < Row::V; ++e)
                q.b[e] = kiln_quantize_s8(kiln_f(kiln_to<T>(v[j][e])), scale, recip);
            if (row.vec && kiln_aligned16(yq)) {
                if (row.col(j, 0) < cols) *reinterpret_cast<decltype(q)*>(yq + r * cols + row.col(j, 0)) = q;
            } else {
#pragma unroll
                for (int e = 0; e < Row::V; ++e)
                    if (row.col(j, e) < cols) yq[r * cols + row.col(j, e)] = q.b[e];
            }
        }
    }
}
