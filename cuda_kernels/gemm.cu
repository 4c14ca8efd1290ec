// fp32 GEMM, C = alpha * op(A) @ op(B) + beta * C, batched by blockIdx.z: Kiln's own tactic beside
// cuBLAS. Operands are addressed through (row, column, batch) element strides, so transposes and
// broadcast batches (stride 0) need no copies. 64x64 tile per block, 16-deep K slices in shared
// memory, 4x4 outputs per thread.
#define TILE 64
#define KT 16

extern "C" __global__ void __launch_bounds__(256)
gemm_f32(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, int M, int N, int K,
         long long a_rs, long long a_cs, long long a_bs, long long b_rs, long long b_cs, long long b_bs,
         long long c_bs, float alpha, float beta) {
    __shared__ float As[KT][TILE + 4];
    __shared__ float Bs[KT][TILE + 4];
    A += blockIdx.z * a_bs;
    B += blockIdx.z * b_bs;
    C += blockIdx.z * c_bs;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = blockIdx.y * TILE, n0 = blockIdx.x * TILE;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += KT) {
        for (int l = threadIdx.x; l < TILE * KT; l += 256) {
            const int mm = l / KT, kk = l % KT, gm = m0 + mm, gk = k0 + kk;
            As[kk][mm] = (gm < M && gk < K) ? A[gm * a_rs + gk * a_cs] : 0.0f;
        }
        for (int l = threadIdx.x; l < TILE * KT; l += 256) {
            const int kk = l / TILE, nn = l % TILE, gk = k0 + kk, gn = n0 + nn;
            Bs[kk][nn] = (gk < K && gn < N) ? B[gk * b_rs + gn * b_cs] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int gm = m0 + ty + 16 * i, gn = n0 + tx + 16 * j;
            if (gm < M && gn < N) {
                float* c = C + (long long)gm * N + gn;
                *c = beta != 0.0f ? alpha * acc[i][j] + beta * *c : alpha * acc[i][j];
            }
        }
}
