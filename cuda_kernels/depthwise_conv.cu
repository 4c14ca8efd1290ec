// Depthwise 2-D convolution (group == C_in == C_out) over channels-last (NHWC) activations, the filters stored
// [kh, kw, C] (the "rskc" weight transform of the ONNX [C, 1, kh, kw] filters): each thread computes one 16-byte run
// of contiguous channels (8 fp16/bf16, 4 fp32) of one output position, or of a few neighbouring positions along W,
// with 16-byte loads of inputs and weights, fp32 sums (FMA), then bias, residual and activation in registers.
// Why: cuDNN's runtime-fusion engines run grouped convolutions poorly (MobileNetV2 at batch 128 spent 17.0 ms in its
// convolutions on an H100, mostly depthwise, against 3.3 ms for torch.compile's whole model); a depthwise layer is a
// few FMAs per loaded byte, so a direct kernel that reads each input once from DRAM is bound by memory bandwidth.
//
// Kernels (suffix f32 / f16 / bf16), all taking (x, w, bias?, z?, y, KilnDwGeom):
//   depthwise_conv_k<K>s<S>_*  kw == K in {3, 5, 7}, W stride S in {1, 2}, W dilation 1, any kh / H stride /
//                              H dilation / padding: a tile of TW outputs along W per thread, the (TW-1)*S+K input
//                              columns of each filter row loaded once and kept in registers
//   depthwise_conv_*           any geometry, one output position per thread
//   depthwise_conv_scalar_*    channel counts that are not a multiple of the 16-byte run: one channel per thread
// Index math is 32-bit: the lowering takes this kernel only when x and y hold fewer than 2^31 elements. bias and z
// may be null; z (the residual) has y's shape and layout. Tensors are arena tensors or weights: 16-byte aligned.
#include "kiln_reduce.cuh"  // kiln_f / kiln_to: fp32 from and to each storage type

struct KilnDwGeom {
    int n, c, h, w, oh, ow;
    int kh, kw, sh, sw, ph, pw, dh, dw;
    int activation;  // 0 none, 1 Relu, 2 Clip [alpha, beta], 3 LeakyRelu (alpha), 4 Sigmoid
    float alpha, beta;
};

template <typename T, int VEC> struct alignas(sizeof(T) * VEC) KilnDwRun { T v[VEC]; };

template <typename T, int VEC>
__device__ __forceinline__ void kiln_dw_load(float (&out)[VEC], const T* p) {
    const KilnDwRun<T, VEC> run = *reinterpret_cast<const KilnDwRun<T, VEC>*>(p);
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = kiln_f(run.v[j]);
}

// comparisons written so that a NaN passes through, as the ONNX ops (numpy) let it
__device__ __forceinline__ float kiln_dw_activate(float v, const KilnDwGeom& g) {
    switch (g.activation) {
        case 1: return v < 0.0f ? 0.0f : v;
        case 2: v = v < g.alpha ? g.alpha : v; return v > g.beta ? g.beta : v;
        case 3: return v < 0.0f ? v * g.alpha : v;
        case 4: return 1.0f / (1.0f + expf(-v));
        default: return v;
    }
}

// acc (the sums plus bias) + z, activated, stored as one run at element offset ``at`` of y
template <typename T, int VEC>
__device__ __forceinline__ void kiln_dw_store(T* __restrict__ y, const T* __restrict__ z, int at, const float (&acc)[VEC],
                                              const KilnDwGeom& g) {
    float zv[VEC];
    if (z != nullptr) {
        kiln_dw_load<T, VEC>(zv, z + at);
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) zv[j] = 0.0f;
    }
    KilnDwRun<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) out.v[j] = kiln_to<T>(kiln_dw_activate(acc[j] + zv[j], g));
    *reinterpret_cast<KilnDwRun<T, VEC>*>(y + at) = out;
}

template <typename T, int VEC>
__device__ __forceinline__ void kiln_dw_bias(float (&acc)[VEC], const T* __restrict__ bias, int c) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = bias != nullptr ? kiln_f(bias[c + j]) : 0.0f;
}

// outputs along W per thread for a K-wide filter row at W stride S: at most 4, and at most 8 input columns in
// registers ((TW-1)*S + K), which keeps a 7x7 filter's tile within the register file
__host__ __device__ constexpr int kiln_dw_tile(int k, int s) {
    return (8 - k) / s + 1 > 4 ? 4 : ((8 - k) / s + 1 < 1 ? 1 : (8 - k) / s + 1);
}

