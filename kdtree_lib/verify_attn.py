"""Tree-verify attention for MLA in its weight-absorbed form.

Absorbed MLA is multi-query attention with 576-wide keys and 512-wide values shared by all heads:
per layer the cache holds kv [B, L_max, 576] = [c_kv (512) | k_rope (64)]. A head's query is
q_latent = q_nope · W_UK (512 wide) plus q_rope (64 wide); its output o_latent (512 wide) is
turned back into the head's value space by W_UV. Tree node i of request b (cache slot
lengths[b] + i) attends to every committed token (slots < lengths[b]) and to tree node j iff bit
(i, j) of the ancestor mask is set.

Outputs: o_latent [B, N, H, 512] (the dtype of q_latent) and lse float32 [B, N, H], the natural
log of the softmax denominator over the scaled scores, so partial results can be merged.

The reference is written in torch in fp32 (NumPy inputs go through it on the CPU); the naive
per-head form below is what it must agree with.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from .checks import as_torch, check_array, check_same_device, dtype_name, framework, to_numpy
from .contracts import Tree, unpack_mask

LATENT_DIM = 512
ROPE_DIM = 64
CACHE_DIM = LATENT_DIM + ROPE_DIM
# K2.6: softmax scale 1/sqrt(128 + 64) times YaRN's mscale squared, mscale = 1 + 0.1 ln(factor 64)
DEFAULT_SCALE = (128 + 64) ** -0.5 * (1 + 0.1 * math.log(64)) ** 2
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
KERNEL_DTYPES = ("bfloat16", "float16")  # what the cupy kernel takes; "auto" runs torch for the others


def verify_attention(q_latent, q_rope, cache, lengths, tree: Tree, *, scale: float = DEFAULT_SCALE,
                     backend: str = "auto"):
    """Attention of every tree node over its request's cache and its ancestors: (o_latent, lse)."""
    batch, nodes, heads = _check_args(q_latent, q_rope, cache, lengths, tree, scale)
    chosen = _backend.resolve(backend, ("torch", "numpy", "cupy"), q_latent, cache, kernel_dtypes=KERNEL_DTYPES)
    if chosen == "cupy":
        return _verify_attention_cupy(q_latent, q_rope, cache, lengths, tree, scale)
    as_numpy = framework(q_latent) == "numpy"
    q_latent, q_rope, cache = (as_torch(x) for x in (q_latent, q_rope, cache))
    allowed = key_mask(lengths, tree, cache.shape[1], device=cache.device)  # (B, N, L)
    out, lse = attend_latent(q_latent, q_rope, cache, allowed, scale)
    if as_numpy:
        return out.numpy(), lse.numpy()
    return out, lse


def attend_latent(q_latent, q_rope, cache, allowed, scale: float):
    """verify_attention's torch reference past its checks, over the key mask `allowed` bool [B, N, L]
    for cache [B, L, 576] (key_mask's): what the model's torch path runs per layer, the mask built
    once per step. No host synchronisation."""
    torch = _torch()
    kv = cache.float()
    scores = (torch.einsum("bnhc,blc->bnhl", q_latent.float(), kv[..., :LATENT_DIM])
              + torch.einsum("bnhr,blr->bnhl", q_rope.float(), kv[..., LATENT_DIM:])) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))  # (B, N, H, L)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bnhl,blc->bnhc", torch.exp(scores - lse[..., None]), kv[..., :LATENT_DIM])
    return out.to(q_latent.dtype), lse


def verify_attention_naive(q_nope, q_rope, cache, lengths, tree: Tree, *, w_uk, w_uv,
                           scale: float = DEFAULT_SCALE):
    """The same attention with per-head keys and values (what the absorbed form must equal).

    q_nope [B, N, H, d_nope]; w_uk [H, d_nope, 512] and w_uv [H, d_v, 512] are the two halves of
    kv_b_proj; keys are c_kv·W_UKᵀ ⊕ k_rope, values c_kv·W_UVᵀ. Returns (out [B, N, H, d_v], lse).
    """
    torch = _torch()
    q_nope, q_rope, cache, w_uk, w_uv = (as_torch(x).float() for x in (q_nope, q_rope, cache, w_uk, w_uv))
    allowed = key_mask(lengths, tree, cache.shape[1], device=cache.device)
    c_kv, k_rope = cache[..., :LATENT_DIM], cache[..., LATENT_DIM:]
    k_nope = torch.einsum("blc,hdc->blhd", c_kv, w_uk)  # (B, L, H, d_nope)
    values = torch.einsum("blc,hdc->blhd", c_kv, w_uv)  # (B, L, H, d_v)
    scores = (torch.einsum("bnhd,blhd->bnhl", q_nope, k_nope)
              + torch.einsum("bnhr,blr->bnhl", q_rope, k_rope)) * scale
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bnhl,blhd->bnhd", torch.exp(scores - lse[..., None]), values)
    return out, lse


