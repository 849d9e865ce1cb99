// tree_build.cu — DDTree's draft tree on the GPU; launched from kdtree_lib/tree_build.py.
//
// One CTA per request: docs/DESIGN.md §3's best-first heap, bit-identical to the NumPy reference (same
// pops, same order, ties included), then the derived arrays (children lists, ancestor mask) in
// parallel. The heap is replaced by "one pending entry per popped node": every pop of a child of
// node p pushes p's next child (the sibling) and the new node's first child, so the live heap entries
// are exactly {next child of p : p popped}, one slot per popped node, and a pop is an argmax over the
// slots (larger log w first; equal weights compare rank tuples by climbing the popped nodes' parents
// in shared memory, which is what Python's tuple comparison does).
//
//   v1  slots in registers, 2 per thread, ceil(budget / 2) threads; a pop is a block-wide argmax (two
//       REDUX per warp, one __syncthreads past budget 64) that reads the draft for the pushed entries.
//       Removed: v2 was faster at all 64 configurations of the last run that timed both (commit
//       9ac49f2); data/results/tree_build.csv keeps their rows.
//   v2  build_tree_v2: one warp for every budget. Slot j lives in lane j % 32 as a 32-bit word (the
//       top 27 bits of the order-preserving weight key, then the column j / 32), and each lane keeps
//       its best word in a register. A pop is two shuffles of the winner's new words, a warp-wide
//       rescan of the winner's row and one round of REDUX (the rescan and the other lanes' best words
//       together) that gives the next pop's winner: the same work whatever the budget. Each entry's
//       sibling and child weights and words are computed when it is pushed; node records and new
//       entries are written, and entries reloaded, by predicated stores and loads of only the lanes
//       that own them (the winner, lane i % 32), so that work overlaps the reductions without branches
//       and without the other lanes' shared-memory traffic (bank-conflict replays otherwise). Ties of
//       the 27-bit prefixes (equal weights, or closer than ~2^-15 relative) take an exact path:
//       float64 weights, then rank tuples. When every rank a pop can read fits, the draft is staged
//       as float64 (no conversions, no global reads in the pops).
#include "common.cuh"

#define KD_MAX_NODES 1025          // budget <= 1024 pops plus the root

// ---------------------------------------------------------------------------------------------
// tree build: the pending entries and their order

// A pending heap entry is identified by (slot, rank, depth): the next child of popped node `slot`,
// with that rank at that depth. Packed in one int for the shuffles: 10 + 10 + 6 bits.
__device__ __forceinline__ int entry_code(int slot, int rank, int depth) { return slot | (rank << 10) | (depth << 20); }
__device__ __forceinline__ int entry_slot(int code) { return code & 1023; }
__device__ __forceinline__ int entry_rank(int code) { return (code >> 10) & 1023; }
__device__ __forceinline__ int entry_depth(int code) { return code >> 20; }

struct TreeScratch {  // (the popped nodes' log-weights go straight to the output)
    short parent[KD_MAX_NODES];        // node indices < 1025 and ranks < 1024 fit in 16 bits
    short rank[KD_MAX_NODES];
    short first_child[KD_MAX_NODES];
    short next_sibling[KD_MAX_NODES];
    unsigned char depth[KD_MAX_NODES];
    int n_nodes;
};

// Whether entry a's rank tuple sorts before entry b's (Python tuple order, a proper prefix first;
// two pending entries never are prefixes of each other). Climbs the popped ancestors.
__device__ bool rank_tuple_less(int a, int b, const TreeScratch& s) {
    int node_a = entry_slot(a), rank_a = entry_rank(a), depth_a = entry_depth(a);
    int node_b = entry_slot(b), rank_b = entry_rank(b), depth_b = entry_depth(b);
    for (; depth_a > depth_b; --depth_a) {
        rank_a = s.rank[node_a];
        node_a = s.parent[node_a];
    }
    for (; depth_b > depth_a; --depth_b) {
        rank_b = s.rank[node_b];
        node_b = s.parent[node_b];
    }
    while (node_a != node_b) {
        rank_a = s.rank[node_a];
        node_a = s.parent[node_a];
        rank_b = s.rank[node_b];
        node_b = s.parent[node_b];
    }
    return rank_a < rank_b;
}

// The heap order: larger log-weight first (key = -log w), then the smaller rank tuple.
__device__ __forceinline__ bool pops_first(double weight_a, int code_a, double weight_b, int code_b,
                                           const TreeScratch& s) {
    if (weight_a != weight_b) return weight_a > weight_b;
    if (weight_a == kd_neg_inf_d()) return false;  // both empty
    return rank_tuple_less(code_a, code_b, s);
}

// An unsigned key ordered like the weight (-0.0 and +0.0 equal, as in the reference's comparisons);
// 0 for an empty slot (-inf), below every finite weight.
__device__ __forceinline__ unsigned long long weight_key(double weight) {
    const long long bits = __double_as_longlong(weight == 0.0 ? 0.0 : weight);
    const unsigned long long key = bits >= 0 ? ((unsigned long long)bits | 0x8000000000000000ull)
                                             : ~(unsigned long long)bits;
    return weight == kd_neg_inf_d() ? 0ull : key;
}

