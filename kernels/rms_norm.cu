// rms_norm.cu — RMSNorm over the last axis of 16-bit rows, alone or after a residual add; launched from
// kdtree_lib/rms_norm.py, which holds the torch formula these reproduce (kdtree_lib.model.RMSNorm's).
//
//   v1  rms_norm_<dtype>_held<k>: one CTA per row; thread t holds the row's 16-byte vectors (8 values)
//       t, t + blockDim, ... (k of them) in registers, squares them in fp32 (each square rounded, as
//       torch's pow), and one block reduction gives the sum; then the row is written with torch's
//       rounding points: out = weight * to_dtype(x * rsqrt(sum * (1/dim) + eps)), the product with
//       the weight rounded to the dtype as torch's mul of two 16-bit tensors rounds it.
//   v1  rms_norm_add_<dtype>_held<k>: the same over s = x + residual (rounded to the dtype as torch's
//       add), which is written out as well (the residual stream the layer carries on).
//
// The block size depends on the row length only, so a row's summation order, and its output, is the
// same whatever the number of rows in the launch (torch's reduction splits differently by shape).
// Only that order differs from torch's: the fp32 sum moves by a few ulps, which rarely flips one
// output rounding (tests/test_rms_norm_kernel.py derives the bound).
#include "common.cuh"

#define KD_NORM_VALUES 8  // 16-bit values per 16-byte vector

// Row r of x (row stride x_stride elements), of residual when kAdd (stride residual_stride) -> out row r
// (contiguous), and summed row r when kAdd. dim % 8 == 0, every row and weight 16-byte aligned,
// dim / 8 <= kVec * blockDim.x (the launcher's checks).
template <bool kHalf, int kVec, bool kAdd>
__device__ __forceinline__ void rms_norm_row(const u16* __restrict__ x, i64 x_stride, const u16* __restrict__ residual,
                                             i64 residual_stride, const u16* __restrict__ weight, int dim,
                                             float inv_dim, float eps, u16* __restrict__ out,
                                             u16* __restrict__ summed) {
    __shared__ float scratch[KD_WARP_SIZE];
    const i64 row = blockIdx.x;
    const int vectors = dim / KD_NORM_VALUES;
    const uint4* x_row = reinterpret_cast<const uint4*>(x + row * x_stride);
    u32 held[kVec][4];  // a vector as 4 words of 2 values
    float squares = 0.f;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
        const int v = threadIdx.x + j * blockDim.x;
        if (v >= vectors) continue;
        const uint4 loaded = x_row[v];
        held[j][0] = loaded.x, held[j][1] = loaded.y, held[j][2] = loaded.z, held[j][3] = loaded.w;
        if constexpr (kAdd) {
            const uint4 other = reinterpret_cast<const uint4*>(residual + row * residual_stride)[v];
            const u32 others[4] = {other.x, other.y, other.z, other.w};
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                const float2 a = kd_unpack2<kHalf>(held[j][w]), b = kd_unpack2<kHalf>(others[w]);
                held[j][w] = kd_pack2<kHalf>(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y));
            }
            uint4* summed_row = reinterpret_cast<uint4*>(summed + row * (i64)dim);
            summed_row[v] = uint4{held[j][0], held[j][1], held[j][2], held[j][3]};
        }
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float2 pair = kd_unpack2<kHalf>(held[j][w]);
            // rounded products, then adds: no fused multiply-add, as torch's pow then sum
            squares = __fadd_rn(squares, __fmul_rn(pair.x, pair.x));
            squares = __fadd_rn(squares, __fmul_rn(pair.y, pair.y));
        }
    }
    const float total = kd_block_all_reduce(squares, [](float a, float b) { return __fadd_rn(a, b); }, scratch);
    const float scale = rsqrtf(__fadd_rn(__fmul_rn(total, inv_dim), eps));  // torch: mean = sum * (1/n), + eps
    const uint4* weight_vectors = reinterpret_cast<const uint4*>(weight);
    uint4* out_row = reinterpret_cast<uint4*>(out + row * (i64)dim);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
        const int v = threadIdx.x + j * blockDim.x;
        if (v >= vectors) continue;
        const uint4 gains = weight_vectors[v];
        const u32 gain_words[4] = {gains.x, gains.y, gains.z, gains.w};
        u32 result[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const float2 pair = kd_unpack2<kHalf>(held[j][w]), gain = kd_unpack2<kHalf>(gain_words[w]);
            // x.float() * scale, .to(dtype), then weight * that (in fp32, rounded to the dtype)
            const u32 rounded = kd_pack2<kHalf>(__fmul_rn(pair.x, scale), __fmul_rn(pair.y, scale));
            const float2 normed = kd_unpack2<kHalf>(rounded);
            result[w] = kd_pack2<kHalf>(__fmul_rn(gain.x, normed.x), __fmul_rn(gain.y, normed.y));
        }
        out_row[v] = uint4{result[0], result[1], result[2], result[3]};
    }
}

// One launch per (dtype, vectors a thread holds, fused add): grid (rows), block (threads, a multiple of 32).
// (1024, 1): with the default minimum ptxas held one variant to 32 registers and spilled.
#define KD_NORM_KERNELS(kHalf, dtype, kVec)                                                                      \
    extern "C" __global__ void __launch_bounds__(1024, 1)                                                        \
    rms_norm_##dtype##_held##kVec(const u16* __restrict__ x, i64 x_stride, const u16* __restrict__ weight,       \
                                  int dim, float inv_dim, float eps, u16* __restrict__ out) {                    \
        rms_norm_row<kHalf, kVec, false>(x, x_stride, nullptr, 0, weight, dim, inv_dim, eps, out, nullptr);      \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024, 1)                                                        \
    rms_norm_add_##dtype##_held##kVec(const u16* __restrict__ x, i64 x_stride, const u16* __restrict__ residual, \
                                      i64 residual_stride, const u16* __restrict__ weight, int dim,              \
                                      float inv_dim, float eps, u16* __restrict__ out,                           \
                                      u16* __restrict__ summed) {                                                \
        rms_norm_row<kHalf, kVec, true>(x, x_stride, residual, residual_stride, weight, dim, inv_dim, eps, out,  \
                                        summed);                                                                 \
    }

KD_NORM_KERNELS(false, bf16, 1)
KD_NORM_KERNELS(false, bf16, 2)
KD_NORM_KERNELS(false, bf16, 4)
KD_NORM_KERNELS(false, bf16, 8)
KD_NORM_KERNELS(true, f16, 1)
KD_NORM_KERNELS(true, f16, 2)
KD_NORM_KERNELS(true, f16, 4)
KD_NORM_KERNELS(true, f16, 8)
