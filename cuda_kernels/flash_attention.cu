// Fused attention (FlashAttention-2 style): Y = softmax(scale * Q K^T + mask) V in one kernel.
// Why our own kernel: the unfused form writes the [batch*heads, Sq, Skv] score matrix to memory and back
// twice and needs Q/K/V in [batch, heads, seq, dim]; exporters produce [batch, seq, heads*dim], so that
// costs head split/merge transposes as well. Here Q, K, V and Y are read and written through element
// strides over (batch, head, seq) with a contiguous head dim, so both the 3-D and the 4-D ONNX forms run
// without copies, and the scores never leave registers.
//
// One block = 64 query rows of one (batch, head); 4 warps of 16 rows each. Q is staged in shared memory once;
// keys and values stream through a two-stage shared-memory ring in tiles of BN rows (cp.async: the next tile
// loads while this one is used); every warp keeps its rows' running max / sum (online softmax, base 2) and
// its output accumulator in registers. Tensor cores through mma.sync: m16n8k16 for fp16/bf16 with ldmatrix
// fragment loads (.trans for V), m16n8k8 TF32 for fp32 storage (only when the build allows TF32).
// Accumulation and softmax are fp32. A mask that does not vary with the query row (BERT's padding mask
// [batch, 1, 1, keys]; none at all) is staged per tile in shared memory as a base-2 bias together with the
// key bounds; one that does streams raw through cp.async with K/V (contiguous, 16-byte aligned rows) or, when
// it cannot, is staged as a [BM][BN] bias tile. The output goes through shared memory to 16-byte stores.
//
// flash_attention_q_*: Y is also quantized to int8 (kiln.AttentionQuantize: the attention output's
// QuantizeLinear folded in, passes/fuse_attention_quantize.py) and only the int8 tensor is written: the
// value rounded to T, as the unfused Attention stores it, then kiln_quantize_s8.
//
// Session 9 rewrite (was: Q fragments by scalar global loads, synchronous K/V tiles, V fragments from four
// 2-byte shared loads each, the mask read per element): docs/cuda-backend.md "Session 9".
#include "kiln_reduce.cuh"

struct KilnFlashGeom {
    long long qb, qh, qs;      // Q element strides over (batch, head, seq); the head dim is contiguous
    long long kb, kh, ks;      // K (kv heads)
    long long vb, vh, vs;      // V (kv heads)
    long long ob, oh, os;      // Y
    long long mb, mh, mq, mk;  // mask element strides over (batch, head, query, key); 0 = broadcast
    int heads, kv_group;       // query heads; query heads per kv head (grouped-query attention)
    int sq, skv;               // query and key lengths
    int causal, causal_offset; // 1: key k > query q + causal_offset is masked out
    int mask_kind;             // 0 none, 1 additive (storage type), 2 boolean (true = attend)
    float scale;
};

constexpr int FLASH_BM = 64;      // query rows per block
constexpr int FLASH_THREADS = 128;
constexpr float FLASH_LOG2E = 1.4426950408889634f;

// Shared-memory geometry of one (T, D): keys per tile, padded row (conflict-free ldmatrix / fragment loads).
// The layout (engine_core/backends/cuda/lowering.py flash_shared_bytes sizes it):
template <typename T, int D> struct KilnFlashTiles {
    static constexpr bool TF32 = sizeof(T) == 4;
    static constexpr int KSTEP = TF32 ? 8 : 16;            // mma k extent
    static constexpr int BN = (TF32 && D > 64) ? 32 : 64;  // keys per tile
    static constexpr int LD = D + (TF32 ? 4 : 8);
    // Q [BM][LD], K [2][BN][LD], V [2][BN][LD], then the staged mask: [2][BN] float biases for a mask that
    // is the same for every query row (or none); for one that is not, [2][BM] rows of BN * 4 + 16 bytes: the raw
    // mask tile (BN elements and 16 bytes of padding a row) or [2][BM][BN] float biases (flash_mask_tile)
};

template <typename T, bool QUANT> struct KilnFlashOut { using type = T; };
template <typename T> struct KilnFlashOut<T, true> { using type = signed char; };

