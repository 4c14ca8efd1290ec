// INT8 GEMM with its epilogue in registers, for Hopper (sm_90a wgmma): y[m, n] = epilogue(sum_k x[m, k] * w[n, k]).
// Why: cuBLASLt's IMMA GEMMs write int32 sums (no int8-in / fp16-out form), so every INT8 linear layer's output
// crossed memory as 4 bytes, was read back by a dequantizing kernel and written again (BERT-base batch 64: >= 1.8 ms
// of traffic against 4.6 ms for the whole fp16 model). Here the int32 sums never leave registers: the epilogue
// applies `float(acc) * x_scale * w_scale[n] + bias[n]`, the activation (ReLU or erf GELU) and either
// stores the float type or requantizes `rint(v / y_scale)` to int8 -- the CPU op's order and rounding (QMatMul),
// with __fmul_rn / __fadd_rn so no FMA contraction changes a result (erff itself may differ from the CPU's in the
// last bits, as the generated pointwise kernels' does).
//
// Shape of the kernel: a 128 x BN output tile per block of two consumer warpgroups (each 64 rows, one wgmma
// m64nBNk32 per 32 bytes of K) and a producer warp, K consumed 128 bytes at a time through a STAGES-deep ring of
// shared-memory stages that TMA fills (kiln_qgemm below). BN = 128 keeps 3 stages (97 KiB) and the registers
// small enough that two blocks share an SM: one block's epilogue (erf, division, stores) overlaps the other's
// tensor-core work. Session 7 measured (bench.qgemm, H100, BERT-base shapes) one block per SM slower: 128 wide in
// 4 stages 1.1-1.8x the time (the GELU layer's epilogue then took longer than its GEMM), 256 wide (m64n256k32) in
// 4 stages 1.6-1.9x.
// Operands are K-major (x [M, K] row-major; w as [N, K] rows, the "nk" weight transform) and land in the 128-byte
// swizzled layout wgmma reads: row r's 16-byte chunk c at chunk c ^ (r % 8) of its 128-byte row, 8 rows (1024
// bytes, 1024-aligned) per swizzle atom -- the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B.
// Requirements (the lowering checks them): K % 16 == 0 (TMA's row pitch), N even, 16-byte aligned x / w. Rows past
// M and columns past K or N read zeros (TMA's out-of-bounds fill) and are not stored.
// Compiled for sm_90a only (engine_core/cuda/nvrtc.py ARCH_FEATURES); other targets get empty kernels.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define QG_BM 128
#define QG_BK 128
#define QG_CONSUMERS 256                // two warpgroups of wgmma and epilogue
#define QG_THREADS (QG_CONSUMERS + 32)  // and one producer warp

// activation codes (engine_core/backends/cuda/qgemm.py ACTIVATIONS)
#define QG_ACT_NONE 0
#define QG_ACT_RELU 1
#define QG_ACT_GELU 2
// float type the value is rounded to before requantizing (the QMatMul's float_dtype)
#define QG_ROUND_F32 0
#define QG_ROUND_F16 1
#define QG_ROUND_BF16 2

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QG_WGMMA 1
#endif

// A CUtensorMap (TMA descriptor) passed by value: 128 opaque bytes, 64-byte aligned (the driver encodes it:
// engine_core/cuda/driver.py encode_tensor_map)
struct __align__(64) KilnTensorMap { unsigned long long opaque[16]; };

#ifdef QG_WGMMA

