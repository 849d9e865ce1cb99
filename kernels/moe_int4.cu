// W4A16 grouped MoE of one tree-verify step: bf16 tokens, INT4 routed experts (group 32, bf16 scales),
// mma.sync m16n8k16 bf16 with fp32 accumulation; one source for sm_90 and sm_120. Launched from
// kdtree_lib/moe.py (MoeLaunch); the weight layout is docs/moe-int4.md's.
//
// Versions (llm.c style):
//   v1: route -> gate_up -> down -> combine, four launches with static grids (no host sync, one CUDA
//       graph). Weights are the A operand (16 output rows per tile) and tokens the B operand (8 per
//       tile): a verify step gives each expert 1-30 tokens, so "swap AB" fills the MMA's M with
//       weight rows instead of padding 16 token rows. Codes are dequantized in registers.
//
// Napkin math per call, at K2.6's shapes: hidden H = 7168, 384 experts, top-8, expert width W = 2048
// at TP=1 and 256 in the TP=8 slice; M tokens route 8M (token, expert) pairs to U distinct experts
// (uniform routing expects U = 384·(1 − (376/384)^M): 8 at M = 1, ~60 at 8, ~284 at 64, 384 by 512).
// kdtree_lib.moe.touched_bytes counts the same bytes for the benchmark's roofline.
//   weights     4-bit codes + one bf16 scale per 32 = 9/16 byte a weight, each read once per token
//               pass (8·TOKEN_TILES tokens of an expert): gate_up [2W, H] 2.06 MB (W = 256) or 16.5 MB
//               (W = 2048) an expert, down [H, W] 1.03 or 8.26 MB; 3.10 or 24.8 MB an expert hit,
//               1.19 or 9.51 GB the whole layer.
//   activations x in and the output, M·H·2 bytes each (14.3 KB a token). Between the launches h
//               [8M, W] and y [8M, H] (bf16) are written and read back, 8M·(2W + 2H)·2 bytes: 0.24 MB
//               at M = 1 and 15 MB at M = 64 (TP=8 slice), from L2, but 122 MB at M = 512, past the
//               H200's 50 MB L2.
//   FLOPs       gate_up 2·8M·2W·H + down 2·8M·H·W = 48·M·W·H: 88 MFLOP (W = 256) or 705 MFLOP
//               (W = 2048) a token.
//   bound       FLOP/byte ≈ 28.4·M/U: 3.6 at M = 1, 6.4 at M = 64, 38 at M = 512, against an H200
//               ridge near 150 (mma.sync ~640 TFLOP/s over ~4.25 TB/s copy, bench.ceilings' H200 rows):
//               every verify-sized call is bound by its experts' bytes. TP=8 slice at 4.22 TB/s: M = 1
//               24.8 MB = 5.9 µs, M = 8 184 MB = 44 µs, M = 64 880 MB = 209 µs (TP=1: 8× the bytes).
//               The dequantization (shift, lop3 and two bf16x2 FMAs per pair of weights: 1/16 warp
//               instruction a weight) of one expert pass at W = 256 is ~0.34 M warp instructions,
//               ~0.33 µs of a whole H200's issue slots (132 SMs × 4 schedulers × 1.98 GHz) against
//               0.73 µs for its bytes: it has to overlap the loads, and each further pass adds it again.
//
// One call:
//   moe_route    one CTA: per local expert the count of routed (token, slot) pairs, their offsets, the
//                list of experts hit; each pair's position in expert order (inverse) and its token.
//   moe_gate_up  CTA = (hit expert, 16·T gate rows and the same up rows). Its 8 warps split the 7168
//                inputs, each streams its slice of the packed codes + scales (read once per call) with
//                a register ring DEPTH chunks deep, the warps' partial sums meet in shared memory and
//                h = SiLU(gate)·up is written as bf16 [capacity, width] in expert order.
//   moe_down     CTA = (hit expert, 8·16·T output rows); warps split the width when it is long (TP=1)
//                or each own whole rows (the TP=8 slice, 256 inputs). y written bf16 [capacity, hidden].
//   moe_combine  CTA = (token, 8·128 columns): out[t] = Σ_s weight[t, s]·y[inverse[t, s]] in fp32, slots
//                in order: deterministic, so graph replay equals eager bit for bit.
// The grids cover min(experts, capacity) hit experts; CTAs past the number actually hit (read on the
// device) return at once. Tokens beyond 8·TOKEN_TILES per expert take further passes over its weights.
//
// Repacked layout (kdtree_lib.moe.repack): a [rows, inputs] matrix is cut into 16-row tiles and
// 64-input chunks; lane (g, c) = (lane / 4, lane % 4) of the warp owns rows g and g + 8 and inputs
// 16c .. 16c + 15 of a chunk, as one 16-byte word of codes (4 words, one per 16-input MMA step) and one
// u32 of the two rows' scales (both inputs of the lane are in group 2·chunk + c / 2). The MMA's
// k order is permuted the same way in A and B, so a lane's B operand is 16 consecutive activations
// (two 16-byte loads). In word b the eight nibbles are, from bit 0: (g, 4b), (g+8, 4b), (g, 4b+2),
// (g+8, 4b+2), (g, 4b+1), (g+8, 4b+1), (g, 4b+3), (g+8, 4b+3) (input offsets within the lane's 16),
// so (word >> 4i) & 0x000f000f holds A register i's two codes.

