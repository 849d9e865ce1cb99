// Tree-verify attention for absorbed MLA on Hopper's warpgroup MMA (wgmma), sm_90a only. The
// portable mma.sync kernel (verify_attn.cu) states the problem and its napkin math (bytes and
// FLOPs per call) and stays the one for sm_120 and every other device; kdtree_lib/verify_attn.py
// picks this one on compute capability 9.0. Both share verify_attn_common.cuh (key range, mask,
// epilogue, split merge).
//
// Versions (docs/kernel-notes.md: what each one measured, and the trials not kept):
//   v1: 64 rows × 64-key tiles, two warpgroups splitting S = Q·Kᵀ by keys and owning the two halves
//       of O, 128-byte-swizzled shared memory read by wgmma descriptors
//   v2: like v1, one scorer: warpgroup 0 computes S as m64n64 and multiplies its P from registers
//   v3: like v2, pipelined: warpgroup 1 issues every KV load, whose landing completes the stage's
//       mbarrier phase, and its P·V trails warpgroup 0's S by a tile
//   v4: like v3, each warpgroup stages its rows in shared memory and stores them in 16-byte pieces;
//       16-bit split partials
//
// One CTA = 64 query rows (tree node × head) × one split of the key range, two warpgroups:
//   * Q (64 × 576) stays in shared memory; KV tiles of 64 keys stream through two cp.async stages.
//     Every 64-row × 576 tile is stored as nine 64-column blocks of 64 rows × 128 bytes, each row
//     128-byte swizzled (16-byte chunk c of row r at chunk c ^ r % 8), the layout a wgmma shared
//     memory descriptor reads directly, K-major (Q, K, P) as well as MN-major (V).
//   * Warpgroup 0 computes S = Q·Kᵀ once per tile (36 × m64n64k16, Q and K from shared memory)
//     and the online softmax in registers (log2 domain); it writes P (64 × 64, bf16/f16, swizzled)
//     over the tile's rope block, which only S reads, and the rows' rescale factors.
//   * O += P·V: warpgroup w owns output columns [256w, 256w + 256) (64 × 256 fp32, 128 registers
//     a thread): 4 × m64n256k16 with V = the tile's first 512 columns as the MN-major B operand,
//     P from warpgroup 0's registers or, for warpgroup 1, from shared memory.
//   * Warpgroup 1 also issues the KV loads; their landing completes the stage's mbarrier phase
//     (cp.async.mbarrier.arrive), so warpgroup 1 never waits for memory and its P·V of tile t can
//     overlap warpgroup 0's S of tile t + 1, instead of idling while warpgroup 0 scores.
//   * The contract is the portable kernel's: per-request lengths, mask only on tiles reaching the
//     tree slots or the split's end, rows past N·H and keys past len + N zero-filled (never
//     read), split partials (16-bit, fp32 LSE) merged by the merge kernels (VA_MERGE_KERNELS).

#include "verify_attn_common.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "verify_attn_sm90a.cu needs sm_90a (wgmma); build verify_attn.cu for other targets"
#endif