__device__ __forceinline__ void kiln_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// one arrival that also tells the barrier to expect `bytes` of TMA writes before its phase completes
__device__ __forceinline__ void kiln_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void kiln_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// until the barrier's phase of this parity has completed
__device__ __forceinline__ void kiln_mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\nKILN_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra KILN_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// TMA: the box at (column x, row y) of the tensor `map` describes into shared memory at `dst` (swizzled as the
// map says); its bytes count toward `bar`'s expected transactions
__device__ __forceinline__ void kiln_tma_load_2d(unsigned dst, const KilnTensorMap* map, int x, int y, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"((unsigned long long)map), "r"(x), "r"(y), "r"(bar) : "memory");
}
__device__ __forceinline__ void kiln_fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void kiln_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kiln_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void kiln_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory matrix descriptor of a K-major, 128-byte-swizzled tile: start address >> 4 (bits 0-13), leading
// byte offset (unused by swizzled K-major layouts: 1), stride byte offset 1024 >> 4 between 8-row groups (bits
// 32-45), layout type 1 = 128B swizzle (bits 62-63).
__device__ __forceinline__ unsigned long long kiln_smem_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void kiln_wgmma_m64n128k32_s8(int (&d)[64], unsigned long long a, unsigned long long b,
                                                          int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
          "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]),
          "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]),
          "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]),
          "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]),
          "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]),
          "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]),
          "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
        : "l"(a), "l"(b), "r"(accumulate));
}


template <int V> struct KilnInt { static constexpr int value = V; };
// f(KilnInt<I>{}) ... f(KilnInt<END - 1>{}): a loop whose index is a compile-time constant in every body
template <int I, int END, typename F> __device__ __forceinline__ void kiln_static_for(F&& f) {
    if constexpr (I < END) {
        f(KilnInt<I>{});
        kiln_static_for<I + 1, END>(f);
    }
}

// dequantize, bias, activation: one output element in the CPU op's order (ACT a compile-time QG_ACT_*; a layer
// without bias has zeros folded)
template <int ACT> __device__ __forceinline__ float kiln_qg_value(int acc, float x_scale, float w_scale, float bias) {
    float v = __fadd_rn(__fmul_rn(__fmul_rn((float)acc, x_scale), w_scale), bias);
    if constexpr (ACT == QG_ACT_RELU) v = v > 0.0f ? v : 0.0f;
    if constexpr (ACT == QG_ACT_GELU) v = __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.0f, erff(__fmul_rn(v, 0.7071067811865476f))));
    return v;
}

// v / y_scale rounded to nearest: the quotient by the reciprocal, then one correction step with the exact residual
// (fma) -- the correctly rounded quotient whenever nothing over- or underflows, which for values bounded by the
// int8 range times a scale holds. Why not __fdiv_rn: its out-of-range slow path at each of a thread's 64 stores.
__device__ __forceinline__ float kiln_qg_div(float v, float y_scale, float y_recip) {
    const float q = __fmul_rn(v, y_recip);
    return __fmaf_rn(__fmaf_rn(-q, y_scale, v), y_recip, q);
}
// requantize: round to the layer's float type (ROUND: the tensor the unfused graph stores), then QuantizeLinear
template <int ROUND> __device__ __forceinline__ signed char kiln_qg_quantize(float v, float y_scale, float y_recip) {
    if constexpr (ROUND == QG_ROUND_F16) v = __half2float(__float2half_rn(v));
    if constexpr (ROUND == QG_ROUND_BF16) v = __bfloat162float(__float2bfloat16_rn(v));
    return (signed char)fminf(fmaxf(rintf(kiln_qg_div(v, y_scale, y_recip)), -128.0f), 127.0f);
}

// two adjacent outputs to memory: the float types convert, int8 requantizes (ROUND matters only there)
template <typename T, int ROUND> struct KilnQgStore;
template <int ROUND> struct KilnQgStore<float, ROUND> {
    __device__ __forceinline__ static void pair(float* y, float a, float b, float, float) { *reinterpret_cast<float2*>(y) = make_float2(a, b); }
};
template <int ROUND> struct KilnQgStore<__half, ROUND> {
    __device__ __forceinline__ static void pair(__half* y, float a, float b, float, float) { *reinterpret_cast<__half2*>(y) = __floats2half2_rn(a, b); }
};
template <int ROUND> struct KilnQgStore<__nv_bfloat16, ROUND> {
    __device__ __forceinline__ static void pair(__nv_bfloat16* y, float a, float b, float, float) {
        *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(a, b);
    }
};
template <int ROUND> struct KilnQgStore<signed char, ROUND> {
    __device__ __forceinline__ static void pair(signed char* y, float a, float b, float y_scale, float y_recip) {
        char2 q;
        q.x = kiln_qg_quantize<ROUND>(a, y_scale, y_recip);
        q.y = kiln_qg_quantize<ROUND>(b, y_scale, y_recip);
        *reinterpret_cast<char2*>(y) = q;
    }
};