// The lane holding the warp's first entry in heap order (every lane gets the same answer): two
// hardware max-reductions on the key, then, only for exactly equal weights, rank tuples.
__device__ __forceinline__ int warp_winner(double weight, int code, const TreeScratch& s) {
    const unsigned long long key = weight_key(weight);
    const unsigned high = (unsigned)(key >> 32), low = (unsigned)key;
    const unsigned top_high = __reduce_max_sync(KD_FULL_MASK, high);
    const unsigned top_low = __reduce_max_sync(KD_FULL_MASK, high == top_high ? low : 0u);
    const unsigned tied = __ballot_sync(KD_FULL_MASK, high == top_high && low == top_low);
    int winner = __ffs(tied) - 1;
    if ((top_high | top_low) != 0u) {  // every lane walks the same (rare) tie chain
        for (unsigned rest = tied & (tied - 1); rest != 0u; rest &= rest - 1) {
            const int lane = __ffs(rest) - 1;
            const int other = __shfl_sync(KD_FULL_MASK, code, lane);
            const int best = __shfl_sync(KD_FULL_MASK, code, winner);
            if (rank_tuple_less(other, best, s)) winner = lane;
        }
    }
    return winner;
}

// The draft's log-probabilities: the first `cached` ranks of every depth are staged in shared
// memory before the pops, as float32, and deeper ranks (only reachable when D * K is large) come
// from global memory; or (when every rank a pop can read fits) all of them are staged, already
// converted to float64, the type the weights add.
template <typename Staged>  // float or double
struct DraftRowsOf {
    const Staged* cache;  // [D, cached] in shared memory
    const float* global;  // [D, K]
    int cached, topk;
    __device__ __forceinline__ Staged operator()(int row, int rank) const {
        const Staged staged = cache[row * cached + min(rank, cached - 1)];
        if constexpr (sizeof(Staged) == sizeof(double)) return staged;  // every readable rank is staged
        else return rank < cached ? staged : global[row * topk + rank];  // a predicated global load, no
    }                                                                    // branch (D * K < 2^31)
};

// ---------------------------------------------------------------------------------------------
// tree build v2: one warp, a flat frontier of 32-bit words, one round of REDUX per pop

#define KD_MAX_SLOTS 1024                                   // slot j < budget: node j's next child
#define KD_FRONTIER_COLUMNS (KD_MAX_SLOTS / KD_WARP_SIZE)   // slot j: lane j % 32, column j / 32
#define KD_FRONTIER_STRIDE (KD_FRONTIER_COLUMNS + 1)        // words per lane row (conflict-free columns)
#define KD_LIVE_WORD 0x00100000u                            // words of finite weights are >= this

// A pending entry as its pop needs it: its weight, and the weights it will push then (computed
// when the entry itself is pushed, off the pops' critical path), with their frontier words.
struct Entry {
    double weight;
    double sibling;           // log w of its next sibling (-inf: none)
    double child;             // log w of its first child (-inf: none)
    unsigned sibling_prefix;  // frontier_word(sibling, 0): the slot's word once this entry pops
    unsigned child_word;      // frontier_word(child, (row + 1) % 32): the child's prefix and draft row
    unsigned meta;            // rank | row << 10 | last << 15: the draft row (depth - 1), and the last
                              // node popped from this slot (0: none yet), whose next sibling it links
};

__device__ __forceinline__ unsigned entry_meta(int rank, int row, int last) { return rank | (row << 10) | (last << 15); }
__device__ __forceinline__ int meta_rank(unsigned meta) { return meta & 1023; }
__device__ __forceinline__ int meta_row(unsigned meta) { return (meta >> 10) & 31; }
__device__ __forceinline__ int meta_last(unsigned meta) { return meta >> 15; }

struct alignas(16) StoredEntry {  // an Entry in shared memory (sibling_prefix is recomputed): bytes
    double weight, sibling, child;  // 0-15 (weight, sibling), then 16-31 (child, child_word, meta), as
    unsigned child_word, meta;      // the predicated stores and loads below move them
};
static_assert(sizeof(StoredEntry) == 32, "two 16-byte halves");

struct Frontier {
    unsigned word[KD_WARP_SIZE * KD_FRONTIER_STRIDE];     // [lane][column]: see frontier_word; 0 = empty
    StoredEntry entry[KD_MAX_SLOTS];                      // the rest of each slot's Entry, by slot: slot j's
};                                                        // is written and read by lane j % 32 only

// The one frontier of a v2 block, whichever draft type its pops read.
__device__ __forceinline__ Frontier& block_frontier() {
    __shared__ Frontier frontier;
    return frontier;
}

__device__ __forceinline__ int frontier_index(int slot) { return (slot & 31) * KD_FRONTIER_STRIDE + (slot >> 5); }

// A slot's 32-bit word: the top 27 bits of its weight's order-preserving key (weight_key's, taken
// from the high half of the double; -0.0, and the negative subnormals that share its high half,
// get +0.0's), then its column. Larger weights give larger or equal words; weights whose 27-bit
// prefixes are equal (ties, or closer than ~2^-15 relative) compare by column, so the pops check
// for them. Finite weights give words >= KD_LIVE_WORD, -inf below it.
__device__ __forceinline__ unsigned frontier_word(double weight, int column) {
    const unsigned high = (unsigned)__double2hiint(weight);
    const unsigned key = high > 0x80000000u ? ~high : high | 0x80000000u;
    return (key & ~31u) | (unsigned)column;
}