namespace va {
namespace wg {

constexpr int kRows = 64;                        // query rows per CTA (one wgmma M)
constexpr int kKeys = 64;                        // keys per KV tile
constexpr int kThreads = 256;                    // two warpgroups
constexpr int kBlockBytes = 64 * 128;            // one 64-column block of a 64-row tile
constexpr int kTileBytes = 9 * kBlockBytes;      // 64 rows × 576 (Q or one KV stage)
constexpr int kStatBytes = 4 * kRows * 4;        // rescale factors [2][64], row sums [64], 2 mbarriers
constexpr int kStagedRowBytes = kLatent * 2 + 16;  // an epilogue row in shared memory (padded: no bank conflicts)
constexpr int kAlign = 1024;                     // 128-byte swizzle atoms are 1024-byte aligned
constexpr int kSmemBytes = kAlign + 3 * kTileBytes + kStatBytes;  // kdtree_lib KernelConfig.smem_bytes
static_assert(kSmemBytes <= 232448, "more than sm_90's 227 KB opt-in");

// Shared memory descriptor of a 128-byte-swizzled operand: start address, leading byte offset
// (MN-major: stride between 64-element blocks; unused K-major), stride byte offset (between
// 8-row groups), swizzle mode 1 (128 B). Offsets below 256 KB are added to the low word in 16 B.
__device__ __forceinline__ u64 smem_descriptor(u32 address, u32 leading_bytes, u32 stride_bytes) {
  return (u64)((address & 0x3ffff) >> 4) | ((u64)(leading_bytes >> 4) << 16) | ((u64)(stride_bytes >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy shared memory writes (threads, cp.async) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator accesses across wgmma's issue and wait.
template <int kCount>
__device__ __forceinline__ void fence_registers(float* registers) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(registers[i])::"memory");
}

// d (64 × 64, fp32) = a·bᵀ (+ d when accumulate): a, b K-major in shared memory.
template <bool kHalf>
__device__ __forceinline__ void wgmma_m64n64(float (&d)[32], u64 a, u64 b, bool accumulate) {
#define VA_WGMMA_N64(TYPE)                                                                                         \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                             \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                     \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),     \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),   \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])    \
      : "l"(a), "l"(b), "r"((int)accumulate))
  if constexpr (kHalf) {
    VA_WGMMA_N64("f16");
  } else {
    VA_WGMMA_N64("bf16");
  }
#undef VA_WGMMA_N64
}

#define VA_F8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
// The 128 fp32 accumulator operands of an m64n256 wgmma: their place-holders and registers d[0..127].
#define VA_ACCUMULATORS_256                                                                                      \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                       \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "                             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                             \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "                 \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define VA_ACCUMULATOR_REGISTERS_256                                                                             \
  VA_F8(0), VA_F8(8), VA_F8(16), VA_F8(24), VA_F8(32), VA_F8(40), VA_F8(48), VA_F8(56), VA_F8(64), VA_F8(72),   \
  VA_F8(80), VA_F8(88), VA_F8(96), VA_F8(104), VA_F8(112), VA_F8(120)

// d (64 × 256, fp32) += a·b: a (64 × 16) K-major, b (16 × 256) MN-major, both in shared memory.
template <bool kHalf>
__device__ __forceinline__ void wgmma_m64n256_mn(float (&d)[128], u64 a, u64 b) {
#define VA_WGMMA_N256(TYPE)                                                                                        \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                                                \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                           \
      VA_ACCUMULATORS_256                                                                                        \
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                                                         \
      : VA_ACCUMULATOR_REGISTERS_256                                                                             \
      : "l"(a), "l"(b), "r"(1))
  if constexpr (kHalf) {
    VA_WGMMA_N256("f16");
  } else {
    VA_WGMMA_N256("bf16");
  }
#undef VA_WGMMA_N256
}

// The same with a from registers (the m64k16 A fragment: rows 16·warp + quad_row (+8), columns
// 2·quad_col (+8) packed in pairs, i.e. the accumulator layout of S).
template <bool kHalf>
__device__ __forceinline__ void wgmma_m64n256_mn(float (&d)[128], const u32 (&a)[4], u64 b) {
#define VA_WGMMA_N256_RS(TYPE)                                                                                     \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                                                                \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"                                           \
      VA_ACCUMULATORS_256                                                                                        \
      "}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"                                                         \
      : VA_ACCUMULATOR_REGISTERS_256                                                                             \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
  if constexpr (kHalf) {
    VA_WGMMA_N256_RS("f16");
  } else {
    VA_WGMMA_N256_RS("bf16");
  }
#undef VA_WGMMA_N256_RS
}
#undef VA_ACCUMULATOR_REGISTERS_256
#undef VA_ACCUMULATORS_256
#undef VA_F8

__device__ __forceinline__ void barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// A shared memory mbarrier that completes a phase once `count` threads' cp.async copies (issued
// before their arrive_on_copies) have landed; consumers wait for the phase by its parity.
__device__ __forceinline__ void mbarrier_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_on_copies(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// The pipelined CTA: group 0 scores, group 1 loads and trails it. Per tile t (stage t % 2):
//   group 0: [wait for tile t's copies: mbarrier of the stage] S = Q·Kᵀ, softmax, O[:, :256]
//            rescaled, P written over the tile's rope block (dead once S is done) with the rows'
//            rescale factors, [P ready], P·V from its registers, [stage free, if tile t + 2 exists].
//   group 1: [wait P ready] O[:, 256:] rescaled, P·V from shared memory, [wait stage free] loads
//            of tile t + 2 into the stage, whose landing completes the stage's mbarrier phase.
// Group 1 never waits for a load, and its P·V of tile t can overlap group 0's S of tile t + 1.
// Named barriers pair group 0's arrivals with group 1's waits (256 threads each); each kind
// alternates between two ids by tile parity, so one side can never lap the other on an id.
constexpr int kPReady = 1, kStageFree = 3;  // ids kX + (tile & 1); 0 is __syncthreads'
constexpr int kStaged = 5;                  // + group: the group's epilogue rows are in shared memory

template <bool kHalf>
__device__ __forceinline__ void verify_attn_cta(
    const u16* __restrict__ q_latent, const u16* __restrict__ q_rope, const u16* __restrict__ cache,
    const int* __restrict__ lengths, const u32* __restrict__ mask, u16* __restrict__ out, float* __restrict__ lse,
    u16* __restrict__ partial_out, float* __restrict__ partial_lse, int nodes, int heads, int l_max, int words,
    int chunk, float scale_log2) {
  if (kd_dynamic_smem_bytes() < kSmemBytes) __trap();  // the launcher's KernelConfig.smem_bytes disagrees
  extern __shared__ unsigned char smem_raw[];
  const u32 raw_address = kd_smem_address(smem_raw);
  const u32 q_smem = (raw_address + kAlign - 1) & ~(kAlign - 1);
  const u32 kv_smem = q_smem + kTileBytes;  // two stages
  unsigned char* stage_bytes = smem_raw + (kv_smem - raw_address);
  float* rescale = reinterpret_cast<float*>(stage_bytes + 2 * kTileBytes);  // [2][64] by tile parity
  float* sums = rescale + 2 * kRows;                                        // [64] group 0's row sums
  const u32 tile_landed = kd_smem_address(sums + kRows);                    // 2 mbarriers, one per stage

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp >> 2;  // owns O columns [256g, 256g + 256); group 0 also scores
  const int quad_row = lane >> 2, quad_col = lane & 3;
  const int b = blockIdx.z, split = blockIdx.y;
  const int rows = nodes * heads;
  const int row0 = blockIdx.x * kRows;
  const KeyRange range = key_range<kKeys>(lengths, b, l_max, nodes, split, chunk);
  const int warp_row0 = (warp & 3) * 16;

  // Loads: 8 threads per row, thread `load_sub` copies chunk load_sub of each 64-column block, so
  // a warp reads four full 128-byte segments per instruction; the swizzle is a per-thread constant.
  // Q: all 256 threads; every KV tile: group 1's 128, signalling the stage's mbarrier.
  const int load_sub = tid & 7;
  const u16* cache_b = cache + (i64)b * l_max * kWidth;
  auto load_rows = [&](u32 dst_tile, int first, int threads_per_pass, int row_in_pass, auto source) {
    const u32 offset = row_in_pass * 128 + ((load_sub ^ (row_in_pass & 7)) << 4);  // row & 7 is the same in every pass
    for (int pass = 0; pass < kKeys * 8 / threads_per_pass; ++pass) {
      const int r = pass * (threads_per_pass / 8) + row_in_pass;
      const u32 dst = dst_tile + pass * (threads_per_pass / 8) * 128 + offset;
#pragma unroll
      for (int block = 0; block < 9; ++block) source(dst + block * kBlockBytes, first + r, block);
    }
  };
  auto kv_source = [&](u32 dst, int key, int block) {
    const bool valid = key < range.kv_len;
    kd_cp_async16(dst, cache_b + (i64)(valid ? key : 0) * kWidth + block * 64 + load_sub * 8, valid);
  };
  auto load_tile_and_signal = [&](int tile) {  // group 1
    load_rows(kv_smem + (tile & 1) * kTileBytes, range.begin + tile * kKeys, kThreads / 2, (tid - kThreads / 2) >> 3,
              kv_source);
    mbarrier_arrive_on_copies(tile_landed + 8 * (tile & 1));
  };
  if (tid == 0) {
    mbarrier_init(tile_landed, kThreads / 2);
    mbarrier_init(tile_landed + 8, kThreads / 2);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  load_rows(q_smem, row0, kThreads, tid >> 3, [&](u32 dst, int row, int block) {
    const bool valid = row < rows;
    const i64 q_row = (i64)b * rows + (valid ? row : 0);
    const u16* src = block < 8 ? q_latent + q_row * kLatent + block * 64 : q_rope + q_row * kRope;
    kd_cp_async16(dst, src + load_sub * 8, valid);
  });
  kd_cp_async_commit();
  if (group == 1 && range.tiles > 0) load_tile_and_signal(0);
  kd_cp_async_commit();
  kd_cp_async_wait<1>();  // Q (tiles are waited for on their mbarriers)
  fence_async_shared();
  __syncthreads();
  // Tile 1 only once Q is in: at the start every CTA loads at once, and the first S waits for
  // Q and tile 0 alone (tile 1 still lands before tile 0's P·V is done).
  if (group == 1 && range.tiles > 1) load_tile_and_signal(1);

  // Accumulator fragments (wgmma D layout): warp w of the group holds rows 16w + quad_row (+8);
  // element 4j + 2h + e is column 8j + 2·quad_col + e of row half h.
  float o[32][4];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  auto& o_tile = *reinterpret_cast<float(*)[128]>(&o[0][0]);
  // group 0: log2-domain max, partial sums
  float row_max[2] = {kd_neg_inf_f(), kd_neg_inf_f()}, row_sum[2] = {0.f, 0.f};
  const u64 q_desc = smem_descriptor(q_smem, 16, 1024);
  auto rescale_rows = [&](int h, float alpha) {  // O rows of half h times alpha
    if (__any_sync(KD_FULL_MASK, alpha != 1.f)) {  // most tiles leave every row maximum unchanged
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        o[j][2 * h] *= alpha;
        o[j][2 * h + 1] *= alpha;
      }
    }
  };

  for (int tile = 0; tile < range.tiles; ++tile) {
    const int parity = tile & 1;
    const u32 stage = kv_smem + parity * kTileBytes;
    const u32 p_smem = stage + 8 * kBlockBytes;  // the tile's rope block, free once S is done: P
    unsigned char* p_bytes = stage_bytes + parity * kTileBytes + 8 * kBlockBytes;  // the same, for stores
    const u64 v_desc = smem_descriptor(stage + group * 4 * kBlockBytes, kBlockBytes, 1024);
    if (group == 0) {
      mbarrier_wait(tile_landed + 8 * parity, (tile >> 1) & 1);  // the stage's (tile / 2)-th phase
      fence_async_shared();
      float s[8][4];
      const u64 k_desc = smem_descriptor(stage, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kWidth / 16; ++k) {
        const u32 step = ((k >> 2) * kBlockBytes + (k & 3) * 32) >> 4;
        wgmma_m64n64<kHalf>(*reinterpret_cast<float(*)[32]>(&s[0][0]), q_desc + step, k_desc + step, k > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      fence_registers<32>(&s[0][0]);

      const int tile_start = range.begin + tile * kKeys;
      if (tile_start + kKeys > range.unmasked_end) {  // keys past the split or the tree, non-ancestors
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = row0 + warp_row0 + quad_row + 8 * h;
          const bool real_row = row < rows;
          const u32* mask_row = mask + ((i64)b * nodes + (real_row ? row / heads : 0)) * words;
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!key_visible(tile_start + 8 * j + 2 * quad_col + e, range, real_row, mask_row))
                s[j][2 * h + e] = kd_neg_inf_f();
        }
      }
      // P = exp2(S·scale − max), row sums, O rescaled; P packed as A fragments (k step kk: key
      // tiles 2kk, 2kk + 1) and into the swizzled P tile (keys 8j + 2·quad_col in chunk j).
      u32 p_own[4][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = warp_row0 + quad_row + 8 * h;
        float m = kd_neg_inf_f();
#pragma unroll
        for (int j = 0; j < 8; ++j) m = fmaxf(m, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
        const float new_max = fmaxf(row_max[h], quad_reduce<true>(m) * scale_log2);
        const float base = new_max == kd_neg_inf_f() ? 0.f : new_max;  // a row with no key yet
        const float alpha = fast_exp2(row_max[h] - base);
        row_max[h] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s[j][2 * h] = fast_exp2(fmaf(s[j][2 * h], scale_log2, -base));
          s[j][2 * h + 1] = fast_exp2(fmaf(s[j][2 * h + 1], scale_log2, -base));
          sum += s[j][2 * h] + s[j][2 * h + 1];
          p_own[j >> 1][h + 2 * (j & 1)] = kd_pack2<kHalf>(s[j][2 * h], s[j][2 * h + 1]);
          *reinterpret_cast<u32*>(p_bytes + r * 128 + ((j ^ (r & 7)) << 4) + quad_col * 4) =
              p_own[j >> 1][h + 2 * (j & 1)];
        }
        row_sum[h] = row_sum[h] * alpha + sum;
        if (quad_col == 0) rescale[parity * kRows + r] = alpha;
        rescale_rows(h, alpha);
      }
      fence_async_shared();
      barrier_arrive(kPReady + parity, kThreads);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) wgmma_m64n256_mn<kHalf>(o_tile, p_own[kk], v_desc + ((kk * 16 * 128) >> 4));
      wgmma_commit();
      wgmma_wait_all();
      fence_registers<128>(&o[0][0]);
      if (tile + 2 < range.tiles) barrier_arrive(kStageFree + parity, kThreads);
    } else {
      group_barrier(kPReady + parity, kThreads);
#pragma unroll
      for (int h = 0; h < 2; ++h) rescale_rows(h, rescale[parity * kRows + warp_row0 + quad_row + 8 * h]);
      const u64 p_desc = smem_descriptor(p_smem, 16, 1024);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kKeys / 16; ++k)
        wgmma_m64n256_mn<kHalf>(o_tile, p_desc + ((k * 32) >> 4), v_desc + ((k * 16 * 128) >> 4));
      wgmma_commit();
      wgmma_wait_all();
      fence_registers<128>(&o[0][0]);
      if (tile + 2 < range.tiles) {
        group_barrier(kStageFree + parity, kThreads);
        load_tile_and_signal(tile + 2);
      }
    }
  }

