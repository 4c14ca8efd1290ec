// 2-D max/average pooling (MaxPool, AveragePool, GlobalMaxPool, GlobalAveragePool) over any layout:
// one thread per output element, input and output addressed by element strides (n, c, h, w), so NCHW
// and channels-last tensors take the same kernel. Threads walk the output in its physical order (c
// fastest for channels-last), which keeps neighbouring threads on neighbouring addresses.
// Accumulation in fp32 for every storage type.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>

struct KilnPoolGeom {
    long long xs[4];
    long long ys[4];
    int n, c, h, w, oh, ow;
    int kh, kw, sh, sw, ph, pw, ph_end, pw_end, dh, dw;
    int channels_last, count_include_pad;
};

__device__ __forceinline__ float kiln_f(float v) { return v; }
__device__ __forceinline__ float kiln_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float kiln_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T kiln_to(float v);
template <> __device__ __forceinline__ float kiln_to<float>(float v) { return v; }
template <> __device__ __forceinline__ __half kiln_to<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 kiln_to<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

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

#define KILN_POOL(T, SUFFIX)                                                                          \
    extern "C" __global__ void max_pool_##SUFFIX(const T* x, T* y, KilnPoolGeom g) { pool2d<T, true>(x, y, g); } \
    extern "C" __global__ void avg_pool_##SUFFIX(const T* x, T* y, KilnPoolGeom g) { pool2d<T, false>(x, y, g); }

KILN_POOL(float, f32)
KILN_POOL(__half, f16)
KILN_POOL(__nv_bfloat16, bf16)
