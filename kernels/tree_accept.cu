// tree_accept.cu — the verified tree's walk and the KV-cache compaction; launched from
// kdtree_lib/tree_accept.py. Neither needs the host: the compaction reads the walk's outputs.
//
//   v1  accept_kernel: one CTA per request; every node tests "my token is the target's token at my
//       parent" in parallel and keeps the first matching child per parent (children are numbered in
//       sibling order), then one thread follows the matches from the root (<= D steps in shared
//       memory)
//   v1  compact_cache_<unit>: one CTA per (request, layer) moves accepted node k's cache row from
//       slot lengths + path[k] to lengths + k, in 16/4/2/1-byte units, each round reading all its
//       units before writing any (a source can be another row's destination)
#include "common.cuh"

#define KD_NO_MATCH 0x7fffffff

// tokens/parents int32 [B, N], n_nodes int32 [B], posterior int32|int64 [B, N]
// -> path int32 [B, path_len] (-1 padded), n_accepted int32 [B], bonus int32 [B].
// Dynamic shared memory: 2 * N ints.
extern "C" __global__ void __launch_bounds__(128)
accept_kernel(const int* __restrict__ tokens, const int* __restrict__ parents, const int* __restrict__ n_nodes,
              const void* __restrict__ posterior, int posterior_is_int64, int capacity, int path_len,
              int* __restrict__ path, int* __restrict__ n_accepted, int* __restrict__ bonus) {
    extern __shared__ int s_shared[];
    int* s_target = s_shared;               // the target's token at each node
    int* s_match = s_shared + capacity;     // the first child (lowest index) carrying that token
    const int b = blockIdx.x, t = threadIdx.x;
    const long long base = (long long)b * capacity;
    const int count = min(max(n_nodes[b], 1), capacity);
    for (int j = t; j < capacity; j += blockDim.x) {
        s_target[j] = posterior_is_int64 ? (int)((const long long*)posterior)[base + j]
                                         : ((const int*)posterior)[base + j];
        s_match[j] = KD_NO_MATCH;
    }
    __syncthreads();
    for (int j = 1 + t; j < count; j += blockDim.x) {
        const int parent = parents[base + j];
        if (parent >= 0 && parent < j && tokens[base + j] == s_target[parent]) atomicMin(&s_match[parent], j);
    }
    __syncthreads();
    if (t == 0) {
        int* out = path + (long long)b * path_len;
        int node = 0, length = 1;
        out[0] = 0;
        while (length < path_len && s_match[node] != KD_NO_MATCH) {
            node = s_match[node];
            out[length++] = node;
        }
        n_accepted[b] = length;
        bonus[b] = s_target[node];
        for (int k = length; k < path_len; ++k) out[k] = -1;
    }
}

#define KD_COMPACT_THREADS 128
#define KD_COMPACT_UNITS_PER_THREAD 8

// One (request, layer): rows k = 1 .. n_accepted-1 move from slot L + path[k] to slot L + k.
// A source can be another row's destination (path[k] = k' > k), so each round reads all its
// units into registers before any thread writes. Rounds go in increasing k, and a later round
// never reads what an earlier one wrote: its sources are L + path[k'] >= L + k' > every earlier
// destination (and a row with path[k] = k is skipped).
template <typename Unit>
__device__ void compact_rows(const unsigned long long* __restrict__ layers, long long slots, int row_units,
                             const int* __restrict__ path, int path_len, const int* __restrict__ n_accepted,
                             const void* __restrict__ lengths, int lengths_is_int64, void* __restrict__ new_lengths) {
    __shared__ int s_source[64];  // path_len <= D + 1 <= 33
    const int b = blockIdx.x, layer = blockIdx.y, t = threadIdx.x;
    const long long length = lengths_is_int64 ? ((const long long*)lengths)[b] : ((const int*)lengths)[b];
    const int accepted = min(max(n_accepted[b], 1), path_len);
    if (layer == 0 && t == 0) {
        if (lengths_is_int64) ((long long*)new_lengths)[b] = length + accepted;
        else ((int*)new_lengths)[b] = (int)(length + accepted);
    }
    for (int k = t; k < accepted; k += blockDim.x) s_source[k] = path[(long long)b * path_len + k];
    __syncthreads();
    Unit* cache = reinterpret_cast<Unit*>(layers[layer]) + (long long)b * slots * row_units;
    const int total = (accepted - 1) * row_units;  // units of rows 1 .. accepted-1
    constexpr int round_units = KD_COMPACT_THREADS * KD_COMPACT_UNITS_PER_THREAD;
    for (int first = 0; first < total; first += round_units) {
        Unit held[KD_COMPACT_UNITS_PER_THREAD];
#pragma unroll
        for (int u = 0; u < KD_COMPACT_UNITS_PER_THREAD; ++u) {
            const int e = first + u * KD_COMPACT_THREADS + t;
            if (e < total) {
                const int k = 1 + e / row_units, column = e - (k - 1) * row_units;
                const long long source = length + s_source[k];
                if (source != length + k && source < slots && length + k < slots)
                    held[u] = cache[source * row_units + column];
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < KD_COMPACT_UNITS_PER_THREAD; ++u) {
            const int e = first + u * KD_COMPACT_THREADS + t;
            if (e < total) {
                const int k = 1 + e / row_units, column = e - (k - 1) * row_units;
                const long long source = length + s_source[k], destination = length + k;
                if (source != destination && source < slots && destination < slots)
                    cache[destination * row_units + column] = held[u];
            }
        }
        __syncthreads();
    }
}

// layers: uint64 [n_layers] device pointers of the per-layer caches [B, slots, row_units units];
// grid (B, n_layers), block KD_COMPACT_THREADS. lengths int32|int64 [B]; new_lengths the same dtype.
#define KD_COMPACT_KERNEL(NAME, UNIT)                                                                      \
    extern "C" __global__ void __launch_bounds__(KD_COMPACT_THREADS)                                        \
    NAME(const unsigned long long* __restrict__ layers, long long slots, int row_units,                     \
         const int* __restrict__ path, int path_len, const int* __restrict__ n_accepted,                    \
         const void* __restrict__ lengths, int lengths_is_int64, void* __restrict__ new_lengths) {          \
        compact_rows<UNIT>(layers, slots, row_units, path, path_len, n_accepted, lengths, lengths_is_int64, \
                           new_lengths);                                                                    \
    }

KD_COMPACT_KERNEL(compact_cache_16, uint4)
KD_COMPACT_KERNEL(compact_cache_4, unsigned int)
KD_COMPACT_KERNEL(compact_cache_2, unsigned short)
KD_COMPACT_KERNEL(compact_cache_1, unsigned char)