// The epilogue of one finished tile: accumulator register 4j + 2h + e holds row 16 * warp + lane / 4 + 8h, column
// 8j + 2 (lane % 4) + e of the warpgroup's 64 rows. The loop over j is unrolled at compile time (kiln_static_for): a
// runtime index into acc would move the whole array to local memory, which ptxas did for the 256-wide int8 kernel
// when the loop was left to #pragma unroll. `cols` (shared memory) holds the tile's w_scale[BN], then bias[BN].
// ACT, ROUND and FULL (no row or column of the tile past M or N: no bounds checks) are compile-time, so an element
// costs ~6 instructions (fp16, no activation): with them as run-time branches the epilogue took two thirds of the
// consumers' time on BERT's 768 x 768 layer (ncu source counters, session 8).
template <int BN, typename T, int ACT, int ROUND, bool FULL>
__device__ __forceinline__ void kiln_qg_epilogue(const int (&acc)[BN / 2], T* __restrict__ y, const float* cols,
                                                 int m0, int n0, int M, int N, float x_scale, float y_scale) {
    const float y_recip = 1.0f / y_scale;  // IEEE division: the correctly rounded reciprocal kiln_qg_div needs
    const int lane = threadIdx.x % 32, warp = (threadIdx.x % 128) / 32;
    const int row = m0 + (threadIdx.x / 128) * 64 + warp * 16 + lane / 4;
    T* const y_row = y + (size_t)row * N + n0 + (lane % 4) * 2;  // this thread's first element; + 8 N: h = 1
    kiln_static_for<0, BN / 8>([&](auto j_) {
        constexpr int j = decltype(j_)::value;
        const int c = j * 8 + (lane % 4) * 2;
        if (!FULL && n0 + c >= N) return;
        const float2 ws = *reinterpret_cast<const float2*>(cols + c), b = *reinterpret_cast<const float2*>(cols + BN + c);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (!FULL && row + 8 * h >= M) continue;
            const float v0 = kiln_qg_value<ACT>(acc[4 * j + 2 * h], x_scale, ws.x, b.x);
            const float v1 = kiln_qg_value<ACT>(acc[4 * j + 2 * h + 1], x_scale, ws.y, b.y);
            KilnQgStore<T, ROUND>::pair(y_row + (size_t)h * 8 * N + j * 8, v0, v1, y_scale, y_recip);
        }
    });
}

template <typename T> struct KilnQgInt8 { static constexpr bool value = false; };
template <> struct KilnQgInt8<signed char> { static constexpr bool value = true; };

// The epilogue copy for this tile: the activation, the rounding before requantizing (int8 outputs only: the float
// outputs have one copy) and whether the tile is whole, each chosen once per tile
template <int BN, typename T>
__device__ __forceinline__ void kiln_qg_epilogue_for(int act, int round_to, const int (&acc)[BN / 2], T* __restrict__ y,
                                                     const float* cols, int m0, int n0, int M, int N, float x_scale,
                                                     float y_scale) {
    const bool full = m0 + QG_BM <= M && n0 + BN <= N;
    auto run = [&](auto act_, auto round_) {
        constexpr int A = decltype(act_)::value, R = decltype(round_)::value;
        if (full) kiln_qg_epilogue<BN, T, A, R, true>(acc, y, cols, m0, n0, M, N, x_scale, y_scale);
        else kiln_qg_epilogue<BN, T, A, R, false>(acc, y, cols, m0, n0, M, N, x_scale, y_scale);
    };
    auto rounded = [&](auto act_) {
        if constexpr (KilnQgInt8<T>::value) {
            if (round_to == QG_ROUND_F16) run(act_, KilnInt<QG_ROUND_F16>{});
            else if (round_to == QG_ROUND_BF16) run(act_, KilnInt<QG_ROUND_BF16>{});
            else run(act_, KilnInt<QG_ROUND_F32>{});
        } else {
            run(act_, KilnInt<QG_ROUND_F32>{});
        }
    };
    if (act == QG_ACT_GELU) rounded(KilnInt<QG_ACT_GELU>{});
    else if (act == QG_ACT_RELU) rounded(KilnInt<QG_ACT_RELU>{});
    else rounded(KilnInt<QG_ACT_NONE>{});
}

