// INT8 GEMM with its epilogue in registers, for Hopper (sm_90a wgmma): y[m, n] = epilogue(sum_k x[m, k] * w[n, k]).
// Why: cuBLASLt's IMMA GEMMs write int32 sums (no int8-in / fp16-out form), so every INT8 linear layer's output
// crossed memory as 4 bytes, was read back by a dequantizing kernel and written again (BERT-base batch 64: >= 1.8 ms
// of traffic against 4.6 ms for the whole fp16 model). Here the int32 sums never leave registers: the epilogue
// applies `float(acc) * x_scale * w_scale[n] + bias[n]`, the activation (ReLU or erf GELU) and either
// stores the float type or requantizes `rint(v / y_scale)` to int8 -- the CPU op's order and rounding (QMatMul),
// with __fmul_rn / __fadd_rn so no FMA contraction changes a result. GELU is a fitted polynomial (kiln_gelu) whose
// error is that of the CPU op's fp32 erf form, not its bits.
//
// Shape of the kernel: 128 x 128 output tiles, K consumed 128 bytes at a time through a ring of shared-memory
// stages that TMA fills, a producer thread and consumer warpgroups (one wgmma m64n128k32 per 64 rows and 32 bytes
// of K) that synchronize through mbarriers, in two teams taking turns over tiles: ping-pong, and pairs for GELU
// (kiln_qgemm).
// Session 7 measured 256-wide tiles (m64n256k32) 1.6-1.9x slower.
// Operands are K-major (x [M, K] row-major; w as [N, K] rows, the "nk" weight transform) and land in the 128-byte
// swizzled layout wgmma reads: row r's 16-byte chunk c at chunk c ^ (r % 8) of its 128-byte row, 8 rows (1024
// bytes, 1024-aligned) per swizzle atom -- the layout TMA writes with CU_TENSOR_MAP_SWIZZLE_128B.
// Requirements (the lowering checks them): K % 16 == 0 (TMA's row pitch), N even, 16-byte aligned x / w. Rows past
// M and columns past K or N read zeros (TMA's out-of-bounds fill) and are not stored.
// Compiled for sm_90a only (engine_core/cuda/nvrtc.py ARCH_FEATURES); other targets get empty kernels.
#include "kiln_reduce.cuh"  // kiln_div_rn (and cuda_fp16.h, cuda_bf16.h)

#define QG_BM 128
#define QG_BK 128
#define QG_BN 128

// activation codes (engine_core/backends/cuda/qgemm.py ACTIVATIONS)
#define QG_ACT_NONE 0
#define QG_ACT_RELU 1
#define QG_ACT_GELU 2
#define QG_ACT_GELU_Q 3  // GELU requantized to int8 at a scale its cheaper form's error is < 1% of (kiln_gelu_q)
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

// erf GELU, v Phi(v), with log2 Phi(-t) (t = |v| <= 5.5) as one degree-9 polynomial and one ex2.approx:
// ~17 instructions where erff's ~30 (a coefficient select per term) made the FFN1 epilogue issue-bound. Its absolute
// error against exact GELU is <= 4e-7 on [-9, 9], as the fp32 `v/2 (1 + erf(v / sqrt 2))` of the CPU op (python -m
// tools.fit_gelu fits the coefficients and prints both; engine_core/backends/cuda/qgemm.py GELU_LOG2_PHI).
__device__ __forceinline__ float kiln_gelu(float v) {
    constexpr float LIMIT = 5.5f;  // Phi(-5.5) = 1.9e-8: past it, 1 - h rounds to 1 and v h to ~0
    const float t = fminf(fabsf(v), LIMIT);
    float p = 8.220337832653968e-08f;  // GELU_LOG2_PHI, c9 .. c1 (Horner), then -1: Phi(0) = 1/2 exactly
    p = __fmaf_rn(p, t, -2.1366759028751403e-06f);
    p = __fmaf_rn(p, t, 2.131196015398018e-05f);
    p = __fmaf_rn(p, t, -7.357532740570605e-05f);
    p = __fmaf_rn(p, t, -0.0004709532659035176f);
    p = __fmaf_rn(p, t, 0.007591825909912586f);
    p = __fmaf_rn(p, t, -0.052937086671590805f);
    p = __fmaf_rn(p, t, -0.4590352475643158f);
    p = __fmaf_rn(p, t, -1.1511279344558716f);
    p = __fmaf_rn(p, t, -1.0f);
    float h;  // Phi(-t)
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(h) : "f"(p));
    const float phi = v >= 0.0f ? __fsub_rn(1.0f, h) : (t < LIMIT ? h : 0.0f);
    return __fmul_rn(v, phi);
}