template <typename T, int KW, int SW>
__device__ void depthwise_tiled(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                                const T* __restrict__ z, T* __restrict__ y, const KilnDwGeom& g) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int TW = kiln_dw_tile(KW, SW);
    constexpr int SPAN = (TW - 1) * SW + KW;
    const int runs = g.c / VEC;
    const int tiles = (g.ow + TW - 1) / TW;
    const int total = g.n * g.oh * tiles * runs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int r = i;
        const int c = (r % runs) * VEC; r /= runs;
        const int ow0 = (r % tiles) * TW; r /= tiles;
        const int oh = r % g.oh;
        const int n = r / g.oh;
        float acc[TW][VEC];
        kiln_dw_bias<T, VEC>(acc[0], bias, c);
#pragma unroll
        for (int t = 1; t < TW; ++t)
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[t][j] = acc[0][j];
        const int iw0 = ow0 * SW - g.pw;
        for (int a = 0; a < g.kh; ++a) {
            const int ih = oh * g.sh - g.ph + a * g.dh;
            if (ih < 0 || ih >= g.h) continue;
            const T* row = x + (n * g.h + ih) * g.w * g.c + c;
            float in[SPAN][VEC];
#pragma unroll
            for (int s = 0; s < SPAN; ++s) {
                const int iw = iw0 + s;
                if (iw >= 0 && iw < g.w) {
                    kiln_dw_load<T, VEC>(in[s], row + iw * g.c);
                } else {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) in[s][j] = 0.0f;
                }
            }
            const T* taps = w + a * KW * g.c + c;
#pragma unroll
            for (int b = 0; b < KW; ++b) {
                float wv[VEC];
                kiln_dw_load<T, VEC>(wv, taps + b * g.c);
#pragma unroll
                for (int t = 0; t < TW; ++t)
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[t][j] = fmaf(in[t * SW + b][j], wv[j], acc[t][j]);
            }
        }
        const int out = ((n * g.oh + oh) * g.ow + ow0) * g.c + c;
#pragma unroll
        for (int t = 0; t < TW; ++t)
            if (ow0 + t < g.ow) kiln_dw_store<T, VEC>(y, z, out + t * g.c, acc[t], g);
    }
}

template <typename T, int VEC>
__device__ void depthwise_any(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                              const T* __restrict__ z, T* __restrict__ y, const KilnDwGeom& g) {
    const int runs = g.c / VEC;
    const int total = g.n * g.oh * g.ow * runs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int r = i;
        const int c = (r % runs) * VEC; r /= runs;
        const int ow = r % g.ow; r /= g.ow;
        const int oh = r % g.oh;
        const int n = r / g.oh;
        float acc[VEC];
        kiln_dw_bias<T, VEC>(acc, bias, c);
        for (int a = 0; a < g.kh; ++a) {
            const int ih = oh * g.sh - g.ph + a * g.dh;
            if (ih < 0 || ih >= g.h) continue;
            for (int b = 0; b < g.kw; ++b) {
                const int iw = ow * g.sw - g.pw + b * g.dw;
                if (iw < 0 || iw >= g.w) continue;
                float in[VEC], wv[VEC];
                kiln_dw_load<T, VEC>(in, x + ((n * g.h + ih) * g.w + iw) * g.c + c);
                kiln_dw_load<T, VEC>(wv, w + (a * g.kw + b) * g.c + c);
#pragma unroll
                for (int j = 0; j < VEC; ++j) acc[j] = fmaf(in[j], wv[j], acc[j]);
            }
        }
        kiln_dw_store<T, VEC>(y, z, ((n * g.oh + oh) * g.ow + ow) * g.c + c, acc, g);
    }
}

#define KILN_DW_ARGS(T) const T* x, const T* w, const T* bias, const T* z, T* y, KilnDwGeom g
#define KILN_DW_TILED(T, SUFFIX, K, S)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) depthwise_conv_k##K##s##S##_##SUFFIX(KILN_DW_ARGS(T)) {     \
        depthwise_tiled<T, K, S>(x, w, bias, z, y, g);                                                             \
    }
#define KILN_DW(T, SUFFIX)                                                                                         \
    KILN_DW_TILED(T, SUFFIX, 3, 1) KILN_DW_TILED(T, SUFFIX, 3, 2) KILN_DW_TILED(T, SUFFIX, 5, 1)                 \
    KILN_DW_TILED(T, SUFFIX, 5, 2) KILN_DW_TILED(T, SUFFIX, 7, 1) KILN_DW_TILED(T, SUFFIX, 7, 2)                 \
    extern "C" __global__ void __launch_bounds__(256) depthwise_conv_##SUFFIX(KILN_DW_ARGS(T)) {                 \
        depthwise_any<T, 16 / sizeof(T)>(x, w, bias, z, y, g);                                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) depthwise_conv_scalar_##SUFFIX(KILN_DW_ARGS(T)) {          \
        depthwise_any<T, 1>(x, w, bias, z, y, g);                                                                  \
    }

KILN_DW(float, f32)
KILN_DW(__half, f16)
KILN_DW(__nv_bfloat16, bf16)