__device__ __forceinline__ void store_entry(Frontier& f, int slot, const Entry& e) {
    f.entry[slot] = {e.weight, e.sibling, e.child, e.child_word, e.meta};
}

__device__ __forceinline__ Entry load_entry(const Frontier& f, int slot) {
    const StoredEntry e = f.entry[slot];
    return {e.weight, e.sibling, e.child, frontier_word(e.sibling, 0), e.child_word, e.meta};
}

// Predicated shared-memory stores and loads: each is one instruction under a predicate, executed by
// the lanes where `on` holds and skipped by the others without a branch (the compiler turns an `if`
// around a few stores into a divergent branch). The loads leave the destination as it was where
// `on` is false.

__device__ __forceinline__ void store_shared_if(bool on, short* to, short value) {
    asm volatile("{ .reg .pred on; setp.ne.b32 on, %0, 0; @on st.shared.u16 [%1], %2; }"
                 :: "r"((int)on), "r"(kd_smem_address(to)), "h"(value) : "memory");
}

__device__ __forceinline__ void store_shared_if(bool on, unsigned char* to, unsigned value) {
    asm volatile("{ .reg .pred on; setp.ne.b32 on, %0, 0; @on st.shared.u8 [%1], %2; }"
                 :: "r"((int)on), "r"(kd_smem_address(to)), "r"(value) : "memory");
}

__device__ __forceinline__ void store_shared_if(bool on, unsigned* to, unsigned value) {
    asm volatile("{ .reg .pred on; setp.ne.b32 on, %0, 0; @on st.shared.u32 [%1], %2; }"
                 :: "r"((int)on), "r"(kd_smem_address(to)), "r"(value) : "memory");
}

// An Entry's child_word and meta as the 8 bytes StoredEntry holds them in.
__device__ __forceinline__ unsigned long long entry_words(const Entry& e) {
    return (unsigned long long)e.meta << 32 | e.child_word;
}

__device__ __forceinline__ void store_entry_if(bool on, Frontier& f, int slot, const Entry& e) {
    asm volatile("{ .reg .pred on; setp.ne.b32 on, %0, 0;\n\t"
                 "@on st.shared.v2.f64 [%1], {%2, %3};\n\t"
                 "@on st.shared.v2.b64 [%1+16], {%4, %5}; }"
                 :: "r"((int)on), "r"(kd_smem_address(&f.entry[slot])), "d"(e.weight), "d"(e.sibling),
                    "d"(e.child), "l"(entry_words(e)) : "memory");
}

__device__ __forceinline__ void load_entry_if(bool on, const Frontier& f, int slot, Entry& e) {
    unsigned long long words = entry_words(e);
    asm volatile("{ .reg .pred on; setp.ne.b32 on, %4, 0;\n\t"
                 "@on ld.shared.v2.f64 {%0, %1}, [%5];\n\t"
                 "@on ld.shared.v2.b64 {%2, %3}, [%5+16]; }"
                 : "+d"(e.weight), "+d"(e.sibling), "+d"(e.child), "+l"(words)
                 : "r"((int)on), "r"(kd_smem_address(&f.entry[slot])) : "memory");
    e.child_word = (unsigned)words;
    e.meta = (unsigned)(words >> 32);
    e.sibling_prefix = frontier_word(e.sibling, 0);
}

// Entry (weight, rank, row) with its sibling and child weights, in the reference's arithmetic.
// Reads stay in bounds whatever the arguments. A live entry's weight and logp are finite, so a -inf
// next logp or head gives a -inf push by itself (dead entries may get NaN pushes: never popped).
template <typename Rows>
__device__ __forceinline__ Entry make_entry(double weight, int rank, int row, int last, const Rows& lp,
                                            int depth_limit) {
    using Value = decltype(lp(0, 0));
    const Value current = lp(row, min(rank, lp.topk - 1));
    const Value next_read = lp(row, min(rank + 1, lp.topk - 1));
    const Value head_read = lp(min(row + 1, depth_limit - 1), 0);
    const Value next = rank + 1 < lp.topk ? next_read : static_cast<Value>(kd_neg_inf_f());
    const Value head = row + 1 < depth_limit ? head_read : static_cast<Value>(kd_neg_inf_f());
    Entry e;
    e.weight = weight;
    e.sibling = (weight - (double)current) + (double)next;
    e.child = weight + (double)head;
    e.sibling_prefix = frontier_word(e.sibling, 0);
    e.child_word = frontier_word(e.child, (row + 1) & 31);
    e.meta = entry_meta(rank, row, last);
    return e;
}

// The slot of the heap's first entry, exactly (float64 weights, then rank tuples), over the first
// `columns` columns of every lane; every lane gets the same answer. Only when prefixes tie.
__device__ int exact_first_slot(int columns, const Frontier& f, const TreeScratch& s) {
    __syncwarp();  // the popped nodes' ranks and parents were written by other lanes
    const int lane = kd_lane();
    double weight = kd_neg_inf_d();
    int code = 0;
    for (int c = 0; c < columns; ++c) {
        const int slot = c * KD_WARP_SIZE + lane;
        if (f.word[lane * KD_FRONTIER_STRIDE + c] < KD_LIVE_WORD) continue;
        const unsigned meta = f.entry[slot].meta;
        const int slot_code = entry_code(slot, meta_rank(meta), meta_row(meta) + 1);
        if (pops_first(f.entry[slot].weight, slot_code, weight, code, s)) {
            weight = f.entry[slot].weight;
            code = slot_code;
        }
    }
    return entry_slot(__shfl_sync(KD_FULL_MASK, code, warp_winner(weight, code, s)));
}