def absorb_query(q_nope, w_uk):
    """q_latent = q_nope · W_UK per head: [B, N, H, d_nope] x [H, d_nope, 512] -> [B, N, H, 512]."""
    return _torch().einsum("bnhd,hdc->bnhc", q_nope, w_uk)


def project_output(o_latent, w_uv):
    """A head's value-space output from its latent output: o_latent · W_UVᵀ -> [B, N, H, d_v]."""
    return _torch().einsum("bnhc,hdc->bnhd", o_latent, w_uv)


def key_mask(lengths, tree: Tree, slots: int, *, device=None):
    """bool [B, N, slots]: may tree node i attend to cache slot l (committed prefix or ancestor)?
    Torch lengths and mask on `device` stay there (no host read: a decode step builds it); other
    inputs are copied there."""
    torch = _torch()
    nodes = tree.capacity
    if framework(lengths) == "torch" and framework(tree.mask) == "torch" and lengths.device == tree.mask.device:
        lengths = lengths.long().to(device or lengths.device)
        device = lengths.device
        words = tree.mask.to(device).contiguous().view(torch.int32).long() & 0xFFFFFFFF      # (B, N, W)
        bits = (words[..., None] >> torch.arange(32, device=device)) & 1                    # (B, N, W, 32), little-endian
        ancestors = bits.flatten(-2)[..., :nodes].bool()                                    # (B, N, N)
    else:
        lengths = torch.as_tensor(to_numpy(lengths).astype(np.int64), device=device)
        ancestors = torch.as_tensor(unpack_mask(tree.mask, nodes), device=device)  # (B, N, N)
    slot = torch.arange(slots, device=device)
    allowed = (slot[None, :] < lengths[:, None])[:, None, :].repeat(1, nodes, 1)  # (B, N, L)
    tree_slots = (lengths[:, None] + torch.arange(nodes, device=device))[:, None, :].expand(-1, nodes, -1)
    return allowed.scatter(2, tree_slots, ancestors)


def _check_args(q_latent, q_rope, cache, lengths, tree, scale):
    check_array("q_latent", q_latent, dtypes=FLOAT_DTYPES, shape=(None, None, None, LATENT_DIM))
    batch, nodes, heads, _ = q_latent.shape
    dtype = dtype_name(q_latent)
    check_array("q_rope", q_rope, dtypes=dtype, shape=(batch, nodes, heads, ROPE_DIM))
    check_array("cache", cache, dtypes=dtype, shape=(batch, None, CACHE_DIM))
    check_array("lengths", lengths, dtypes=("int32", "int64"), shape=(batch,))
    if not isinstance(tree, Tree):
        raise ValueError(f"tree: expected a Tree, got {type(tree).__name__}")
    if (tree.batch, tree.capacity) != (batch, nodes):
        raise ValueError(f"tree: expected batch {batch} and {nodes} nodes (as q_latent), "
                         f"got batch {tree.batch} and {tree.capacity} nodes")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale: expected a positive finite number, got {scale!r}")
    check_same_device(q_latent=q_latent, q_rope=q_rope, cache=cache, lengths=lengths,
                      **{"tree.mask": tree.mask})
    if framework(lengths) != "cupy" and not (framework(lengths) == "torch" and lengths.is_cuda):
        host_lengths = to_numpy(lengths)
        if (host_lengths < 0).any() or (host_lengths + nodes > cache.shape[1]).any():
            raise ValueError(f"lengths: each must be >= 0 with lengths + {nodes} tree nodes "
                             f"<= L_max={cache.shape[1]}")
    return batch, nodes, heads


def _torch():
    import torch
    return torch


# ----------------------------------------------------------------------------------------------
# CuPy kernels: tensor-core tree-verify attention, portable (kernels/verify_attn.cu, mma.sync) and
# Hopper-only (kernels/verify_attn_sm90a.cu, wgmma)