#include "common.cuh"

namespace moe {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kChunk = 64;                  // inputs per repacked chunk
constexpr u32 kCodeMask = 0x000f000fu;      // one nibble into each bf16 half
constexpr u32 kBf16Magic = 0x43004300u;     // bf16 128.0: 128 + code (< 2^7) is exact in the mantissa
constexpr u32 kBf16One = 0x3f803f80u;
constexpr u32 kBf16Minus136 = 0xc308c308u;  // -(128 + 8): code - 8 = q, exact
constexpr u32 kBf16MinusZero = 0x80008000u;

__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// (word & 0x000f000f) | 0x43004300 in one lop3: two codes as bf16 128 + code.
__device__ __forceinline__ u32 codes_as_bf16x2(u32 word) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(word), "n"(kCodeMask), "n"(kBf16Magic));
  return d;
}

// Both halves of a bf16 pair set to its low (kHigh = false) or high half.
template <bool kHigh>
__device__ __forceinline__ u32 broadcast_half(u32 pair) {
  u32 d;
  asm("prmt.b32 %0, %1, %1, %2;\n" : "=r"(d) : "r"(pair), "n"(kHigh ? 0x3232 : 0x1010));
  return d;
}

// One repacked word -> the four A registers of an m16n8k16 tile. (code - 8) is exact in bf16 and
// times the scale is rounded once: the same bf16 weight as rounding the fp32 dequantized weight.
__device__ __forceinline__ void dequantize(u32 word, u32 scale_lo, u32 scale_hi, u32 (&a)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const u32 q = fma_bf16x2(codes_as_bf16x2(word >> (4 * i)), kBf16One, kBf16Minus136);
    a[i] = fma_bf16x2(q, (i & 1) ? scale_hi : scale_lo, kBf16MinusZero);
  }
}

// Weights are read once per call: no L1 allocation (the activations, re-read by every CTA of an
// expert, keep the default path).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ u32 load_stream(const u32* p) {
  u32 v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ u16 to_bf16(float x) { return (u16)(kd_pack2<false>(x, 0.f) & 0xffffu); }

// Routing metadata written by moe_route, read by every later kernel: offsets [experts + 1], the
// number of experts hit, then their ids in increasing order.
struct Meta {
  const int* words;
  int experts;
  __device__ int begin(int e) const { return words[e]; }
  __device__ int end(int e) const { return words[e + 1]; }
  __device__ int hit() const { return words[experts + 1]; }
  __device__ int hit_expert(int i) const { return words[experts + 2 + i]; }
};

template <int kTiles, int kTokenTiles>
struct Stage {
  uint4 codes[kTiles];
  u32 scales[kTiles];
  uint4 act[kTokenTiles][2];
};

template <int kTiles, int kSplit, int kTokenTiles>
__host__ __device__ constexpr int reduce_bytes() {
  return kSplit > 1 ? kWarps * kTiles * kTokenTiles * 4 * 32 * 4 : 0;
}