// Best-first pops of one request by one warp. Lane l owns slots l, l + 32, ... (its row of words);
// it keeps in registers its largest word `best` (slot best_slot, its Entry best_entry) and the
// largest word ^ 31, `mirrored`: their low 5 bits are the last and 31 - the first column with the
// largest prefix, so that prefix is unique in the row iff they add up to 31. `top`, the largest
// (prefix, lane) over the lanes, is known when a pop starts. A pop:
//   1. the winner is lane top % 32, unless a prefix ties (then exact_first_slot);
//   2. the words that change go where they are compared: the winner's row is rescanned by the
//      warp (lane c reads column c) with the popped slot's new word (its next sibling's) and slot
//      i's (node i's first child's) if it lies there, lane i % 32 merges slot i's word otherwise;
//      the rescan and the other lanes' best words are reduced in the same round of REDUX, which
//      gives the next pop's `top`;
//   3. meanwhile node i is recorded and the two new entries are made and stored, each by the lane
//      that owns it (predicated stores: no branches); then the winner and lane i % 32, the only
//      lanes whose best slot or its Entry can have changed, reload their best Entry.
// Each lane's best_entry stays its best slot's record: slot j's record is only written by lane
// j % 32, in a pop where that lane reloads. The loop-carried chain is the REDUX round, the shuffles
// from the winner and the rescan's load; no step depends on the budget. Returns the node count, root included.
template <typename Rows>
__device__ int best_first_pops_v2(const Rows& lp, int depth_limit, int budget, TreeScratch& s,
                                  double* __restrict__ log_weights) {
    Frontier& f = block_frontier();
    const int lane = kd_lane();
    for (int c = 0; c < KD_FRONTIER_STRIDE; ++c) f.word[c * KD_WARP_SIZE + lane] = 0u;
    const Entry empty = {kd_neg_inf_d(), kd_neg_inf_d(), kd_neg_inf_d(), 0u, 0u, entry_meta(0, 0, 0)};
    for (int slot = lane; slot < budget; slot += KD_WARP_SIZE) store_entry(f, slot, empty);  // valid rows

    Entry best_entry = empty;
    int best_slot = lane;
    unsigned best = 0u, mirrored = 31u;
    const double first = lp(0, 0);
    if (lane == 0 && first != kd_neg_inf_d()) {  // slot 0: the root's first child, log w = logp[0, 0]
        best = frontier_word(first, 0);
        mirrored = best ^ 31u;
        f.word[0] = best;
    }
    const Entry root_child = make_entry(first, 0, 0, 0, lp, depth_limit);
    if (lane == 0) {
        best_entry = root_child;
        store_entry(f, 0, best_entry);
    }
    __syncwarp();  // rows are read across lanes

    unsigned top = __reduce_max_sync(KD_FULL_MASK, (best & ~31u) | (unsigned)lane);
    int n_nodes = 1;
    double* weight_out = log_weights + 1;  // log_weights + i (a register, not recomputed per pop)
    for (int i = 1; i <= budget && top >= KD_LIVE_WORD; ++i, ++weight_out) {  // pop i creates node i; slots 0 .. i-1 exist
        // 1. the winner
        int winner = top & 31;
        unsigned column_word = f.word[winner * KD_FRONTIER_STRIDE + lane];  // the winner's row
        const bool unique_in_row = (best & 31u) + (mirrored & 31u) == 31u;
        if (__ballot_sync(KD_FULL_MASK, (best >> 5) == (top >> 5) && (lane != winner || !unique_in_row))) {
            const int slot = exact_first_slot(((i - 1) >> 5) + 1, f, s);
            winner = slot & 31;
            column_word = f.word[winner * KD_FRONTIER_STRIDE + lane];
            if (lane == winner) {
                best_slot = slot;
                best_entry = load_entry(f, slot);
            }
        }
        const bool pops = lane == winner;
        const unsigned popped_word = __shfl_sync(KD_FULL_MASK, best_entry.sibling_prefix | (unsigned)(best_slot >> 5), winner);
        const unsigned child_word = __shfl_sync(KD_FULL_MASK, best_entry.child_word, winner);
        const double child = __shfl_sync(KD_FULL_MASK, best_entry.child, winner);
        n_nodes = i + 1;

        // 2. the next pop's `top`
        const int pusher = i & 31;
        const unsigned pushed_word = (child_word & ~31u) | (unsigned)(i >> 5);
        const bool pushes = i < budget && pushed_word >= KD_LIVE_WORD;
        const bool pushes_here = pushes && lane == pusher;
        if (lane == (int)(popped_word & 31u)) column_word = popped_word;
        if (pushes && pusher == winner && lane == (i >> 5)) column_word = pushed_word;
        if (pushes_here && !pops) {
            best = max(best, pushed_word);
            mirrored = max(mirrored, pushed_word ^ 31u);
        }
        const unsigned row_best = __reduce_max_sync(KD_FULL_MASK, column_word);
        const unsigned row_mirrored = __reduce_max_sync(KD_FULL_MASK, column_word ^ 31u);
        const unsigned others_top = __reduce_max_sync(KD_FULL_MASK, pops ? 0u : (best & ~31u) | (unsigned)lane);
        top = max(others_top, (row_best & ~31u) | (unsigned)winner);

        __syncwarp();  // the winner's row was read across lanes in 1; 3 writes it (and slot i's row)
        // 3. node i (the winner's slot is its parent), the winner's next sibling into that slot, node
        // i's first child into slot i (lane i % 32; both in the winner, rarely)
        const int rank = meta_rank(best_entry.meta), row = meta_row(best_entry.meta), last = meta_last(best_entry.meta);
        const int child_row = min((int)(child_word & 31u), depth_limit - 1);
        const Entry made = make_entry(pops ? best_entry.sibling : child, pops ? rank + 1 : 0, pops ? row : child_row,
                                      pops ? i : 0, lp, depth_limit);
        store_shared_if(pops, &s.parent[i], (short)best_slot);
        store_shared_if(pops, &s.rank[i], (short)rank);
        store_shared_if(pops, &s.depth[i], (unsigned)(row + 1));
        store_shared_if(pops, &(last == 0 ? s.first_child : s.next_sibling)[last == 0 ? best_slot : last], (short)i);
        if (pops) *weight_out = best_entry.weight;
        const bool writes = pops || pushes_here;
        const int made_slot = pops ? best_slot : i;  // (a -inf sibling: an empty slot's record)
        store_entry_if(writes, f, made_slot, made);
        store_shared_if(writes, &f.word[frontier_index(made_slot)], pops ? popped_word : pushed_word);
        if (__any_sync(KD_FULL_MASK, pushes_here && pops)) {
            const Entry first_child = make_entry(child, 0, child_row, 0, lp, depth_limit);
            if (pushes_here) {
                store_entry(f, i, first_child);
                f.word[frontier_index(i)] = pushed_word;
            }
        }
        if (pops) {
            best = row_best;
            mirrored = row_mirrored;
        }
        best_slot = (int)(best & 31u) * KD_WARP_SIZE + lane;
        load_entry_if(writes, f, best_slot, best_entry);
        __syncwarp();  // the rows written here are read across lanes in the next pop
    }
    return n_nodes;
}