// GELU for int8 outputs: v / (1 + 2^(v q(t))), t = min(v^2, 36), q a quadratic (python -m tools.fit_gelu --form
// sigmoid; engine_core/backends/cuda/qgemm.py GELU_SIGMOID): 7 instructions with ex2.approx and rcp.approx, ~10
// fewer than kiln_gelu on the FFN1 epilogue, which is issue-bound. Absolute error <= 2.6e-5 against exact GELU: the
// lowering takes it only where that is under 1% of the int8 step (y_scale >= GELU_SIGMOID_MIN_SCALE), so a result
// can differ from kiln_gelu's by one step only where the exact value lies that close to a rounding boundary.
// Past t = 36 (|v| > 6) the exponent keeps growing linearly in v: 1 / (1 + 2^z) still goes to 0 (v < 0) or 1 (v > 0).
__device__ __forceinline__ float kiln_gelu_q(float v) {
    const float t = fminf(__fmul_rn(v, v), 36.0f);
    const float q = __fmaf_rn(__fmaf_rn(t, 0.0010142630198970437f, -0.10677571594715118f), t, -2.301121234893799f);
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__fmul_rn(v, q)));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(__fadd_rn(1.0f, e)));
    return __fmul_rn(v, r);
}

// Whether the kernel may fold x_scale into w_scale, add the bias in the same FMA and requantize with a multiply by
// 1 / y_scale: where the activation is kiln_gelu_q, whose own error (2.6e-5) is already far above what these
// reorderings change (an ulp of the value, ~1e-7 of a step), so its int8 result is the same but within that much of a
// rounding boundary. 4 of ~25 instructions an element on the issue-bound FFN1 epilogue.
template <int ACT> struct KilnQgFold { static constexpr bool value = ACT == QG_ACT_GELU_Q; };

// dequantize, bias, activation: one output element in the CPU op's order (ACT a compile-time QG_ACT_*; a layer
// without bias has zeros folded); folded (KilnQgFold), w_scale is x_scale * w_scale and the bias is added by the FMA
template <int ACT> __device__ __forceinline__ float kiln_qg_value(int acc, float x_scale, float w_scale, float bias) {
    float v = KilnQgFold<ACT>::value ? __fmaf_rn((float)acc, w_scale, bias)
                                     : __fadd_rn(__fmul_rn(__fmul_rn((float)acc, x_scale), w_scale), bias);
    if constexpr (ACT == QG_ACT_RELU) v = v > 0.0f ? v : 0.0f;
    if constexpr (ACT == QG_ACT_GELU) v = kiln_gelu(v);
    if constexpr (ACT == QG_ACT_GELU_Q) v = kiln_gelu_q(v);
    return v;
}

