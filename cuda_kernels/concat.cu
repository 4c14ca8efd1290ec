// Concat in one launch: every input copied into its slice of the output, each read through its own strides (its own
// layout: linear, or channels-last NHWC) and written through the output's. Why one kernel: a strided copy launch per
// input cost DenseNet-121 ~600 launches per inference (62 Concats of up to 25 inputs), and at batch 1 the launches,
// not the bytes, set its time.
//
// table: `count` rows of KILN_CONCAT_ROW int64s (lower_rules/movement.py, concat_table), uploaded once per binding:
//   [0] first_block, [1] blocks: the grid's blocks [first_block, first_block + blocks) copy this input
//   [2] units, [3] dst_offset: the input's size and its slice's offset in the output, in units of unit_bytes
//   [4] rank, [5] unit_bytes: the iteration dims after merging (right-aligned in the arrays below: unused leading
//       slots have extent 1 and stride 0), and the bytes one access moves: a vector of elements where the innermost
//       dim is contiguous in both tensors, else one element
//   [6, 12) shape, [12, 18) dst strides, [18, 24) src strides: the dims in the output's memory order (consecutive
//       threads write consecutive addresses), strides in units
// x0..x31: the inputs' addresses, as kernel parameters (the runner refreshes them per run; a captured CUDA graph
// replays the ones it captured, as for every other launch). Inputs past 32 go to further launches.
#define KILN_CONCAT_MAX_INPUTS 32
#define KILN_CONCAT_MAX_RANK 6
#define KILN_CONCAT_ROW 24
#define KILN_CONCAT_UNROLL 4  // units per thread in flight (loads before stores); the host sizes the grid for it

struct KilnConcatDims {
    long long shape[KILN_CONCAT_MAX_RANK];
    long long dst[KILN_CONCAT_MAX_RANK];
    long long src[KILN_CONCAT_MAX_RANK];
    int rank;
};

// Unit offsets (dst, src) of unit i. Indices stay compile-time (registers, no local memory); `first` is the outermost
// used slot, which takes what is left of i without a division. 32-bit div/mod where the unit count allows.
template <typename I>
__device__ __forceinline__ void kiln_concat_offsets(I i, const KilnConcatDims& d, long long& od, long long& os) {
    const int first = KILN_CONCAT_MAX_RANK - d.rank;
    od = 0;
    os = 0;
#pragma unroll
    for (int k = KILN_CONCAT_MAX_RANK - 1; k >= 0; --k) {
        I c = 0;
        if (k == first) {
            c = i;
        } else if (k > first) {
            const I len = (I)d.shape[k];
            c = i % len;
            i /= len;
        }
        od += (long long)c * d.dst[k];
        os += (long long)c * d.src[k];
    }
}

template <typename T, typename I>
__device__ __forceinline__ void kiln_concat_units(T* __restrict__ y, const T* __restrict__ x, long long units,
                                                  const KilnConcatDims& d, long long first, long long step) {
    for (long long base = first; base < units; base += KILN_CONCAT_UNROLL * step) {
        T v[KILN_CONCAT_UNROLL];
        long long od[KILN_CONCAT_UNROLL];
#pragma unroll
        for (int u = 0; u < KILN_CONCAT_UNROLL; ++u) {
            const long long i = base + u * step;
            if (i < units) {
                long long os;
                kiln_concat_offsets<I>((I)i, d, od[u], os);
                v[u] = x[os];
            }
        }
#pragma unroll
        for (int u = 0; u < KILN_CONCAT_UNROLL; ++u) {
            if (base + u * step < units) y[od[u]] = v[u];
        }
    }
}

template <typename T>
__device__ __forceinline__ void kiln_concat_copy(char* y, const char* x, long long units, const KilnConcatDims& d,
                                                 long long first, long long step) {
    if (units <= 0xffffffffLL) {
        kiln_concat_units<T, unsigned int>(reinterpret_cast<T*>(y), reinterpret_cast<const T*>(x), units, d, first,
                                           step);
    } else {
        kiln_concat_units<T, unsigned long long>(reinterpret_cast<T*>(y), reinterpret_cast<const T*>(x), units, d,
                                                 first, step);
    }
}