// One CTA of either GEMM. kGateUp: tiles [0, kTiles/2) are gate tiles and [kTiles/2, kTiles) the up
// tiles of the same rows, fused into h = SiLU(gate)·up; else kTiles down tiles per warp group.
// Warps form kWarps / kSplit groups; the kSplit warps of a group split the inputs.
template <bool kGateUp, int kTiles, int kSplit, int kTokenTiles, int kDepth>
__device__ __forceinline__ void gemm_cta(const uint4* __restrict__ codes, const u32* __restrict__ scales,
                                         const u16* __restrict__ act, u16* __restrict__ out, const Meta meta,
                                         const int* __restrict__ sorted_token, int inputs, int rows) {
  constexpr int kGroups = kWarps / kSplit;
  constexpr int kTokens = 8 * kTokenTiles;
  constexpr int kRowTiles = kGateUp ? kTiles / 2 : kTiles;  // output tiles per warp group
  static_assert(kWarps % kSplit == 0, "the warps split evenly");
  static_assert(!kGateUp || kTiles % 2 == 0, "gate and up tiles pair up");
  if constexpr (kSplit > 1) {
    if (kd_dynamic_smem_bytes() < (u32)reduce_bytes<kTiles, kSplit, kTokenTiles>()) __trap();  // launcher disagrees
  }
  if ((int)blockIdx.y >= meta.hit()) return;
  const int expert = meta.hit_expert(blockIdx.y);
  const int begin = meta.begin(expert), end = meta.end(expert);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int part = warp % kSplit, group = warp / kSplit;
  const int chunks = inputs / kChunk, per_part = kd_ceil_div(chunks, kSplit);
  const int first_chunk = part * per_part;
  const int n_chunks = max(0, min(chunks - first_chunk, per_part));
  const int out_stride = kGateUp ? rows / 2 : rows;  // h is [capacity, width], y [capacity, hidden]

  const uint4* code_at[kTiles];
  const u32* scale_at[kTiles];
  int tile_row[kRowTiles];  // first output row of each output tile
  {
    const int base = (blockIdx.x * kGroups + group) * kRowTiles;
#pragma unroll
    for (int i = 0; i < kTiles; ++i) {
      const int tile = kGateUp && i >= kRowTiles ? rows / 32 + base + i - kRowTiles : base + i;
      if (i < kRowTiles) tile_row[i] = 16 * tile;
      const i64 first = ((i64)expert * (rows / 16) + tile) * chunks + first_chunk;
      code_at[i] = codes + first * 32 + lane;
      scale_at[i] = scales + first * 16 + g * 2 + (c >> 1);
    }
  }
  extern __shared__ float reduce[];  // [warp][tile][token tile][4][lane]

  for (int pass_begin = begin; pass_begin < end; pass_begin += kTokens) {
    const u16* act_at[kTokenTiles];
    bool act_valid[kTokenTiles];
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt) {
      const int position = pass_begin + tt * 8 + g;  // B column g of token tile tt
      act_valid[tt] = position < end;
      const int row = !act_valid[tt] ? 0 : kGateUp ? sorted_token[position] : position;
      act_at[tt] = act + (i64)row * inputs + first_chunk * kChunk + 16 * c;
    }
    auto load = [&](Stage<kTiles, kTokenTiles>& s, int j) {
#pragma unroll
      for (int i = 0; i < kTiles; ++i) {
        s.codes[i] = load_stream(code_at[i] + j * 32);
        s.scales[i] = load_stream(scale_at[i] + j * 16);
      }
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) {
        const uint4* src = reinterpret_cast<const uint4*>(act_at[tt] + j * kChunk);
        s.act[tt][0] = act_valid[tt] ? src[0] : uint4{0u, 0u, 0u, 0u};
        s.act[tt][1] = act_valid[tt] ? src[1] : uint4{0u, 0u, 0u, 0u};
      }
    };
    float acc[kTiles][kTokenTiles][4];
#pragma unroll
    for (int i = 0; i < kTiles; ++i)