  // Row sums over the quad (group 0), shared with group 1; group 0 writes the LSE.
  if (group == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) quad_reduce_store<false>(row_sum[h], sums + warp_row0 + quad_row + 8 * h, quad_col);
  }
  __syncthreads();  // also: every wgmma is done, so the Q tile and both stages are free
  // The normalised rows, in the output's 16-bit type, staged in the dead Q tile (each group its
  // own 256 columns) and stored by store_staged_rows.
  const RowDestination dst = row_destination(out, lse, partial_out, partial_lse, b, rows, row0);
  unsigned char* staging = smem_raw + (q_smem - raw_address) + group * 512;  // the group's half of each row
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp_row0 + quad_row + 8 * h;
    const float l = sums[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    if (group == 0 && quad_col == 0 && row0 + r < rows) dst.lse[r] = row_lse(row_max[h], l);
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<u32*>(staging + r * kStagedRowBytes + (8 * j + 2 * quad_col) * 2) =
          kd_pack2<kHalf>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
  }
  group_barrier(kStaged + group, kThreads / 2);
  store_staged_rows(dst.o + group * 256, min(kRows, rows - row0), 256 * 2, tid & 127, kThreads / 2,
                    [&](int r) { return staging + r * kStagedRowBytes; });
}

}  // namespace wg
}  // namespace va

#define VA_WGMMA_KERNEL(NAME, HALF)                                                                         \
  extern "C" __global__ void __launch_bounds__(va::wg::kThreads, 1) NAME(                                      \
      const u16* q_latent, const u16* q_rope, const u16* cache, const int* lengths, const u32* mask, u16* out, \
      float* lse, u16* partial_out, float* partial_lse, int nodes, int heads, int l_max, int words,         \
      int chunk, float scale_log2) {                                                                          \
    va::wg::verify_attn_cta<(HALF) != 0>(q_latent, q_rope, cache, lengths, mask, out, lse, partial_out,        \
                                         partial_lse, nodes, heads, l_max, words, chunk, scale_log2);          \
  }

#ifdef VA_HALF
// NVRTC: the type the launcher needs.
VA_WGMMA_KERNEL(verify_attn, VA_HALF)
#else
// nvcc (CI's compile test, ptxas -v): kdtree_lib.verify_attn.KERNEL_CONFIGS' wgmma variant, both types.
VA_WGMMA_KERNEL(verify_attn_rows64_keys64_wgmma_pipelined_bf16, 0)
VA_WGMMA_KERNEL(verify_attn_rows64_keys64_wgmma_pipelined_f16, 1)
#endif

VA_MERGE_KERNELS