__device__ __forceinline__ unsigned flash_pack(__half lo, __half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}
__device__ __forceinline__ unsigned flash_pack(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}
__device__ __forceinline__ unsigned flash_tf32(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ float flash_exp2(float x) {  // 2^x; -inf -> 0
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// D (16x8, fp32) += A (16x16) * B (16x8), fp16 or bf16 operands
__device__ __forceinline__ void flash_mma(float* d, const unsigned* a, const unsigned* b, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void flash_mma(float* d, const unsigned* a, const unsigned* b, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// D (16x8, fp32) += A (16x8) * B (8x8), TF32 operands
__device__ __forceinline__ void flash_mma(float* d, const unsigned* a, const unsigned* b, float) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void flash_ldmatrix(unsigned* r, const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void flash_ldmatrix_trans(unsigned* r, const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// 16 bytes global -> shared without registers; `bytes` 0 writes zeros (rows past the tensor's end).
__device__ __forceinline__ void flash_cp16(void* dst, const void* src, int bytes) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(a), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void flash_cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void flash_cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }

// `rows` x D elements (row stride `stride`, contiguous columns) into a padded shared tile; rows past `valid`
// become zeros. cp.async 16-byte words when `vec` (16-byte aligned rows), else element copies. A thread copies one
// 16-byte column of every RSTEP-th row: its addresses are computed once and step by a constant (the loop unrolls
// where `rows` is a constant), where a division and a 64-bit multiply a word made the tile copies a quarter of the
// kernel's stall samples (ncu source page, session 13).
template <typename T, int D, int LD>
__device__ __forceinline__ void flash_tile(T* __restrict__ tile, const T* __restrict__ src, long long stride,
                                           int rows, int valid, bool vec) {
    constexpr int VEC = 16 / sizeof(T), CHUNKS = D / VEC, RSTEP = FLASH_THREADS / CHUNKS;
    static_assert(FLASH_THREADS % CHUNKS == 0, "every thread keeps one column of 16 bytes");
    if (vec) {
        const int r0 = threadIdx.x / CHUNKS, c = (threadIdx.x % CHUNKS) * VEC;
        const T* from = src + r0 * stride + c;
        T* to = tile + r0 * LD + c;
        const long long step = RSTEP * stride;
#pragma unroll
        for (int r = r0; r < rows; r += RSTEP, from += step, to += RSTEP * LD)
            flash_cp16(to, r < valid ? from : src, r < valid ? 16 : 0);
    } else {
        for (int i = threadIdx.x; i < rows * D; i += FLASH_THREADS) {
            const int r = i / D, c = i % D;
            tile[r * LD + c] = r < valid ? src[r * stride + c] : kiln_to<T>(0.0f);
        }
    }
}

__device__ __forceinline__ bool flash_rows_aligned(const void* base, long long stride_bytes) {
    return (((unsigned long long)base | (unsigned long long)stride_bytes) & 15) == 0;
}

// The mask of keys n0 .. n0 + BN - 1 as a base-2 additive bias: log2(e) * mask, -inf for masked-out (boolean
// false) keys and keys past the end, for rows block_row .. block_row + BM - 1 ([BM][BN]; rows past the queries 0):
// a mask that varies per query but cannot stream raw (flash_mask_raw). A thread keeps one key and walks rows:
// consecutive threads read consecutive keys, no index division. (One row for every query: flash_mask_fetch.)
template <typename T, int BN>
__device__ __forceinline__ void flash_mask_tile(float* __restrict__ dst, const void* __restrict__ mask,
                                                const KilnFlashGeom& g, long long mrow, int block_row, int n0) {
    static_assert(FLASH_THREADS % BN == 0, "a thread keeps one key");
    constexpr int STEP = FLASH_THREADS / BN;
    const int col = threadIdx.x % BN, key = n0 + col;
    const T* madd = static_cast<const T*>(mask) + mrow + (long long)key * g.mk;
    const bool* mbool = static_cast<const bool*>(mask) + mrow + (long long)key * g.mk;
#pragma unroll 8
    for (int r = threadIdx.x / BN; r < FLASH_BM; r += STEP) {
        const int row = block_row + r;
        const long long at = (long long)row * g.mq;
        float bias = 0.0f;
        if (key >= g.skv) bias = -CUDART_INF_F;
        else if (g.mask_kind == 0 || row >= g.sq) bias = 0.0f;
        else if (g.mask_kind == 1) bias = kiln_f(madd[at]) * FLASH_LOG2E;
        else if (!mbool[at]) bias = -CUDART_INF_F;
        dst[r * BN + col] = bias;
    }
}

// A mask row shared by every query (or none) in two halves: flash_mask_fetch loads this thread's key's element
// a tile ahead (an additive T or a bool; nothing past the keys or without a mask), flash_mask_store turns it into the
// base-2 bias once the tile before is computed. Why: as one step, the load's latency from memory stalled warps 0 and
// 1 before every tile while the others waited at the barrier (ncu source page, BERT-base's [B, 1, 1, S] mask: 18% of
// the kernel's stall samples on the two conversions that waited for it, session 13).
template <typename T> struct KilnFlashMaskElement {
    T add;
    bool keep;
};

template <typename T, int BN>
__device__ __forceinline__ KilnFlashMaskElement<T> flash_mask_fetch(const void* __restrict__ mask, const KilnFlashGeom& g,
                                                                   long long mrow, int n0) {
    KilnFlashMaskElement<T> m{kiln_to<T>(0.0f), true};
    const int key = n0 + (int)threadIdx.x;
    if ((int)threadIdx.x < BN && key < g.skv) {
        const long long at = mrow + (long long)key * g.mk;
        if (g.mask_kind == 1) m.add = static_cast<const T*>(mask)[at];
        else if (g.mask_kind == 2) m.keep = static_cast<const bool*>(mask)[at];
    }
    return m;
}

template <typename T, int BN>
__device__ __forceinline__ void flash_mask_store(float* __restrict__ dst, KilnFlashMaskElement<T> m,
                                                 const KilnFlashGeom& g, int n0) {
    if ((int)threadIdx.x >= BN) return;
    const bool out = n0 + (int)threadIdx.x >= g.skv || !m.keep;
    dst[threadIdx.x] = out ? -CUDART_INF_F : g.mask_kind == 1 ? kiln_f(m.add) * FLASH_LOG2E : 0.0f;
}

// The raw mask of rows block_row .. + BM - 1, keys n0 .. n0 + BN - 1 (M: T for an additive mask, bool) by
// cp.async with the K/V tile: rows of BN elements padded by 16 bytes (conflict-free pair reads), zeros past the
// queries and keys. Needs contiguous keys and 16-byte aligned rows. Why: a mask that varies per query row is
// as many loads as a K tile; as synchronous loads every tile waited on them (BERT's exported mask: 146 us).
template <typename M, int BN>
__device__ __forceinline__ void flash_mask_raw(unsigned char* __restrict__ dst, const M* __restrict__ src,
                                               long long mq, int rows_valid, int keys_valid) {
    constexpr int VEC = 16 / sizeof(M), CHUNKS = BN / VEC, ROW = BN * sizeof(M) + 16;
    for (int i = threadIdx.x; i < FLASH_BM * CHUNKS; i += FLASH_THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const int keys = min(max(keys_valid - c * VEC, 0), VEC), bytes = r < rows_valid ? keys * (int)sizeof(M) : 0;
        flash_cp16(dst + r * ROW + c * 16, bytes ? static_cast<const void*>(src + r * mq + c * VEC) : src, bytes);
    }
}

// Bytes of one mask element: T for an additive mask, bool
template <typename T> __device__ __forceinline__ int flash_mask_size(const KilnFlashGeom& g) {
    return g.mask_kind == 1 ? (int)sizeof(T) : 1;
}

// Whether this block's mask streams raw (flash_mask_raw): it varies per query row, its keys are contiguous and
// its rows 16-byte aligned.
template <typename T>
__device__ __forceinline__ bool flash_streams_raw_mask(const void* mask, const KilnFlashGeom& g) {
    if (g.mask_kind == 0 || g.mq == 0 || g.mk != 1) return false;
    const long long first = (long long)blockIdx.z * g.mb + (long long)blockIdx.y * g.mh + (long long)blockIdx.x * FLASH_BM * g.mq;
    const int size = flash_mask_size<T>(g);
    return flash_rows_aligned(static_cast<const unsigned char*>(mask) + first * size, g.mq * size);
}

// RAW: the mask streams raw (flash_streams_raw_mask); a separate instantiation, so the common path (one bias
// row per key tile, or no mask) keeps a loop without the raw mask's conversions and its registers.
template <typename T, int D, bool QUANT, bool RAW>
__device__ void flash_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                void* __restrict__ y, const void* __restrict__ mask, KilnFlashGeom g,
                                const float* __restrict__ y_scale) {
    using Tiles = KilnFlashTiles<T, D>;
    constexpr bool TF32 = Tiles::TF32;
    constexpr int KSTEP = Tiles::KSTEP, BN = Tiles::BN, LD = Tiles::LD;
    extern __shared__ __align__(128) unsigned char flash_smem[];
    T* qs = reinterpret_cast<T*>(flash_smem);  // later the output tile
    T* ks = qs + FLASH_BM * LD;
    T* vs = ks + 2 * BN * LD;
    float* biases = reinterpret_cast<float*>(vs + 2 * BN * LD);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, tig = lane & 3;           // mma fragment coordinates
    const int b = blockIdx.z, h = blockIdx.y;
    const int kvh = h / g.kv_group;
    const int block_row = blockIdx.x * FLASH_BM;
    const int row0 = block_row + warp * 16;              // this warp's first query row
    const T* qp = q + b * g.qb + h * g.qh + (long long)block_row * g.qs;
    const T* kp = k + b * g.kb + kvh * g.kh;
    const T* vp = v + b * g.vb + kvh * g.vh;
    const bool q_vec = flash_rows_aligned(qp, g.qs * (long long)sizeof(T));
    const bool kv_vec = flash_rows_aligned(kp, g.ks * (long long)sizeof(T)) && flash_rows_aligned(vp, g.vs * (long long)sizeof(T));

    int kv_end = g.skv;
    if (g.causal) {  // keys past the block's last row's frontier are masked for every row of the block
        const long long last = (long long)block_row + FLASH_BM - 1 + g.causal_offset + 1;
        kv_end = (int)max(0LL, min((long long)g.skv, last));
    }
    const int tiles = (kv_end + BN - 1) / BN;
    const int mask_rows = g.mask_kind != 0 && g.mq != 0 ? FLASH_BM : 1;  // staged bias rows (flash_mask_tile; one: flash_mask_fetch)
    const long long mrow = (long long)b * g.mb + (long long)h * g.mh;
    // RAW: the per-row mask streams through cp.async (flash_mask_raw) into rows of raw_row bytes, from the row
    // flash_streams_raw_mask checked (recomputed from mrow here: reading blockIdx again cost the loop registers)
    const int mask_size = flash_mask_size<T>(g), raw_row = BN * mask_size + 16;
    const unsigned char* mask_rows_base = static_cast<const unsigned char*>(mask) + (mrow + (long long)block_row * g.mq) * mask_size;
    unsigned char* raw_s = reinterpret_cast<unsigned char*>(biases);
    const bool mask_row = !RAW && mask_rows == 1;  // one bias row a tile, fetched a tile ahead (flash_mask_fetch)
    KilnFlashMaskElement<T> next_mask{};

    auto load_tile = [&](int t) {
        const int n0 = t * BN, valid = min(BN, g.skv - n0), stage = t & 1;
        flash_tile<T, D, LD>(ks + stage * BN * LD, kp + n0 * g.ks, g.ks, BN, valid, kv_vec);
        flash_tile<T, D, LD>(vs + stage * BN * LD, vp + n0 * g.vs, g.vs, BN, valid, kv_vec);
        if constexpr (RAW) {
            if (g.mask_kind == 1)
                flash_mask_raw<T, BN>(raw_s + stage * FLASH_BM * raw_row, reinterpret_cast<const T*>(mask_rows_base) + n0,
                                      g.mq, g.sq - block_row, g.skv - n0);
            else
                flash_mask_raw<bool, BN>(raw_s + stage * FLASH_BM * raw_row,
                                         reinterpret_cast<const bool*>(mask_rows_base) + n0, g.mq, g.sq - block_row,
                                         g.skv - n0);
        } else if (mask_rows > 1) {
            flash_mask_tile<T, BN>(biases + stage * FLASH_BM * BN, mask, g, mrow, block_row, n0);
        } else {
            next_mask = flash_mask_fetch<T, BN>(mask, g, mrow, n0);
        }
    };
    flash_tile<T, D, LD>(qs, qp, g.qs, FLASH_BM, g.sq - block_row, q_vec);
    if (tiles > 0) load_tile(0);
    flash_cp_commit();
    const KilnFlashMaskElement<T> first_mask = next_mask;  // stored after the first wait: its load has landed

    unsigned qa[D / KSTEP][4];
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m_a = -CUDART_INF_F, m_b = -CUDART_INF_F, l_a = 0.0f, l_b = 0.0f;
    const int ra = row0 + gid, rb = row0 + gid + 8;
    const float scale2 = g.scale * FLASH_LOG2E;
    const int bias_a = mask_rows > 1 ? (warp * 16 + gid) * BN : 0, bias_b = mask_rows > 1 ? bias_a + 8 * BN : 0;

    for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) {  // the stage tile t - 1 used is free (the barrier at the end of the last iteration)
            load_tile(t + 1);
            flash_cp_commit();
            flash_cp_wait<1>();
        } else {
            flash_cp_wait<0>();
        }
        if (mask_row && t == 0) flash_mask_store<T, BN>(biases, first_mask, g, 0);
        __syncthreads();
        const T* kt_s = ks + (t & 1) * BN * LD;
        const T* vt_s = vs + (t & 1) * BN * LD;
        const float* bias = biases + (t & 1) * mask_rows * BN;
        const unsigned char* raw_a = raw_s + (t & 1) * FLASH_BM * raw_row + (warp * 16 + gid) * raw_row;
        const unsigned char* raw_b = raw_a + 8 * raw_row;
        const int n0 = t * BN;

        if (t == 0) {  // this warp's Q fragments: rows row0 .. row0 + 15
            const T* qw = qs + warp * 16 * LD;
#pragma unroll
            for (int kk = 0; kk < D / KSTEP; ++kk) {
                if constexpr (TF32) {
                    const int c = kk * 8 + tig;
                    qa[kk][0] = flash_tf32(kiln_f(qw[gid * LD + c]));
                    qa[kk][1] = flash_tf32(kiln_f(qw[(gid + 8) * LD + c]));
                    qa[kk][2] = flash_tf32(kiln_f(qw[gid * LD + c + 4]));
                    qa[kk][3] = flash_tf32(kiln_f(qw[(gid + 8) * LD + c + 4]));
                } else {
                    flash_ldmatrix(qa[kk], qw + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
                }
            }
        }

        // S = Q K^T for this warp's 16 rows x BN keys
        float s[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
        if constexpr (TF32) {
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                const T* krow = kt_s + (nt * 8 + gid) * LD;
#pragma unroll
                for (int kk = 0; kk < D / KSTEP; ++kk) {
                    const unsigned bf[2] = {flash_tf32(krow[kk * 8 + tig]), flash_tf32(krow[kk * 8 + tig + 4])};
                    flash_mma(s[nt], qa[kk], bf, T());
                }
            }
        } else {
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {  // n tiles 2 np and 2 np + 1
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    unsigned bf[4];  // b0, b1 of tile 2 np; b0, b1 of tile 2 np + 1
                    flash_ldmatrix(bf, kt_s + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
                    flash_mma(s[2 * np], qa[kk], bf, T());
                    flash_mma(s[2 * np + 1], qa[kk], bf + 2, T());
                }
            }
        }

        // scale, mask, bounds (base 2); running max per row
        float tile_a = -CUDART_INF_F, tile_b = -CUDART_INF_F;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            const int col = nt * 8 + 2 * tig;
            float biased[4];
            if constexpr (RAW) {  // the raw mask pair of keys col, col + 1 in rows a and b
                if (g.mask_kind == 1) {
                    const T* pa = reinterpret_cast<const T*>(raw_a) + col;
                    const T* pb = reinterpret_cast<const T*>(raw_b) + col;
                    biased[0] = kiln_f(pa[0]) * FLASH_LOG2E; biased[1] = kiln_f(pa[1]) * FLASH_LOG2E;
                    biased[2] = kiln_f(pb[0]) * FLASH_LOG2E; biased[3] = kiln_f(pb[1]) * FLASH_LOG2E;
                } else {
                    biased[0] = raw_a[col] ? 0.0f : -CUDART_INF_F; biased[1] = raw_a[col + 1] ? 0.0f : -CUDART_INF_F;
                    biased[2] = raw_b[col] ? 0.0f : -CUDART_INF_F; biased[3] = raw_b[col + 1] ? 0.0f : -CUDART_INF_F;
                }
                if (n0 + col >= g.skv) biased[0] = biased[2] = -CUDART_INF_F;
                if (n0 + col + 1 >= g.skv) biased[1] = biased[3] = -CUDART_INF_F;
            } else {
                const float2 pair_a = *reinterpret_cast<const float2*>(bias + bias_a + col);
                const float2 pair_b = *reinterpret_cast<const float2*>(bias + bias_b + col);
                biased[0] = pair_a.x; biased[1] = pair_a.y; biased[2] = pair_b.x; biased[3] = pair_b.y;
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = e < 2 ? ra : rb;
                const int key = n0 + col + (e & 1);
                float x = fmaf(s[nt][e], scale2, biased[e]);
                if (g.causal && key > row + g.causal_offset) x = -CUDART_INF_F;
                s[nt][e] = x;
                if (e < 2) tile_a = fmaxf(tile_a, x); else tile_b = fmaxf(tile_b, x);
            }
        }
        for (int off = 1; off < 4; off <<= 1) {
            tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffff, tile_a, off));
            tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffff, tile_b, off));
        }
        const float new_a = fmaxf(m_a, tile_a), new_b = fmaxf(m_b, tile_b);
        const float base_a = new_a == -CUDART_INF_F ? 0.0f : new_a;  // fully masked so far: weights 0, not NaN
        const float base_b = new_b == -CUDART_INF_F ? 0.0f : new_b;
        const float alpha_a = flash_exp2(m_a - base_a), alpha_b = flash_exp2(m_b - base_b);
        m_a = new_a;
        m_b = new_b;
        l_a *= alpha_a;
        l_b *= alpha_b;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            acc[i][0] *= alpha_a; acc[i][1] *= alpha_a;
            acc[i][2] *= alpha_b; acc[i][3] *= alpha_b;
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            s[nt][0] = flash_exp2(s[nt][0] - base_a); s[nt][1] = flash_exp2(s[nt][1] - base_a);
            s[nt][2] = flash_exp2(s[nt][2] - base_b); s[nt][3] = flash_exp2(s[nt][3] - base_b);
            l_a += s[nt][0] + s[nt][1];
            l_b += s[nt][2] + s[nt][3];
        }

        // Y += P V: P's accumulator fragments are reused as A operands without leaving registers
        if constexpr (TF32) {
            // a k step of 8 keys = one S tile; logical k = t maps to key 2t and t + 4 to key 2t + 1 (the
            // order of a sum's terms is free, as long as P and V use the same one)
#pragma unroll
            for (int nt = 0; nt < BN / 8; ++nt) {
                const unsigned pa[4] = {flash_tf32(s[nt][0]), flash_tf32(s[nt][2]), flash_tf32(s[nt][1]),
                                        flash_tf32(s[nt][3])};
                const T* v0 = vt_s + (nt * 8 + 2 * tig) * LD;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    const unsigned bf[2] = {flash_tf32(v0[dt * 8 + gid]), flash_tf32(v0[LD + dt * 8 + gid])};
                    flash_mma(acc[dt], pa, bf, T());
                }
            }
        } else {
#pragma unroll
            for (int kt = 0; kt < BN / 16; ++kt) {
                const unsigned pa[4] = {
                    flash_pack(kiln_to<T>(s[2 * kt][0]), kiln_to<T>(s[2 * kt][1])),
                    flash_pack(kiln_to<T>(s[2 * kt][2]), kiln_to<T>(s[2 * kt][3])),
                    flash_pack(kiln_to<T>(s[2 * kt + 1][0]), kiln_to<T>(s[2 * kt + 1][1])),
                    flash_pack(kiln_to<T>(s[2 * kt + 1][2]), kiln_to<T>(s[2 * kt + 1][3]))};
#pragma unroll
                for (int dp = 0; dp < D / 16; ++dp) {  // d tiles 2 dp and 2 dp + 1
                    unsigned bf[4];
                    flash_ldmatrix_trans(bf, vt_s + (kt * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + dp * 16 + (lane >> 4) * 8);
                    flash_mma(acc[2 * dp], pa, bf, T());
                    flash_mma(acc[2 * dp + 1], pa, bf + 2, T());
                }
            }
        }
        if (mask_row && t + 1 < tiles) flash_mask_store<T, BN>(biases + ((t + 1) & 1) * BN, next_mask, g, n0 + BN);
        __syncthreads();  // every warp is done with this stage before the next iteration refills it
    }

    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffff, l_a, off);
        l_b += __shfl_xor_sync(0xffffffff, l_b, off);
    }
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;

    // the warp's 16 output rows as T into its own rows of the Q tile, then whole rows out in 16-byte pieces
    flash_cp_wait<0>();  // no tile at all (every key masked by causality): Q's copies must land first
    __syncthreads();
    T* ow = qs + warp * 16 * LD;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + 2 * tig;
        if constexpr (TF32) {
            *reinterpret_cast<float2*>(ow + gid * LD + c) = make_float2(acc[dt][0] * inv_a, acc[dt][1] * inv_a);
            *reinterpret_cast<float2*>(ow + (gid + 8) * LD + c) = make_float2(acc[dt][2] * inv_b, acc[dt][3] * inv_b);
        } else {
            *reinterpret_cast<unsigned*>(ow + gid * LD + c) = flash_pack(kiln_to<T>(acc[dt][0] * inv_a), kiln_to<T>(acc[dt][1] * inv_a));
            *reinterpret_cast<unsigned*>(ow + (gid + 8) * LD + c) = flash_pack(kiln_to<T>(acc[dt][2] * inv_b), kiln_to<T>(acc[dt][3] * inv_b));
        }
    }
    __syncwarp();
    using Out = typename KilnFlashOut<T, QUANT>::type;
    Out* yp = static_cast<Out*>(y) + b * g.ob + h * g.oh;
    const float qscale = QUANT ? *y_scale : 1.0f, qrecip = 1.0f / qscale;  // IEEE: kiln_div_rn's reciprocal
    struct alignas(16) Chunk { T v[8]; };
    struct alignas(8) Bytes { signed char v[8]; };
    for (int i = lane; i < 16 * (D / 8); i += 32) {
        const int r = i / (D / 8), c = (i % (D / 8)) * 8, row = row0 + r;
        if (row >= g.sq) continue;
        const Chunk chunk = *reinterpret_cast<const Chunk*>(ow + r * LD + c);
        Out* dst = yp + row * g.os + c;
        if constexpr (QUANT) {
            Bytes out;
#pragma unroll
            for (int e = 0; e < 8; ++e) out.v[e] = kiln_quantize_s8(kiln_f(chunk.v[e]), qscale, qrecip);
            if (((unsigned long long)dst & 7) == 0) {
                *reinterpret_cast<Bytes*>(dst) = out;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) dst[e] = out.v[e];
            }
        } else if (kiln_aligned16(dst)) {
            *reinterpret_cast<Chunk*>(dst) = chunk;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[e] = chunk.v[e];
        }
    }
}

