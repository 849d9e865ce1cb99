// Probes: kernels that measure the machine, not the problem, so a benchmark can put a kernel's time
// beside what the device can do at best. Launched from kdtree_lib/bench/ceilings.py, each timed the
// way the benchmarks time every call (kdtree_lib/bench/timing.py: CUDA events, L2 flushed first).
//
// Kernels:
//   mma_sync_ceiling: the rate of the MMA of the portable verify-attention and MoE kernels
//                     (common.cuh's kd_mma_m16n8k16: bf16 in, fp32 accumulators) with no memory
//                     traffic: 8 independent chains a warp on register operands, enough to keep the
//                     tensor pipe full.
//   launch_floor:     an empty kernel: what one launch costs under the benchmarks' timing, a floor
//                     under every call's time however little work it does.
//   launch_params:    the host's side of a launch: parameter packing and its cost (see below).
// The copy-bandwidth ceiling is torch's device-to-device copy (bench/ceilings.copy_bandwidth).

#include "common.cuh"

// FLOPs = blocks · warps · iters · 8 chains · 4096 (one m16n8k16).
extern "C" __global__ void __launch_bounds__(256) mma_sync_ceiling(float* sink, int iters) {
  const u32 x = 0x3c003c00u ^ (threadIdx.x & 0x00010001u);  // small finite bf16 pairs
  const u32 a[4] = {x, x ^ 0x00020000u, x, x ^ 0x00000002u};
  float acc[8][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) kd_mma_m16n8k16<false>(acc[c], a, x, x ^ 0x00040004u);
  }
  float total = 0.f;
#pragma unroll
  for (int c = 0; c < 8; ++c) total += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (total == 1234.5f) sink[0] = total;  // never true; keeps the chains live
}

extern "C" __global__ void launch_floor() {}

// launch_params: a parameter list like the project's kernels' (scalars of every packed type and two
// pointers). With `out` set, thread 0 writes each parameter's bits there (the packing check of
// tests/test_cuda_launch.py: widened to 64 bits, floats as their bit patterns); with `out` null it
// does nothing, so its launch costs what an argument list costs the host (bench/ceilings.launch_host_costs).
extern "C" __global__ void launch_params(int a, unsigned int b, long long c, unsigned long long d, float e, double f,
                                         const void* p, unsigned long long* out) {
  if (out == nullptr || threadIdx.x != 0 || blockIdx.x != 0) return;
  out[0] = static_cast<unsigned int>(a);
  out[1] = b;
  out[2] = static_cast<unsigned long long>(c);
  out[3] = d;
  out[4] = __float_as_uint(e);
  out[5] = static_cast<unsigned long long>(__double_as_longlong(f));
  out[6] = reinterpret_cast<unsigned long long>(p);
}
