// tree_build.cu — DDTree's draft tree on the GPU (issue 3); launched from kdtree_lib/tree_build.py.
//
//   draft_topk_kernel   one CTA per draft position: log-softmax and the top-k of a logits row
//                       (radix select on (value, -id) keys, then a bitonic sort of the survivors)
//   build_tree_kernel   one CTA per request: DESIGN.md §3's best-first heap, bit-identical to the
//                       NumPy reference (same pops, same order, ties included), then the derived
//                       arrays (children lists, ancestor mask) in parallel
//
// build_tree_kernel, v1 (this file): the heap is replaced by "one pending entry per popped node".
// Every pop of a child of node p pushes p's next child (the sibling) and the new node's first
// child, so the live heap entries are exactly {next child of p : p popped}: thread p holds node
// p's pending entry in registers, and a pop is a block-wide argmax (warp shuffles, one
// __syncthreads). Ties on the weight compare rank tuples by walking the popped nodes' parents in
// shared memory (at most D steps), which is what Python's tuple comparison does.
#include "common.cuh"

#define KD_MAX_NODES 1025          // budget <= 1024 pops plus the root
#define KD_TOPK_THREADS 512
#define KD_TOPK_DIGIT_BITS 11
#define KD_TOPK_BINS (1 << KD_TOPK_DIGIT_BITS)
#define KD_TOPK_CAPACITY 4096      // survivors sorted in shared memory (>= the largest k, 1024)

static_assert(KD_TOPK_BINS % KD_TOPK_THREADS == 0, "each thread scans whole bins");

// ---------------------------------------------------------------------------------------------
// draft top-k

// A 64-bit key that orders (larger value first, then smaller id first) as an unsigned integer:
// the float's order-preserving bits above the complemented id. -0.0 counts as +0.0.
__device__ __forceinline__ unsigned long long topk_key(float value, int id) {
    const unsigned bits = __float_as_uint(value == 0.0f ? 0.0f : value);
    const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (unsigned)(~(unsigned)id);
}

__device__ __forceinline__ float topk_key_value(unsigned long long key) {
    const unsigned ordered = (unsigned)(key >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered);
}

__device__ __forceinline__ int topk_key_id(unsigned long long key) { return (int)(~(unsigned)key); }

// Running max and sum of exp(x - max) (online softmax); -inf entries carry no mass.
struct SoftmaxState {
    float max;
    float sum;
};

__device__ __forceinline__ void softmax_push(SoftmaxState& state, float x) {
    if (x > state.max) {
        state.sum = state.sum * expf(state.max - x) + 1.0f;
        state.max = x;
    } else if (x != kd_neg_inf_f()) {
        state.sum += expf(x - state.max);
    }
}

__device__ __forceinline__ SoftmaxState softmax_merge(SoftmaxState a, SoftmaxState b) {
    const float max = fmaxf(a.max, b.max);
    if (max == kd_neg_inf_f()) return {max, 0.0f};
    return {max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

// The whole block's softmax state, returned to every thread. scratch: __shared__ SoftmaxState[32].
__device__ SoftmaxState softmax_block_merge(SoftmaxState state, SoftmaxState* scratch) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const SoftmaxState other = {__shfl_xor_sync(KD_FULL_MASK, state.max, offset),
                                    __shfl_xor_sync(KD_FULL_MASK, state.sum, offset)};
        state = softmax_merge(state, other);
    }
    if (kd_lane() == 0) scratch[kd_warp()] = state;
    __syncthreads();
    SoftmaxState total = scratch[0];
    for (int w = 1; w < (int)(blockDim.x / KD_WARP_SIZE); ++w) total = softmax_merge(total, scratch[w]);
    return total;
}