// Persistent and warp-specialized: block b computes output tiles b, b + gridDim.x, ... (tile t: rows
// (t / tiles_n) * 128, columns (t % tiles_n) * BN, so the blocks running at once share their x rows and all of w in
// L2). Its (tile, K slice) steps form one sequence through a STAGES-deep ring of shared-memory stages:
//   - the producer warp's first thread waits for a stage to be empty, then loads the step's x and w boxes into it
//     by TMA (one instruction each; the copy engine writes the 128-byte swizzle) and the stage's "full" barrier
//     completes when their bytes have landed;
//   - each consumer warpgroup waits for the stage to be full, issues its four wgmmas, waits for the step before's
//     wgmmas (wgmma.wait_group 1: one step stays queued on the tensor cores) and marks that step's stage empty.
// No __syncthreads in the loop: the producer runs up to STAGES steps ahead, into the next tile while the consumers
// run the epilogue. Session 7's kernel (every thread issuing cp.async, a barrier and wgmma.wait_group 0 per K slice)
// reached 316-662 TOPS on BERT-base's layers.
template <int BN, int STAGES, typename T>
__device__ __forceinline__ void kiln_qgemm(T* __restrict__ y, const KilnTensorMap* x, const KilnTensorMap* w,
                                           const float* __restrict__ w_scale, const float* __restrict__ bias, int M,
                                           int N, int K, float x_scale, float y_scale, int act, int round_to) {
    extern __shared__ unsigned char kiln_qg_smem[];
    __shared__ __align__(8) unsigned long long kiln_qg_bars[2 * STAGES];  // full[STAGES], then empty[STAGES]
    static_assert(2 * BN == QG_CONSUMERS, "a consumer thread per column's scale and bias");
    __shared__ __align__(16) float kiln_qg_cols[2][2 * BN];  // per tile parity: w_scale[BN], bias[BN]
    constexpr int A_BYTES = QG_BM * QG_BK, STAGE_BYTES = (QG_BM + BN) * QG_BK;
    const unsigned raw = (unsigned)__cvta_generic_to_shared(kiln_qg_smem);
    const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms must be 1024-byte aligned
    const unsigned full = (unsigned)__cvta_generic_to_shared(kiln_qg_bars), empty = full + 8 * STAGES;
    const int tiles_n = (N + BN - 1) / BN, tiles = tiles_n * ((M + QG_BM - 1) / QG_BM);
    const int ktiles = (K + QG_BK - 1) / QG_BK;
    const int mine = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            kiln_mbar_init(full + 8 * s, 1);                             // the producer's expect_tx arrival
            kiln_mbar_init(empty + 8 * s, QG_CONSUMERS / 32);            // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
    __syncthreads();

    if (threadIdx.x >= QG_CONSUMERS) {  // the producer warp: its first thread issues every load
        if (threadIdx.x == QG_CONSUMERS) {
            int stage = 0, round = 0;
            for (int tile = 0; tile < mine; ++tile) {
                const int t = blockIdx.x + tile * gridDim.x, m0 = (t / tiles_n) * QG_BM, n0 = (t % tiles_n) * BN;
                for (int kt = 0; kt < ktiles; ++kt) {
                    if (round > 0) kiln_mbar_wait(empty + 8 * stage, (round - 1) & 1);
                    const unsigned dst = base + stage * STAGE_BYTES, bar = full + 8 * stage;
                    kiln_mbar_expect_tx(bar, STAGE_BYTES);  // whole boxes: TMA counts zero-filled bytes too
                    kiln_tma_load_2d(dst, x, kt * QG_BK, m0, bar);
                    kiln_tma_load_2d(dst + A_BYTES, w, kt * QG_BK, n0, bar);
                    if (++stage == STAGES) stage = 0, ++round;
                }
            }
        }
        return;
    }

    const int wg = threadIdx.x / 128, lane = threadIdx.x % 32;
    int acc[BN / 2];
    int stage = 0, round = 0, previous = -1;  // previous: the stage the step before read, until it is released
    for (int tile = 0; tile < mine; ++tile) {
        const int t = blockIdx.x + tile * gridDim.x, m0 = (t / tiles_n) * QG_BM, n0 = (t % tiles_n) * BN;
        // the tile's per-column w_scale (threads < BN) and bias (the others), read from global memory now and stored
        // to shared memory after the K loop: the epilogue's loads then do not wait on global memory
        const int c = n0 + threadIdx.x % BN;
        const float col_value = c < N ? (threadIdx.x < BN ? w_scale : bias)[c] : 0.0f;
        for (int kt = 0; kt < ktiles; ++kt) {
            kiln_mbar_wait(full + 8 * stage, round & 1);
            const unsigned tile_base = base + stage * STAGE_BYTES;
            const unsigned long long da = kiln_smem_desc(tile_base + wg * 64 * QG_BK), db = kiln_smem_desc(tile_base + A_BYTES);
            kiln_wgmma_fence();
#pragma unroll
            for (int s = 0; s < QG_BK / 32; ++s) {  // 32 bytes of K a step: the descriptor start moves 32 >> 4
                const int accumulate = kt > 0 || s > 0;  // a tile's first product overwrites the last tile's sums
                kiln_wgmma_m64n128k32_s8(acc, da + 2 * s, db + 2 * s, accumulate);
            }
            kiln_wgmma_commit();
            kiln_wgmma_wait<1>();  // the step before's wgmmas are done reading their stage
            if (previous >= 0 && lane == 0) kiln_mbar_arrive(empty + 8 * previous);
            previous = stage;
            if (++stage == STAGES) stage = 0, ++round;
        }
        kiln_wgmma_wait<0>();
        if (lane == 0) kiln_mbar_arrive(empty + 8 * previous);
        previous = -1;
        // two buffers: a warpgroup a tile ahead writes the other one while the slower one still reads this one, and
        // cannot come back to this one before the slower warpgroup has passed the next barrier
        float* cols = kiln_qg_cols[tile & 1];
        cols[threadIdx.x] = col_value;
        asm volatile("bar.sync 1, %0;\n" ::"n"(QG_CONSUMERS) : "memory");  // the consumers only
        kiln_qg_epilogue_for<BN, T>(act, round_to, acc, y, cols, m0, n0, M, N, x_scale, y_scale);
    }
}
#endif  // QG_WGMMA

