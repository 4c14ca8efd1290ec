// Many small device-to-device copies in one launch: a batch's per-request gathers and deliveries (CUDA shared
// memory). Why a kernel: the copy engines take each copy of a cuMemcpyBatchAsync on its own, so a batch of 64
// requests x 4 tensors of a few KB cost milliseconds of copy-engine time per run; here each block moves one
// segment, 16 bytes a thread where the segment's addresses and size allow it.
// table: `count` rows of (dst, src, nbytes), 64-bit each, in device memory.
extern "C" __global__ void copy_segments(const unsigned long long* __restrict__ table, int count) {
    for (int seg = blockIdx.x; seg < count; seg += gridDim.x) {
        char* dst = reinterpret_cast<char*>(table[3 * seg]);
        const char* src = reinterpret_cast<const char*>(table[3 * seg + 1]);
        const unsigned long long nbytes = table[3 * seg + 2];
        const unsigned long long wide = ((table[3 * seg] | table[3 * seg + 1]) & 15ull) == 0 ? nbytes / 16 : 0;
        uint4* dst4 = reinterpret_cast<uint4*>(dst);
        const uint4* src4 = reinterpret_cast<const uint4*>(src);
        for (unsigned long long i = threadIdx.x; i < wide; i += blockDim.x) {
            dst4[i] = src4[i];
        }
        for (unsigned long long i = wide * 16 + threadIdx.x; i < nbytes; i += blockDim.x) {
            dst[i] = src[i];
        }
    }
}