#define KILN_CONCAT_PARAMS4(a, b, c, e) const char *x##a, const char *x##b, const char *x##c, const char *x##e
#define KILN_CONCAT_PICK4(a, b, c, e)  \
    if (input == a) x = x##a;          \
    if (input == b) x = x##b;          \
    if (input == c) x = x##c;          \
    if (input == e) x = x##e;

extern "C" __global__ void __launch_bounds__(256) concat_copy(
    char* __restrict__ y, const long long* __restrict__ table, int count, int elem_bytes,
    KILN_CONCAT_PARAMS4(0, 1, 2, 3), KILN_CONCAT_PARAMS4(4, 5, 6, 7), KILN_CONCAT_PARAMS4(8, 9, 10, 11),
    KILN_CONCAT_PARAMS4(12, 13, 14, 15), KILN_CONCAT_PARAMS4(16, 17, 18, 19), KILN_CONCAT_PARAMS4(20, 21, 22, 23),
    KILN_CONCAT_PARAMS4(24, 25, 26, 27), KILN_CONCAT_PARAMS4(28, 29, 30, 31)) {
    // This block's input: the rows' first blocks ascend, so the rows starting at or before it are a prefix; each warp
    // finds it with one load per lane and a ballot.
    const int lane = threadIdx.x & 31;
    const long long start = lane < count ? table[lane * KILN_CONCAT_ROW] : 0x7fffffffffffffffLL;
    const int input = __popc(__ballot_sync(0xffffffffu, start <= (long long)blockIdx.x)) - 1;
    const char* x = x0;
    KILN_CONCAT_PICK4(0, 1, 2, 3)
    KILN_CONCAT_PICK4(4, 5, 6, 7)
    KILN_CONCAT_PICK4(8, 9, 10, 11)
    KILN_CONCAT_PICK4(12, 13, 14, 15)
    KILN_CONCAT_PICK4(16, 17, 18, 19)
    KILN_CONCAT_PICK4(20, 21, 22, 23)
    KILN_CONCAT_PICK4(24, 25, 26, 27)
    KILN_CONCAT_PICK4(28, 29, 30, 31)

    const long long* row = table + input * KILN_CONCAT_ROW;
    const long long first_block = row[0], blocks = row[1];
    long long units = row[2], offset = row[3];
    int unit = (int)row[5];
    KilnConcatDims d;
    d.rank = (int)row[4];
#pragma unroll
    for (int k = 0; k < KILN_CONCAT_MAX_RANK; ++k) {
        d.shape[k] = row[6 + k];
        d.dst[k] = row[6 + KILN_CONCAT_MAX_RANK + k];
        d.src[k] = row[6 + 2 * KILN_CONCAT_MAX_RANK + k];
    }
    // Vector units need both addresses aligned to them; the host knows only the strides (an I/O tensor's address is
    // the caller's). Otherwise move single elements: the innermost dim (stride 1 in both) grows by the vector width,
    // every other stride and the offset scale with it.
    const unsigned long long ends = (unsigned long long)(y + offset * unit) | (unsigned long long)x;
    if (unit > elem_bytes && (ends & (unsigned long long)(unit - 1)) != 0) {
        const int scale = unit / elem_bytes;
        units *= scale;
        offset *= scale;
        d.shape[KILN_CONCAT_MAX_RANK - 1] *= scale;
#pragma unroll
        for (int k = 0; k < KILN_CONCAT_MAX_RANK - 1; ++k) {
            d.dst[k] *= scale;
            d.src[k] *= scale;
        }
        unit = elem_bytes;
    }
    char* dst = y + offset * unit;
    const long long first = (blockIdx.x - first_block) * (long long)blockDim.x + threadIdx.x;
    const long long step = blocks * blockDim.x;
    switch (unit) {
        case 1: kiln_concat_copy<unsigned char>(dst, x, units, d, first, step); break;
        case 2: kiln_concat_copy<unsigned short>(dst, x, units, d, first, step); break;
        case 4: kiln_concat_copy<unsigned int>(dst, x, units, d, first, step); break;
        case 8: kiln_concat_copy<unsigned long long>(dst, x, units, d, first, step); break;
        case 16: kiln_concat_copy<uint4>(dst, x, units, d, first, step); break;
    }
}
