// The paged KV cache of a decoder (engine_core/generate/device_kv.py) and the engine's dense past / present tensors:
// every layer's keys and values in one launch each way. kv_layout.py's gather_reference and scatter_reference are
// the same in numpy (the CPU tests' contract).
//
// Pool: `keys` and `values`, each [blocks, layers, heads, block_tokens, row] words. Engine side: one tensor per
// (layer, part) (part 0 keys, 1 values), slice `layer * 2 + part` at `slice_words * (layer * 2 + part)` words from
// the base, each [batch, heads, rows, row] (rows = past for past_key_values, past + new for present).
// `tables` [batch, max_blocks] int32: row b's blocks in token order; `lengths` [batch]: its cached tokens;
// `counts` [batch]: its new tokens to keep (0 for a pad row).
// A word is the widest of 16, 8, 4, 2, 1 bytes dividing a row of head_dim elements (the host picks it), so the
// copies move 16 bytes a thread for fp16 / fp32 heads of 8 or more elements.
// Grid: x over (layer, part, b, head), one block each (no divisions to find them per word); threads stride over the
// tensor's rows x row words.

template <typename W>
__device__ __forceinline__ void kv_gather(W* __restrict__ past, const W* __restrict__ keys,
                                          const W* __restrict__ values, const int* __restrict__ tables,
                                          const int* __restrict__ lengths, int layers, int batch, int heads,
                                          int past_len, int row, int block_tokens, int max_blocks,
                                          long long slice_words) {
    const int h = blockIdx.x % heads;
    const int b = (blockIdx.x / heads) % batch;
    const int slice = blockIdx.x / (heads * batch);  // layer * 2 + part
    const int layer = slice >> 1;
    const W* pool = (slice & 1) ? values : keys;
    const int pad = past_len - lengths[b];
    const int* table = tables + (long long)b * max_blocks;
    W* out = past + slice * slice_words + ((long long)b * heads + h) * past_len * row;
    const int words = past_len * row;
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        const int p = i / row;
        const int j = p - pad;  // the sequence's token at this row (left padding before its first)
        W value{};
        if (j >= 0) {
            const long long block = table[j / block_tokens];
            value = pool[(((block * layers + layer) * heads + h) * block_tokens + j % block_tokens) * row + (i - p * row)];
        }
        out[i] = value;
    }
}

template <typename W>
__device__ __forceinline__ void kv_scatter(W* __restrict__ keys, W* __restrict__ values,
                                           const W* __restrict__ present, const int* __restrict__ tables,
                                           const int* __restrict__ lengths, const int* __restrict__ counts,
                                           int layers, int batch, int heads, int past_len, int new_len, int row,
                                           int block_tokens, int max_blocks, long long slice_words) {
    const int h = blockIdx.x % heads;
    const int b = (blockIdx.x / heads) % batch;
    const int slice = blockIdx.x / (heads * batch);
    const int layer = slice >> 1;
    W* pool = (slice & 1) ? values : keys;
    const int start = lengths[b];
    const int* table = tables + (long long)b * max_blocks;
    const W* in = present + slice * slice_words + (((long long)b * heads + h) * (past_len + new_len) + past_len) * row;
    const int words = counts[b] * row;  // only the real new tokens: a pad row writes nothing
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
        const int j = i / row;
        const int token = start + j;
        const long long block = table[token / block_tokens];
        pool[(((block * layers + layer) * heads + h) * block_tokens + token % block_tokens) * row + (i - j * row)] = in[i];
    }
}

#define KILN_KV_CACHE(W, NAME)                                                                                      \
    extern "C" __global__ void kv_gather_##NAME(W* past, const W* keys, const W* values, const int* tables,         \
                                                const int* lengths, int layers, int batch, int heads, int past_len, \
                                                int row, int block_tokens, int max_blocks, long long slice_words) { \
        kv_gather(past, keys, values, tables, lengths, layers, batch, heads, past_len, row, block_tokens,           \
                  max_blocks, slice_words);                                                                         \
    }                                                                                                               \
    extern "C" __global__ void kv_scatter_##NAME(W* keys, W* values, const W* present, const int* tables,          \
                                                 const int* lengths, const int* counts, int layers, int batch,      \
                                                 int heads, int past_len, int new_len, int row, int block_tokens,   \
                                                 int max_blocks, long long slice_words) {                           \
        kv_scatter(keys, values, present, tables, lengths, counts, layers, batch, heads, past_len, new_len, row,    \
                   block_tokens, max_blocks, slice_words);                                                          \
    }

KILN_KV_CACHE(unsigned char, w1)
KILN_KV_CACHE(unsigned short, w2)
KILN_KV_CACHE(unsigned int, w4)
KILN_KV_CACHE(unsigned long long, w8)
KILN_KV_CACHE(uint4, w16)