#pragma unroll
      for (int tt = 0; tt < kTokenTiles; ++tt) acc[i][tt][0] = acc[i][tt][1] = acc[i][tt][2] = acc[i][tt][3] = 0.f;

    Stage<kTiles, kTokenTiles> ring[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
      if (d < n_chunks) load(ring[d], d);
    for (int j0 = 0; j0 < n_chunks; j0 += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        if (j0 + d >= n_chunks) break;
        Stage<kTiles, kTokenTiles>& s = ring[d];
#pragma unroll
        for (int i = 0; i < kTiles; ++i) {
          const u32 scale_lo = broadcast_half<false>(s.scales[i]), scale_hi = broadcast_half<true>(s.scales[i]);
          const u32 words[4] = {s.codes[i].x, s.codes[i].y, s.codes[i].z, s.codes[i].w};
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            u32 a[4];
            dequantize(words[b], scale_lo, scale_hi, a);
#pragma unroll
            for (int tt = 0; tt < kTokenTiles; ++tt) {
              const uint4 v = s.act[tt][b >> 1];
              kd_mma_m16n8k16<false>(acc[i][tt], a, (b & 1) ? v.z : v.x, (b & 1) ? v.w : v.y);
            }
          }
        }
        if (j0 + d + kDepth < n_chunks) load(s, j0 + d + kDepth);
      }
    }

    if constexpr (kSplit > 1) {  // the group's partial sums, added in warp order (deterministic)
      float* mine = reduce + warp * kTiles * kTokenTiles * 128 + lane;
      if (part != 0) {
#pragma unroll
        for (int i = 0; i < kTiles; ++i)
#pragma unroll
          for (int tt = 0; tt < kTokenTiles; ++tt)
#pragma unroll
            for (int r = 0; r < 4; ++r) mine[((i * kTokenTiles + tt) * 4 + r) * 32] = acc[i][tt][r];
      }
      __syncthreads();
      if (part == 0) {
        for (int other = 1; other < kSplit; ++other) {
          const float* theirs = mine + other * kTiles * kTokenTiles * 128;
#pragma unroll
          for (int i = 0; i < kTiles; ++i)
#pragma unroll
            for (int tt = 0; tt < kTokenTiles; ++tt)
#pragma unroll
              for (int r = 0; r < 4; ++r) acc[i][tt][r] += theirs[((i * kTokenTiles + tt) * 4 + r) * 32];
        }
      }
      __syncthreads();  // the next pass reuses the buffer
    }
    if (part != 0) continue;
    // Accumulator r of a tile holds row g + 8·(r / 2) and token column 2c + r % 2.
#pragma unroll
    for (int tt = 0; tt < kTokenTiles; ++tt)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int position = pass_begin + tt * 8 + 2 * c + (r & 1);
        if (position >= end) continue;
        u16* dst = out + (i64)position * out_stride + g + 8 * (r >> 1);
#pragma unroll
        for (int i = 0; i < kRowTiles; ++i) {
          float value = acc[i][tt][r];
          if constexpr (kGateUp) value = value / (1.f + __expf(-value)) * acc[i + kRowTiles][tt][r];
          dst[tile_row[i]] = to_bf16(value);
        }
      }
  }
}

// Weighted sum of each token's routed outputs. A thread owns 8 outputs (16-byte loads and stores) and
// issues all of its slots' loads before the first sum: one CTA per token looping over the columns had
// each thread wait on top_k dependent loads per 8 columns (latency-bound: ~30 us at M = 1 under ncu for
// 0.12 MB, docs/kernel-notes.md). The sums are the same fp32 operations in the same slot order.
constexpr int kCombineMaxTopK = 16;  // kdtree_lib.moe.COMBINE_MAX_TOP_K, checked before the launch

__device__ __forceinline__ void combine_token(const u16* __restrict__ y, const int* __restrict__ inverse,
                                              const float* __restrict__ weights, u16* __restrict__ out,
                                              int hidden, int top_k) {
  const int token = blockIdx.x;
  const int column = 8 * (blockIdx.y * blockDim.x + threadIdx.x);
  if (column >= hidden) return;
  int position[kCombineMaxTopK];
  float w[kCombineMaxTopK];
  uint4 v[kCombineMaxTopK];
#pragma unroll
  for (int s = 0; s < kCombineMaxTopK; ++s) {
    position[s] = s < top_k ? inverse[token * top_k + s] : -1;  // -1: no slot, or an expert of another rank
    w[s] = s < top_k ? weights[token * top_k + s] : 0.f;
  }
#pragma unroll
  for (int s = 0; s < kCombineMaxTopK; ++s)
    if (position[s] >= 0) v[s] = *reinterpret_cast<const uint4*>(y + (i64)position[s] * hidden + column);
  float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s = 0; s < kCombineMaxTopK; ++s) {
    if (position[s] < 0) continue;
    const u32 pairs[4] = {v[s].x, v[s].y, v[s].z, v[s].w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      sum[2 * q] += w[s] * kd_unpack2<false>(pairs[q]).x;
      sum[2 * q + 1] += w[s] * kd_unpack2<false>(pairs[q]).y;
    }
  }
  const uint4 packed = uint4{kd_pack2<false>(sum[0], sum[1]), kd_pack2<false>(sum[2], sum[3]),
                             kd_pack2<false>(sum[4], sum[5]), kd_pack2<false>(sum[6], sum[7])};
  *reinterpret_cast<uint4*>(out + (i64)token * hidden + column) = packed;
}

}  // namespace moe

