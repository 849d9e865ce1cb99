// Tree-verify attention for absorbed MLA: bf16/f16 tensor cores (mma.sync m16n8k16 + ldmatrix),
// one source for sm_90 and sm_120. Launched from kdtree_lib/verify_attn.py (_verify_attention_cupy).
//
// Versions (docs/kernel-notes.md: what each one measured, and the trials not kept):
//   v1: one CTA per (row block, key split), Q in shared memory, KV tiles through a cp.async ring,
//       the mask only on tiles reaching the tree slots, split partials merged by LSE
//   v2: like v1, k-split accumulator chains for small warp tiles, the "wide" variant (two scoring
//       warps with 32×32 tiles), deeper rings
//   v3: like v2, the rows staged in shared memory and stored in 16-byte pieces; 16-bit split partials
//   v4: like v3, warps of 16 rows hold their Q fragments in registers across tiles
//   v5: like v4, those warps stage Q in the ring's last stage (no Q tile), so two groups of them
//       (rows32_keys32_stages2) fit a 99 KB block
//
// Problem (docs/DESIGN.md §3): request b has rows = N·H query rows (tree node × head, packed in that
// order, 576 wide = q_latent 512 | q_rope 64) and one key/value stream shared by every head: cache
// rows [0, len + N) (576-wide keys, their first 512 columns are the values). Row (node i) may see
// every key < len and tree key len + j iff bit j of mask[b, i] is set.
//
// Napkin math per call and layer (K2.6: 64 heads, H = 8 a rank at TP=8; keys = L + N; rows = N·H;
// kdtree_lib.bench.verify_attn's traffic_bytes and flops count the same for its roofline):
//   bytes   the latent cache read once, 576 bf16 = 1152 bytes a key for all heads: 37.7 MB a request
//           at L = 32k (4.7 MB at 4k, 151 MB at 128k); Q in and O + LSE out, 1152 + 1024 + 4 bytes a
//           row (1.1 MB at N = 64, H = 8). With several key splits, each split also writes its
//           16-bit partial rows and LSEs (1028 bytes a row) and the merge reads them back.
//   FLOPs   S = Q·Kᵀ 2·rows·keys·576, O = P·V 2·rows·keys·512: 2176·rows·keys a request
//           (36.6 GFLOP at N = 64, H = 8, L = 32k).
//   bound   FLOP/byte ≈ 1.9·rows; an H200's ridge is near 150 (mma.sync ~640 TFLOP/s over ~4.25 TB/s
//           copy, bench.ceilings' rows), so from ~80 rows a call is compute-bound. B = 1, H = 8,
//           L = 32k, bytes at 4.22 TB/s against MMAs at 640 TFLOP/s: N = 1 (decode) 8.9 against
//           0.9 µs, N = 16 9.0 against 14.3 µs, N = 64 9.2 against 57 µs.
//
// Kernel (one CTA = ROWS query rows × one split of the key range):
//   * Q (ROWS × 576) is loaded once into shared memory; warps of 16 rows then hold their Q
//     fragments in registers, so their Q needs no tile of its own (it lands in the ring's last
//     stage). KV tiles of KEYS rows stream through a STAGES-deep cp.async ring, each tile read
//     from global once per CTA for all heads and nodes.
//   * Warps form ROW_GROUPS groups of 4. In a group every warp owns 16·ROW_TILES rows and output
//     columns [128c, 128c+128) of O (warp c), so the 128 KB fp32 accumulator of a 64-row CTA is
//     spread over 8 warps. S = Q·Kᵀ is cut by keys among SCORING warps of the group: 4 (16×32
//     or 32×16 warp tiles) or, in the "wide" variant, 2 with 32×32 tiles (256 instead of 384
//     bytes of ldmatrix traffic per MMA; group 0 scores with warps 0-1 and group 1 with warps 6-7,
//     so each SM sub-partition keeps one scoring warp). Small warp tiles split the k loop over
//     independent accumulator chains so MMA latency stays hidden.
//   * Online softmax in the log2 domain: row maxima are exchanged through shared memory (named
//     barrier per group), P is written to shared memory as bf16/f16 and re-read with ldmatrix as
//     the A operand of O += P·V; V comes from the same KV tile with ldmatrix.trans.
//   * Only tiles reaching the tree slots (or the split's end) evaluate the mask; prefix tiles run
//     unmasked. Rows past N·H and keys past len + N are zero-filled, never read out of bounds.
//   * The normalised rows are staged in shared memory and stored in 16-byte pieces: with one split
//     as the bf16/f16 output, with several as the split's partial O in the same 16-bit type (and
//     its fp32 LSE), which verify_attn_merge_* combines by LSE.
// Shared memory is XOR-swizzled in 16-byte chunks (chunk ^ row%8), so ldmatrix and cp.async are
// free of bank conflicts; P rows are padded by 16 bytes instead.
//
// Configurations are template parameters. NVRTC (the launcher) builds one per module, selected with
// -DVA_HALF=0|1 -DVA_ROW_TILES -DVA_ROW_GROUPS -DVA_KEYS -DVA_STAGES -DVA_SCORING; a plain nvcc build (CI's
// compile test, ptxas -v) instantiates every configuration the launcher may pick.

