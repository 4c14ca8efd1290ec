// Fused attention (FlashAttention-2 style): Y = softmax(scale * Q K^T + mask) V in one kernel.
// Why our own kernel: the unfused form writes the [batch*heads, Sq, Skv] score matrix to memory and back
// twice and needs Q/K/V in [batch, heads, seq, dim]; exporters produce [batch, seq, heads*dim], so that
// costs head split/merge transposes as well. Here Q, K, V and Y are read and written through element
// strides over (batch, head, seq) with a contiguous head dim, so both the 3-D and the 4-D ONNX forms run
// without copies, and the scores never leave registers.
//
// One block = 64 query rows of one (batch, head); 4 warps of 16 rows each. Keys and values stream through
// shared memory in tiles of BN rows; every warp keeps its rows' running max / sum (online softmax) and
// its output accumulator in registers. Tensor cores through mma.sync: m16n8k16 for fp16/bf16, m16n8k8
// TF32 for fp32 storage (only when the build allows TF32). Accumulation and softmax are fp32.
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

// Copy `rows` x D elements (row stride `stride`, contiguous columns) into a padded shared tile; rows past
// `valid` become zeros. 16-byte words when the source allows it.
template <typename T, int D, int LD>
__device__ __forceinline__ void flash_tile(T* __restrict__ tile, const T* __restrict__ src, long long stride,
                                           int rows, int valid) {
    constexpr int VEC = 16 / sizeof(T);
    const bool aligned = ((reinterpret_cast<unsigned long long>(src) | (unsigned long long)(stride * sizeof(T))) & 15) == 0;
    if (aligned) {
        for (int i = threadIdx.x; i < rows * (D / VEC); i += FLASH_THREADS) {
            const int r = i / (D / VEC), c = (i % (D / VEC)) * VEC;
            uint4 word = make_uint4(0, 0, 0, 0);
            if (r < valid) word = *reinterpret_cast<const uint4*>(src + r * stride + c);
            *reinterpret_cast<uint4*>(tile + r * LD + c) = word;
        }
    } else {
        for (int i = threadIdx.x; i < rows * D; i += FLASH_THREADS) {
            const int r = i / D, c = i % D;
            tile[r * LD + c] = r < valid ? src[r * stride + c] : kiln_to<T>(0.0f);
        }
    }
}