// Group the routes by local expert [first_expert, first_expert + experts). One CTA of 1024 threads
// (experts <= 1024): counts by shared atomics (the order inside an expert is arbitrary; each
// position's result does not depend on it), offsets and the list of experts hit by block scans.
extern "C" __global__ void __launch_bounds__(1024) moe_route(const int* __restrict__ ids, int routes, int top_k,
                                                             int first_expert, int experts, int* __restrict__ meta,
                                                             int* __restrict__ sorted_token,
                                                             int* __restrict__ inverse) {
  __shared__ unsigned counts[1024];
  __shared__ int starts[1024];
  __shared__ unsigned scratch[32];
  const int tid = threadIdx.x;
  counts[tid] = 0u;
  __syncthreads();
  for (int r = tid; r < routes; r += blockDim.x) {
    const int e = ids[r] - first_expert;
    inverse[r] = e >= 0 && e < experts ? (int)atomicAdd(&counts[e], 1u) : -1;  // rank inside the expert
  }
  __syncthreads();
  const unsigned count = tid < experts ? counts[tid] : 0u;
  const unsigned end = kd_block_inclusive_scan(count, scratch);
  if (tid < experts) {
    starts[tid] = (int)(end - count);
    meta[tid] = (int)(end - count);
    if (tid == experts - 1) meta[experts] = (int)end;
  }
  const bool hit = count > 0u;
  const unsigned hit_rank = kd_block_inclusive_scan(hit ? 1u : 0u, scratch);
  if (hit) meta[experts + 2 + hit_rank - 1] = tid;
  if (tid == blockDim.x - 1) meta[experts + 1] = (int)hit_rank;
  __syncthreads();
  for (int r = tid; r < routes; r += blockDim.x) {
    const int rank = inverse[r];
    if (rank < 0) continue;
    const int position = starts[ids[r] - first_expert] + rank;
    inverse[r] = position;
    sorted_token[position] = r / top_k;
  }
}

extern "C" __global__ void __launch_bounds__(128) moe_combine(const u16* y, const int* inverse, const float* weights,
                                                              u16* out, int hidden, int top_k) {
  moe::combine_token(y, inverse, weights, out, hidden, top_k);
}

// Configurations (kdtree_lib.moe.GEMM_CONFIGS lists the same): TILES per warp, SPLIT warps over the
// inputs, TOKEN_TILES of 8 tokens per pass, DEPTH chunks in flight per warp.
#define MOE_GEMM(NAME, GATE_UP, TILES, SPLIT, TOKEN_TILES, DEPTH)                                              \
  extern "C" __global__ void __launch_bounds__(moe::kThreads, 1)                                               \
      NAME(const uint4* codes, const u32* scales, const u16* act, u16* out, const int* meta, int experts,       \
           const int* sorted_token, int inputs, int rows) {                                                    \
    moe::gemm_cta<GATE_UP, TILES, SPLIT, TOKEN_TILES, DEPTH>(codes, scales, act, out, moe::Meta{meta, experts}, \
                                                             sorted_token, inputs, rows);                      \
  }

MOE_GEMM(moe_gate_up_t2_s8_tt1_d8, true, 2, 8, 1, 8)
MOE_GEMM(moe_gate_up_t4_s8_tt2_d3, true, 4, 8, 2, 3)
MOE_GEMM(moe_gate_up_t4_s8_tt4_d2, true, 4, 8, 4, 2)
MOE_GEMM(moe_down_t1_s1_tt1_d4, false, 1, 1, 1, 4)
MOE_GEMM(moe_down_t2_s1_tt2_d4, false, 2, 1, 2, 4)
MOE_GEMM(moe_down_t2_s1_tt4_d4, false, 2, 1, 4, 4)
MOE_GEMM(moe_down_t1_s8_tt1_d4, false, 1, 8, 1, 4)
MOE_GEMM(moe_down_t1_s8_tt2_d4, false, 1, 8, 2, 4)
MOE_GEMM(moe_down_t1_s8_tt4_d4, false, 1, 8, 4, 4)