// ---------------------------------------------------------------------------------------------
// tree build: the kernels

// The DFlash chain: node d is the argmax token of position d (one thread; at most 32 nodes).
template <typename Rows>
__device__ int chain_pops(const Rows& lp, int depth_limit, int budget, TreeScratch& s, double* __restrict__ log_weights) {
    double weight = 0.0;
    int n_nodes = 1;
    for (int d = 1; d <= min(budget, depth_limit); ++d) {
        const double head = lp(d - 1, 0);
        if (head == kd_neg_inf_d()) break;
        weight += head;
        s.parent[d] = (short)(d - 1);
        s.rank[d] = 0;
        s.depth[d] = (unsigned char)d;
        log_weights[d] = weight;
        s.first_child[d - 1] = (short)d;
        n_nodes = d + 1;
    }
    return n_nodes;
}

#define KD_STAGE_UNROLL 8

// The first `cached` ranks of every depth of one request's draft [D, K] -> cache [D, cached] (the
// whole block; loads first, stores after, to keep many in flight). Returns the rows reading it.
template <typename Staged>
__device__ DraftRowsOf<Staged> stage_draft(const float* __restrict__ draft, int depth_limit, int topk, int cached,
                                           Staged* cache) {
    const int staged = depth_limit * cached;
    for (int first = threadIdx.x; first < staged; first += KD_STAGE_UNROLL * blockDim.x) {
        float values[KD_STAGE_UNROLL];
#pragma unroll
        for (int u = 0; u < KD_STAGE_UNROLL; ++u) {
            const int e = first + u * blockDim.x;
            values[u] = e < staged ? draft[(long long)(e / cached) * topk + e % cached] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < KD_STAGE_UNROLL; ++u) {
            const int e = first + u * blockDim.x;
            if (e < staged) cache[e] = values[u];
        }
    }
    __syncthreads();
    return {cache, draft, cached, topk};
}

// One request's pops into s (the chain by thread 0, best-first by warp 0), after the block stages
// its draft as Staged values (float, or double when every readable rank fits).
template <typename Staged>
__device__ __forceinline__ void pop_request(const float* __restrict__ draft, int depth_limit, int topk, int budget,
                                            int chain_mode, int cached, Staged* cache, TreeScratch& s,
                                            double* __restrict__ weights) {
    const DraftRowsOf<Staged> lp = stage_draft(draft, depth_limit, topk, cached, cache);
    const int t = threadIdx.x;
    if (chain_mode) {
        if (t == 0) s.n_nodes = chain_pops(lp, depth_limit, budget, s, weights);
    } else if (t < KD_WARP_SIZE) {
        const int count = best_first_pops_v2(lp, depth_limit, budget, s, weights);
        if (t == 0) s.n_nodes = count;
    }
}

