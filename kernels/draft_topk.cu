// draft_topk.cu — the drafter's top-k log-probabilities on the GPU, fused into one read of the logits;
// launched from kdtree_lib/draft_topk.py (backend "cupy").
//
//   v1  draft_topk_vec4/vec1: one CTA of 1024 threads per draft position. An 11-bit radix select on
//       unique (value, -id) keys histograms the row, stopping as soon as the keys at or above the
//       chosen digit fit in shared memory (usually after the first pass, which also runs the online
//       softmax); the survivors are gathered in a second read and bitonic-sorted. vec4 reads float4
//       (vocab % 4 == 0, 16-byte aligned rows), vec1 any row. Kept for k > KD_TOPK_FAST_MAX_K.
//   v3  draft_topk_fused_vec4/vec1: one launch, many CTAs per row (k <= KD_TOPK_FAST_MAX_K).
//       A CTA of 256 threads reads a slice of 1 to KD_TOPK_MAX_CHUNKS chunks of 4096 logits (16 per
//       thread per chunk, four 16-byte loads in flight), writes the slice's (max, sum exp(x - max), L),
//       and keeps a superset of the slice's top k: every logit >= L, where L is the k-th largest of
//       the 256 per-thread maxima (k distinct logits are >= L, so the slice's k largest are too). A
//       one-chunk slice keeps its logits in registers; in a longer one, a thread re-reads (L1/L2)
//       only the chunks whose maximum reaches L. When that set is larger than the slice's candidate
//       room, or L is -inf, the CTA finds its exact top k by the radix select instead. The last CTA
//       of a row to finish (a ticket per row: atomicAdd after __threadfence) merges the row: the
//       online-softmax rule over the slices' states in a fixed order, the candidates >= max L (every
//       slice's L is below the row's k-th largest logit) staged in shared memory, an 8-bit radix
//       select from the staged keys' common prefix down to <= KD_TOPK_RANKED survivors, each
//       survivor's rank counted against the others by a few threads (no sort), and the ticket reset
//       for the next launch (CUDA graph replays). (docs/kernel-notes.md: v2 -> v3 and their H200 times.)
//
// The selected values are the logits themselves, so the ids and their order are exact (ties by
// ascending id). The normaliser is this kernel's own float32 sum, which differs from torch's
// logsumexp in the last bits: draft_topk's exact paths call torch for that reason (see its docstring).
//
// Bad input is never read back on the host: v3 flags a row holding NaN (bit 1), +inf (bit 2) or
// only -inf (bit 4) in `status` (OR-ed, sticky until the host clears it) and writes that row's
// log-probabilities as NaN.
#include "common.cuh"

#define KD_TOPK_THREADS 1024
#define KD_TOPK_UNROLL 4           // loads in flight per thread
#define KD_TOPK_DIGIT_BITS 11
#define KD_TOPK_BINS (1 << KD_TOPK_DIGIT_BITS)
#define KD_TOPK_CAPACITY 4096      // survivors sorted in shared memory (>= the largest k, 1024)
#define KD_TOPK_SLICE_THREADS 256
#define KD_TOPK_SLICE_LOADS 4      // 16-byte loads per thread: a slice is 256 * 4 * 4 = 4096 logits
#define KD_TOPK_PER_THREAD (4 * KD_TOPK_SLICE_LOADS)
#define KD_TOPK_SLICE (KD_TOPK_SLICE_THREADS * KD_TOPK_PER_THREAD)
#define KD_TOPK_MAX_CHUNKS 4      // chunks of KD_TOPK_SLICE logits per v3 slice (draft_topk.slice_chunks)
#define KD_TOPK_FAST_MAX_K 128     // v3's k (the bound L is loose beyond: see the header)
#define KD_TOPK_MERGE_UNROLL 8     // candidate loads in flight per thread of the merging CTA
#define KD_TOPK_MERGE_BITS 8       // the merge's radix digit: one bin per thread of the CTA
#define KD_TOPK_MERGE_STAGED 3840  // a row's candidates staged in shared memory (30 KB)
#define KD_TOPK_MAX_SLICES 1024    // slices per row (draft_topk.TopKLaunch checks it)
#define KD_TOPK_RANKED 128         // survivors ranked by counting (>= KD_TOPK_FAST_MAX_K)
#define KD_TOPK_BAD_NAN 1u
#define KD_TOPK_BAD_POS_INF 2u
#define KD_TOPK_BAD_ALL_NEG_INF 4u