// two adjacent outputs to memory: the float types convert, int8 requantizes (ROUND and ACT matter only there)
template <typename T, int ROUND, int ACT> struct KilnQgStore;
template <int ROUND, int ACT> struct KilnQgStore<float, ROUND, ACT> {
    __device__ __forceinline__ static void pair(float* y, float a, float b, float, float) { *reinterpret_cast<float2*>(y) = make_float2(a, b); }
};
template <int ROUND, int ACT> struct KilnQgStore<__half, ROUND, ACT> {
    __device__ __forceinline__ static void pair(__half* y, float a, float b, float, float) { *reinterpret_cast<__half2*>(y) = __floats2half2_rn(a, b); }
};
template <int ROUND, int ACT> struct KilnQgStore<__nv_bfloat16, ROUND, ACT> {
    __device__ __forceinline__ static void pair(__nv_bfloat16* y, float a, float b, float, float) {
        *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(a, b);
    }
};
// requantize: round to the layer's float type (ROUND: the tensor the unfused graph stores; a pair converts in one
// instruction), then QuantizeLinear; folded (KilnQgFold: GELU, >= -0.17, at a scale >= 1/256, so never under -44
// steps), times the reciprocal and saturated at 127 only
template <int ROUND, int ACT> struct KilnQgStore<signed char, ROUND, ACT> {
    __device__ __forceinline__ static void pair(signed char* y, float a, float b, float y_scale, float y_recip) {
        if constexpr (ROUND == QG_ROUND_F16) {
            const float2 r = __half22float2(__floats2half2_rn(a, b));
            a = r.x, b = r.y;
        }
        if constexpr (ROUND == QG_ROUND_BF16) {
            const float2 r = __bfloat1622float2(__floats2bfloat162_rn(a, b));
            a = r.x, b = r.y;
        }
        char2 q;
        if constexpr (KilnQgFold<ACT>::value) {
            q.x = kiln_s8_rint(fminf(__fmul_rn(a, y_recip), 127.0f));
            q.y = kiln_s8_rint(fminf(__fmul_rn(b, y_recip), 127.0f));
        } else {
            q.x = kiln_quantize_s8(a, y_scale, y_recip);
            q.y = kiln_quantize_s8(b, y_scale, y_recip);
        }
        *reinterpret_cast<char2*>(y) = q;
    }
};

// The epilogue of 64 finished rows (one m64 accumulator of a warpgroup, rows row0 ..): accumulator register
// 4j + 2h + e holds row 16 * warp + lane / 4 + 8h, column 8j + 2 (lane % 4) + e, for warp and lane of thread `tid`
// of the warpgroup. Loops over j are unrolled at compile time (kiln_static_for): a runtime index into acc would
// move the whole array to local memory, which ptxas did for the 256-wide int8 kernel when the loop was left to
// #pragma unroll. `cols` (shared memory) holds the tile's w_scale[BN], then bias[BN]. ACT and ROUND are
// compile-time, so an element costs ~6 instructions (fp16, no activation): as run-time branches the epilogue took
// two thirds of the consumers' time on BERT's 768 x 768 layer (ncu source counters, session 8).
//
// kiln_qg_pair: the two adjacent outputs of (j, h), each thread's element pair, to `dst`
template <int BN, typename T, int ACT, int ROUND, int J>
__device__ __forceinline__ void kiln_qg_pair(const int (&acc)[BN / 2], int h, T* dst, const float* cols, int lane,
                                             float x_scale, float y_scale, float y_recip) {
    const int c = J * 8 + (lane % 4) * 2;
    const float2 ws = *reinterpret_cast<const float2*>(cols + c), b = *reinterpret_cast<const float2*>(cols + BN + c);
    const float v0 = kiln_qg_value<ACT>(acc[4 * J + 2 * h], x_scale, ws.x, b.x);
    const float v1 = kiln_qg_value<ACT>(acc[4 * J + 2 * h + 1], x_scale, ws.y, b.y);
    KilnQgStore<T, ROUND, ACT>::pair(dst, v0, v1, y_scale, y_recip);
}

// Byte `byte` of row `row` in a warp's staging slice: 16 rows of CHUNK bytes whose 16-byte chunks are swizzled by
// row, so that a pair store (8 rows at one column) and a 16-byte read (whole rows) each hit distinct banks. CHUNK
// is 128 in the ping-pong kernels, 64 in the GELU ones (16 consumer warps leave less shared memory): rows sharing
// a 128-byte bank line are then told apart by row / 2.
template <int CHUNK> __device__ __forceinline__ int kiln_qg_staged(int row, int byte) {
    constexpr int SHIFT = CHUNK == 128 ? 0 : 1;
    return row * CHUNK + ((((byte >> 4) ^ (row >> SHIFT)) & (CHUNK / 16 - 1)) << 4) + (byte & 15);
}