#include "verify_attn_common.cuh"

namespace va {

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(address)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

template <int kRowTiles, int kRowGroups, int kKeys, int kStages, int kScoring>
struct Shape {
  static constexpr int kWarpRows = 16 * kRowTiles;               // rows per warp (= per group)
  static constexpr int kRows = kWarpRows * kRowGroups;           // query rows per CTA
  static constexpr int kThreads = 128 * kRowGroups;              // 4 warps per group
  static constexpr int kScoringWarps = kScoring;                 // warps of a group computing S
  static constexpr int kWarpKeys = kKeys / kScoring;              // S columns per scoring warp
  static constexpr int kKeyTiles = kWarpKeys / 8;                // n8 tiles of S per warp
  static constexpr int kChains = 4 / (kRowTiles * kKeyTiles) > 1 ? 4 / (kRowTiles * kKeyTiles) : 1;
  static constexpr int kPStride = (kKeys + 8) * 2;               // bytes per P row (padded)
  // Warps of 16 rows hold their Q fragments in registers across tiles (32-row warps would need
  // twice the registers); their Q lands in the ring's last stage, free until the first step loads it.
  static constexpr bool kQInRegisters = kRowTiles == 1;
  static constexpr int kQBytes = kQInRegisters ? 0 : kRows * kRowBytes;
  static constexpr int kStageBytes = kKeys * kRowBytes;
  static constexpr int kPBytes = kRows * kPStride;
  static constexpr int kSmemBytes = kQBytes + kStages * kStageBytes + kPBytes + 4 * kRows * 4;
  static_assert(kKeys == 32 || kKeys == 64, "KEYS must be 32 or 64");
  static_assert(kStages >= 2, "the pipeline needs at least two stages");
  static_assert(kRowTiles == 1 || kRowTiles == 2, "ROW_TILES must be 1 or 2");
  static_assert(kScoring == 4 || (kScoring == 2 && kRowGroups == 2), "two scoring warps need two groups");
  static_assert(kKeys % (kThreads / 8) == 0 && kRows % (kThreads / 8) == 0, "whole load passes");
  static_assert(!kQInRegisters || kRows <= kKeys, "Q is staged in one KV stage");
};

// One CTA: rows [blockIdx.x·ROWS, +ROWS) of request blockIdx.z over key split blockIdx.y.
template <bool kHalf, int kRowTiles, int kRowGroups, int kKeys, int kStages, int kScoring>
__device__ __forceinline__ void verify_attn_cta(
    const u16* __restrict__ q_latent,   // [B, rows, 512]
    const u16* __restrict__ q_rope,     // [B, rows, 64]
    const u16* __restrict__ cache,      // [B, l_max, 576]
    const int* __restrict__ lengths,    // [B]
    const u32* __restrict__ mask,       // [B, N, words]
    u16* __restrict__ out,              // [B, rows, 512]           (one split)
    float* __restrict__ lse,            // [B, rows]                (one split)
    u16* __restrict__ partial_out,      // [splits, B, rows, 512]   (several splits; 16-bit, added in fp32)
    float* __restrict__ partial_lse,    // [splits, B, rows]        (several splits)
    int nodes, int heads, int l_max, int words, int chunk, float scale_log2) {
  using S = Shape<kRowTiles, kRowGroups, kKeys, kStages, kScoring>;
  if (kd_dynamic_smem_bytes() < S::kSmemBytes) __trap();  // the launcher's KernelConfig.smem_bytes disagrees
  extern __shared__ unsigned char smem[];  // 16-byte aligned is all cp.async and ldmatrix need
  const u32 kv_smem = kd_smem_address(smem) + S::kQBytes;
  const u32 q_smem = S::kQInRegisters ? kv_smem + (kStages - 1) * S::kStageBytes : kd_smem_address(smem);
  const u32 p_smem = kv_smem + kStages * S::kStageBytes;
  unsigned char* p_bytes = smem + S::kQBytes + kStages * S::kStageBytes;
  float* exchange = reinterpret_cast<float*>(p_bytes + S::kPBytes);  // [4][ROWS]: row max, then row sum

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp >> 2, column = warp & 3;  // column: output columns [128c, 128c+128) in O
  // The key slice this warp scores in S: its column, or with two scoring warps per group, columns
  // 0-1 of group 0 and 2-3 of group 1 (so each SM sub-partition has one scoring warp).
  const int slice = S::kScoringWarps == 4 ? column : group == 0 ? column : column - 2;
  const bool scores = slice >= 0 && slice < S::kScoringWarps;
  const int quad_row = lane >> 2, quad_col = lane & 3;
  const int b = blockIdx.z, split = blockIdx.y;
  const int rows = nodes * heads;
  const int row0 = blockIdx.x * S::kRows;

  const KeyRange range = key_range<kKeys>(lengths, b, l_max, nodes, split, chunk);
  const int kv_len = range.kv_len, key_begin = range.begin, n_tiles = range.tiles;

  // Loads: 8 threads per row, thread `load_sub` copies chunks load_sub + 8q (q < 9), so a warp
  // reads four full 128-byte segments per instruction and the swizzle is one per-thread constant.
  constexpr int kRowsPerPass = S::kThreads / 8;
  const int load_row = tid >> 3, load_sub = tid & 7;
  const u32 load_swizzle = (load_sub ^ (load_row & 7)) << 4;  // row & 7 is the same in every pass
  const u16* cache_b = cache + (i64)b * l_max * kWidth;
  auto load_tile = [&](int tile, int stage) {
    const int tile_start = key_begin + tile * kKeys;
#pragma unroll
    for (int pass = 0; pass < kKeys / kRowsPerPass; ++pass) {
      const int r = pass * kRowsPerPass + load_row;
      const bool valid = tile_start + r < kv_len;
      const u16* src = cache_b + (i64)(valid ? tile_start + r : 0) * kWidth + load_sub * 8;
      const u32 dst = kv_smem + stage * S::kStageBytes + r * kRowBytes + load_swizzle;
#pragma unroll
      for (int q = 0; q < kRowChunks / 8; ++q) kd_cp_async16(dst + q * 128, src + q * 64, valid);
    }
  };

  // Prologue: Q (with the first tile, as group 0), then the rest of the ring.
#pragma unroll
  for (int pass = 0; pass < S::kRows / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + load_row;
    const bool valid = row0 + r < rows;
    const i64 q_row = (i64)b * rows + (valid ? row0 + r : 0);
    const u16* latent = q_latent + q_row * kLatent + load_sub * 8;
    const u32 dst = q_smem + r * kRowBytes + load_swizzle;
#pragma unroll
    for (int q = 0; q < kLatent / 64; ++q) kd_cp_async16(dst + q * 128, latent + q * 64, valid);
    kd_cp_async16(dst + (kLatent / 64) * 128, q_rope + q_row * kRope + load_sub * 8, valid);
  }
#pragma unroll
  for (int stage = 0; stage < kStages - 1; ++stage) {
    if (stage < n_tiles) load_tile(stage, stage);
    kd_cp_async_commit();
  }

  float o[kRowTiles][16][4];  // O for rows (group, tile, quad_row [+8]) × this warp's 128 columns
  float row_max[kRowTiles][2], row_sum[kRowTiles][2];  // log2-domain running max, partial sums
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt) {
#pragma unroll
    for (int j = 0; j < 16; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = kd_neg_inf_f();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const int warp_row0 = group * S::kWarpRows;  // first CTA row of this warp's group
  const int barrier_id = 1 + group;
  const int group_threads = 128;

  // ldmatrix lane addresses. Every operand row read by a lane has row % 8 == lane % 8, so chunk
  // 2k + hi of the swizzled layout sits at 128·(k / 4) + 16·((2·(k % 4)) ^ hi ^ lane % 8): four
  // per-lane offsets (k % 4) per operand, the rest is an immediate.
  u32 q_lane[4], k_lane[4], v_lane[4];
  {
    const int q_hi = lane >> 4, k_hi = (lane >> 3) & 1, v_hi = lane >> 4, r7 = lane & 7;
    const int q_row = warp_row0 + (lane & 15);
    const int k_row = S::kKeyTiles == 1 ? max(slice, 0) * 8 + (lane & 7)
                                        : max(slice, 0) * S::kWarpKeys + (lane & 7) + ((lane >> 4) << 3);
    const int v_row = lane & 15;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      q_lane[m] = q_smem + q_row * kRowBytes + (((2 * m) ^ q_hi ^ r7) << 4);
      k_lane[m] = k_row * kRowBytes + (((2 * m) ^ k_hi ^ r7) << 4);
      v_lane[m] = v_row * kRowBytes + column * 256 + (((2 * m) ^ v_hi ^ r7) << 4);
    }
  }
  const u32 p_lane = p_smem + (warp_row0 + (lane & 15)) * S::kPStride + (lane >> 4) * 16;

  // 16-row warps keep their Q fragments (36 × 4 registers) across tiles: S then reads only K from
  // shared memory, a third of its ldmatrix traffic, which bounds S for these small warp tiles. The
  // first step's barrier orders these reads before the ring reuses the stage.
  constexpr bool kQInRegisters = S::kQInRegisters;
  u32 q_frag[kQInRegisters ? kWidth / 16 : 1][4];
  if constexpr (kQInRegisters) {
    kd_cp_async_wait<kStages - 2>();  // Q (and tile 0)
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kWidth / 16; ++kk) ldmatrix_x4(q_frag[kk], q_lane[kk & 3] + (kk >> 2) * 128);
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    kd_cp_async_wait<kStages - 2>();
    __syncthreads();  // tile visible to all; everyone is done with tile - 1 (its stage and P)
    {
      const int next = tile + kStages - 1;
      if (next < n_tiles) load_tile(next, next % kStages);
      kd_cp_async_commit();
    }
    const u32 stage = kv_smem + (tile % kStages) * S::kStageBytes;
    const int tile_start = key_begin + tile * kKeys;

    // S = Q·Kᵀ for this warp's rows and its kWarpKeys keys, over all 576 dims (scoring warps only).
    // Small warp tiles accumulate alternate k-steps into separate chains (MMA latency).
    float chains[S::kChains][kRowTiles][S::kKeyTiles][4];
    float (&s)[kRowTiles][S::kKeyTiles][4] = chains[0];
    if (scores) {
#pragma unroll
      for (int c = 0; c < S::kChains; ++c)
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < S::kKeyTiles; ++nt)
            chains[c][mt][nt][0] = chains[c][mt][nt][1] = chains[c][mt][nt][2] = chains[c][mt][nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kWidth / 16; ++kk) {
        u32 a[kRowTiles][4];
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
          if constexpr (kQInRegisters) {
#pragma unroll
            for (int i = 0; i < 4; ++i) a[mt][i] = q_frag[kk][i];
          } else {
            ldmatrix_x4(a[mt], q_lane[kk & 3] + mt * 16 * kRowBytes + (kk >> 2) * 128);
          }
        }
        u32 bk[S::kKeyTiles][2];
        if constexpr (S::kKeyTiles == 1) {
          u32 r[2];
          ldmatrix_x2(r, stage + k_lane[kk & 3] + (kk >> 2) * 128);
          bk[0][0] = r[0]; bk[0][1] = r[1];
        } else {
#pragma unroll
          for (int pair = 0; pair < S::kKeyTiles / 2; ++pair) {
            u32 r[4];
            ldmatrix_x4(r, stage + k_lane[kk & 3] + pair * 16 * kRowBytes + (kk >> 2) * 128);
            bk[2 * pair][0] = r[0]; bk[2 * pair][1] = r[1]; bk[2 * pair + 1][0] = r[2]; bk[2 * pair + 1][1] = r[3];
          }
        }
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < S::kKeyTiles; ++nt)
            kd_mma_m16n8k16<kHalf>(chains[kk % S::kChains][mt][nt], a[mt], bk[nt][0], bk[nt][1]);
      }
