// 2-D max/average pooling (MaxPool, AveragePool, GlobalMaxPool, GlobalAveragePool) over any layout:
// one thread per output element, input and output addressed by element strides (n, c, h, w), so NCHW
// and channels-last tensors take the same kernel. Threads walk the output in its physical order (c
// fastest for channels-last), which keeps neighbouring threads on neighbouring addresses.
// Accumulation in fp32 for every storage type. Channels-last tensors with 16-byte channel runs take
// pool2d_nhwc; channels-last pools over whole rows (global pools) take pool_band_nhwc, which spreads a
// window over a block.
#include "kiln_reduce.cuh"  // kiln_f / kiln_to: fp32 from and to each storage type

struct KilnPoolGeom {
    long long xs[4];
    long long ys[4];
    int n, c, h, w, oh, ow;
    int kh, kw, sh, sw, ph, pw, ph_end, pw_end, dh, dw;
    int channels_last, count_include_pad;
};

template <typename T, bool IS_MAX>
__device__ void pool2d(const T* __restrict__ x, T* __restrict__ y, const KilnPoolGeom& g) {
    const long long total = (long long)g.n * g.c * g.oh * g.ow;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i;
        int n, c, oh, ow;
        if (g.channels_last) {
            c = r % g.c; r /= g.c; ow = r % g.ow; r /= g.ow; oh = r % g.oh; n = r / g.oh;
        } else {
            ow = r % g.ow; r /= g.ow; oh = r % g.oh; r /= g.oh; c = r % g.c; n = r / g.c;
        }
        const T* base = x + n * g.xs[0] + c * g.xs[1];
        float acc = IS_MAX ? -CUDART_INF_F : 0.0f;
        int count = 0;
        for (int a = 0; a < g.kh; ++a) {
            const int ih = oh * g.sh - g.ph + a * g.dh;
            for (int b = 0; b < g.kw; ++b) {
                const int iw = ow * g.sw - g.pw + b * g.dw;
                const bool inside = ih >= 0 && ih < g.h && iw >= 0 && iw < g.w;
                if (inside) {
                    const float v = kiln_f(base[ih * g.xs[2] + iw * g.xs[3]]);
                    acc = IS_MAX ? fmaxf(acc, v) : acc + v;
                    ++count;
                } else if (!IS_MAX && g.count_include_pad && ih < g.h + g.ph_end && iw < g.w + g.pw_end) {
                    ++count;  // a padded position: counts, adds zero
                }
            }
        }
        if (!IS_MAX) acc = count > 0 ? acc / (float)count : 0.0f;
        y[n * g.ys[0] + c * g.ys[1] + oh * g.ys[2] + ow * g.ys[3]] = kiln_to<T>(acc);
    }
}

// Channels-last with contiguous channels (xs[1] == ys[1] == 1, C a multiple of 16 bytes' worth): one thread per
// 16-byte run of channels of one output position, 32-bit index math (the lowering checks both tensors hold
// fewer than 2^31 elements). Why: the generic kernel's 64-bit divisions and 2-byte loads made ResNet-50's
// 3x3/2 max pool at batch 128 cost 0.6 ms on the H100, ~7x its memory traffic.
template <typename T, bool IS_MAX>
__device__ void pool2d_nhwc(const T* __restrict__ x, T* __restrict__ y, const KilnPoolGeom& g) {
    constexpr int VEC = 16 / sizeof(T);
    struct alignas(16) Run { T v[VEC]; };
    const int runs = g.c / VEC;
    const int total = g.n * g.oh * g.ow * runs;
    const int xs0 = (int)g.xs[0], xs2 = (int)g.xs[2], xs3 = (int)g.xs[3];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int r = i;
        const int c = (r % runs) * VEC; r /= runs;
        const int ow = r % g.ow; r /= g.ow;
        const int oh = r % g.oh;
        const int n = r / g.oh;
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = IS_MAX ? -CUDART_INF_F : 0.0f;
        int count = 0;
        for (int a = 0; a < g.kh; ++a) {
            const int ih = oh * g.sh - g.ph + a * g.dh;
            for (int b = 0; b < g.kw; ++b) {
                const int iw = ow * g.sw - g.pw + b * g.dw;
                if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) {
                    const Run in = *reinterpret_cast<const Run*>(x + n * xs0 + ih * xs2 + iw * xs3 + c);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float v = kiln_f(in.v[j]);
                        acc[j] = IS_MAX ? fmaxf(acc[j], v) : acc[j] + v;
                    }
                    ++count;
                } else if (!IS_MAX && g.count_include_pad && ih < g.h + g.ph_end && iw < g.w + g.pw_end) {
                    ++count;
                }
            }
        }
        Run out;
#pragma unroll
        for (int j = 0; j < VEC; ++j) out.v[j] = kiln_to<T>(IS_MAX ? acc[j] : (count > 0 ? acc[j] / (float)count : 0.0f));
        *reinterpret_cast<Run*>(y + n * (int)g.ys[0] + oh * (int)g.ys[2] + ow * (int)g.ys[3] + c) = out;
    }
}