// MIN_BLOCKS: blocks per SM the register budget must allow (4 for D <= 64: 128 registers, a few spilled bytes;
// short sequences are latency-bound, so more resident blocks beat a few more registers)
#define KILN_FLASH(T, SUFFIX, D, MIN_BLOCKS)                                                                  \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, MIN_BLOCKS)                                 \
        flash_attention_##D##_##SUFFIX(const T* q, const T* k, const T* v, T* y, const void* mask,           \
                                       KilnFlashGeom g) {                                                   \
        if (flash_streams_raw_mask<T>(mask, g)) flash_attention<T, D, false, true>(q, k, v, y, mask, g, nullptr);  \
        else flash_attention<T, D, false, false>(q, k, v, y, mask, g, nullptr);                             \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, MIN_BLOCKS)                                 \
        flash_attention_q_##D##_##SUFFIX(const T* q, const T* k, const T* v, signed char* y,                 \
                                         const void* mask, KilnFlashGeom g, const float* y_scale) {         \
        if (flash_streams_raw_mask<T>(mask, g)) flash_attention<T, D, true, true>(q, k, v, y, mask, g, y_scale);   \
        else flash_attention<T, D, true, false>(q, k, v, y, mask, g, y_scale);                              \
    }

KILN_FLASH(__half, f16, 32, 4)
KILN_FLASH(__half, f16, 64, 4)
KILN_FLASH(__half, f16, 128, 3)
KILN_FLASH(__nv_bfloat16, bf16, 32, 4)
KILN_FLASH(__nv_bfloat16, bf16, 64, 4)
KILN_FLASH(__nv_bfloat16, bf16, 128, 3)
KILN_FLASH(float, tf32, 32, 3)
KILN_FLASH(float, tf32, 64, 3)
KILN_FLASH(float, tf32, 128, 2)