// Sort keys[0, size) in descending order; size a power of two. All threads call it.
__device__ void bitonic_sort_descending(unsigned long long* keys, int size) {
    for (int span = 2; span <= size; span <<= 1) {
        for (int stride = span >> 1; stride > 0; stride >>= 1) {
            for (int pair = threadIdx.x; pair < size / 2; pair += blockDim.x) {
                const int lo = 2 * pair - (pair & (stride - 1));
                const int hi = lo + stride;
                const bool descending = (lo & span) == 0;
                const unsigned long long a = keys[lo], b = keys[hi];
                if ((a < b) == descending) {
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
            __syncthreads();
        }
    }
}

// logits [rows, vocab] float32 -> out_logp [rows, k] float32 (descending), out_ids [rows, k] int32.
// Radix select: each pass histograms the next 11 bits of the keys that share the prefix chosen so
// far and keeps the digit where the count of larger keys reaches k; it stops as soon as the keys
// >= that digit fit in shared memory (usually after the first pass, which also computes the
// softmax denominator). Keys are unique, so the survivors are exactly determined.
extern "C" __global__ void __launch_bounds__(KD_TOPK_THREADS)
draft_topk_kernel(const float* __restrict__ logits, int vocab, int k,
                  float* __restrict__ out_logp, int* __restrict__ out_ids) {
    __shared__ unsigned s_hist[KD_TOPK_BINS];
    __shared__ unsigned long long s_keys[KD_TOPK_CAPACITY];
    __shared__ unsigned s_scan[32];
    __shared__ SoftmaxState s_softmax[32];
    __shared__ unsigned s_digit, s_count_above, s_count_from;
    __shared__ unsigned s_taken;

    const int t = threadIdx.x;
    const float* row = logits + (long long)blockIdx.x * vocab;
    const int padded = kd_ceil_div(vocab, KD_WARP_SIZE) * KD_WARP_SIZE;  // whole warps in every loop
    constexpr int bins_per_thread = KD_TOPK_BINS / KD_TOPK_THREADS;

    SoftmaxState softmax = {kd_neg_inf_f(), 0.0f};
    unsigned long long prefix = 0ull;  // the digits chosen so far
    int shift = 64;                    // the key bits below the prefix
    unsigned above = 0u;               // keys known to be larger than every key with the prefix
    unsigned survivors = 0u;
    for (bool first_pass = true;; first_pass = false) {
        const int bits = min(KD_TOPK_DIGIT_BITS, shift);
        const int low = shift - bits;
        for (int bin = t; bin < KD_TOPK_BINS; bin += blockDim.x) s_hist[bin] = 0u;
        __syncthreads();
        for (int i = t; i < padded; i += blockDim.x) {
            const bool valid = i < vocab;
            const float x = valid ? row[i] : kd_neg_inf_f();
            if (first_pass) softmax_push(softmax, x);
            const unsigned long long key = topk_key(x, i);
            const bool in_prefix = valid && (shift == 64 || (key >> shift) == prefix);
            kd_warp_histogram_add(s_hist, in_prefix ? (int)((key >> low) & (KD_TOPK_BINS - 1)) : -1);
        }
        __syncthreads();
        // thread t owns digits top, top-1, ... (descending), so a prefix sum over threads counts
        // the keys above each digit
        const int top = KD_TOPK_BINS - 1 - t * bins_per_thread;
        unsigned mine = 0u;
        for (int j = 0; j < bins_per_thread; ++j) mine += s_hist[top - j];
        const unsigned before = above + kd_block_inclusive_scan(mine, s_scan) - mine;
        if (before < (unsigned)k && before + mine >= (unsigned)k) {
            unsigned count = before;
            for (int j = 0; j < bins_per_thread; ++j) {
                const unsigned in_bin = s_hist[top - j];
                if (count + in_bin >= (unsigned)k) {
                    s_digit = top - j;
                    s_count_above = count;
                    s_count_from = count + in_bin;
                    break;
                }
                count += in_bin;
            }
        }
        __syncthreads();
        prefix = (prefix << bits) | s_digit;
        shift = low;
        survivors = s_count_from;
        if (survivors <= KD_TOPK_CAPACITY || shift == 0) break;
        above = s_count_above;
    }
    const unsigned long long threshold = prefix << shift;

    // gather the survivors (keys >= threshold: exactly `survivors` of them) and sort them
    if (t == 0) s_taken = 0u;
    __syncthreads();
    for (int i = t; i < padded; i += blockDim.x) {
        const bool valid = i < vocab;
        const unsigned long long key = topk_key(valid ? row[i] : 0.0f, i);
        const bool take = valid && key >= threshold;
        const int slot = kd_warp_append(&s_taken, take);
        if (take) s_keys[slot] = key;
    }
    int size = 1;
    while (size < (int)survivors) size <<= 1;
    __syncthreads();
    for (int j = survivors + t; j < size; j += blockDim.x) s_keys[j] = 0ull;  // below every real key
    __syncthreads();
    bitonic_sort_descending(s_keys, size);

    const SoftmaxState total = softmax_block_merge(softmax, s_softmax);
    const float log_sum = logf(total.sum);
    const long long out = (long long)blockIdx.x * k;
    for (int j = t; j < k; j += blockDim.x) {
        const unsigned long long key = s_keys[j];
        out_logp[out + j] = (topk_key_value(key) - total.max) - log_sum;
        out_ids[out + j] = topk_key_id(key);
    }
}

// ---------------------------------------------------------------------------------------------
// tree build

// A pending heap entry is identified by (slot, rank, depth): the next child of popped node `slot`,
// with that rank at that depth. Packed in one int for the shuffles: 10 + 10 + 6 bits.
__device__ __forceinline__ int entry_code(int slot, int rank, int depth) { return slot | (rank << 10) | (depth << 20); }
__device__ __forceinline__ int entry_slot(int code) { return code & 1023; }
__device__ __forceinline__ int entry_rank(int code) { return (code >> 10) & 1023; }
__device__ __forceinline__ int entry_depth(int code) { return code >> 20; }

// Whether entry a's rank tuple sorts before entry b's (Python tuple order, a proper prefix first;
// two pending entries never are prefixes of each other). Climbs the popped ancestors.
__device__ bool rank_tuple_less(int a, int b, const int* s_parent, const int* s_rank) {
    int node_a = entry_slot(a), rank_a = entry_rank(a), depth_a = entry_depth(a);
    int node_b = entry_slot(b), rank_b = entry_rank(b), depth_b = entry_depth(b);
    for (; depth_a > depth_b; --depth_a) {
        rank_a = s_rank[node_a];
        node_a = s_parent[node_a];
    }
    for (; depth_b > depth_a; --depth_b) {
        rank_b = s_rank[node_b];
        node_b = s_parent[node_b];
    }
    while (node_a != node_b) {
        rank_a = s_rank[node_a];
        node_a = s_parent[node_a];
        rank_b = s_rank[node_b];
        node_b = s_parent[node_b];
    }
    return rank_a < rank_b;
}

// The heap order: larger log-weight first (key = -log w), then the smaller rank tuple.
__device__ __forceinline__ bool pops_first(double weight_a, int code_a, double weight_b, int code_b,
                                           const int* s_parent, const int* s_rank) {
    if (weight_a != weight_b) return weight_a > weight_b;
    if (weight_a == kd_neg_inf_d()) return false;  // both empty
    return rank_tuple_less(code_a, code_b, s_parent, s_rank);
}

struct TreeScratch {
    int parent[KD_MAX_NODES];
    int rank[KD_MAX_NODES];
    int depth[KD_MAX_NODES];
    int first_child[KD_MAX_NODES];
    int next_sibling[KD_MAX_NODES];
    double log_weight[KD_MAX_NODES];
    float head[32];              // logp[b, d, 0]: the first child's log-probability at each depth
    double warp_weight[2][32];   // per-warp winners, double-buffered by pop parity
    int warp_code[2][32];
    int n_nodes;
};

// Best-first pops of one request (all threads call; returns the node count, root included).
// Thread t owns slot t: the pending next child of node t (weight -inf when there is none).
__device__ int best_first_pops(const float* __restrict__ lp, int depth_limit, int topk, int budget, TreeScratch& s) {
    const int t = threadIdx.x, lane = kd_lane(), warp = kd_warp();
    double weight = kd_neg_inf_d();
    int depth = 0, rank = 0, last_child = -1;
    float current = 0.0f, next = kd_neg_inf_f();  // logp of this entry and of its next sibling
    const float* row = lp;                          // logp[b, depth - 1, :]
    if (t == 0 && s.head[0] != kd_neg_inf_f()) {
        weight = (double)s.head[0];
        depth = 1;
        current = s.head[0];
        next = topk > 1 ? row[1] : kd_neg_inf_f();
    }
    int n_nodes = 1;
    for (int i = 1; i <= budget; ++i) {  // pop i creates node i
        const int parity = i & 1;
        const int live_warps = kd_ceil_div(i, KD_WARP_SIZE);  // only slots < i can hold entries
        double best = weight;
        int code = entry_code(t, rank, depth);
        if (warp < live_warps) {
            const int live_lanes = min(KD_WARP_SIZE, i - warp * KD_WARP_SIZE);
            for (int offset = 1; offset < live_lanes; offset <<= 1) {
                const double other = __shfl_down_sync(KD_FULL_MASK, best, offset);
                const int other_code = __shfl_down_sync(KD_FULL_MASK, code, offset);
                if (pops_first(other, other_code, best, code, s.parent, s.rank)) {
                    best = other;
                    code = other_code;
                }
            }
            if (lane == 0) {
                s.warp_weight[parity][warp] = best;
                s.warp_code[parity][warp] = code;
            }
        }
        __syncthreads();
        best = lane < live_warps ? s.warp_weight[parity][lane] : kd_neg_inf_d();
        code = lane < live_warps ? s.warp_code[parity][lane] : 0;
        for (int offset = 1; offset < live_warps; offset <<= 1) {
            const double other = __shfl_down_sync(KD_FULL_MASK, best, offset);
            const int other_code = __shfl_down_sync(KD_FULL_MASK, code, offset);
            if (pops_first(other, other_code, best, code, s.parent, s.rank)) {
                best = other;
                code = other_code;
            }
        }
        best = __shfl_sync(KD_FULL_MASK, best, 0);
        code = __shfl_sync(KD_FULL_MASK, code, 0);
        if (best == kd_neg_inf_d()) break;  // heap empty (the same decision in every thread)

        const int parent = entry_slot(code), popped_rank = entry_rank(code), popped_depth = entry_depth(code);
        n_nodes = i + 1;
        if (t == parent) {  // link node i under its parent, then push the parent's next child
            if (last_child < 0) s.first_child[parent] = i;
            else s.next_sibling[last_child] = i;
            last_child = i;
            if (next != kd_neg_inf_f()) {
                weight = (weight - (double)current) + (double)next;  // the reference's order
                ++rank;
                current = next;
                next = rank + 1 < topk ? row[rank + 1] : kd_neg_inf_f();
            } else {
                weight = kd_neg_inf_d();
            }
        }
        // node i is recorded by its own slot's thread, so lanes of its warp see it after the
        // __syncwarp below and other warps after the next pop's __syncthreads
        if (t == (i < (int)blockDim.x ? i : 0)) {
            s.parent[i] = parent;
            s.rank[i] = popped_rank;
            s.depth[i] = popped_depth;
            s.log_weight[i] = best;
        }
        if (t == i && i < budget && popped_depth < depth_limit && s.head[popped_depth] != kd_neg_inf_f()) {
            row = lp + (long long)popped_depth * topk;  // push node i's first child
            weight = best + (double)s.head[popped_depth];
            depth = popped_depth + 1;
            rank = 0;
            current = s.head[popped_depth];
            next = topk > 1 ? row[1] : kd_neg_inf_f();
        }
        __syncwarp();
    }
    return n_nodes;
}

// The DFlash chain: node d is the argmax token of position d (one thread; at most 32 nodes).
__device__ int chain_pops(int depth_limit, int budget, TreeScratch& s) {
    double weight = 0.0;
    int n_nodes = 1;
    for (int d = 1; d <= min(budget, depth_limit); ++d) {
        const float lp = s.head[d - 1];
        if (lp == kd_neg_inf_f()) break;
        weight += (double)lp;
        s.parent[d] = d - 1;
        s.rank[d] = 0;
        s.depth[d] = d;
        s.log_weight[d] = weight;
        s.first_child[d - 1] = d;
        n_nodes = d + 1;
    }
    return n_nodes;
}

// logp float32 [B, D, K], ids int32 [B, D, K], root int32|int64 [B] -> the Tree of DESIGN.md §3 at
// capacity N (every output element is written). blockDim.x: 32..1024, at least budget in "tree" mode.
extern "C" __global__ void __launch_bounds__(1024)
build_tree_kernel(const float* __restrict__ logp, const int* __restrict__ ids, const void* __restrict__ root,
                  int root_is_int64, int depth_limit, int topk, int budget, int capacity, int chain_mode,
                  int* __restrict__ tokens, int* __restrict__ parents, int* __restrict__ depths,
                  int* __restrict__ n_nodes, unsigned* __restrict__ mask, int* __restrict__ first_child,
                  int* __restrict__ next_sibling, double* __restrict__ log_weights) {
    __shared__ TreeScratch s;
    const int b = blockIdx.x, t = threadIdx.x;
    const long long draft_base = (long long)b * depth_limit * topk;
    const float* lp = logp + draft_base;
    for (int j = t; j < capacity; j += blockDim.x) {
        s.parent[j] = -1;
        s.rank[j] = 0;
        s.depth[j] = 0;
        s.first_child[j] = -1;
        s.next_sibling[j] = -1;
        s.log_weight[j] = j == 0 ? 0.0 : kd_neg_inf_d();
    }
    if (t < depth_limit) s.head[t] = lp[(long long)t * topk];
    __syncthreads();
    if (chain_mode) {
        if (t == 0) s.n_nodes = chain_pops(depth_limit, budget, s);
    } else {
        const int count = best_first_pops(lp, depth_limit, topk, budget, s);
        if (t == 0) s.n_nodes = count;
    }
    __syncthreads();

    const int count = s.n_nodes;
    const long long base = (long long)b * capacity;
    for (int j = t; j < capacity; j += blockDim.x) {
        int token = 0;
        if (j == 0) token = root_is_int64 ? (int)((const long long*)root)[b] : ((const int*)root)[b];
        else if (j < count) token = ids[draft_base + (long long)(s.depth[j] - 1) * topk + s.rank[j]];
        tokens[base + j] = token;
        parents[base + j] = s.parent[j];
        depths[base + j] = s.depth[j];
        first_child[base + j] = s.first_child[j];
        next_sibling[base + j] = s.next_sibling[j];
        log_weights[base + j] = s.log_weight[j];
    }
    if (t == 0) n_nodes[b] = count;
    // mask word w of row j: the bits of j's ancestors (and j) in [32w, 32w + 32); padding rows
    // have parent -1, so they hold their own bit only
    const int words = kd_ceil_div(capacity, 32);
    for (int e = t; e < capacity * words; e += blockDim.x) {
        const int j = e / words, lo = (e - j * words) * 32;
        unsigned bits = 0u;
        for (int a = j; a >= lo; a = s.parent[a]) {
            if (a < lo + 32) bits |= 1u << (a - lo);
        }
        mask[base * words + e] = bits;
    }
}
