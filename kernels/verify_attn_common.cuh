// verify_attn_common.cuh — what the two verify-attention kernels share: the portable mma.sync one
// (verify_attn.cu, sm_90 and sm_120) and the wgmma one (verify_attn_sm90a.cu, sm_90a only).
//
// Problem constants, PTX wrappers (cp.async, shared addresses, conversions, fast exp2/log2), the
// key range one CTA covers, the tree-mask test, the epilogue's row store (bf16/f16 output or a
// split's fp32 partial) and the kernel that merges split partials by LSE.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

namespace va {

constexpr int kLatent = 512;          // value width (c_kv)
constexpr int kRope = 64;             // rope part of the key
constexpr int kWidth = 576;           // key width = cache row
constexpr int kRowChunks = kWidth / 8;  // 16-byte chunks in a row (72)
constexpr int kRowBytes = kWidth * 2;   // 1152
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ u32 smem_address(const void* pointer) {
  u32 address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

// 16-byte async copy global -> shared; when !valid the destination is zero-filled and src unread.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ u32 dynamic_smem_bytes() {
  u32 bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  return bytes;
}

// Named barrier for the `threads` threads of one warp group (id 0 is __syncthreads').
__device__ __forceinline__ void group_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Two floats -> packed 16-bit pair (lo in the low half), round to nearest even.
template <bool kHalf>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
  u32 packed;
  if constexpr (kHalf) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

// Two adjacent output values: a 16-bit pair (the output) or an fp32 pair (a split's partial).
template <bool kHalf>
__device__ __forceinline__ void store_pair(u16* dst, float lo, float hi) {
  *reinterpret_cast<u32*>(dst) = pack2<kHalf>(lo, hi);
}
template <bool kHalf>
__device__ __forceinline__ void store_pair(float* dst, float lo, float hi) {
  *reinterpret_cast<float2*>(dst) = float2{lo, hi};
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
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
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
  r.tiles = r.end > r.begin ? (r.end - r.begin + kKeys - 1) / kKeys : 0;
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

// Epilogue for one accumulator row half h (rows quad_row, quad_row + 8 of an m16n8 / wgmma
// fragment): kTiles column pairs at stride 8, normalised by inv, to the bf16/f16 output (one
// split) or the split's fp32 partial; `writes_lse` threads also write the row's LSE.
template <bool kHalf, int kTiles>
__device__ __forceinline__ void store_output_row(const float (&o)[kTiles][4], int h, float inv, float row_lse,
                                                 bool writes_lse, i64 out_row, int col0, int split, i64 total_rows,
                                                 u16* out, float* lse, float* partial_out, float* partial_lse) {
  auto store_row = [&](auto* dst) {
#pragma unroll
    for (int j = 0; j < kTiles; ++j) store_pair<kHalf>(dst + 8 * j, o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
  };
  if (gridDim.y == 1) {
    store_row(out + out_row * kLatent + col0);
    if (writes_lse) lse[out_row] = row_lse;
  } else {
    const i64 part_row = (i64)split * total_rows + out_row;
    store_row(partial_out + part_row * kLatent + col0);
    if (writes_lse) partial_lse[part_row] = row_lse;
  }
}

// Combine the splits of one output row: lse = log Σ exp(lse_s), O = Σ exp(lse_s − lse)·O_s.
// One block per row, no block-wide reduction before the loads: every warp reduces the row's split
// LSEs itself (shuffles), then sums every 8th split over all 512 columns (four float4 per lane,
// independent loads); the warps' sums meet once in shared memory. One block per row keeps the
// grid to a single wave where the old (row, quarter) blocks needed several (many rows, few splits).
constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / 32;

template <bool kMax>
__device__ __forceinline__ float warp_reduce(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, offset);
    x = kMax ? fmaxf(x, y) : x + y;
  }
  return x;
}

template <bool kHalf>
__device__ __forceinline__ void merge_row(const float* __restrict__ partial_out, const float* __restrict__ partial_lse,
                                          u16* __restrict__ out, float* __restrict__ lse, int total_rows, int splits) {
  __shared__ float4 warp_sum[kMergeWarps][kLatent / 4];
  const i64 row = blockIdx.x;  // b * rows + row
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row_lse = partial_lse + row;  // split s at s * total_rows

  float m = neg_inf();
  for (int s = lane; s < splits; s += 32) m = fmaxf(m, row_lse[(i64)s * total_rows]);
  m = warp_reduce<true>(m);
  const float base = m == neg_inf() ? 0.f : m;  // every split empty: O = 0, lse = -inf
  float total = 0.f;
  for (int s = lane; s < splits; s += 32) total += fast_exp2((row_lse[(i64)s * total_rows] - base) * kLog2e);
  total = warp_reduce<false>(total);
  const float scale = total > 0.f ? 1.f / total : 0.f;

  // Lane l holds columns 4l + 128j (j < 4) of this warp's splits.
  const float* src = partial_out + row * kLatent + 4 * lane;
  const i64 split_stride = (i64)total_rows * kLatent;
  float4 acc[4] = {};
#pragma unroll 2
  for (int s = warp; s < splits; s += kMergeWarps) {
    const float w = fast_exp2((row_lse[(i64)s * total_rows] - base) * kLog2e);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 x = *reinterpret_cast<const float4*>(src + s * split_stride + 128 * j);
      acc[j].x += w * x.x; acc[j].y += w * x.y; acc[j].z += w * x.z; acc[j].w += w * x.w;
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) warp_sum[warp][lane + 32 * j] = acc[j];
  __syncthreads();
  const float* sums = reinterpret_cast<const float*>(warp_sum);  // thread t: columns 2t, 2t + 1
  float x = 0.f, y = 0.f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
    x += sums[w * kLatent + 2 * tid];
    y += sums[w * kLatent + 2 * tid + 1];
  }
  *reinterpret_cast<u32*>(out + row * kLatent + 2 * tid) = pack2<kHalf>(x * scale, y * scale);
  if (tid == 0) lse[row] = total > 0.f ? base + logf(total) : neg_inf();
}

}  // namespace va

// The split merge kernels, one per 16-bit type; every verify-attention module defines them.
#define VA_MERGE_KERNELS                                                                                         \
  extern "C" __global__ void __launch_bounds__(va::kMergeThreads) verify_attn_merge_bf16(                        \
      const float* partial_out, const float* partial_lse, u16* out, float* lse, int total_rows, int splits) {     \
    va::merge_row<false>(partial_out, partial_lse, out, lse, total_rows, splits);                                \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(va::kMergeThreads) verify_attn_merge_f16(                         \
      const float* partial_out, const float* partial_lse, u16* out, float* lse, int total_rows, int splits) {     \
    va::merge_row<true>(partial_out, partial_lse, out, lse, total_rows, splits);                                 \
  }
