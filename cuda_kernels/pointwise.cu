// Pointwise kernel family: one kernel per (op, dtypes), generated from this template by
// engine_core/backends/cuda/pointwise.py, which appends one KILN_POINTWISE{1,2,3} line per kernel.
// Why strides: numpy broadcasting, Transpose, Expand, Slice and Concat are all "read input i at
// sum(coord * in_stride)"; one indexer covers them, and the host merges contiguous dims first so the
// common same-shape case runs with rank 1 (one division per element).
#define KILN_MAX_RANK 6

struct KilnIndexer {
    long long shape[KILN_MAX_RANK];
    long long out[KILN_MAX_RANK];
    long long in0[KILN_MAX_RANK];
    long long in1[KILN_MAX_RANK];
    long long in2[KILN_MAX_RANK];
};

__device__ __forceinline__ void kiln_offsets(long long i, long long n, int rank, const KilnIndexer& ix, long long& oy,
                                             long long& o0, long long& o1, long long& o2) {
    oy = o0 = o1 = o2 = 0;
    if (n <= 0xffffffffLL) {  // every dim fits 32 bits: 32-bit div/mod cost a fraction of 64-bit ones
        unsigned int r = (unsigned int)i;
        for (int d = rank - 1; d >= 0; --d) {
            const unsigned int len = (unsigned int)ix.shape[d];
            const long long c = r % len;
            r /= len;
            oy += c * ix.out[d];
            o0 += c * ix.in0[d];
            o1 += c * ix.in1[d];
            o2 += c * ix.in2[d];
        }
        return;
    }
    for (int d = rank - 1; d >= 0; --d) {
        const long long c = i % ix.shape[d];
        i /= ix.shape[d];
        oy += c * ix.out[d];
        o0 += c * ix.in0[d];
        o1 += c * ix.in1[d];
        o2 += c * ix.in2[d];
    }
}

// KILN_FOR_EACH(STMT) runs STMT for every output element i with its offsets oy, o0, o1, o2.
// Rank <= 1 (same-shape or scalar-broadcast operands after dim merging, the common case): offsets
// are one multiply, and the grid-stride loop is unrolled 4 ways (the host launches a quarter as many
// threads) so each thread has four independent loads in flight. Higher ranks: the general indexer.
#define KILN_FOR_EACH(STMT)                                                                           \
    const long long kiln_step = (long long)gridDim.x * blockDim.x;                                    \
    const long long kiln_first = blockIdx.x * (long long)blockDim.x + threadIdx.x;                    \
    if (rank <= 1) {                                                                                  \
        const long long sy = ix.out[0], s0 = ix.in0[0], s1 = ix.in1[0], s2 = ix.in2[0];              \
        for (long long kiln_base = kiln_first; kiln_base < n; kiln_base += 4 * kiln_step) {          \
            _Pragma("unroll") for (int kiln_u = 0; kiln_u < 4; ++kiln_u) {                           \
                const long long i = kiln_base + kiln_u * kiln_step;                                   \
                if (i < n) {                                                                          \
                    const long long oy = i * sy, o0 = i * s0, o1 = i * s1, o2 = i * s2;               \
                    (void)o1; (void)o2;                                                               \
                    STMT                                                                              \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    } else {                                                                                          \
        for (long long i = kiln_first; i < n; i += kiln_step) {                                       \
            long long oy, o0, o1, o2;                                                                 \
            kiln_offsets(i, n, rank, ix, oy, o0, o1, o2);                                             \
            (void)o1; (void)o2;                                                                       \
            STMT                                                                                      \
        }                                                                                             \
    }

#define KILN_POINTWISE1(NAME, TY, T0, EXPR)                                                           \
    extern "C" __global__ void NAME(TY* __restrict__ y, const T0* __restrict__ x0, const void*,       \
                                    const void*, long long n, int rank, KilnIndexer ix) {            \
        KILN_FOR_EACH({ const T0 a = x0[o0]; y[oy] = (TY)(EXPR); })                                   \
    }

#define KILN_POINTWISE2(NAME, TY, T0, T1, EXPR)                                                       \
    extern "C" __global__ void NAME(TY* __restrict__ y, const T0* __restrict__ x0,                    \
                                    const T1* __restrict__ x1, const void*, long long n, int rank,    \
                                    KilnIndexer ix) {                                                 \
        KILN_FOR_EACH({ const T0 a = x0[o0]; const T1 b = x1[o1]; y[oy] = (TY)(EXPR); })              \
    }

#define KILN_POINTWISE3(NAME, TY, T0, T1, T2, EXPR)                                                   \
    extern "C" __global__ void NAME(TY* __restrict__ y, const T0* __restrict__ x0,                    \
                                    const T1* __restrict__ x1, const T2* __restrict__ x2, long long n, \
                                    int rank, KilnIndexer ix) {                                       \
        KILN_FOR_EACH({ const T0 a = x0[o0]; const T1 b = x1[o1]; const T2 c = x2[o2];                \
                        y[oy] = (TY)(EXPR); })                                                        \
    }

#ifndef KILN_GENERATED
// The template alone (CI compiles every .cu file) instantiates one kernel of each arity.
KILN_POINTWISE1(pw_relu_f32, float, float, a > 0.0f ? a : 0.0f)
KILN_POINTWISE2(pw_add_f32, float, float, float, a + b)
KILN_POINTWISE3(pw_where_f32, float, bool, float, float, a ? b : c)
#endif