KERNEL_FILE = "verify_attn.cu"
KERNEL_FILE_SM90A = "verify_attn_sm90a.cu"
MIN_SPLIT_KEYS = 64  # a split may be a single KV tile: short contexts still spread over the SMs
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant of the kernel: CTA shape and pipeline depth (template parameters)."""
    row_tiles: int   # 16-row MMA tiles per warp
    row_groups: int  # groups of 4 warps; a CTA holds 16 * row_tiles * row_groups query rows
    keys: int        # keys per KV tile
    stages: int      # depth of the cp.async ring
    scoring: int = 4  # warps of a group computing S (2: two 32x32 warp tiles, less shared-memory traffic)
    wgmma: bool = False  # the sm_90a kernel (two warpgroups, 64 rows x 64-key tiles, two stages, pipelined)

    @property
    def rows(self) -> int:
        return 16 * self.row_tiles * self.row_groups

    @property
    def threads(self) -> int:
        return 128 * self.row_groups

    @property
    def smem_bytes(self) -> int:
        """Q tile + KV ring + P + the row-statistics exchange (kernels' kSmemBytes).

        mma.sync: P rows padded by 16 bytes, a 4 x rows exchange; warps of 16 rows hold Q in
        registers and stage it in the ring's last stage (no Q tile). wgmma: P over the tile's rope
        block, 4 x rows statistics (rescale factors, row sums, mbarriers), 1 KB to align the swizzle atoms."""
        row_bytes = 2 * CACHE_DIM
        q_tile = 0 if self.q_in_registers else self.rows * row_bytes
        tiles = q_tile + self.stages * self.keys * row_bytes
        if self.wgmma:
            return 1024 + tiles + 4 * self.rows * 4
        return tiles + self.rows * (self.keys + 8) * 2 + 4 * self.rows * 4

    @property
    def q_in_registers(self) -> bool:
        """mma.sync warps of 16 rows keep their Q fragments in registers (kernels/verify_attn.cu)."""
        return not self.wgmma and self.row_tiles == 1

    @property
    def q_fragment_registers(self) -> int:
        """32-bit registers a thread holds of Q across tiles: a 16 x 16 A fragment (4) per 16 of the
        576 columns, or 0 where S reads Q from shared memory."""
        return CACHE_DIM // 16 * 4 if self.q_in_registers else 0

    @property
    def accumulator_registers(self) -> int:
        """fp32 registers a thread holds of O (rows x 512, spread over the CTA's threads)."""
        return self.rows * LATENT_DIM // self.threads

    @property
    def kernel_file(self) -> str:
        return KERNEL_FILE_SM90A if self.wgmma else KERNEL_FILE

    @property
    def arch(self) -> str | None:
        """An architecture-specific NVRTC target, or None for the current device's own."""
        return "sm_90a" if self.wgmma else None

    def nvrtc_options(self, half: bool) -> tuple[str, ...]:
        if self.wgmma:
            return (f"-DVA_HALF={int(half)}",)
        return (f"-DVA_HALF={int(half)}", f"-DVA_ROW_TILES={self.row_tiles}", f"-DVA_ROW_GROUPS={self.row_groups}",
                f"-DVA_KEYS={self.keys}", f"-DVA_STAGES={self.stages}", f"-DVA_SCORING={self.scoring}")

    @property
    def name(self) -> str:
        if self.wgmma:
            return f"rows{self.rows}_keys{self.keys}_wgmma_pipelined"
        return f"rows{self.rows}_keys{self.keys}_stages{self.stages}" + ("_wide" if self.scoring == 2 else "")


# The variants (kernels/verify_attn.cu instantiates the same list for nvcc), and which to prefer
# for a request's rows = N*H: the largest CTA whose rows the request fills at least half.
KERNEL_CONFIGS = {c.name: c for c in (
    KernelConfig(row_tiles=2, row_groups=2, keys=64, stages=2),  # 64 rows share each KV tile
    KernelConfig(row_tiles=2, row_groups=2, keys=64, stages=2, scoring=2),
    KernelConfig(row_tiles=2, row_groups=1, keys=64, stages=2),
    KernelConfig(row_tiles=2, row_groups=1, keys=32, stages=3),
    KernelConfig(row_tiles=1, row_groups=2, keys=32, stages=2),  # two groups of 16-row warps: fits 99 KB
    KernelConfig(row_tiles=1, row_groups=1, keys=64, stages=2),
    KernelConfig(row_tiles=1, row_groups=1, keys=32, stages=4),  # few rows: deepest ring
    KernelConfig(row_tiles=1, row_groups=1, keys=32, stages=2),  # fits 99 KB per block (sm_120)
    KernelConfig(row_tiles=2, row_groups=2, keys=64, stages=2, wgmma=True),  # sm_90a (compute capability 9.0)
)}
# Per CTA size, the variants in the order the launcher tries them: the fastest on the H200 first (for
# 64 rows: wgmma where it runs, then two scoring warps, then four), then ones that fit in less shared
# memory; docs/kernel-notes.md has the measurements.
PREFERRED = {64: ("rows64_keys64_wgmma_pipelined", "rows64_keys64_stages2_wide", "rows64_keys64_stages2"),
             32: ("rows32_keys64_stages2", "rows32_keys32_stages3", "rows32_keys32_stages2"),
             16: ("rows16_keys64_stages2", "rows16_keys32_stages4", "rows16_keys32_stages2")}
MAX_SPLITS = 1024  # kernels/verify_attn.cu kMaxSplits
# 32-bit registers per SM on sm_90 and sm_120; every variant uses close to 255 a thread (ptxas -v),
# so a CTA of T threads takes 256·T of them and register files, not shared memory, can cap residency.
REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is cut: config, row blocks per request, key splits and keys per split."""
    config_name: str
    row_blocks: int
    splits: int
    chunk: int

    @property
    def config(self) -> KernelConfig:
        return KERNEL_CONFIGS[self.config_name]


def plan_launch(batch: int, rows: int, slots: int, *, sms: int, smem_per_block: int, smem_per_sm: int,
                wgmma: bool = False, config: str | None = None, splits: int | None = None) -> LaunchPlan:
    """Choose the variant (by rows = N*H, the device's shared memory and whether it runs sm_90a's
    wgmma) and the key split.

    Splits fill the GPU when B * row_blocks is small (batch 1 is the common case) without
    spilling a partial second wave; each split covers a whole number of KV tiles and at least
    MIN_SPLIT_KEYS keys. `slots` is L_max: lengths live on the device, so the split is sized for
    the cache capacity and CTAs past a request's length exit after writing an empty partial.
    """
    if config is None:
        preference = [name for size, names in PREFERRED.items() if size < 2 * max(rows, 16) for name in names]
        fitting = [name for name in preference if _can_run(KERNEL_CONFIGS[name], smem_per_block, wgmma)]
        if not fitting:
            raise ValueError(f"device: {smem_per_block} bytes of shared memory per block fit no kernel variant")
        config = fitting[0]
    elif config not in KERNEL_CONFIGS:
        raise ValueError(f"config: expected one of {sorted(KERNEL_CONFIGS)}, got {config!r}")
    elif KERNEL_CONFIGS[config].wgmma and not wgmma:
        raise ValueError(f"config: {config} needs a compute capability 9.0 device (sm_90a wgmma)")
    chosen = KERNEL_CONFIGS[config]
    row_blocks = -(-rows // chosen.rows)
    tiles = -(-slots // chosen.keys)
    if splits is None:
        resident = max(1, min(smem_per_sm // (chosen.smem_bytes + 1024), REGISTERS_PER_SM // (256 * chosen.threads)))
        wanted = max(1, (sms * resident) // max(1, batch * row_blocks))
        splits = max(1, min(wanted, tiles // max(1, MIN_SPLIT_KEYS // chosen.keys), MAX_SPLITS))
    elif not (isinstance(splits, int) and 1 <= splits <= MAX_SPLITS):
        raise ValueError(f"splits: expected an integer in 1..{MAX_SPLITS}, got {splits!r}")
    tiles_per_split = -(-tiles // min(splits, tiles))
    return LaunchPlan(config, row_blocks, -(-tiles // tiles_per_split), tiles_per_split * chosen.keys)


class VerifyLaunch:
    """One prepared verify-attention call: device views, outputs, workspace, plan and the kernel
    arguments, built once so a call costs only the launches (decode loops, benchmarks).

    Calling it enqueues the kernel (and the split merge) on torch's current stream; nothing here
    synchronises, so it can run back to back in a benchmark or inside a CUDA graph.
    """

    def __init__(self, plan: LaunchPlan, half: bool, arrays: dict, sizes: tuple, out, lse):
        self.plan, self.out, self.lse = plan, out, lse
        self._half, self._sizes = half, sizes
        self._arrays = arrays  # keeps the converted inputs and the workspace alive
        batch, nodes, heads, l_max, words, scale_log2 = sizes
        self._calls = []  # PreparedLaunches: the kernel, then the merge
        if batch * nodes * heads == 0:
            return
        from . import cuda
        main, merge = _kernel_functions(plan.config_name, half)
        a, config = {name: cuda.pointer(x) for name, x in arrays.items()}, plan.config
        device = cuda.device_index(arrays["q_latent"])
        self._calls.append(cuda.PreparedLaunch(
            main, (plan.row_blocks, plan.splits, batch), (config.threads,),
            (a["q_latent"], a["q_rope"], a["cache"], a["lengths"], a["mask"], a["out"], a["lse"], a["partial_out"],
             a["partial_lse"], np.int32(nodes), np.int32(heads), np.int32(l_max), np.int32(words),
             np.int32(plan.chunk), np.float32(scale_log2)), shared_mem=config.smem_bytes, device=device))
        if plan.splits > 1:
            rows = batch * nodes * heads
            self._calls.append(cuda.PreparedLaunch(
                merge, (rows, 4), (256,),
                (a["partial_out"], a["partial_lse"], a["out"], a["lse"], np.int32(rows), np.int32(plan.splits)),
                device=device))

    def __call__(self, *, merge: bool = True):
        """Enqueue the kernel and, with several splits, the merge (merge=False: timing breakdowns)."""
        for launch in self._calls if merge else self._calls[:1]:
            launch()
        return self.out, self.lse

    def with_cache(self, cache) -> "VerifyLaunch":
        """The same call over another layer's cache of the same shape, dtype and device: queries,
        lengths, mask, outputs and split workspace are this launch's (a model's layers run one after
        another on one stream, so they share them). Checks metadata only."""
        from . import cuda
        mine = self._arrays["cache"]
        check_array("cache", cache, dtypes="float16" if self._half else "bfloat16",
                    shape=tuple(int(n) for n in mine.shape))
        if framework(cache) != "torch" or not cache.is_cuda or cuda.device_index(cache) != mine.device.id:
            raise ValueError(f"cache: expected a torch tensor on cuda:{mine.device.id} like the prepared one")
        if not cache.is_contiguous():
            raise ValueError("cache: the kernel reads it in place and needs it C-contiguous")
        return VerifyLaunch(self.plan, self._half, {**self._arrays, "cache": cuda.as_cupy(cache)}, self._sizes,
                            self.out, self.lse)


def prepare_verify_launch(q_latent, q_rope, cache, lengths, tree: Tree, *, scale: float = DEFAULT_SCALE,
                          out=None, lse=None, config: str | None = None, splits: int | None = None) -> VerifyLaunch:
    """Check, convert and allocate for the CuPy kernel; `out`/`lse` may be given (tests poison them)."""
    from . import cuda
    batch, nodes, heads = _check_args(q_latent, q_rope, cache, lengths, tree, scale)
    half = _check_kernel_args(q_latent, cache, tree, nodes, out, lse)
    l_max, words, rows = int(cache.shape[1]), (nodes + 31) // 32, nodes * heads
    sms, smem_per_block, smem_per_sm = _device_limits()
    plan = plan_launch(batch, rows, l_max, sms=sms, smem_per_block=smem_per_block, smem_per_sm=smem_per_sm,
                       wgmma=_runs_sm90a(), config=config, splits=splits)
    if out is None:
        out = cuda.device_empty(q_latent, (batch, nodes, heads, LATENT_DIM), dtype_name(q_latent))
    if lse is None:
        lse = cuda.device_empty(q_latent, (batch, nodes, heads), "float32")
    arrays = {"q_latent": _device_contiguous(q_latent), "q_rope": _device_contiguous(q_rope),
              "cache": _device_contiguous(cache), "lengths": _device_int32(lengths),
              "mask": _device_int32(tree.mask), "out": cuda.as_cupy(out), "lse": cuda.as_cupy(lse)}
    if plan.splits > 1:
        # a split's partial O in the output's 16-bit type (the merge adds in fp32), its LSE in fp32
        arrays["partial_out"] = cuda.as_cupy(cuda.device_empty(
            q_latent, (plan.splits, batch, rows, LATENT_DIM), dtype_name(q_latent)))
        arrays["partial_lse"] = cuda.as_cupy(cuda.device_empty(q_latent, (plan.splits, batch, rows), "float32"))
    else:  # unused by the kernel with one split
        arrays["partial_out"] = arrays["partial_lse"] = arrays["lse"]
    sizes = (batch, nodes, heads, l_max, words, float(scale) * math.log2(math.e))
    return VerifyLaunch(plan, half, arrays, sizes, out, lse)


def _verify_attention_cupy(q_latent, q_rope, cache, lengths, tree, scale):
    return prepare_verify_launch(q_latent, q_rope, cache, lengths, tree, scale=scale)()


def _check_kernel_args(q_latent, cache, tree: Tree, nodes: int, out=None, lse=None) -> bool:
    """What the kernel needs beyond _check_args (metadata only, no sync); True for float16."""
    dtype = dtype_name(q_latent)
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"q_latent: the cupy kernel takes {' or '.join(KERNEL_DTYPES)}, got {dtype}")
    batch = int(q_latent.shape[0])
    if cache.shape[1] < nodes:
        raise ValueError(f"cache: L_max={cache.shape[1]} cannot hold the {nodes} tree nodes")
    if batch > MAX_GRID_YZ:
        raise ValueError(f"q_latent: at most {MAX_GRID_YZ} requests per call, got {batch}")
    check_array("tree.mask", tree.mask, dtypes=("uint32", "int32"), shape=(batch, nodes, (nodes + 31) // 32))
    heads = int(q_latent.shape[2])
    if out is not None:
        check_array("out", out, dtypes=dtype, shape=(batch, nodes, heads, LATENT_DIM))
    if lse is not None:
        check_array("lse", lse, dtypes="float32", shape=(batch, nodes, heads))
    return dtype == "float16"


def _device_contiguous(x):
    """A C-contiguous CuPy view of a device array (torch bf16 as int16)."""
    from . import cuda
    if framework(x) == "torch":
        return cuda.as_cupy(x.contiguous())
    import cupy
    return cupy.ascontiguousarray(x)


def _device_int32(x):
    """lengths / the mask as a contiguous int32 device array (a uint32 mask is reinterpreted)."""
    import cupy
    from . import cuda
    kind = framework(x)
    if kind == "numpy":
        return cupy.asarray(np.ascontiguousarray(x).view(np.int32) if x.dtype == np.uint32 else x.astype(np.int32))
    if kind == "torch":
        torch = _torch()
        x = x.contiguous().view(torch.int32) if x.dtype == torch.uint32 else x.to(torch.int32).contiguous()
        return cuda.as_cupy(x)
    if x.dtype == cupy.uint32:
        return cupy.ascontiguousarray(x).view(cupy.int32)
    return cupy.ascontiguousarray(x, dtype=cupy.int32)


@functools.lru_cache(maxsize=None)
def _device_limits() -> tuple[int, int, int]:
    """(SMs, opt-in shared memory per block, shared memory per SM) of the current device."""
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return props["multiProcessorCount"], props["sharedMemPerBlockOptin"], props["sharedMemPerMultiprocessor"]


def _can_run(config: KernelConfig, smem_per_block: int, wgmma: bool) -> bool:
    """Whether a device with this much shared memory per block (and sm_90a code, if wgmma) runs `config`."""
    return config.smem_bytes <= smem_per_block and (wgmma or not config.wgmma)


def runnable_configs() -> list[str]:
    """The variants the current device can run: shared memory per block, and sm_90a for wgmma."""
    smem_per_block = _device_limits()[1]
    return [name for name, c in KERNEL_CONFIGS.items() if _can_run(c, smem_per_block, _runs_sm90a())]


@functools.lru_cache(maxsize=None)
def _runs_sm90a() -> bool:
    """Does the current device run sm_90a code (wgmma)? Only compute capability 9.0 exactly."""
    import cupy
    return cupy.cuda.Device().compute_capability == "90"


@functools.lru_cache(maxsize=None)
def _kernel_functions(config_name: str, half: bool):
    """(main, merge) CuPy functions of one variant, compiled once by NVRTC."""
    from . import cuda
    config = KERNEL_CONFIGS[config_name]
    options = config.nvrtc_options(half)
    main = cuda.get_function(config.kernel_file, "verify_attn", options, config.arch)
    main.max_dynamic_shared_size_bytes = config.smem_bytes
    merge = cuda.get_function(config.kernel_file, "verify_attn_merge_f16" if half else "verify_attn_merge_bf16",
                              options, config.arch)
    return main, merge
