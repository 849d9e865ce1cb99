// common.cuh — small generic device helpers shared by the kdtree kernels.
//
// No kernel-specific logic lives here: integer helpers, IEEE infinities without <math.h>
// (NVRTC compiles these files without system headers), lane/warp indices, warp and block scans,
// and two warp-aggregated shared-memory atomics (histogram increment, append to a list).
// Every block-level helper must be called by all threads of the block (blockDim.x a multiple of 32).
#pragma once

#define KD_FULL_MASK 0xffffffffu
#define KD_WARP_SIZE 32

__host__ __device__ __forceinline__ constexpr int kd_ceil_div(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ float kd_neg_inf_f() { return __int_as_float(0xff800000); }
__device__ __forceinline__ double kd_neg_inf_d() { return __longlong_as_double(0xfff0000000000000LL); }

__device__ __forceinline__ int kd_lane() { return threadIdx.x & (KD_WARP_SIZE - 1); }
__device__ __forceinline__ int kd_warp() { return threadIdx.x / KD_WARP_SIZE; }
__device__ __forceinline__ unsigned kd_lanemask_lt() { return (1u << kd_lane()) - 1u; }

// Inclusive prefix sum over the 32 lanes of a warp.
__device__ __forceinline__ unsigned kd_warp_inclusive_scan(unsigned value) {
#pragma unroll
    for (int offset = 1; offset < KD_WARP_SIZE; offset <<= 1) {
        const unsigned other = __shfl_up_sync(KD_FULL_MASK, value, offset);
        if (kd_lane() >= offset) value += other;
    }
    return value;
}

// Inclusive prefix sum over the block in thread order. scratch: __shared__ unsigned[32].
__device__ __forceinline__ unsigned kd_block_inclusive_scan(unsigned value, unsigned* scratch) {
    const unsigned inclusive = kd_warp_inclusive_scan(value);
    if (kd_lane() == KD_WARP_SIZE - 1) scratch[kd_warp()] = inclusive;
    __syncthreads();
    if (kd_warp() == 0) {
        const int warps = blockDim.x / KD_WARP_SIZE;
        unsigned total = kd_lane() < warps ? scratch[kd_lane()] : 0u;
        total = kd_warp_inclusive_scan(total);
        if (kd_lane() < warps) scratch[kd_lane()] = total;
    }
    __syncthreads();
    const unsigned before = kd_warp() > 0 ? scratch[kd_warp() - 1] : 0u;
    __syncthreads();  // scratch may be reused as soon as this returns
    return before + inclusive;
}

// hist[bin] += 1 for every lane with bin >= 0, one shared atomic per distinct bin in the warp.
// All 32 lanes must call it (pass bin = -1 for "nothing to count").
__device__ __forceinline__ void kd_warp_histogram_add(unsigned* hist, int bin) {
    const unsigned peers = __match_any_sync(KD_FULL_MASK, bin);
    if (bin >= 0 && kd_lane() == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned)__popc(peers));
}

// Reserve one slot of a shared list per lane with take == true (warp-aggregated atomicAdd on
// *count); returns the slot, or -1 for lanes that take nothing. All 32 lanes must call it.
__device__ __forceinline__ int kd_warp_append(unsigned* count, bool take) {
    const unsigned takers = __ballot_sync(KD_FULL_MASK, take);
    if (takers == 0u) return -1;
    const int leader = __ffs(takers) - 1;
    unsigned base = 0u;
    if (kd_lane() == leader) base = atomicAdd(count, (unsigned)__popc(takers));
    base = __shfl_sync(KD_FULL_MASK, base, leader);
    return take ? (int)(base + __popc(takers & kd_lanemask_lt())) : -1;
}
