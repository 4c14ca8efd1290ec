// Many device-to-device copies in one launch: a batch's per-request gathers and deliveries (CUDA shared memory,
// and system shared memory the server page-locked, whose host addresses the device reads and writes directly).
// Why a kernel: the copy engines take each copy of a cuMemcpyBatchAsync on its own, so a batch of 64 requests x 4
// tensors of a few KB cost milliseconds of copy-engine time per run; here blocks move the segments, 16 bytes a
// thread where the segment's addresses allow it.
// Grid: x over segments, y over KILN_SEGMENT_CHUNK-byte chunks of a segment (the host sizes y for the largest). Why
// chunks: with one block a segment, a 600 KB image was 300 dependent round trips of one block's 2 KB (ResNet-50
// batches from shared memory); chunks spread each segment over many SMs.
// table: `count` rows of (dst, src, nbytes), 64-bit each, in device memory.
#define KILN_SEGMENT_CHUNK 32768ull

extern "C" __global__ void copy_segments(const unsigned long long* __restrict__ table, int count) {
    for (int seg = blockIdx.x; seg < count; seg += gridDim.x) {
        char* dst = reinterpret_cast<char*>(table[3 * seg]);
        const char* src = reinterpret_cast<const char*>(table[3 * seg + 1]);
        const unsigned long long nbytes = table[3 * seg + 2];
        const bool aligned = ((table[3 * seg] | table[3 * seg + 1]) & 15ull) == 0;
        for (unsigned long long begin = blockIdx.y * KILN_SEGMENT_CHUNK; begin < nbytes;
             begin += gridDim.y * KILN_SEGMENT_CHUNK) {
            const unsigned long long end = min(begin + KILN_SEGMENT_CHUNK, nbytes);
            // chunk starts are multiples of 16, so an aligned segment's chunks are aligned too
            const unsigned long long wide_end = aligned ? begin + (end - begin) / 16 * 16 : begin;
            const uint4* src4 = reinterpret_cast<const uint4*>(src + begin);
            uint4* dst4 = reinterpret_cast<uint4*>(dst + begin);
            for (unsigned long long i = threadIdx.x; i < (wide_end - begin) / 16; i += blockDim.x) {
                dst4[i] = src4[i];
            }
            for (unsigned long long i = wide_end + threadIdx.x; i < end; i += blockDim.x) {
                dst[i] = src[i];
            }
        }
    }
}
