// verify_attn_common.cuh — what the two verify-attention kernels share: the portable mma.sync one
// (verify_attn.cu, sm_90 and sm_120) and the wgmma one (verify_attn_sm90a.cu, sm_90a only).
//
// Problem constants, the PTX wrappers only these kernels use (named barriers, fast exp2/log2), quad
// reductions, the key range one CTA covers, the tree-mask test, the epilogue's row destination and
// staged row store, and the kernel that merges split partials by LSE. The wrappers other kernels
// also use (cp.async, shared addresses, 16-bit pairs, the mma.sync m16n8k16) are common.cuh's.
//
// Versions of the merge (docs/kernel-notes.md: the trials not kept):
//   v1: a block per (output row, quarter of its columns), 8 warps each summing every 8th split after
//       two block reductions of the splits' LSEs (max, then the sum of weights)
//   v2: like v1, the partials in the output's 16-bit type (added in fp32)
#pragma once

#include "common.cuh"

namespace va {

constexpr int kLatent = 512;          // value width (c_kv)
constexpr int kRope = 64;             // rope part of the key
constexpr int kWidth = 576;           // key width = cache row
constexpr int kRowChunks = kWidth / 8;  // 16-byte chunks in a row (72)
constexpr int kRowBytes = kWidth * 2;   // 1152

// Named barrier for the `threads` threads of one warp group (id 0 is __syncthreads').
__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Four consecutive 16-bit partial values as floats.
template <bool kHalf>
__device__ __forceinline__ float4 load4(const u16* src) {
  const uint2 packed = *reinterpret_cast<const uint2*>(src);
  const float2 lo = kd_unpack2<kHalf>(packed.x), hi = kd_unpack2<kHalf>(packed.y);
  return float4{lo.x, lo.y, hi.x, hi.y};
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max (kMax) or sum of one value over the quad of lanes that hold a row of an mma accumulator.
template <bool kMax>
__device__ __forceinline__ float quad_reduce(float value) {
#pragma unroll
  for (int offset = 1; offset <= 2; offset <<= 1) {
    const float other = __shfl_xor_sync(KD_FULL_MASK, value, offset);
    value = kMax ? fmaxf(value, other) : value + other;
  }
  return value;
}

// The same, stored by the quad's first lane to `slot` (row statistics exchanged through shared memory).
template <bool kMax>
__device__ __forceinline__ void quad_reduce_store(float value, float* slot, int quad_col) {
  value = quad_reduce<kMax>(value);
  if (quad_col == 0) *slot = value;
}

// The keys one CTA covers: split `split` of request b's stream [0, length + nodes), in tiles of
// kKeys. A bad device-side length is clamped so that it can never address outside the cache.
struct KeyRange {
  int length;        // committed keys (no mask below this)
  int kv_len;        // length + nodes: keys past it are zero-filled, never read
  int begin, end;    // this split's keys
  int tiles;         // KV tiles in [begin, end)
  int unmasked_end;  // keys below this need no mask
};

template <int kKeys>
__device__ __forceinline__ KeyRange key_range(const int* lengths, int b, int l_max, int nodes, int split,
                                              int chunk) {
  KeyRange r;
  r.length = min(max(lengths[b], 0), l_max - nodes);
  r.kv_len = r.length + nodes;
  r.begin = split * chunk;
  r.end = min(r.begin + chunk, r.kv_len);
  r.tiles = r.end > r.begin ? kd_ceil_div(r.end - r.begin, kKeys) : 0;
  r.unmasked_end = min(r.length, r.end);
  return r;
}

// May a query row (of node `mask_row`'s mask, real_row false for padding rows past N·H) see `key`?
// Keys past the split are never visible; tree keys only when they are the node's ancestors.
__device__ __forceinline__ bool key_visible(int key, const KeyRange& range, bool real_row, const u32* mask_row) {
  if (key >= range.end) return false;
  if (key < range.length) return true;
  const int j = key - range.length;  // tree slot, < nodes since key < kv_len
  return real_row && ((mask_row[j >> 5] >> (j & 31)) & 1u);
}

// Where a CTA's rows [row0, ...) of request b go: the output and its LSE with one split, else split
// blockIdx.y's 16-bit partial and its LSE (the merge adds them in fp32).
struct RowDestination {
  u16* o;      // row r's 512 values at o + r·kLatent
  float* lse;  // row r's LSE at lse[r]
};
__device__ __forceinline__ RowDestination row_destination(u16* out, float* lse, u16* partial_out, float* partial_lse,
                                                          int b, int rows, int row0) {
  const i64 first = (i64)b * rows + row0;
  if (gridDim.y == 1) return {out + first * kLatent, lse + first};
  const i64 split_first = (i64)blockIdx.y * gridDim.z * rows + first;
  return {partial_out + split_first * kLatent, partial_lse + split_first};
}

// A row's LSE (natural log) from its log2-domain maximum and its sum; −inf for a row with no key.
__device__ __forceinline__ float row_lse(float max_log2, float sum) {
  return sum > 0.f ? (max_log2 + fast_log2(sum)) * kd_ln2() : kd_neg_inf_f();
}

// Rows staged in shared memory as 16-bit values go out in 16-byte pieces, a warp writing 512
// contiguous bytes (stored straight from MMA fragments, a quad writes 16 bytes of each of eight
// rows per instruction: half sectors). `threads` threads, this one `thread`, copy `bytes` bytes
// of rows [0, count) from staged(r) to dst + r·kLatent.
template <typename Staged>
__device__ __forceinline__ void store_staged_rows(u16* dst, int count, int bytes, int thread, int threads,
                                                  Staged staged) {
  const int pieces = bytes / 16;
  for (int i = thread; i < count * pieces; i += threads) {
    const int r = i / pieces, piece = i % pieces;
    reinterpret_cast<uint4*>(dst + (i64)r * kLatent)[piece] = *reinterpret_cast<const uint4*>(staged(r) + piece * 16);
  }
}

// Combine the splits of one output row: lse = log Σ exp(lse_s), O = Σ exp(lse_s − lse)·O_s.
// Block (row, quarter): 8 warps each sum every 8th split over the quarter's 128 columns (four
// values per lane, independent loads), then the warps' sums are added through shared memory.
// Partials are in the output's 16-bit type; the LSEs are fp32.
constexpr int kMergeThreads = 256;
constexpr int kMaxSplits = 1024;  // kdtree_lib.verify_attn.MAX_SPLITS

__device__ __forceinline__ float block_reduce(float x, bool take_max, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float y = __shfl_xor_sync(KD_FULL_MASK, x, offset);
    x = take_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads();  // scratch may still be read from a previous reduction
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  x = scratch[0];
#pragma unroll
  for (int w = 1; w < kMergeThreads / 32; ++w) x = take_max ? fmaxf(x, scratch[w]) : x + scratch[w];
  return x;
}

template <bool kHalf>
__device__ __forceinline__ void merge_row(const u16* __restrict__ partial_out,
                                          const float* __restrict__ partial_lse, u16* __restrict__ out,
                                          float* __restrict__ lse, int total_rows, int splits) {
  __shared__ float weight[kMaxSplits];
  __shared__ float4 warp_sum[kMergeThreads / 32][32];
  __shared__ float scratch[kMergeThreads / 32];
  const i64 row = blockIdx.x;  // b * rows + row
  const int quarter = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  float m = kd_neg_inf_f();
  for (int s = tid; s < splits; s += kMergeThreads) {
    weight[s] = partial_lse[(i64)s * total_rows + row];
    m = fmaxf(m, weight[s]);
  }
  m = block_reduce(m, true, scratch);
  const float base = m == kd_neg_inf_f() ? 0.f : m;  // every split empty: O = 0, lse = -inf
  float total = 0.f;
  for (int s = tid; s < splits; s += kMergeThreads) {
    weight[s] = fast_exp2((weight[s] - base) * kd_log2e());
    total += weight[s];
  }
  total = block_reduce(total, false, scratch);  // its barriers also publish `weight`
  const float scale = total > 0.f ? 1.f / total : 0.f;

  const u16* src = partial_out + row * kLatent + quarter * 128 + 4 * lane;
  const i64 split_stride = (i64)total_rows * kLatent;
  float4 acc = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int s = warp; s < splits; s += kMergeThreads / 32) {
    const float w = weight[s];
    const float4 x = load4<kHalf>(src + s * split_stride);
    acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
  }
  warp_sum[warp][lane] = acc;
  __syncthreads();
  if (tid < 64) {  // thread t: columns quarter·128 + 2t, +1
    const float* sums = reinterpret_cast<const float*>(warp_sum);
    float x = 0.f, y = 0.f;
#pragma unroll
    for (int w = 0; w < kMergeThreads / 32; ++w) {
      x += sums[w * 128 + 2 * tid];
      y += sums[w * 128 + 2 * tid + 1];
    }
    *reinterpret_cast<u32*>(out + row * kLatent + quarter * 128 + 2 * tid) = kd_pack2<kHalf>(x * scale, y * scale);
  }
  if (quarter == 0 && tid == 0) lse[row] = total > 0.f ? base + logf(total) : kd_neg_inf_f();
}

}  // namespace va

// The split merge kernels, one per 16-bit type; every verify-attention module defines them.
#define VA_MERGE_KERNEL(NAME, HALF)                                                                              \
  extern "C" __global__ void __launch_bounds__(va::kMergeThreads) NAME(                                          \
      const u16* partial_out, const float* partial_lse, u16* out, float* lse, int total_rows, int splits) {       \
    va::merge_row<HALF>(partial_out, partial_lse, out, lse, total_rows, splits);                                 \
  }
#define VA_MERGE_KERNELS                         \
  VA_MERGE_KERNEL(verify_attn_merge_bf16, false) \
  VA_MERGE_KERNEL(verify_attn_merge_f16, true)
