// draft_topk.cu — the drafter's top-k log-probabilities on the GPU, fused into one read of the logits;
// launched from kdtree_lib/draft_topk.py (backend "cupy").
//
//   v1  draft_topk_vec4/vec1: one CTA of 1024 threads per draft position. An 11-bit radix select on
//       unique (value, -id) keys histograms the row, stopping as soon as the keys at or above the
//       chosen digit fit in shared memory (usually after the first pass, which also runs the online
//       softmax); the survivors are gathered in a second read and bitonic-sorted. vec4 reads float4
//       (vocab % 4 == 0, 16-byte aligned rows), vec1 any row.
//
// The selected values are the logits themselves, so the ids and their order are exact (ties by
// ascending id). The normaliser is this kernel's own float32 sum, which differs from torch's
// logsumexp in the last bits: draft_topk's exact paths call torch for that reason (see its docstring).
#include "common.cuh"

#define KD_TOPK_THREADS 1024
#define KD_TOPK_UNROLL 4           // loads in flight per thread
#define KD_TOPK_DIGIT_BITS 11
#define KD_TOPK_BINS (1 << KD_TOPK_DIGIT_BITS)
#define KD_TOPK_CAPACITY 4096      // survivors sorted in shared memory (>= the largest k, 1024)

static_assert(KD_TOPK_BINS % KD_TOPK_THREADS == 0, "each thread scans whole bins");


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

#define KD_LOG2_E 1.4426950408889634f

// Running max and sum of exp(x - max) (online softmax); -inf entries carry no mass.
struct SoftmaxState {
    float max;
    float sum;
};

__device__ __forceinline__ void softmax_push(SoftmaxState& state, float x) {
    if (x > state.max) {
        state.sum = state.sum * exp2f((state.max - x) * KD_LOG2_E) + 1.0f;
        state.max = x;
    } else if (x != kd_neg_inf_f()) {
        state.sum += exp2f((x - state.max) * KD_LOG2_E);
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

// Visit every element of a logits row as (value, index, valid), VEC floats per load and
// KD_TOPK_UNROLL loads in flight per thread; every lane of a warp makes the same number of calls
// (invalid ones past the end), as the warp-wide helpers in `visit` require.
template <int VEC, typename Visit>  // VEC: 4 or 1
__device__ __forceinline__ void for_each_logit(const float* __restrict__ row, int vocab, Visit visit) {
    const int vectors = vocab / VEC;  // VEC divides vocab
    const int padded = kd_ceil_div(vectors, KD_WARP_SIZE) * KD_WARP_SIZE;
    for (int first = threadIdx.x; first < padded; first += KD_TOPK_UNROLL * blockDim.x) {
        float values[KD_TOPK_UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < KD_TOPK_UNROLL; ++u) {
            const int q = first + u * blockDim.x;
            if constexpr (VEC == 4) {
                const float4 loaded = q < vectors ? reinterpret_cast<const float4*>(row)[q]
                                                  : make_float4(kd_neg_inf_f(), kd_neg_inf_f(), kd_neg_inf_f(), kd_neg_inf_f());
                values[u][0] = loaded.x;
                values[u][1] = loaded.y;
                values[u][2] = loaded.z;
                values[u][3] = loaded.w;
            } else {
                values[u][0] = q < vectors ? row[q] : kd_neg_inf_f();
            }
        }
#pragma unroll
        for (int u = 0; u < KD_TOPK_UNROLL; ++u) {
            const int q = first + u * blockDim.x;
            if (q < padded) {  // warp-uniform
#pragma unroll
                for (int c = 0; c < VEC; ++c) visit(values[u][c], q * VEC + c, q < vectors);
            }
        }
    }
}

// logits [rows, vocab] float32 -> out_logp [rows, k] float32 (descending), out_ids [rows, k] int32.
// Radix select: each pass histograms the next 11 bits of the keys that share the prefix chosen so
// far and keeps the digit where the count of larger keys reaches k; it stops as soon as the keys
// >= that digit fit in shared memory (usually after the first pass, which also computes the
// softmax denominator). Keys are unique, so the survivors are exactly determined.
template <int VEC>
__device__ void draft_topk_row(const float* __restrict__ logits, int vocab, int k,
                               float* __restrict__ out_logp, int* __restrict__ out_ids) {
    __shared__ unsigned s_hist[KD_TOPK_BINS];
    __shared__ unsigned long long s_keys[KD_TOPK_CAPACITY];
    __shared__ unsigned s_scan[32];
    __shared__ SoftmaxState s_softmax[32];
    __shared__ unsigned s_digit, s_count_above, s_count_from;
    __shared__ unsigned s_taken;

    const int t = threadIdx.x;
    const float* row = logits + (long long)blockIdx.x * vocab;
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
        for_each_logit<VEC>(row, vocab, [&](float x, int i, bool valid) {
            if (first_pass) softmax_push(softmax, x);  // x = -inf when not valid
            const unsigned long long key = topk_key(x, i);
            const bool in_prefix = valid && (shift == 64 || (key >> shift) == prefix);
            kd_warp_histogram_add(s_hist, in_prefix ? (int)((key >> low) & (KD_TOPK_BINS - 1)) : -1);
        });
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
    for_each_logit<VEC>(row, vocab, [&](float x, int i, bool valid) {
        const unsigned long long key = topk_key(x, i);
        const bool take = valid && key >= threshold;
        const int slot = kd_warp_append(&s_taken, take);
        if (take) s_keys[slot] = key;
    });
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

// draft_topk_vec4 needs vocab % 4 == 0 and 16-byte aligned rows; draft_topk_vec1 takes any row.
extern "C" __global__ void __launch_bounds__(KD_TOPK_THREADS)
draft_topk_vec4(const float* __restrict__ logits, int vocab, int k, float* __restrict__ out_logp,
                int* __restrict__ out_ids) {
    draft_topk_row<4>(logits, vocab, k, out_logp, out_ids);
}

extern "C" __global__ void __launch_bounds__(KD_TOPK_THREADS)
draft_topk_vec1(const float* __restrict__ logits, int vocab, int k, float* __restrict__ out_logp,
                int* __restrict__ out_ids) {
    draft_topk_row<1>(logits, vocab, k, out_logp, out_ids);
}