#pragma unroll
      for (int c = 1; c < S::kChains; ++c)
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int nt = 0; nt < S::kKeyTiles; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] += chains[c][mt][nt][e];

      // Mask: keys past the split or the tree, and tree keys that are not ancestors.
      if (tile_start + kKeys > range.unmasked_end) {
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = row0 + warp_row0 + mt * 16 + quad_row + 8 * h;
            const bool real_row = row < rows;
            const u32* mask_row = mask + ((i64)b * nodes + (real_row ? row / heads : 0)) * words;
#pragma unroll
            for (int nt = 0; nt < S::kKeyTiles; ++nt)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int key = tile_start + slice * S::kWarpKeys + nt * 8 + 2 * quad_col + e;
                if (!key_visible(key, range, real_row, mask_row)) s[mt][nt][2 * h + e] = kd_neg_inf_f();
              }
          }
      }

      // Row maxima of this warp's keys, exchanged with the group's other scoring warps.
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float m = kd_neg_inf_f();
#pragma unroll
          for (int nt = 0; nt < S::kKeyTiles; ++nt) m = fmaxf(m, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
          quad_reduce_store<true>(m, exchange + slice * S::kRows + warp_row0 + mt * 16 + quad_row + 8 * h, quad_col);
        }
    }
    group_barrier(barrier_id, group_threads);

    // Every warp rescales its O; scoring warps turn S into P (bf16/f16, shared memory).