// A pool whose window is the whole unpadded width and a band of kh rows (output (n, c, band, 0) pools rows
// [band * kh, band * kh + kh) of image n), channels-last with contiguous channels and positions (xs[1] == 1,
// xs[2] == w * xs[3], ys[1] == 1; the lowering checks them and that an image holds fewer than 2^31 elements).
// One band of kh == h rows is GlobalAveragePool / GlobalMaxPool (and Max/AveragePool over the whole input); the
// lowering splits a global pool that has few blocks into bands, then pools the bands with this kernel again
// (h = bands, w = 1). Why not pool2d_nhwc: its thread per output run walks the whole window alone, and a global
// pool has few outputs (EfficientNet-B0's first squeeze-and-excitation pool at batch 1: 4 threads, 12,544 loads
// each). Here a block (bx, by) takes image blockIdx.y, band blockIdx.z and up to bx runs of VEC channels (16 bytes;
// VEC = 1 when C is not a multiple of 16 bytes): threadIdx.x over the runs, threadIdx.y over the band's positions
// (a warp reads neighbouring positions' runs: contiguous bytes), fp32 sums in registers, then one shared-memory
// pass over the y lanes, one thread per channel, whose stores are contiguous (no alignment asked of y).
// Blocks of at most 256 threads.
template <typename T, int VEC, bool IS_MAX>
__device__ void pool_band_nhwc(const T* __restrict__ x, T* __restrict__ y, const KilnPoolGeom& g) {
    struct alignas(sizeof(T) * VEC) Run { T v[VEC]; };
    __shared__ float lanes[256 * 8];  // [by][bx][VEC] partial results, VEC <= 8
    const int bx = blockDim.x, by = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
    const int c0 = blockIdx.x * bx * VEC;  // the group's first channel
    const int count = g.kh * g.w, step = (int)g.xs[3];
    const T* base = x + blockIdx.y * g.xs[0] + (long long)blockIdx.z * g.kh * g.xs[2] + c0 + tx * VEC;
    float acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = IS_MAX ? -CUDART_INF_F : 0.0f;
    if (c0 + tx * VEC < g.c) {
        for (int p = ty; p < count; p += 4 * by) {  // four predicated loads in flight before any is used
            Run in[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (p + u * by < count) in[u] = *reinterpret_cast<const Run*>(base + (p + u * by) * step);
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (p + u * by < count) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float v = kiln_f(in[u].v[j]);
                        acc[j] = IS_MAX ? fmaxf(acc[j], v) : acc[j] + v;
                    }
                }
        }
    }
    const int width = bx * VEC;  // the group's channels
#pragma unroll
    for (int j = 0; j < VEC; ++j) lanes[ty * width + tx * VEC + j] = acc[j];
    __syncthreads();
    T* out = y + blockIdx.y * g.ys[0] + blockIdx.z * g.ys[2] + c0;
    for (int t = ty * bx + tx; t < width && c0 + t < g.c; t += bx * by) {
        float s = lanes[t];
        for (int r = 1; r < by; ++r) s = IS_MAX ? fmaxf(s, lanes[r * width + t]) : s + lanes[r * width + t];
        out[t] = kiln_to<T>(IS_MAX ? s : s / (float)count);
    }
}

#define KILN_POOL(T, SUFFIX)                                                                          \
    extern "C" __global__ void max_pool_##SUFFIX(const T* x, T* y, KilnPoolGeom g) { pool2d<T, true>(x, y, g); } \
    extern "C" __global__ void avg_pool_##SUFFIX(const T* x, T* y, KilnPoolGeom g) { pool2d<T, false>(x, y, g); } \
    extern "C" __global__ void max_pool_nhwc_##SUFFIX(const T* x, T* y, KilnPoolGeom g) { pool2d_nhwc<T, true>(x, y, g); } \
    extern "C" __global__ void avg_pool_nhwc_##SUFFIX(const T* x, T* y, KilnPoolGeom g) { pool2d_nhwc<T, false>(x, y, g); } \
    extern "C" __global__ void max_pool_global_nhwc_##SUFFIX(const T* x, T* y, KilnPoolGeom g) {                 \
        pool_band_nhwc<T, 16 / sizeof(T), true>(x, y, g);                                                        \
    }                                                                                                            \
    extern "C" __global__ void avg_pool_global_nhwc_##SUFFIX(const T* x, T* y, KilnPoolGeom g) {                 \
        pool_band_nhwc<T, 16 / sizeof(T), false>(x, y, g);                                                       \
    }                                                                                                            \
    extern "C" __global__ void max_pool_global_nhwc_scalar_##SUFFIX(const T* x, T* y, KilnPoolGeom g) {          \
        pool_band_nhwc<T, 1, true>(x, y, g);                                                                     \
    }                                                                                                            \
    extern "C" __global__ void avg_pool_global_nhwc_scalar_##SUFFIX(const T* x, T* y, KilnPoolGeom g) {          \
        pool_band_nhwc<T, 1, false>(x, y, g);                                                                    \
    }

KILN_POOL(float, f32)
KILN_POOL(__half, f16)
KILN_POOL(__nv_bfloat16, bf16)