// Staged epilogue: each warp writes its 16 rows' pairs CHUNK bytes of columns at a time into its own slice of shared
// memory (`stage`), then stores whole 16-byte vectors of full rows: each warp store fills 32-byte sectors, where
// the pair stores (2-4 bytes a thread, 8 rows of 8-16 bytes a warp store) wrote half or quarter sectors and their
// queue stalled the epilogue (ncu: long-scoreboard waits on the stores' source registers, 768 x 768 layer).
// Needs 16-byte-aligned rows (y and N * sizeof(T)); rows past M and columns past N are computed and not stored.
template <int BN, int CHUNK, typename T, int ACT, int ROUND>
__device__ __forceinline__ void kiln_qg_epilogue_staged(const int (&acc)[BN / 2], T* __restrict__ y,
                                                        const float* cols, unsigned char* stage, int tid, int row0,
                                                        int n0, int M, int N, float x_scale, float y_scale) {
    constexpr int SIZE = (int)sizeof(T), JS = CHUNK / (8 * SIZE), VECTORS = CHUNK / 16;  // per pass: j's, row vectors
    const float y_recip = 1.0f / y_scale;  // IEEE division: the correctly rounded reciprocal kiln_div_rn needs
    const int lane = tid % 32, rows0 = row0 + (tid / 32) * 16;
    unsigned char* const y_tile = reinterpret_cast<unsigned char*>(y + n0);
    kiln_static_for<0, BN / 8 / JS>([&](auto pass_) __attribute__((always_inline)) {  // inlined: acc in registers
        constexpr int pass = decltype(pass_)::value;
        kiln_static_for<0, JS>([&](auto jj_) __attribute__((always_inline)) {
            constexpr int jj = decltype(jj_)::value;
            const int byte = (jj * 8 + (lane % 4) * 2) * SIZE;
#pragma unroll
            for (int h = 0; h < 2; ++h)
                kiln_qg_pair<BN, T, ACT, ROUND, pass * JS + jj>(
                    acc, h, reinterpret_cast<T*>(stage + kiln_qg_staged<CHUNK>(lane / 4 + 8 * h, byte)), cols, lane,
                    x_scale, y_scale, y_recip);
        });
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 16 * VECTORS / 32; ++i) {
            const int v = i * 32 + lane, r = v / VECTORS, byte = pass * CHUNK + (v % VECTORS) * 16;
            const uint4 data = *reinterpret_cast<const uint4*>(stage + kiln_qg_staged<CHUNK>(r, byte - pass * CHUNK));
            if (rows0 + r < M && n0 + byte / SIZE < N)
                *reinterpret_cast<uint4*>(y_tile + (size_t)(rows0 + r) * N * SIZE + byte) = data;
        }
        __syncwarp();  // the slice is read before the next pass writes it
    });
}

// Direct epilogue, for rows that are not 16-byte aligned: each thread stores its pairs, skipping those past M or N
template <int BN, typename T, int ACT, int ROUND>
__device__ __forceinline__ void kiln_qg_epilogue_direct(const int (&acc)[BN / 2], T* __restrict__ y,
                                                        const float* cols, int tid, int row0, int n0, int M, int N,
                                                        float x_scale, float y_scale) {
    const float y_recip = 1.0f / y_scale;
    const int lane = tid % 32, row = row0 + (tid / 32) * 16 + lane / 4;
    T* const y_row = y + (size_t)row * N + n0 + (lane % 4) * 2;  // this thread's first element; + 8 N: h = 1
    kiln_static_for<0, BN / 8>([&](auto j_) __attribute__((always_inline)) {
        constexpr int j = decltype(j_)::value;
        if (n0 + j * 8 + (lane % 4) * 2 >= N) return;
#pragma unroll
        for (int h = 0; h < 2; ++h)
            if (row + 8 * h < M)
                kiln_qg_pair<BN, T, ACT, ROUND, j>(acc, h, y_row + (size_t)h * 8 * N + j * 8, cols, lane, x_scale,
                                                   y_scale, y_recip);
    });
}