#pragma unroll
    for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row0 + mt * 16 + quad_row + 8 * h;
        float tile_max = exchange[r];
#pragma unroll
        for (int w = 1; w < S::kScoringWarps; ++w) tile_max = fmaxf(tile_max, exchange[w * S::kRows + r]);
        const float new_max = fmaxf(row_max[mt][h], tile_max * scale_log2);
        const float base = new_max == kd_neg_inf_f() ? 0.f : new_max;  // a row with no key yet
        const float alpha = fast_exp2(row_max[mt][h] - base);
        row_max[mt][h] = new_max;
        float sum = 0.f;
        if (scores) {
#pragma unroll
          for (int nt = 0; nt < S::kKeyTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = fast_exp2(fmaf(s[mt][nt][2 * h + e], scale_log2, -base));
              s[mt][nt][2 * h + e] = p;
              sum += p;
            }
            const int key = slice * S::kWarpKeys + nt * 8 + 2 * quad_col;
            *reinterpret_cast<u32*>(p_bytes + r * S::kPStride + key * 2) =
                kd_pack2<kHalf>(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]);
          }
        }
        row_sum[mt][h] = row_sum[mt][h] * alpha + sum;
        if (__any_sync(KD_FULL_MASK, alpha != 1.f)) {  // most tiles leave every row maximum unchanged
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            o[mt][j][2 * h] *= alpha;
            o[mt][j][2 * h + 1] *= alpha;
          }
        }
      }
    group_barrier(barrier_id, group_threads);

    // O += P·V for this warp's 128 output columns; V = the tile's first 512 columns.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      u32 a[kRowTiles][4];
