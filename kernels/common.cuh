// common.cuh — small generic device helpers shared by the kdtree kernels.
//
// No kernel-specific logic lives here: the fixed-width names of raw words, integer helpers, IEEE
// infinities and NaN, two float constants without <math.h> (NVRTC compiles these files without system
// headers), lane/warp indices, warp and block scans, a block-wide reduction, two warp-aggregated shared-memory atomics
// (histogram increment, append to a list), and the PTX wrappers more than one kernel file uses:
// the block's dynamic shared memory size, shared-window addresses, 16-byte cp.async, 16-bit pair
// conversions and the mma.sync m16n8k16 tile (bf16 or f16 in, fp32 accumulators).
// Every block-level helper must be called by all threads of the block (blockDim.x a multiple of 32).
#pragma once

#define KD_FULL_MASK 0xffffffffu
#define KD_WARP_SIZE 32

typedef unsigned short u16;     // a bf16 or f16 value as stored (CuPy holds torch's bf16 as int16)
typedef unsigned int u32;       // a packed pair of 16-bit values, a shared-window address
typedef unsigned long long u64;
typedef long long i64;          // element offsets into tensors past 2^31 elements

// Functions, not constexpr variables: NVRTC builds (CuPy's --device-as-default-execution-space)
// would emit a namespace-scope constant as a __device__ global into every module.
__host__ __device__ __forceinline__ constexpr float kd_log2e() { return 1.4426950408889634f; }
__host__ __device__ __forceinline__ constexpr float kd_ln2() { return 0.6931471805599453f; }

__host__ __device__ __forceinline__ constexpr int kd_ceil_div(int a, int b) { return (a + b - 1) / b; }

__device__ __forceinline__ float kd_neg_inf_f() { return __int_as_float(0xff800000); }
__device__ __forceinline__ double kd_neg_inf_d() { return __longlong_as_double(0xfff0000000000000LL); }
__device__ __forceinline__ float kd_nan_f() { return __int_as_float(0x7fc00000); }  // a quiet NaN

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

// One value per lane of a warp exchanged with the lane `offset` away (lane ^ offset): the overloads the
// block reduction below finds; a kernel file adds one for its own struct.
__device__ __forceinline__ float kd_shfl_xor(float value, int offset) {
    return __shfl_xor_sync(KD_FULL_MASK, value, offset);
}
__device__ __forceinline__ u64 kd_shfl_xor(u64 value, int offset) {
    return __shfl_xor_sync(KD_FULL_MASK, value, offset);
}

// The reduction of one value per thread over the block by `op` (associative and commutative: max,
// min, an online-softmax merge), returned to every thread. scratch: __shared__ T[32], free again
// when this returns.
template <typename T, typename Op>
__device__ __forceinline__ T kd_block_all_reduce(T value, Op op, T* scratch) {
#pragma unroll
    for (int offset = KD_WARP_SIZE / 2; offset > 0; offset >>= 1) value = op(value, kd_shfl_xor(value, offset));
    if (kd_lane() == 0) scratch[kd_warp()] = value;
    __syncthreads();
    T total = scratch[0];
    for (int w = 1; w < (int)(blockDim.x / KD_WARP_SIZE); ++w) total = op(total, scratch[w]);
    __syncthreads();
    return total;
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

// ----------------------------------------------------------------------------------------------
// PTX wrappers

// The dynamic shared memory this launch was given: kernels trap when their launcher asked for less
// than the layout they were compiled for.
__device__ __forceinline__ u32 kd_dynamic_smem_bytes() {
    u32 bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
    return bytes;
}

// The shared-window address of a generic pointer into shared memory (cp.async, ldmatrix, mbarrier).
// PTX rather than __cvta_generic_to_shared: the two are not interchangeable for code generation
// (either one in place of the other moves the verify-attention and tree-build kernels' registers by
// up to 8), and the verify-attention kernels were tuned with this one.
__device__ __forceinline__ u32 kd_smem_address(const void* pointer) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
    return address;
}

// 16-byte async copy global -> shared; when !valid the destination is zero-filled and src unread.
__device__ __forceinline__ void kd_cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void kd_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void kd_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Two floats -> packed 16-bit pair (lo in the low half), round to nearest even; kHalf: f16, else bf16.
template <bool kHalf>
__device__ __forceinline__ u32 kd_pack2(float lo, float hi) {
    u32 packed;
    if constexpr (kHalf) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
    }
    return packed;
}

// A packed 16-bit pair back to two floats (lo from the low half); bf16 is the high half of an fp32.
template <bool kHalf>
__device__ __forceinline__ float2 kd_unpack2(u32 packed) {
    if constexpr (kHalf) {
        float lo, hi;
        asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
            : "=f"(lo), "=f"(hi) : "r"(packed));
        return float2{lo, hi};
    } else {
        return float2{__uint_as_float(packed << 16), __uint_as_float(packed & 0xffff0000u)};
    }
}

// d += a·b for one m16n8k16 tile (A row-major 16×16, B column-major 16×8, PTX fragment layouts),
// fp32 accumulators; kHalf: f16 inputs, else bf16. kernels/probes.cu times this instruction.
template <bool kHalf>
__device__ __forceinline__ void kd_mma_m16n8k16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (kHalf) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