template <typename T, int D>
__device__ void flash_attention(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                T* __restrict__ y, const void* __restrict__ mask, KilnFlashGeom g) {
    constexpr bool TF32 = sizeof(T) == 4;
    constexpr int KSTEP = TF32 ? 8 : 16;                 // mma k extent
    constexpr int BN = (TF32 && D > 64) ? 32 : 64;       // keys per tile (keeps shared memory under 48 KiB)
    constexpr int LD = D + (TF32 ? 4 : 8);               // padded row: conflict-free fragment loads
    __shared__ __align__(16) T ks[BN * LD];
    __shared__ __align__(16) T vs[BN * LD];

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gid = lane >> 2, tig = lane & 3;           // mma fragment coordinates
    const int b = blockIdx.z, h = blockIdx.y;
    const int kvh = h / g.kv_group;
    const int row0 = blockIdx.x * FLASH_BM + warp * 16;  // this warp's first query row
    const T* qp = q + b * g.qb + h * g.qh;
    const T* kp = k + b * g.kb + kvh * g.kh;
    const T* vp = v + b * g.vb + kvh * g.vh;

    // Q fragments, loaded once: rows row0+gid and row0+gid+8
    unsigned qa[D / KSTEP][4];
    const int ra = row0 + gid, rb = row0 + gid + 8;
    auto qv = [&](int r, int c) -> T { return r < g.sq ? qp[r * g.qs + c] : kiln_to<T>(0.0f); };
#pragma unroll
    for (int kk = 0; kk < D / KSTEP; ++kk) {
        if constexpr (TF32) {
            const int c = kk * 8 + tig;
            qa[kk][0] = flash_tf32(kiln_f(qv(ra, c)));
            qa[kk][1] = flash_tf32(kiln_f(qv(rb, c)));
            qa[kk][2] = flash_tf32(kiln_f(qv(ra, c + 4)));
            qa[kk][3] = flash_tf32(kiln_f(qv(rb, c + 4)));
        } else {
            const int c = kk * 16 + 2 * tig;
            qa[kk][0] = flash_pack(qv(ra, c), qv(ra, c + 1));
            qa[kk][1] = flash_pack(qv(rb, c), qv(rb, c + 1));
            qa[kk][2] = flash_pack(qv(ra, c + 8), qv(ra, c + 9));
            qa[kk][3] = flash_pack(qv(rb, c + 8), qv(rb, c + 9));
        }
    }

    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float m_a = -CUDART_INF_F, m_b = -CUDART_INF_F, l_a = 0.0f, l_b = 0.0f;

    int kv_end = g.skv;
    if (g.causal) {  // keys past the block's last row's frontier are masked for every row of the block
        const long long last = (long long)blockIdx.x * FLASH_BM + FLASH_BM - 1 + g.causal_offset + 1;
        kv_end = (int)max(0LL, min((long long)g.skv, last));
    }
    const T* madd = static_cast<const T*>(mask);
    const bool* mbool = static_cast<const bool*>(mask);
    const long long mrow = (long long)b * g.mb + (long long)h * g.mh;

    for (int n0 = 0; n0 < kv_end; n0 += BN) {
        const int valid = min(BN, g.skv - n0);
        __syncthreads();  // the previous tile is no longer read
        flash_tile<T, D, LD>(ks, kp + n0 * g.ks, g.ks, BN, valid);
        flash_tile<T, D, LD>(vs, vp + n0 * g.vs, g.vs, BN, valid);
        __syncthreads();

        // S = Q K^T for this warp's 16 rows x BN keys
        float s[BN / 8][4];
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const T* krow = ks + (nt * 8 + gid) * LD;
#pragma unroll
            for (int kk = 0; kk < D / KSTEP; ++kk) {
                unsigned bf[2];
                if constexpr (TF32) {
                    bf[0] = flash_tf32(kiln_f(krow[kk * 8 + tig]));
                    bf[1] = flash_tf32(kiln_f(krow[kk * 8 + tig + 4]));
                } else {
                    bf[0] = *reinterpret_cast<const unsigned*>(krow + kk * 16 + 2 * tig);
                    bf[1] = *reinterpret_cast<const unsigned*>(krow + kk * 16 + 2 * tig + 8);
                }
                flash_mma(s[nt], qa[kk], bf, T());
            }
        }

        // scale, mask, bounds; running max per row
        float tile_a = -CUDART_INF_F, tile_b = -CUDART_INF_F;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = e < 2 ? ra : rb;
                const int key = n0 + nt * 8 + 2 * tig + (e & 1);
                float x = s[nt][e] * g.scale;
                if (key >= g.skv || (g.causal && key > row + g.causal_offset)) {
                    x = -CUDART_INF_F;
                } else if (g.mask_kind != 0 && row < g.sq) {
                    const long long at = mrow + (long long)row * g.mq + (long long)key * g.mk;
                    if (g.mask_kind == 1) x += kiln_f(madd[at]);
                    else if (!mbool[at]) x = -CUDART_INF_F;
                }
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
        const float alpha_a = __expf(m_a - base_a), alpha_b = __expf(m_b - base_b);
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
            s[nt][0] = __expf(s[nt][0] - base_a); s[nt][1] = __expf(s[nt][1] - base_a);
            s[nt][2] = __expf(s[nt][2] - base_b); s[nt][3] = __expf(s[nt][3] - base_b);
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
                const T* v0 = vs + (nt * 8 + 2 * tig) * LD;
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
                const T* v0 = vs + (kt * 16 + 2 * tig) * LD;
#pragma unroll
                for (int dt = 0; dt < D / 8; ++dt) {
                    const int c = dt * 8 + gid;
                    const unsigned bf[2] = {flash_pack(v0[c], v0[LD + c]), flash_pack(v0[8 * LD + c], v0[9 * LD + c])};
                    flash_mma(acc[dt], pa, bf, T());
                }
            }
        }
    }

    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(0xffffffff, l_a, off);
        l_b += __shfl_xor_sync(0xffffffff, l_b, off);
    }
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
    T* yp = y + b * g.ob + h * g.oh;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
        const int c = dt * 8 + 2 * tig;
        if (ra < g.sq) {
            yp[ra * g.os + c] = kiln_to<T>(acc[dt][0] * inv_a);
            yp[ra * g.os + c + 1] = kiln_to<T>(acc[dt][1] * inv_a);
        }
        if (rb < g.sq) {
            yp[rb * g.os + c] = kiln_to<T>(acc[dt][2] * inv_b);
            yp[rb * g.os + c + 1] = kiln_to<T>(acc[dt][3] * inv_b);
        }
    }
}

#define KILN_FLASH(T, SUFFIX, D)                                                                      \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS)                                     \
        flash_attention_##D##_##SUFFIX(const T* q, const T* k, const T* v, T* y, const void* mask,   \
                                       KilnFlashGeom g) {                                           \
        flash_attention<T, D>(q, k, v, y, mask, g);                                                  \
    }

KILN_FLASH(__half, f16, 32)
KILN_FLASH(__half, f16, 64)
KILN_FLASH(__half, f16, 128)
KILN_FLASH(__nv_bfloat16, bf16, 32)
KILN_FLASH(__nv_bfloat16, bf16, 64)
KILN_FLASH(__nv_bfloat16, bf16, 128)
KILN_FLASH(float, tf32, 32)
KILN_FLASH(float, tf32, 64)
KILN_FLASH(float, tf32, 128)