// The epilogue for these 64 rows, staged or direct stores chosen once per tile. ACT and ROUND are the kernel's own
// (template parameters: one kernel per activation and requantizing rounding). Why not run-time switches over copies of
// it in one kernel: every copy is an unrolled epilogue of ~2,000 instructions, and the int8-output ping-pong kernel
// held 24 of them (~330 KB of code); inside a model, where other kernels run between its launches, half its warps'
// stall samples were instruction fetches (ncu "no instruction": 29 us against 17.5 for the fp16-output kernel of the
// same 768 x 768 layer, session 11).
template <int BN, int CHUNK, typename T, int ACT, int ROUND>
__device__ __forceinline__ void kiln_qg_epilogue_for(bool staged, const int (&acc)[BN / 2], T* __restrict__ y,
                                                     const float* cols, unsigned char* stage, int tid, int row0,
                                                     int n0, int M, int N, float x_scale, float y_scale) {
    if (staged) kiln_qg_epilogue_staged<BN, CHUNK, T, ACT, ROUND>(acc, y, cols, stage, tid, row0, n0, M, N, x_scale, y_scale);
    else kiln_qg_epilogue_direct<BN, T, ACT, ROUND>(acc, y, cols, tid, row0, n0, M, N, x_scale, y_scale);
}

// Persistent and warp-specialized: block b computes output tiles b, b + gridDim.x, ... (tile t: rows
// (t / tiles_n) * 128, columns (t % tiles_n) * BN, so the blocks running at once share their x rows and all of w in
// L2). A producer thread walks every (tile, K slice) step in order through a ring of shared-memory stages: it waits
// for a stage to be empty, then loads the step's x and w boxes into it by TMA (the copy engine writes the 128-byte
// swizzle); the stage's "full" barrier completes when the bytes land. Consumer warpgroups wait for a stage to be
// full, issue their wgmmas, wait for the slice before's (wgmma.wait_group 1: one slice stays queued on the tensor
// cores) and mark that slice's stage empty, then run the epilogue. The consumers form two teams that take turns
// over whole tiles (CUTLASS's KernelTmaWarpSpecializedPingpong, written for this GEMM): a team starts its K loop when
// the other has issued all of its previous tile's (the tensor cores run one tile at a time, and no team waits on a
// stage's barrier two phases ahead), so one team's epilogue overlaps the other's K loop. One block per SM, 6 stages.
// Two forms, measured on BERT-base's layers (bench.qgemm, H100, 8192 rows):
//   - PINGPONG (TEAM_WGS = 1), for layers without GELU: a team is one consumer warpgroup owning whole 128 x BN tiles;
//     a producer warpgroup that gives its registers back (setmaxnreg 40) so a consumer holds 128 int32 sums per
//     thread with room for the epilogue (232). 768 x 768: 17.6 -> 12.2 us, FFN2 (K = 3072): 34.0 -> 27.4 us (1,411
//     TOPS; session 8).
//   - Pairs (TEAM_WGS = 2), for GELU, whose epilogue is the longer part and runs faster on eight warps than on four:
//     a team is two consumer warpgroups sharing each tile (64 rows each); a producer warp; 544 threads, 96 of the
//     120 registers they may have. FFN1 + GELU -> int8 56.9 -> 53.9 us against session 8-12's two blocks per SM of
//     one pair each (whose two blocks ran their K loops and epilogues at the same time), 1024 rows 11.6 -> 11.7.
template <int TEAM_WGS> struct KilnQgShape {
    static constexpr bool PRODUCER_WG = TEAM_WGS == 1;        // a whole producer warpgroup giving its registers back
    static constexpr int CONSUMERS = 2 * TEAM_WGS;            // consumer warpgroups: two teams
    static constexpr int STAGES = 6;
    static constexpr int HALVES = 2 / TEAM_WGS;               // m64 row blocks per consumer: whole or half tiles
    static constexpr int CONSUMER0 = PRODUCER_WG ? 128 : 0;   // the first consumer thread
    static constexpr int PRODUCER = PRODUCER_WG ? 0 : 128 * CONSUMERS;  // the thread issuing the loads
    static constexpr int STAGE_READERS = 4 * TEAM_WGS;        // warps reading a stage: its empty barrier's count
    static constexpr int CHUNK = TEAM_WGS == 1 ? 128 : 64;    // bytes a row of each consumer warp's staging slice
};