#pragma unroll
      for (int mt = 0; mt < kRowTiles; ++mt)
        ldmatrix_x4(a[mt], p_lane + mt * 16 * S::kPStride + kk * 32);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        u32 v[4];
        ldmatrix_x4_trans(v, stage + v_lane[j & 3] + kk * 16 * kRowBytes + (j >> 2) * 128);
#pragma unroll
        for (int mt = 0; mt < kRowTiles; ++mt) {
          kd_mma_m16n8k16<kHalf>(o[mt][2 * j], a[mt], v[0], v[1]);
          kd_mma_m16n8k16<kHalf>(o[mt][2 * j + 1], a[mt], v[2], v[3]);
        }
      }
    }
  }
  kd_cp_async_wait<0>();

  // Row sums: over the quad, then over the group's four warps (the exchange buffer is free: every
  // warp of the group passed the last tile's second barrier, after its last read of the maxima).
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      quad_reduce_store<false>(row_sum[mt][h], exchange + column * S::kRows + warp_row0 + mt * 16 + quad_row + 8 * h,
                               quad_col);
  group_barrier(barrier_id, group_threads);

  // The normalised rows, in the output's 16-bit type, staged at the start of shared memory: the
  // group's Q rows (dead: every warp of the group is past its last S) or, with Q in registers, KV
  // stage 0 (dead once every group is past its last P·V), and stored by store_staged_rows. Row r
  // is staged 16·(r % 8) bytes into its row, so that eight rows' fragment stores fall in
  // different banks.
  if constexpr (kQInRegisters && kRowGroups > 1) __syncthreads();
  const RowDestination dst = row_destination(out, lse, partial_out, partial_lse, b, rows, row0);
  auto staged_row = [&](int r) { return smem + r * kRowBytes + (r & 7) * 16; };