// qgemm_sm90_<BN>_<output>: a 1-D grid of at most one block per output tile, QG_THREADS threads, STAGES * (128 + BN)
// * 128 + 1024 bytes of dynamic shared memory (engine_core/backends/cuda/qgemm.py STAGES, shared_bytes). x and w are
// TMA descriptors of x [M, K] and w [N, K] (int8, row-major) in 128 x 128-byte boxes with the 128-byte swizzle.
#define KILN_QGEMM(BN, STAGES, BLOCKS, NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, BLOCKS) qgemm_sm90_##BN##_##NAME(                    \
        T* __restrict__ y, const __grid_constant__ KilnTensorMap x, const __grid_constant__ KilnTensorMap w,       \
        const float* __restrict__ w_scale, const float* __restrict__ bias, int M, int N, int K, float x_scale,     \
        float y_scale, int act, int round_to) {                                                                   \
        KILN_QGEMM_BODY(BN, STAGES, T)                                                                            \
    }
#ifdef QG_WGMMA
#define KILN_QGEMM_BODY(BN, STAGES, T) kiln_qgemm<BN, STAGES, T>(y, &x, &w, w_scale, bias, M, N, K, x_scale, y_scale, act, round_to);
#else
#define KILN_QGEMM_BODY(BN, STAGES, T) __trap();
#endif

KILN_QGEMM(128, 3, 2, f32, float)
KILN_QGEMM(128, 3, 2, f16, __half)
KILN_QGEMM(128, 3, 2, bf16, __nv_bfloat16)
KILN_QGEMM(128, 3, 2, i8, signed char)