static_assert(KD_TOPK_BINS % KD_TOPK_THREADS == 0, "each thread scans whole bins");
static_assert((1 << KD_TOPK_MERGE_BITS) == KD_TOPK_SLICE_THREADS, "the merge's bins: one per thread");
static_assert(KD_TOPK_RANKED <= KD_TOPK_SLICE_THREADS && KD_TOPK_FAST_MAX_K <= KD_TOPK_RANKED, "a survivor per thread");


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
        state.sum = state.sum * exp2f((state.max - x) * kd_log2e()) + 1.0f;
        state.max = x;
    } else if (x != kd_neg_inf_f()) {
        state.sum += exp2f((x - state.max) * kd_log2e());
    }
}

__device__ __forceinline__ SoftmaxState softmax_merge(SoftmaxState a, SoftmaxState b) {
    const float max = fmaxf(a.max, b.max);
    if (max == kd_neg_inf_f()) return {max, 0.0f};
    return {max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

__device__ __forceinline__ SoftmaxState kd_shfl_xor(SoftmaxState state, int offset) {  // for kd_block_all_reduce
    return {kd_shfl_xor(state.max, offset), kd_shfl_xor(state.sum, offset)};
}

// The whole block's softmax state, returned to every thread. scratch: __shared__ SoftmaxState[32].
__device__ __forceinline__ SoftmaxState softmax_block_merge(SoftmaxState state, SoftmaxState* scratch) {
    return kd_block_all_reduce(state, [](SoftmaxState a, SoftmaxState b) { return softmax_merge(a, b); }, scratch);
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

// The radix select's shared scratch, for digits of BITS bits.
template <int BITS = KD_TOPK_DIGIT_BITS>
struct RadixScratch {
    unsigned hist[1 << BITS];
    unsigned scan[32];
    unsigned digit, count_above, count_from;
};

// Radix select over the unique keys a block visits: `source(first_pass, visit)` calls visit(key, valid)
// the same number of times in every lane. Each pass histograms the next BITS bits of the keys that share
// the prefix chosen so far and keeps the digit where the count of larger keys reaches k; it stops as
// soon as the keys >= that digit number at most `stop_at` (>= k). Returns the threshold key: exactly
// `survivors` (k <= survivors <= stop_at) visited valid keys are >= it. Needs at least k valid keys.
// `shift` < 64 starts below a prefix every valid key shares (its top 64 - shift bits, `prefix`).
template <int BITS, typename Source>
__device__ unsigned long long radix_threshold(Source source, unsigned k, unsigned stop_at, RadixScratch<BITS>& scratch,
                                              unsigned& survivors, unsigned long long prefix = 0ull, int shift = 64) {
    constexpr int kBins = 1 << BITS;
    const int t = threadIdx.x;
    const int bins_per_thread = kBins / blockDim.x;
    unsigned above = 0u;  // keys known to be larger than every key with the prefix
    for (bool first_pass = true;; first_pass = false) {
        const int bits = min(BITS, shift);
        const int low = shift - bits;
        for (int bin = t; bin < kBins; bin += blockDim.x) scratch.hist[bin] = 0u;
        __syncthreads();
        source(first_pass, [&](unsigned long long key, bool valid) {
            const bool in_prefix = valid && (shift == 64 || (key >> shift) == prefix);
            kd_warp_histogram_add(scratch.hist, in_prefix ? (int)((key >> low) & (kBins - 1)) : -1);
        });
        __syncthreads();
        // thread t owns digits top, top-1, ... (descending), so a prefix sum over threads counts
        // the keys above each digit
        const int top = kBins - 1 - t * bins_per_thread;
        unsigned mine = 0u;
        for (int j = 0; j < bins_per_thread; ++j) mine += scratch.hist[top - j];
        const unsigned before = above + kd_block_inclusive_scan(mine, scratch.scan) - mine;
        if (before < k && before + mine >= k) {
            unsigned count = before;
            for (int j = 0; j < bins_per_thread; ++j) {
                const unsigned in_bin = scratch.hist[top - j];
                if (count + in_bin >= k) {
                    scratch.digit = top - j;
                    scratch.count_above = count;
                    scratch.count_from = count + in_bin;
                    break;
                }
                count += in_bin;
            }
        }
        __syncthreads();
        prefix = (prefix << bits) | scratch.digit;
        shift = low;
        survivors = scratch.count_from;
        above = scratch.count_above;
        __syncthreads();  // the scratch is rewritten by the next pass or the next call
        if (survivors <= stop_at || shift == 0) break;
    }
    return prefix << shift;
}

// Gather the visited valid keys >= threshold (exactly `survivors` <= capacity of them) into keys[] and
// sort them descending. All threads call it.
template <typename Source>
__device__ void gather_sorted(Source source, unsigned long long threshold, unsigned survivors, unsigned long long* keys,
                              int capacity, unsigned* taken) {
    if (threadIdx.x == 0) *taken = 0u;
    __syncthreads();
    source(false, [&](unsigned long long key, bool valid) {
        const bool take = valid && key >= threshold;
        const int slot = kd_warp_append(taken, take);
        if (take && slot < capacity) keys[slot] = key;  // survivors <= capacity: the guard is for safety
    });
    int size = 1;
    while (size < (int)survivors) size <<= 1;
    __syncthreads();
    for (int j = survivors + threadIdx.x; j < size; j += blockDim.x) keys[j] = 0ull;  // below every real key
    __syncthreads();
    bitonic_sort_descending(keys, size);
}

// v1: logits [rows, vocab] float32 -> out_logp [rows, k] float32 (descending), out_ids [rows, k] int32,
// one CTA per row; the first radix pass also computes the softmax denominator.
template <int VEC>
__device__ void draft_topk_row(const float* __restrict__ logits, int vocab, int k,
                               float* __restrict__ out_logp, int* __restrict__ out_ids) {
    __shared__ RadixScratch<> s_radix;
    __shared__ unsigned long long s_keys[KD_TOPK_CAPACITY];
    __shared__ SoftmaxState s_softmax[32];
    __shared__ unsigned s_taken;

    const int t = threadIdx.x;
    const float* row = logits + (long long)blockIdx.x * vocab;
    SoftmaxState softmax = {kd_neg_inf_f(), 0.0f};
    const auto keys = [&](bool first_pass, auto visit) {
        for_each_logit<VEC>(row, vocab, [&](float x, int i, bool valid) {
            if (first_pass) softmax_push(softmax, x);  // x = -inf when not valid
            visit(topk_key(x, i), valid);
        });
    };
    unsigned survivors;
    const unsigned long long threshold = radix_threshold(keys, (unsigned)k, KD_TOPK_CAPACITY, s_radix, survivors);
    gather_sorted(keys, threshold, survivors, s_keys, KD_TOPK_CAPACITY, &s_taken);

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


// ------------------------------------------------------------------------------------------------
// v3: slices, the last CTA of each row merging it

// Bitonic sort of one float per thread across a block of KD_TOPK_SLICE_THREADS: thread t returns the
// t-th largest. Strides below a warp go through shuffles, the rest through `exchange`.
__device__ float block_sort_descending(float x, float* exchange) {
    const int t = threadIdx.x;
#pragma unroll
    for (int size = 2; size <= KD_TOPK_SLICE_THREADS; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            float other;
            if (stride >= KD_WARP_SIZE) {
                exchange[t] = x;
                __syncthreads();
                other = exchange[t ^ stride];
                __syncthreads();
            } else {
                other = __shfl_xor_sync(KD_FULL_MASK, x, stride);
            }
            const bool keep_max = ((t & stride) == 0) == ((t & size) == 0);
            x = keep_max ? fmaxf(x, other) : fminf(x, other);
        }
    }
    return x;
}

// Chunk `chunk` of a row (KD_TOPK_SLICE logits from `first`) into this thread's registers: element e
// is logit first + ((e / 4) * threads + t) * 4 + e % 4 (16-byte loads, coalesced); -inf past the end.
template <int VEC>
__device__ __forceinline__ void load_chunk(const float* __restrict__ row, int vocab, int first,
                                           float (&v)[KD_TOPK_PER_THREAD]) {
#pragma unroll
    for (int u = 0; u < KD_TOPK_SLICE_LOADS; ++u) {
        const int at = first + (u * KD_TOPK_SLICE_THREADS + (int)threadIdx.x) * 4;
        if constexpr (VEC == 4) {
            const float4 loaded = at < vocab ? __ldg(reinterpret_cast<const float4*>(row + at))
                                             : make_float4(kd_neg_inf_f(), kd_neg_inf_f(), kd_neg_inf_f(), kd_neg_inf_f());
            v[4 * u + 0] = loaded.x;
            v[4 * u + 1] = loaded.y;
            v[4 * u + 2] = loaded.z;
            v[4 * u + 3] = loaded.w;
        } else {
#pragma unroll
            for (int c = 0; c < 4; ++c) v[4 * u + c] = at + c < vocab ? __ldg(row + at + c) : kd_neg_inf_f();
        }
    }
}

__device__ __forceinline__ int chunk_id(int first, int e) {
    return first + ((e / 4) * KD_TOPK_SLICE_THREADS + (int)threadIdx.x) * 4 + e % 4;
}

// The shared memory of a v3 CTA: the slice's scratch, then (in the last CTA of a row) the merge's.
union FusedScratch {
    struct {
        RadixScratch<> radix;
        float exchange[KD_TOPK_SLICE_THREADS];
    } slice;
    struct {
        unsigned long long staged[KD_TOPK_MERGE_STAGED];
        unsigned long long ranked[KD_TOPK_RANKED];
        RadixScratch<KD_TOPK_MERGE_BITS> radix;
        int count[KD_TOPK_MAX_SLICES];  // candidates of each slice of the row
        unsigned long long keys[32];    // block reductions' scratch
        float bounds[32];
        unsigned flags;                 // the row's flags, read (and cleared) once
    } merge;
};

// The merge of one row by the last of its CTAs to finish: the softmax from the slices' states, the
// top k from their candidates (ties by ascending id), log-probabilities value - (log(sum) + max) as
// torch's logsumexp forms them. A flagged row (NaN, +inf, or only -inf) comes out as NaN and is OR-ed
// into status; row_flags[row] and row_ticket[row] are cleared for the next launch. Reads what other
// CTAs wrote through L2 (ld.cg): L1 is not coherent across CTAs.
__device__ void topk_merge_row(int row, int slices, int cap, int k, const unsigned long long* __restrict__ cand_keys,
                               const int* __restrict__ cand_count, const float4* __restrict__ states,
                               unsigned* __restrict__ row_flags, unsigned* __restrict__ row_ticket,
                               unsigned* __restrict__ status, float* __restrict__ out_logp, int* __restrict__ out_ids,
                               FusedScratch& sh, SoftmaxState* s_softmax, unsigned& s_staged, unsigned& s_taken) {
    const int t = threadIdx.x;
    SoftmaxState softmax = {kd_neg_inf_f(), 0.0f};
    float bound = kd_neg_inf_f();
    for (int s = t; s < slices; s += blockDim.x) {
        const float4 state = __ldcg(states + (long long)row * slices + s);
        softmax = softmax_merge(softmax, {state.x, state.y});
        bound = fmaxf(bound, state.z);
        sh.merge.count[s] = __ldcg(cand_count + (long long)row * slices + s);
    }
    if (t == 0) {
        s_staged = 0u;
        s_taken = 0u;
    }
    const SoftmaxState total = softmax_block_merge(softmax, s_softmax);  // synchronises: counts, s_staged
    bound = kd_block_all_reduce(bound, [](float a, float b) { return fmaxf(a, b); }, sh.merge.bounds);
    // every slice's L is at most its k-th largest logit, so at most the row's: keys below the largest
    // L are not in the row's top k (the lowest key of a value v has the id bits all 0)
    const unsigned long long floor = bound == kd_neg_inf_f() ? 0ull : topk_key(bound, -1);

    // stage the row's candidates >= floor in shared memory, every slot's load issued before any is used
    const unsigned long long* keys = cand_keys + (long long)row * slices * cap;
    const int slots = slices * cap;
    const int padded = kd_ceil_div(slots, KD_WARP_SIZE) * KD_WARP_SIZE;
    const auto slot_valid = [&](int j) { return j < slots && j % cap < sh.merge.count[j / cap]; };
    unsigned long long lo = ~0ull, hi = 0ull;  // the staged keys' range: their common prefix is skipped
    for (int first = 0; first < padded; first += KD_TOPK_MERGE_UNROLL * blockDim.x) {
        unsigned long long key[KD_TOPK_MERGE_UNROLL];
        bool take[KD_TOPK_MERGE_UNROLL];
#pragma unroll
        for (int u = 0; u < KD_TOPK_MERGE_UNROLL; ++u) {
            const int j = first + u * blockDim.x + t;
            take[u] = slot_valid(j);
            key[u] = take[u] ? __ldcg(keys + j) : 0ull;
        }
#pragma unroll
        for (int u = 0; u < KD_TOPK_MERGE_UNROLL; ++u) {
            if (first + u * (int)blockDim.x < padded) {  // block-uniform
                take[u] = take[u] && key[u] >= floor;
                const int slot = kd_warp_append(&s_staged, take[u]);
                if (take[u]) {
                    if (slot < KD_TOPK_MERGE_STAGED) sh.merge.staged[slot] = key[u];
                    lo = min(lo, key[u]);
                    hi = max(hi, key[u]);
                }
            }
        }
    }
    lo = kd_block_all_reduce(lo, [](unsigned long long a, unsigned long long b) { return min(a, b); }, sh.merge.keys);
    hi = kd_block_all_reduce(hi, [](unsigned long long a, unsigned long long b) { return max(a, b); }, sh.merge.keys);
    const unsigned staged = s_staged;  // published by the reductions' barriers

    // the keys >= threshold: every staged key when they are few, else the radix select's <= KD_TOPK_RANKED
    unsigned long long threshold = floor;
    unsigned survivors = staged;
    const int staged_padded = kd_ceil_div((int)staged, KD_WARP_SIZE) * KD_WARP_SIZE;
    const auto from_shared = [&](bool, auto visit) {
        for (int j = t; j < staged_padded; j += blockDim.x)
            visit(j < (int)staged ? sh.merge.staged[j] : 0ull, j < (int)staged);
    };
    const auto from_global = [&](bool, auto visit) {  // more candidates than shared memory holds
        for (int j = t; j < padded; j += blockDim.x) {
            const unsigned long long key = slot_valid(j) ? __ldcg(keys + j) : 0ull;
            visit(key, slot_valid(j) && key >= floor);
        }
    };
    const bool in_shared = staged <= KD_TOPK_MERGE_STAGED;
    if (staged > KD_TOPK_RANKED) {  // > k keys, unique, so lo != hi
        const int shift = 64 - __clzll((long long)(lo ^ hi));
        const unsigned long long prefix = shift == 64 ? 0ull : hi >> shift;
        threshold = in_shared ? radix_threshold(from_shared, (unsigned)k, KD_TOPK_RANKED, sh.merge.radix, survivors, prefix, shift)
                              : radix_threshold(from_global, (unsigned)k, KD_TOPK_RANKED, sh.merge.radix, survivors, prefix, shift);
    }
    const auto gather = [&](unsigned long long key, bool valid) {
        const bool take = valid && key >= threshold;
        const int slot = kd_warp_append(&s_taken, take);
        if (take) sh.merge.ranked[slot] = key;
    };
    if (in_shared) from_shared(false, gather);
    else from_global(false, gather);
    if (t == 0) sh.merge.flags = atomicExch(&row_flags[row], 0u);
    __syncthreads();

    // each survivor's rank among them (keys are unique): the top k go straight to their places
    const unsigned flags = sh.merge.flags | (total.max == kd_neg_inf_f() ? KD_TOPK_BAD_ALL_NEG_INF : 0u);
    const float log_z = logf(total.sum) + total.max;
    const long long out = (long long)row * k;
    // `per` threads (consecutive lanes) per survivor, each comparing it with every per-th other
    int per = 1;
    while (per < KD_WARP_SIZE && 2 * per * (int)survivors <= (int)blockDim.x) per <<= 1;  // block-uniform
    const int i = t / per;
    const unsigned long long mine = i < (int)survivors ? sh.merge.ranked[i] : 0ull;
    int rank = 0;
    if (i < (int)survivors) {
        for (int j = t % per; j < (int)survivors; j += per) rank += sh.merge.ranked[j] > mine;
    }
    for (int offset = per / 2; offset > 0; offset >>= 1) rank += __shfl_xor_sync(KD_FULL_MASK, rank, offset);
    if (i < (int)survivors && t % per == 0 && rank < k) {
        out_logp[out + rank] = flags ? kd_nan_f() : topk_key_value(mine) - log_z;
        out_ids[out + rank] = topk_key_id(mine);
    }
    for (int j = (int)survivors + t; j < k; j += blockDim.x) {  // fewer than k: a row of NaN (flagged)
        out_logp[out + j] = kd_nan_f();
        out_ids[out + j] = -1;
    }
    if (t == 0) {
        if (flags) atomicOr(status, flags);
        row_ticket[row] = 0u;
    }
}

// One slice (`chunks` chunks of KD_TOPK_SLICE logits) of one row: grid (slices, rows),
// KD_TOPK_SLICE_THREADS threads. The first read computes the slice's softmax state and each thread's
// maximum; L is the k-th largest of those maxima; a second read (from L1/L2) keeps every logit >= L.
// Writes the slice's state (max, sum, L), its candidates (a superset of its top k, at most `cap` >= 2k
// keys, in no order) and their count; flags NaN/+inf in row_flags[row]; then takes the row's ticket,
// and the last CTA of the row merges it (topk_merge_row).
template <int VEC>
__device__ void topk_slice(const float* __restrict__ logits, int vocab, int k, int chunks, int slices, int cap,
                           unsigned long long* __restrict__ cand_keys, int* __restrict__ cand_count,
                           float4* __restrict__ states, unsigned* __restrict__ row_flags,
                           unsigned* __restrict__ row_ticket, unsigned* __restrict__ status,
                           float* __restrict__ out_logp, int* __restrict__ out_ids) {
    __shared__ FusedScratch sh;
    __shared__ SoftmaxState s_softmax[32];
    __shared__ float s_bound;
    __shared__ unsigned s_taken, s_staged, s_last;

    const int t = threadIdx.x;
    const int slice = blockIdx.x, row = blockIdx.y;
    const float* row_logits = logits + (long long)row * vocab;
    const int base = slice * chunks * KD_TOPK_SLICE;
    // chunks holding logits; chunks <= KD_TOPK_MAX_CHUNKS (draft_topk.TopKLaunch checks it)
    const int used = min(chunks, kd_ceil_div(vocab - base, KD_TOPK_SLICE));
    const long long cell = (long long)row * slices + slice;

    // pass 1: per chunk, this thread's maximum and sum exp(x - max). NaN is ignored by fmaxf and turns
    // the sum into NaN, +inf is the maximum: both are read off the states, not tested per logit.
    float chunk_max[KD_TOPK_MAX_CHUNKS];
    SoftmaxState softmax = {kd_neg_inf_f(), 0.0f};
    bool has_nan = false;
    float v[KD_TOPK_PER_THREAD];
#pragma unroll
    for (int c = 0; c < KD_TOPK_MAX_CHUNKS; ++c) {
        chunk_max[c] = kd_neg_inf_f();
        if (c < used) {
            load_chunk<VEC>(row_logits, vocab, base + c * KD_TOPK_SLICE, v);
            float max = kd_neg_inf_f();
#pragma unroll
            for (int e = 0; e < KD_TOPK_PER_THREAD; ++e) max = fmaxf(max, v[e]);
            float sum = 0.0f;
            if (max != kd_neg_inf_f()) {
#pragma unroll
                for (int e = 0; e < KD_TOPK_PER_THREAD; ++e) sum += expf(v[e] - max);
            }
            has_nan |= sum != sum && max != -kd_neg_inf_f();
            if (max == kd_neg_inf_f()) {  // -inf or NaN only: the sum saw none of it
#pragma unroll
                for (int e = 0; e < KD_TOPK_PER_THREAD; ++e) has_nan |= v[e] != v[e];
            }
            softmax = softmax_merge(softmax, {max, sum});
            chunk_max[c] = max;
        }
    }
    const bool has_pos_inf = softmax.max == -kd_neg_inf_f();
    float thread_max = kd_neg_inf_f();
#pragma unroll
    for (int c = 0; c < KD_TOPK_MAX_CHUNKS; ++c) thread_max = fmaxf(thread_max, chunk_max[c]);
    const SoftmaxState total = softmax_block_merge(softmax, s_softmax);
    const bool any_nan = __syncthreads_or(has_nan), any_pos_inf = __syncthreads_or(has_pos_inf);
    if (t == 0) {
        if (any_nan || any_pos_inf)
            atomicOr(&row_flags[row], (any_nan ? KD_TOPK_BAD_NAN : 0u) | (any_pos_inf ? KD_TOPK_BAD_POS_INF : 0u));
        s_taken = 0u;
    }

    // L: the k-th largest per-thread maximum (k distinct logits are >= L), by a block-wide bitonic
    // sort: warp sorts ranked across the 8 warps' lists by binary searches (two barriers) measured
    // slower (H200, B=64 D=7 k=8, 4 chunks: 186 us at 6a36a18 against 151 at e2fc428; kernel-notes)
    const float ranked = block_sort_descending(thread_max, sh.slice.exchange);
    if (t == k - 1) s_bound = ranked;
    __syncthreads();
    const float bound = s_bound;
    if (t == 0) states[cell] = make_float4(total.max, total.sum, bound, 0.0f);
    unsigned long long* slots = cand_keys + cell * cap;
    unsigned count = 0u;
    bool exact = true;  // block-uniform
    if (bound != kd_neg_inf_f()) {
        // pass 2: only a chunk whose maximum reaches L holds candidates (a few threads of the block);
        // one chunk is still in registers, more are re-read from L1/L2. Candidates are rare, so each
        // takes its slot with its own shared atomic (no warp-wide step per logit).
#pragma unroll
        for (int c = 0; c < KD_TOPK_MAX_CHUNKS; ++c) {
            if (chunk_max[c] >= bound) {  // false past `used` (-inf) and for NaN
                const int first = base + c * KD_TOPK_SLICE;
                if (used > 1) load_chunk<VEC>(row_logits, vocab, first, v);
#pragma unroll
                for (int e = 0; e < KD_TOPK_PER_THREAD; ++e) {
                    if (v[e] >= bound) {  // false for NaN and, as L is finite, for -inf
                        const unsigned slot = atomicAdd(&s_taken, 1u);
                        if (slot < (unsigned)cap) slots[slot] = topk_key(v[e], chunk_id(first, e));
                    }
                }
            }
        }
        __syncthreads();
        count = s_taken;
        exact = count > (unsigned)cap;
        __syncthreads();  // every thread has read s_taken before it is reset
        if (exact && t == 0) s_taken = 0u;
    }
    if (exact) {
        // too many logits >= L (ties, or a slice of -inf): the slice's exact top k by radix select
        const auto keys = [&](bool, auto visit) {
            for (int c = 0; c < used; ++c) {
                const int first = base + c * KD_TOPK_SLICE;
                if (used > 1) load_chunk<VEC>(row_logits, vocab, first, v);
#pragma unroll
                for (int e = 0; e < KD_TOPK_PER_THREAD; ++e)
                    visit(topk_key(v[e] != v[e] ? kd_neg_inf_f() : v[e], chunk_id(first, e)), chunk_id(first, e) < vocab);
            }
        };
        const unsigned length = (unsigned)min(chunks * KD_TOPK_SLICE, vocab - base);
        const unsigned long long threshold = radix_threshold(keys, min((unsigned)k, length), (unsigned)cap, sh.slice.radix, count);
        keys(false, [&](unsigned long long key, bool valid) {
            const bool take = valid && key >= threshold;
            const int slot = kd_warp_append(&s_taken, take);
            if (take) slots[slot] = key;
        });
    }
    if (t == 0) cand_count[cell] = (int)count;

    // the row's ticket: the CTA that takes the last one sees every slice's writes (each thread fenced
    // its own before the barrier) and merges the row
    __threadfence();
    __syncthreads();
    if (t == 0) s_last = atomicAdd(&row_ticket[row], 1u) == (unsigned)(slices - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    topk_merge_row(row, slices, cap, k, cand_keys, cand_count, states, row_flags, row_ticket, status, out_logp, out_ids,
                   sh, s_softmax, s_staged, s_taken);
}

// logits [rows, vocab] float32 -> out_logp [rows, k] float32 (descending), out_ids [rows, k] int32, in one
// launch: grid (slices, rows). Scratch (the launcher's, never read by it): cand_keys [rows, slices, cap],
// cand_count [rows, slices], states [rows, slices]; row_flags and row_ticket [rows] zero before the first
// launch and left zero by each. status: OR of the flagged rows' bits (cleared by the host).
#define KD_TOPK_FUSED_PARAMS                                                                                     \
    const float *__restrict__ logits, int vocab, int k, int chunks, int slices, int cap,                        \
        unsigned long long *__restrict__ cand_keys, int *__restrict__ cand_count, float4 *__restrict__ states, \
        unsigned *__restrict__ row_flags, unsigned *__restrict__ row_ticket, unsigned *__restrict__ status,     \
        float *__restrict__ out_logp, int *__restrict__ out_ids
#define KD_TOPK_FUSED_ARGS \
    logits, vocab, k, chunks, slices, cap, cand_keys, cand_count, states, row_flags, row_ticket, status, out_logp, out_ids

extern "C" __global__ void __launch_bounds__(KD_TOPK_SLICE_THREADS, 4) draft_topk_fused_vec4(KD_TOPK_FUSED_PARAMS) {
    topk_slice<4>(KD_TOPK_FUSED_ARGS);
}

extern "C" __global__ void __launch_bounds__(KD_TOPK_SLICE_THREADS, 4) draft_topk_fused_vec1(KD_TOPK_FUSED_PARAMS) {
    topk_slice<1>(KD_TOPK_FUSED_ARGS);
}