// Where the tile's columns go: y [M, N], or with `split` > 0 (a multiple of BN) the part n0 / split of y0, y1, y2,
// each [M, split]: one GEMM of concatenated weights writing separate tensors (Q, K and V: a Split after it that the
// lowering folds into the kernel). The epilogue gets the part's base (n0 as the part's own column) and row length.
template <typename T> struct KilnQgOut {
    T* y;
    int n0, ld;
};
template <typename T>
__device__ __forceinline__ KilnQgOut<T> kiln_qg_out(T* y0, T* y1, T* y2, int split, int n0, int N) {
    if (split == 0) return {y0, n0, N};
    const int part = n0 / split;
    return {part == 0 ? y0 : part == 1 ? y1 : y2, n0 - part * split, split};
}

template <int TEAM_WGS, typename T, int ACT, int ROUND>
__device__ __forceinline__ void kiln_qgemm(T* __restrict__ y0, T* __restrict__ y1, T* __restrict__ y2, int split,
                                           const KilnTensorMap* x, const KilnTensorMap* w,
                                           const float* __restrict__ w_scale, const float* __restrict__ bias, int M,
                                           int N, int K, float x_scale, float y_scale) {
    using Shape = KilnQgShape<TEAM_WGS>;
    constexpr int BN = QG_BN, STAGES = Shape::STAGES, HALVES = Shape::HALVES;
    constexpr int A_BYTES = QG_BM * QG_BK, STAGE_BYTES = (QG_BM + BN) * QG_BK;
    extern __shared__ unsigned char kiln_qg_smem[];
    // full[STAGES], empty[STAGES], then turn[2] (team t may start its next tile's K loop)
    __shared__ __align__(8) unsigned long long kiln_qg_bars[2 * STAGES + 2];
    __shared__ __align__(16) float kiln_qg_cols[Shape::CONSUMERS][2][2 * BN];  // consumer, tile parity: w_scale, bias
    static_assert(BN == 128, "a consumer thread per column's scale and bias");
    const unsigned raw = (unsigned)__cvta_generic_to_shared(kiln_qg_smem);
    const unsigned base = (raw + 1023u) & ~1023u;  // swizzle atoms must be 1024-byte aligned
    const unsigned full = (unsigned)__cvta_generic_to_shared(kiln_qg_bars), empty = full + 8 * STAGES,
                   turn = empty + 8 * STAGES;
    const int tiles_n = (N + BN - 1) / BN, tiles = tiles_n * ((M + QG_BM - 1) / QG_BM);
    const int ktiles = (K + QG_BK - 1) / QG_BK;
    const int mine = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            kiln_mbar_init(full + 8 * s, 1);  // the producer's expect_tx arrival
            kiln_mbar_init(empty + 8 * s, Shape::STAGE_READERS);
        }
        kiln_mbar_init(turn, 4 * TEAM_WGS);  // one arrival per warp of the other team
        kiln_mbar_init(turn + 8, 4 * TEAM_WGS);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to the TMA unit
    }
    __syncthreads();

    if (Shape::PRODUCER_WG ? threadIdx.x < Shape::CONSUMER0 : threadIdx.x >= Shape::PRODUCER) {  // the producer's warp(group)
        if constexpr (Shape::PRODUCER_WG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == Shape::PRODUCER) {
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
    if constexpr (Shape::PRODUCER_WG) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    // the consumer warpgroup, broadcast from lane 0 so that the compiler knows it is warp-uniform (as CUTLASS's
    // canonical_warp_group_idx): the ping-pong kernels' stage and descriptor arithmetic then runs on uniform
    // registers (the pair kernels keep their loop counters in ordinary registers and move each wgmma's descriptors;
    // broadcasting the stage index too moved them to uniform registers but made FFN1 slower, 52.4 vs 50.0 us)
    const int me = __shfl_sync(0xffffffffu, (threadIdx.x - Shape::CONSUMER0) / 128, 0);
    const int tid = threadIdx.x % 128, lane = threadIdx.x % 32;
    const int team = me / TEAM_WGS, a_row0 = TEAM_WGS == 2 ? 64 * (me % 2) : 0;  // the consumer's first row in the tile
    // this warp's staging slice (16 rows of CHUNK bytes past the stage ring), used when rows are 16-byte aligned
    unsigned char* const staging = kiln_qg_smem + (base - raw) + STAGES * STAGE_BYTES +
                                 (threadIdx.x - Shape::CONSUMER0) / 32 * 16 * Shape::CHUNK;
    const int ld = split ? split : N;  // the row length of every output part
    const bool staged = (size_t)ld * sizeof(T) % 16 == 0 && kiln_aligned16(y0) && (split == 0 || kiln_aligned16(y1) &&
                                                                                   kiln_aligned16(y2));
    int acc[HALVES][BN / 2];
    // team 0 takes the block's even tiles, team 1 the odd ones
    for (int tile = team, turns = 0; tile < mine; tile += 2, ++turns) {
        const int t = blockIdx.x + tile * gridDim.x, m0 = (t / tiles_n) * QG_BM, n0 = (t % tiles_n) * BN;
        // the tile's per-column w_scale and bias, read from global memory now and stored to shared memory after the
        // K loop: the epilogue's loads then do not wait on global memory
        const float ws = n0 + tid < N ? w_scale[n0 + tid] : 0.0f, b = n0 + tid < N ? bias[n0 + tid] : 0.0f;
        // team 1's first tile waits for team 0's first K loop, later ones for the other team's last
        if (tile > 0) kiln_mbar_wait(turn + 8 * team, (team == 0 ? turns - 1 : turns) & 1);
        const int first = tile * ktiles;  // this tile's first step in the producer's sequence
        int stage = first % STAGES, round = first / STAGES, previous = -1;
        for (int kt = 0; kt < ktiles; ++kt) {
            kiln_mbar_wait(full + 8 * stage, round & 1);
            const unsigned a = base + stage * STAGE_BYTES + a_row0 * QG_BK;
            const unsigned long long db = kiln_smem_desc(base + stage * STAGE_BYTES + A_BYTES);
            kiln_wgmma_fence();
#pragma unroll
            for (int s = 0; s < QG_BK / 32; ++s) {  // 32 bytes of K a step: the descriptor start moves 32 >> 4
                const int accumulate = kt > 0 || s > 0;  // a tile's first product overwrites the last tile's sums
#pragma unroll
                for (int h = 0; h < HALVES; ++h)
                    kiln_wgmma_m64n128k32_s8(acc[h], kiln_smem_desc(a + h * 64 * QG_BK) + 2 * s, db + 2 * s, accumulate);
            }
            kiln_wgmma_commit();
            kiln_wgmma_wait<1>();  // the slice before's wgmmas are done reading their stage
            if (previous >= 0 && lane == 0) kiln_mbar_arrive(empty + 8 * previous);
            previous = stage;
            if (++stage == STAGES) stage = 0, ++round;
        }
        if (lane == 0) kiln_mbar_arrive(turn + 8 * (1 - team));  // every K slice is issued: its turn
        kiln_wgmma_wait<0>();
        if (lane == 0) kiln_mbar_arrive(empty + 8 * previous);
        // two buffers: a warp a tile ahead writes the other one while a slower warp still reads this one, and cannot
        // come back to this one before every warp of the consumer has passed the next barrier
        float* cols = kiln_qg_cols[me][turns & 1];
        cols[tid] = KilnQgFold<ACT>::value ? __fmul_rn(ws, x_scale) : ws;
        cols[BN + tid] = b;
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + me) : "memory");  // this consumer's warps only
        const KilnQgOut<T> out = kiln_qg_out(y0, y1, y2, split, n0, N);
#pragma unroll
        for (int h = 0; h < HALVES; ++h)
            kiln_qg_epilogue_for<BN, Shape::CHUNK, T, ACT, ROUND>(staged, acc[h], out.y, cols, staging, tid,
                                                                 m0 + a_row0 + 64 * h, out.n0, M, out.ld, x_scale,
                                                                 y_scale);
    }
}
#endif  // QG_WGMMA