#pragma unroll
  for (int mt = 0; mt < kRowTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp_row0 + mt * 16 + quad_row + 8 * h;
      const float l = exchange[r] + exchange[S::kRows + r] + exchange[2 * S::kRows + r] + exchange[3 * S::kRows + r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      if (column == 0 && quad_col == 0 && row0 + r < rows) dst.lse[r] = row_lse(row_max[mt][h], l);
#pragma unroll
      for (int j = 0; j < 16; ++j)
        *reinterpret_cast<u32*>(staged_row(r) + (column * 128 + 8 * j + 2 * quad_col) * 2) =
            kd_pack2<kHalf>(o[mt][j][2 * h] * inv, o[mt][j][2 * h + 1] * inv);
    }
  group_barrier(barrier_id, group_threads);
  store_staged_rows(dst.o + (i64)warp_row0 * kLatent, min(S::kWarpRows, rows - row0 - warp_row0), kLatent * 2,
                    tid & (group_threads - 1), group_threads, [&](int r) { return staged_row(warp_row0 + r); });
}

}  // namespace va

#define VA_KERNEL(NAME, HALF, ROW_TILES, ROW_GROUPS, KEYS, STAGES, SCORING)                                     \
  extern "C" __global__ void __launch_bounds__(128 * (ROW_GROUPS), 1) NAME(                                    \
      const u16* q_latent, const u16* q_rope, const u16* cache, const int* lengths, const u32* mask, u16* out, \
      float* lse, u16* partial_out, float* partial_lse, int nodes, int heads, int l_max, int words,           \
      int chunk, float scale_log2) {                                                                          \
    va::verify_attn_cta<(HALF) != 0, ROW_TILES, ROW_GROUPS, KEYS, STAGES, SCORING>(                           \
        q_latent, q_rope, cache, lengths, mask, out, lse, partial_out, partial_lse, nodes, heads, l_max,     \
        words, chunk, scale_log2);                                                                            \
  }

#ifdef VA_KEYS
// NVRTC: the configuration the launcher chose.
VA_KERNEL(verify_attn, VA_HALF, VA_ROW_TILES, VA_ROW_GROUPS, VA_KEYS, VA_STAGES, VA_SCORING)
#else
// nvcc: every configuration of kdtree_lib.verify_attn.KERNEL_CONFIGS (bf16; f16 is the same code).
VA_KERNEL(verify_attn_rows64_keys64_stages2, 0, 2, 2, 64, 2, 4)
VA_KERNEL(verify_attn_rows64_keys64_stages2_wide, 0, 2, 2, 64, 2, 2)
VA_KERNEL(verify_attn_rows32_keys64_stages2, 0, 2, 1, 64, 2, 4)
VA_KERNEL(verify_attn_rows32_keys32_stages3, 0, 2, 1, 32, 3, 4)
VA_KERNEL(verify_attn_rows32_keys32_stages2, 0, 1, 2, 32, 2, 4)
VA_KERNEL(verify_attn_rows16_keys64_stages2, 0, 1, 1, 64, 2, 4)
VA_KERNEL(verify_attn_rows16_keys32_stages4, 0, 1, 1, 32, 4, 4)
VA_KERNEL(verify_attn_rows16_keys32_stages2, 0, 1, 1, 32, 2, 4)
#endif

VA_MERGE_KERNELS