// logp float32 [B, D, K], ids int32 [B, D, K], root int32|int64 [B] -> the Tree of docs/DESIGN.md §3 at
// capacity N (every output element is written). Dynamic shared memory: D * cached values, the first
// `cached` ranks of every depth, float32, or float64 when staged_f64 (then every rank a pop can
// read, cached >= min(K, budget + 2)). Warp 0 pops; the whole block (any multiple of 32 threads)
// stages the draft and writes the outputs. One block per SM in the bounds: ptxas may then give the
// pops more registers than at the default occupancy target.
extern "C" __global__ void __launch_bounds__(512, 1)
build_tree_v2(const float* __restrict__ logp, const int* __restrict__ ids, const void* __restrict__ root,
              int root_is_int64, int depth_limit, int topk, int budget, int capacity, int chain_mode, int cached,
              int staged_f64, int* __restrict__ tokens, int* __restrict__ parents, int* __restrict__ depths,
              int* __restrict__ n_nodes, unsigned* __restrict__ mask, int* __restrict__ first_child,
              int* __restrict__ next_sibling, double* __restrict__ log_weights) {
    __shared__ TreeScratch s;
    extern __shared__ double s_draft[];  // [D, cached] float32 or float64 values
    const int b = blockIdx.x, t = threadIdx.x;
    const long long draft_base = (long long)b * depth_limit * topk;
    for (int j = t; j < capacity; j += blockDim.x) {
        s.parent[j] = -1;
        s.rank[j] = 0;
        s.depth[j] = 0;
        s.first_child[j] = -1;
        s.next_sibling[j] = -1;
    }
    const long long base = (long long)b * capacity;
    double* weights = log_weights + base;  // nodes 1 .. count-1 are written by the pops
    if (staged_f64) {  // uniform over the block
        pop_request(logp + draft_base, depth_limit, topk, budget, chain_mode, cached, s_draft, s, weights);
    } else {
        pop_request(logp + draft_base, depth_limit, topk, budget, chain_mode, cached, (float*)s_draft, s, weights);
    }
    __syncthreads();

    const int count = s.n_nodes;
    for (int j = t; j < capacity; j += blockDim.x) {
        int token = 0;
        if (j == 0) token = root_is_int64 ? (int)((const long long*)root)[b] : ((const int*)root)[b];
        else if (j < count) token = ids[draft_base + (long long)(s.depth[j] - 1) * topk + s.rank[j]];
        tokens[base + j] = token;
        parents[base + j] = s.parent[j];
        depths[base + j] = s.depth[j];
        first_child[base + j] = s.first_child[j];
        next_sibling[base + j] = s.next_sibling[j];
        if (j == 0 || j >= count) weights[j] = j == 0 ? 0.0 : kd_neg_inf_d();
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

// ---------------------------------------------------------------------------------------------
// SGLang's tree policy (its speculative/ddtree_utils.py) in SGLang's output layout, and the EAGLE
// left-child/right-sibling arrays; launched from kdtree_lib/tree_build.py (SGLangBuildLaunch,
// EagleFormatLaunch) for kdtree_lib.integrations.sglang.
//
// One CTA per request. Warp 0 pops with the same "one pending entry per popped node" frontier as
// v2 (slot j: node j's next child), but plainly: a pop is a warp-wide argmax over the slots in
// shared memory (float64 weights, equal weights by rank tuples: pops_first). The policy's parts
// are parameters: the depth bonus added to every first child's weight, the early stop (an entry off
// the top-1 spine lighter than (logp[0, 0] - log budget) - margin is dropped: no node, no pushes;
// log budget comes from the host so the threshold is Python's to the bit), the breadth-first
// relabel (depth-major, a parent's children contiguous, in pop order). With no bonus, no stop and
// no relabel it is the paper's heap in pop order (SGLang PR #29907's build_ddtree_tree_from_topk).
// The derived arrays (visibility, first child, next sibling) are written by the whole block.
// A pop scans ~count / 32 slots per lane in shared memory, then v2's warp_winner (two REDUX); the
// draft's first ranks are staged in shared memory (docs/kernel-notes.md has the measurements).

#define KD_SGLANG_THREADS 256

struct SGLangScratch {
    TreeScratch s;                      // the popped nodes, in pop order (children lists in pop order)
    double weight[KD_MAX_SLOTS];        // slot j's pending entry: node j's next child (-inf: none)
    short slot_rank[KD_MAX_SLOTS];      // its rank (its depth is node j's + 1)
    short last[KD_MAX_SLOTS];           // the last node popped from slot j (0: none yet)
    unsigned char spine[KD_MAX_NODES];  // node on the top-1 spine (every rank on its path 0)
    short order[KD_MAX_NODES];          // output index -> pop index
    short new_index[KD_MAX_NODES];      // pop index -> output index
    short new_parent[KD_MAX_NODES];     // output index -> its parent's output index (-1: none)
    short head[KD_MAX_NODES];           // children lists by output index (see children_links)
    int bad;
};

// The pending entry of slot j as pops_first compares it.
__device__ __forceinline__ int slot_code(int slot, const SGLangScratch& g) {
    return entry_code(slot, g.slot_rank[slot], g.s.depth[slot] + 1);
}

#define KD_SGLANG_STAGED 4096  // draft values staged in shared memory (16 KB): ranks < 4096 / D of every depth

// The policy's pops of one request by warp 0 into g.s; returns the node count, root included. The
// draft's values are float32, added as float64 (the reference's arithmetic).
__device__ int sglang_pops(const DraftRowsOf<float>& lp, int depth_limit, int width, int budget,
                           double depth_bonus, double stop_below, SGLangScratch& g) {
    const int lane = kd_lane();
    for (int j = lane; j < budget; j += KD_WARP_SIZE) {
        g.weight[j] = kd_neg_inf_d();
        g.slot_rank[j] = 0;
        g.last[j] = 0;
    }
    __syncwarp();
    if (lane == 0) {
        g.weight[0] = lp(0, 0);
        g.spine[0] = 1;
    }
    __syncwarp();
    int count = 0;  // nodes popped
    while (count < budget) {
        double best = kd_neg_inf_d();
        int code = 0;
        for (int j = lane; j <= count; j += KD_WARP_SIZE) {
            const int c = slot_code(j, g);
            if (pops_first(g.weight[j], c, best, code, g.s)) {
                best = g.weight[j];
                code = c;
            }
        }
        // the warp's first entry: two REDUX on the weight's key, rank tuples only for equal weights
        const int winner = warp_winner(best, code, g.s);
        best = __shfl_sync(KD_FULL_MASK, best, winner);
        code = __shfl_sync(KD_FULL_MASK, code, winner);
        if (best == kd_neg_inf_d()) break;  // the heap is empty (every lane sees it)
        const int slot = entry_slot(code), rank = entry_rank(code), row = entry_depth(code) - 1;
        const bool on_spine = g.spine[slot] && rank == 0;
        const bool dropped = !on_spine && best < stop_below;
        __syncwarp();  // every lane has read the slots before lane 0 writes them
        if (lane == 0) {
            if (dropped) {
                g.weight[slot] = kd_neg_inf_d();
            } else {
                const int i = count + 1;
                g.s.parent[i] = (short)slot;
                g.s.rank[i] = (short)rank;
                g.s.depth[i] = (unsigned char)(row + 1);
                g.spine[i] = on_spine;
                if (g.last[slot] == 0) g.s.first_child[slot] = (short)i;
                else g.s.next_sibling[g.last[slot]] = (short)i;
                g.last[slot] = (short)i;
                g.weight[slot] = rank + 1 < width ? (best - (double)lp(row, rank)) + (double)lp(row, rank + 1)
                                                 : kd_neg_inf_d();
                g.slot_rank[slot] = (short)(rank + 1);
                if (i < budget) {
                    g.weight[i] = row + 1 < depth_limit ? best + (double)lp(row + 1, 0) + depth_bonus
                                                        : kd_neg_inf_d();
                    g.slot_rank[i] = 0;
                    g.last[i] = 0;
                }
            }
        }
        count += dropped ? 0 : 1;
        __syncwarp();
    }
    return count + 1;
}

// Children lists from parents by output index, nodes 1 .. n-1 (a parent outside [0, n) is none):
// first child and next sibling in ascending index order. One thread, last node first.
__device__ void children_links(const short* new_parent, int n, short* head, long long* __restrict__ next_sibling) {
    for (int c = n - 1; c >= 1; --c) {
        const int q = new_parent[c];
        const bool child = q >= 0 && q < n;
        next_sibling[c] = child ? head[q] : -1;
        if (child) head[q] = (short)c;
    }
}

// logp float32 [B, D, K] and ids int32|int64 [B, D, K] (the first `width` columns read) -> SGLang's
// tensors at capacity N = budget + 1, every element written: node_tokens, node_depths [B, budget]
// (0 past the tree), parents [B, N] (-1 at the root and past the tree), visibility [B, N, N]
// (ancestors and self), sizes [B] (nodes, root included), when not null next_token and
// next_sibling [B, N] (-1: none), and when not null retrive_index [B, N] (b * N + node: SGLang's
// build_eagle_tree_format at draft_token_num N, which the drop-in then answers without a launch). bad[b] = 1, and a root-only tree, where the draft holds a value
// the build cannot use (NaN or +-inf at rank 0; with finite_all, anywhere in the first `width`).
extern "C" __global__ void __launch_bounds__(KD_SGLANG_THREADS)
build_tree_sglang(const float* __restrict__ logp, const void* __restrict__ ids, int ids_is_int64, int depth_limit,
                  int topk, int width, int budget, int chain_mode, int relabel, int finite_all, double depth_bonus,
                  double log_budget, double stop_margin, int use_stop, long long* __restrict__ node_tokens,
                  long long* __restrict__ node_depths, long long* __restrict__ parents, bool* __restrict__ visibility,
                  long long* __restrict__ sizes, long long* __restrict__ next_token,
                  long long* __restrict__ next_sibling, long long* __restrict__ retrive_index, int* __restrict__ bad) {
    __shared__ SGLangScratch g;
    __shared__ float staged[KD_SGLANG_STAGED];
    const int b = blockIdx.x, t = threadIdx.x, capacity = budget + 1;
    const long long draft_base = (long long)b * depth_limit * topk;
    const float* draft = logp + draft_base;
    for (int j = t; j < capacity; j += blockDim.x) {
        g.s.parent[j] = -1;
        g.s.rank[j] = 0;
        g.s.depth[j] = 0;
        g.s.first_child[j] = -1;
        g.s.next_sibling[j] = -1;
        g.spine[j] = 0;
        g.head[j] = -1;
    }
    if (t == 0) g.bad = 0;
    const DraftRowsOf<float> lp = stage_draft(draft, depth_limit, topk, min(width, KD_SGLANG_STAGED / depth_limit),
                                              staged);  // (synchronises the block)
    const int checked = finite_all ? width : 1;
    for (int e = t; e < depth_limit * checked; e += blockDim.x) {
        const float v = draft[(long long)(e / checked) * topk + e % checked];
        if (!(v > kd_neg_inf_f() && v < -kd_neg_inf_f())) g.bad = 1;  // NaN or +-inf
    }
    __syncthreads();
    if (g.bad) {
        if (t == 0) g.s.n_nodes = 1;
    } else if (chain_mode) {  // budget == D: the top-1 chain, as SGLang's spine fast path
        for (int d = t + 1; d <= min(budget, depth_limit); d += blockDim.x) {
            g.s.parent[d] = (short)(d - 1);
            g.s.depth[d] = (unsigned char)d;
            g.s.first_child[d - 1] = (short)d;
        }
        if (t == 0) g.s.n_nodes = min(budget, depth_limit) + 1;
    } else if (t < KD_WARP_SIZE) {
        const double first = lp(0, 0);
        const double stop_below = use_stop ? (first - log_budget) - stop_margin : kd_neg_inf_d();
        const int count = sglang_pops(lp, depth_limit, width, budget, depth_bonus, stop_below, g);
        if (t == 0) g.s.n_nodes = count;
    }
    __syncthreads();
    const int n = g.s.n_nodes;
    if (relabel) {  // output order: breadth-first from the root (a queue walked by one thread)
        if (t == 0) {
            g.order[0] = 0;
            g.new_index[0] = 0;
            int tail = 1;
            for (int head = 0; head < tail; ++head) {
                for (int c = g.s.first_child[g.order[head]]; c != -1; c = g.s.next_sibling[c]) {
                    g.new_index[c] = (short)tail;
                    g.order[tail++] = (short)c;
                }
            }
        }
    } else {  // pop order
        for (int p = t; p < n; p += blockDim.x) {
            g.order[p] = (short)p;
            g.new_index[p] = (short)p;
        }
    }
    __syncthreads();
    for (int p = t; p < capacity; p += blockDim.x)
        g.new_parent[p] = p == 0 || p >= n ? (short)-1 : g.new_index[g.s.parent[g.order[p]]];
    __syncthreads();
    const long long row_base = (long long)b * capacity;
    const bool links = next_token != nullptr;  // with next_sibling
    if (links && t == 0) {
        children_links(g.new_parent, n, g.head, next_sibling + row_base);
        next_sibling[row_base] = -1;
    }
    for (int j = t; j < budget; j += blockDim.x) {  // node j + 1
        const int p = j + 1;
        long long token = 0, depth = 0;
        if (p < n) {
            const int old = g.order[p];
            const long long at = draft_base + (long long)(g.s.depth[old] - 1) * topk + g.s.rank[old];
            token = ids_is_int64 ? ((const long long*)ids)[at] : (long long)((const int*)ids)[at];
            depth = g.s.depth[old];
        }
        node_tokens[(long long)b * budget + j] = token;
        node_depths[(long long)b * budget + j] = depth;
    }
    for (int p = t; p < capacity; p += blockDim.x) {
        parents[row_base + p] = g.new_parent[p];
        if (links && p >= n) next_sibling[row_base + p] = -1;
        if (retrive_index != nullptr) retrive_index[row_base + p] = row_base + p;
    }
    if (t == 0) {
        sizes[b] = n;
        bad[b] = g.bad;
    }
    if (visibility != nullptr) {
        bool* rows = visibility + row_base * capacity;
        for (long long e = t; e < (long long)capacity * capacity; e += blockDim.x) {
            const int r = (int)(e / capacity), c = (int)(e - (long long)r * capacity);
            int a = r;
            if (r < n && c < n) {
                while (a > c) a = g.new_parent[a];
            }
            rows[e] = r < n && c < n && a == c;
        }
    }
    __syncthreads();  // head is complete
    if (links) {
        for (int p = t; p < capacity; p += blockDim.x) next_token[row_base + p] = p < n ? g.head[p] : -1;
    }
}

// SGLang's build_eagle_tree_format: parents int64 [B, columns] and sizes int64 [B] -> retrive_index,
// retrive_next_token, retrive_next_sibling int64 [B, width]. Node k < n = clamp(sizes[b], 0,
// min(width, columns)) is a child of parents[b, k] when 1 <= k and 0 <= parents[b, k] < n; children in
// ascending index order. Every element written.
extern "C" __global__ void __launch_bounds__(KD_SGLANG_THREADS)
eagle_tree_format(const long long* __restrict__ parents, int columns, const long long* __restrict__ sizes, int width,
                  long long* __restrict__ retrive_index, long long* __restrict__ next_token,
                  long long* __restrict__ next_sibling) {
    __shared__ short parent_of[KD_MAX_NODES];
    __shared__ short head[KD_MAX_NODES];
    const int b = blockIdx.x, t = threadIdx.x;
    const long long size = sizes[b];
    const int n = (int)(size < 0 ? 0 : (size > min(width, columns) ? min(width, columns) : size));
    const long long base = (long long)b * width;
    for (int k = t; k < width; k += blockDim.x) {
        const long long p = k < n ? parents[(long long)b * columns + k] : -1;
        parent_of[k] = (short)(p >= 0 && p < n ? p : -1);
        head[k] = -1;
        retrive_index[base + k] = base + k;
    }
    __syncthreads();
    if (t == 0) children_links(parent_of, n, head, next_sibling + base);
    __syncthreads();
    for (int k = t; k < width; k += blockDim.x) {
        next_token[base + k] = k < n ? head[k] : -1;
        if (k >= n || k == 0) next_sibling[base + k] = -1;
    }
}