// qgemm_sm90[_gelu]_128_<act><round>_<output>: a 1-D grid of at most one block per output tile (and per SM), 384
// threads (ping-pong: the kernels without GELU) or 544 (pairs: GELU), STAGES * (128 + 128) * 128 + consumer warps * 16
// * CHUNK + 1024 bytes of dynamic shared memory (engine_core/backends/cuda/qgemm.py Form). <act> is the QG_ACT_* code, <round> the QG_ROUND_* code (int8
// outputs only; 0 for float ones). x and w are TMA descriptors of x [M, K] and w [N, K] (int8, row-major) in 128 x
// 128-byte boxes with the 128-byte swizzle. y0 [M, N], or with split > 0 the parts y0, y1, y2 (kiln_qg_out).
#define KILN_QGEMM(TEAM_WGS, THREADS, NAME, T, ACT, ROUND)                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) NAME(                                           \
        T* __restrict__ y0, T* __restrict__ y1, T* __restrict__ y2, int split,                                    \
        const __grid_constant__ KilnTensorMap x, const __grid_constant__ KilnTensorMap w,                          \
        const float* __restrict__ w_scale, const float* __restrict__ bias, int M, int N, int K, float x_scale,     \
        float y_scale) {                                                                                          \
        KILN_QGEMM_BODY(TEAM_WGS, T, ACT, ROUND)                                                                  \
    }
#ifdef QG_WGMMA
#define KILN_QGEMM_BODY(TEAM_WGS, T, ACT, ROUND) \
    kiln_qgemm<TEAM_WGS, T, ACT, ROUND>(y0, y1, y2, split, &x, &w, w_scale, bias, M, N, K, x_scale, y_scale);
#else
#define KILN_QGEMM_BODY(TEAM_WGS, T, ACT, ROUND) __trap();
#endif

// ping-pong: no activation or ReLU; float outputs, or int8 after rounding to the layer's float type
#define KILN_QGEMM_PINGPONG(ACT)                                                                                 \
    KILN_QGEMM(1, 384, qgemm_sm90_128_##ACT##0_f32, float, ACT, QG_ROUND_F32)                             \
    KILN_QGEMM(1, 384, qgemm_sm90_128_##ACT##0_f16, __half, ACT, QG_ROUND_F32)                            \
    KILN_QGEMM(1, 384, qgemm_sm90_128_##ACT##0_bf16, __nv_bfloat16, ACT, QG_ROUND_F32)                    \
    KILN_QGEMM(1, 384, qgemm_sm90_128_##ACT##0_i8, signed char, ACT, QG_ROUND_F32)                        \
    KILN_QGEMM(1, 384, qgemm_sm90_128_##ACT##1_i8, signed char, ACT, QG_ROUND_F16)                        \
    KILN_QGEMM(1, 384, qgemm_sm90_128_##ACT##2_i8, signed char, ACT, QG_ROUND_BF16)
KILN_QGEMM_PINGPONG(0)
KILN_QGEMM_PINGPONG(1)
// pairs: GELU, and the cheap GELU for int8 outputs (session 12: the one-warpgroup ping-pong form ran that one faster
// alone, 53.4 against 57.3 us for FFN1 at 8192 rows, but slower inside BERT-base at batch 64, 59.7 against 57.4)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_20_f32, float, QG_ACT_GELU, QG_ROUND_F32)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_20_f16, __half, QG_ACT_GELU, QG_ROUND_F32)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_20_bf16, __nv_bfloat16, QG_ACT_GELU, QG_ROUND_F32)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_20_i8, signed char, QG_ACT_GELU, QG_ROUND_F32)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_21_i8, signed char, QG_ACT_GELU, QG_ROUND_F16)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_22_i8, signed char, QG_ACT_GELU, QG_ROUND_BF16)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_30_i8, signed char, QG_ACT_GELU_Q, QG_ROUND_F32)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_31_i8, signed char, QG_ACT_GELU_Q, QG_ROUND_F16)
KILN_QGEMM(2, 544, qgemm_sm90_gelu_128_32_i8, signed char, QG_ACT_GELU_Q, QG_ROUND_BF16)
