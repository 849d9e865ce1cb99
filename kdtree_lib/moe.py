"""The routed experts of one MoE layer for a verify step: tokens x top-k routes, SwiGLU experts.

out[t] = Σ_s weights[t, s] · down_e(SiLU(gate_e(x_t)) · up_e(x_t)),  e = routes[t, s]

over the experts this rank holds (ids first_expert .. first_expert + experts - 1; other ids add
nothing, so TP and EP ranks both return a partial sum for the all-reduce).

Experts are `Int4Experts` (K2.6's INT4, resident as 4.5 bits per weight in the kernel's layout,
docs/moe-int4.md) or `DenseExperts` (bf16/fp32 stacks, as model.Experts holds them). Backends:
- "numpy" and "torch": the reference, one expert at a time, in the input's precision (fp32 for
  NumPy; torch bf16 inputs give torch's bf16 numerics, the baseline the kernel's error is held to);
- "cupy": kernels/moe_int4.cu (bf16 tokens, INT4 experts), four launches, no host sync;
- "auto": the kernel for bf16 CUDA inputs with INT4 experts where CuPy runs, else the reference.
The kernel's plan (its gate_up and down configurations) comes from plan_moe's formula, or, once
PLAN_FROM_ROWS is on, from the fastest plan bench.moe_int4 measured on this device (choose_plan).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from .checks import as_torch, check_array, dtype_name, framework, is_on_gpu, to_numpy

GROUP_SIZE = 32        # the checkpoint's quantization group (inputs per bf16 scale)
CODES_PER_WORD = 8     # 4-bit codes per int32, along the input dimension
CODE_OFFSET = 8        # code = q + 8
TILE_ROWS = 16         # the kernel layout's row tile (one MMA's M)
CHUNK = 64             # the kernel layout's input chunk (four MMA k steps)
LANES = 32
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ROUTE_DTYPES = ("int32", "int64")
INT4_FIELDS = ("gate_up_codes", "gate_up_scales", "down_codes", "down_scales")


# ----------------------------------------------------------------------------------------------
# the kernel layout: a one-time permutation of the checkpoint's codes and scales (4.5 bits/weight)

def _torch():
    import torch
    return torch


def _nibbles(words):
    """int32 [..., n] -> uint8 [..., n, 8], code j of each word from bits 4j."""
    torch = _torch()
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 0xF).to(torch.uint8)


def _words(nibbles):
    """uint8 [..., 8] -> int32 [...]: the inverse of _nibbles."""
    torch = _torch()
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    words = (nibbles.long() << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def repack(packed, scale):
    """Checkpoint layout -> kernel layout, for stacked experts.

    packed int32 [E, rows, inputs/8] (code j of word w is input 8w + j), scale bf16 [E, rows,
    inputs/32] -> codes int32 [E, rows/16, inputs/64, 32, 4] and scales bf16 [E, rows/16,
    inputs/64, 8, 2, 2]: lane (g, c) of a 16-row tile's chunk owns rows g, g+8 and inputs
    16c..16c+15 (four words, nibble order in docs/moe-int4.md); its scales are those two rows'
    of group 2·chunk + c/2.
    """
    experts, rows, words = packed.shape
    tiles, chunks = rows // TILE_ROWS, words * CODES_PER_WORD // CHUNK
    codes = _nibbles(packed).reshape(experts, tiles, 2, 8, chunks, 4, 4, 2, 2)  # E T half g J c b hi lo
    codes = codes.permute(0, 1, 4, 3, 5, 6, 8, 7, 2)                          # E T J g c b lo hi half
    codes = _words(codes.reshape(experts, tiles, chunks, LANES, 4, CODES_PER_WORD))
    scales = scale.reshape(experts, tiles, 2, 8, chunks, 2).permute(0, 1, 4, 3, 5, 2)  # E T J g group half
    return codes.contiguous(), scales.contiguous()


def unpack(codes, scales):
    """Kernel layout -> checkpoint layout (the inverse of repack)."""
    experts, tiles, chunks = codes.shape[:3]
    rows, inputs = tiles * TILE_ROWS, chunks * CHUNK
    nibbles = _nibbles(codes).reshape(experts, tiles, chunks, 8, 4, 4, 2, 2, 2)  # E T J g c b lo hi half
    nibbles = nibbles.permute(0, 1, 8, 3, 2, 4, 5, 7, 6)                      # E T half g J c b hi lo
    packed = _words(nibbles.reshape(experts, rows, inputs // CODES_PER_WORD, CODES_PER_WORD))
    scale = scales.permute(0, 1, 5, 3, 2, 4).reshape(experts, rows, inputs // GROUP_SIZE)
    return packed.contiguous(), scale.contiguous()


def dequantize(packed, scale):
    """Checkpoint layout [E, rows, inputs/8] + [E, rows, inputs/32] -> float32 [E, rows, inputs]."""
    torch = _torch()
    values = (_nibbles(packed).to(torch.int32) - CODE_OFFSET).float()          # (E, rows, inputs/8, 8)
    grouped = values.reshape(*packed.shape[:2], -1, GROUP_SIZE)               # (E, rows, inputs/32, 32)
    return (grouped * scale.float()[..., None]).reshape(*packed.shape[:2], -1)


def layout_shapes(experts: int, rows: int, inputs: int) -> tuple[tuple, tuple]:
    """The kernel layout's (codes, scales) shapes for `experts` stacked [rows, inputs] matrices."""
    tiles, chunks = rows // TILE_ROWS, inputs // CHUNK
    return (experts, tiles, chunks, LANES, 4), (experts, tiles, chunks, 8, 2, 2)


# ----------------------------------------------------------------------------------------------
# the experts

@dataclass(frozen=True)
class Int4Experts:
    """One rank's routed experts, INT4 in the kernel layout (torch tensors, one device).

    gate_up: rows [0, width) gate, [width, 2·width) up, inputs = hidden; down: rows = hidden,
    inputs = width. Build from the checkpoint's layout with `from_checkpoint`.
    """
    gate_up_codes: object   # int32 [E, 2W/16, H/64, 32, 4]
    gate_up_scales: object  # bf16  [E, 2W/16, H/64, 8, 2, 2]
    down_codes: object      # int32 [E, H/16, W/64, 32, 4]
    down_scales: object     # bf16  [E, H/16, W/64, 8, 2, 2]
    hidden: int
    width: int
    first_expert: int = 0
    total_experts: int | None = None  # ids a route may name (the model's experts); default: this rank's last + 1

    def __post_init__(self):
        h, w = _check_sizes(self.hidden, self.width)
        experts = int(self.gate_up_codes.shape[0]) if hasattr(self.gate_up_codes, "shape") else 0
        for name, (rows, inputs) in (("gate_up", (2 * w, h)), ("down", (h, w))):
            codes_shape, scales_shape = layout_shapes(experts, rows, inputs)
            check_array(f"{name}_codes", getattr(self, f"{name}_codes"), dtypes="int32", shape=codes_shape)
            check_array(f"{name}_scales", getattr(self, f"{name}_scales"), dtypes="bfloat16", shape=scales_shape)
        _check_expert_ids(self.first_expert, experts, self.total_experts)

    @classmethod
    def from_checkpoint(cls, gate_up_packed, gate_up_scale, down_packed, down_scale, *, hidden: int, width: int,
                        group_size: int = GROUP_SIZE, first_expert: int = 0, total_experts: int | None = None,
                        experts_per_repack: int = 8) -> "Int4Experts":
        """From stacked checkpoint-layout tensors (gate and up concatenated along rows), repacked
        `experts_per_repack` experts at a time so the transient byte-per-code copy stays small."""
        torch = _torch()
        if group_size != GROUP_SIZE:
            raise ValueError(f"group_size: the kernel layout takes the checkpoint's group of {GROUP_SIZE} inputs, "
                             f"got {group_size}")
        h, w = _check_sizes(hidden, width)
        experts = int(gate_up_packed.shape[0]) if hasattr(gate_up_packed, "shape") else 0
        check_array("gate_up_packed", gate_up_packed, dtypes="int32", shape=(experts, 2 * w, h // CODES_PER_WORD))
        check_array("gate_up_scale", gate_up_scale, dtypes="bfloat16", shape=(experts, 2 * w, h // GROUP_SIZE))
        check_array("down_packed", down_packed, dtypes="int32", shape=(experts, h, w // CODES_PER_WORD))
        check_array("down_scale", down_scale, dtypes="bfloat16", shape=(experts, h, w // GROUP_SIZE))
        for name, scale in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
            if not bool(torch.isfinite(scale).all()):
                raise ValueError(f"{name}: contains NaN or inf")
        parts = {"gate_up": [], "down": []}
        for start in range(0, experts, experts_per_repack):
            block = slice(start, start + experts_per_repack)
            parts["gate_up"].append(repack(gate_up_packed[block], gate_up_scale[block]))
            parts["down"].append(repack(down_packed[block], down_scale[block]))
        stacked = {name: [torch.cat(t) for t in zip(*pieces)] for name, pieces in parts.items()}
        return cls(*stacked["gate_up"], *stacked["down"], hidden=h, width=w, first_expert=first_expert,
                   total_experts=total_experts)

    @property
    def n_experts(self) -> int:
        return int(self.gate_up_codes.shape[0])

    @property
    def device(self):
        return self.gate_up_codes.device

    def expert_weights(self, local: int, dtype):
        """(gate_up [2W, H], down [H, W]) of local expert `local`, dequantized to `dtype`."""
        e = slice(local, local + 1)
        gate_up = dequantize(*unpack(self.gate_up_codes[e], self.gate_up_scales[e]))[0]
        down = dequantize(*unpack(self.down_codes[e], self.down_scales[e]))[0]
        return gate_up.to(dtype), down.to(dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate_up_codes, self.gate_up_scales,
                                                          self.down_codes, self.down_scales))


@dataclass(frozen=True)
class DenseExperts:
    """One rank's routed experts as float stacks (model.Experts' gate_up_proj and down_proj)."""
    gate_up: object  # [E, 2W, H]
    down: object     # [E, H, W]
    first_expert: int = 0
    total_experts: int | None = None

    def __post_init__(self):
        check_array("gate_up", self.gate_up, dtypes=FLOAT_DTYPES, ndim=3)
        experts, rows, hidden = self.gate_up.shape
        check_array("down", self.down, dtypes=FLOAT_DTYPES, shape=(experts, hidden, rows // 2))
        _check_expert_ids(self.first_expert, experts, self.total_experts)

    @property
    def hidden(self) -> int:
        return int(self.gate_up.shape[2])

    @property
    def width(self) -> int:
        return int(self.down.shape[2])

    @property
    def n_experts(self) -> int:
        return int(self.gate_up.shape[0])

    def expert_weights(self, local: int, dtype):
        return self.gate_up[local].to(dtype), self.down[local].to(dtype)


def fits_kernel_layout(hidden: int, width: int) -> bool:
    """Whether experts of this hidden size and (per-rank) width have a kernel layout."""
    return hidden > 0 and width > 0 and hidden % CHUNK == 0 and width % CHUNK == 0


def _check_sizes(hidden, width) -> tuple[int, int]:
    for name, value in (("hidden", hidden), ("width", width)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0 or value % CHUNK:
            raise ValueError(f"{name}: expected a positive multiple of {CHUNK} (the kernel layout's chunk), "
                             f"got {value!r}")
    return int(hidden), int(width)


def _check_expert_ids(first: int, experts: int, total):
    if total is not None and not first + experts <= total:
        raise ValueError(f"total_experts: {total} is fewer than first_expert {first} + {experts} local experts")


def random_experts(n_experts: int, hidden: int, width: int, *, seed: int = 0, device="cpu", first_expert: int = 0,
                   total_experts: int | None = None) -> Int4Experts:
    """Random INT4 experts straight in the kernel layout (any int32 is eight valid codes), with
    scales that keep a layer's outputs of order one for unit-variance tokens."""
    torch = _torch()
    generator = torch.Generator(device=device).manual_seed(seed)

    def matrix(rows, inputs):
        codes_shape, scales_shape = layout_shapes(n_experts, rows, inputs)
        codes = torch.randint(-2 ** 31, 2 ** 31, codes_shape, dtype=torch.int64, generator=generator,
                              device=device).to(torch.int32)
        std_q = math.sqrt((16 ** 2 - 1) / 12)  # codes uniform over 0..15
        scales = torch.rand(scales_shape, generator=generator, device=device) + 0.5
        return codes, (scales / (std_q * math.sqrt(inputs))).to(torch.bfloat16)

    return Int4Experts(*matrix(2 * width, hidden), *matrix(hidden, width), hidden=hidden, width=width,
                       first_expert=first_expert, total_experts=total_experts)


# ----------------------------------------------------------------------------------------------
# the entry point and the reference

def moe_forward(x, routes, weights, experts, *, backend: str = "auto", capacity: int | None = None,
                routed: bool = False):
    """The weighted sum of each token's routed experts held here: [M, H] in x's dtype and framework.

    x [M, H]; routes int [M, k] (expert ids); weights float [M, k]; experts Int4Experts or
    DenseExperts; capacity (kernel only): routed pairs the work buffers hold, >= M·k (default M·k).
    routed=True: routes and weights come from a router (ids in range and finite weights by
    construction), so their values are not read back (on a GPU that read is a host synchronisation
    per layer); shapes and dtypes are still checked. A decode step does not call this per layer at
    all: it runs a prepared launch per layer (MoeLaunch.with_experts).
    """
    _check_args(x, routes, weights, experts, capacity)
    chosen = _backend.resolve(backend, ("torch", "numpy", "cupy") if isinstance(experts, Int4Experts)
                              else ("torch", "numpy"), x, routes)
    if backend == "auto" and chosen == "cupy" and dtype_name(x) != "bfloat16":
        chosen = "torch"
    if chosen == "cupy":
        return prepare_moe_launch(x, routes, weights, experts, capacity=capacity, routed=routed)()
    if not routed:
        _check_values(routes, weights, experts)
    return _moe_reference(x, routes, weights, experts)


def _moe_reference(x, routes, weights, experts):
    """One expert at a time in x's precision (NumPy inputs: fp32 through torch on the CPU)."""
    torch = _torch()
    import torch.nn.functional as F
    as_numpy = framework(x) == "numpy"
    x, routes, weights = (as_torch(a) for a in (x, routes, weights))
    if as_numpy:
        x = x.float()
    out = torch.zeros_like(x)
    local = routes.long() - experts.first_expert
    for expert in torch.unique(local).tolist():
        if not 0 <= expert < experts.n_experts:
            continue  # another rank's expert
        token, slot = torch.where(local == expert)
        gate_up, down = (w.to(x.device) for w in experts.expert_weights(expert, x.dtype))
        gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down)                                    # (n, H)
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out.numpy() if as_numpy else out


def _check_args(x, routes, weights, experts, capacity=None):
    if not isinstance(experts, (Int4Experts, DenseExperts)):
        raise ValueError(f"experts: expected Int4Experts or DenseExperts, got {type(experts).__name__}")
    check_array("x", x, dtypes=FLOAT_DTYPES, shape=(None, experts.hidden))
    tokens = int(x.shape[0])
    check_array("routes", routes, dtypes=ROUTE_DTYPES, shape=(tokens, None))
    check_array("weights", weights, dtypes=FLOAT_DTYPES, shape=tuple(routes.shape))
    pairs = tokens * int(routes.shape[1])
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer))
                                 or capacity < pairs):
        raise ValueError(f"capacity: must hold the {tokens} tokens x {routes.shape[1]} routes = {pairs} routed "
                         f"pairs, got {capacity!r}")


def _check_values(routes, weights, experts):
    """Route ids in [0, total_experts) and finite weights. Device inputs cost one synchronisation,
    so the check is skipped while a CUDA graph is being captured (it checked at the eager call)."""
    total = experts.total_experts or experts.first_expert + experts.n_experts
    if routes.shape[0] * routes.shape[1] == 0:
        return
    if is_on_gpu(routes) or is_on_gpu(weights):
        torch = _torch()
        if torch.cuda.is_current_stream_capturing():
            return
        routes_t, weights_t = as_torch(routes), as_torch(weights)
        summary = torch.stack([routes_t.min().long(), routes_t.max().long(),
                               (~torch.isfinite(weights_t)).any().long()]).tolist()
    else:
        host_routes, host_weights = to_numpy(routes), to_numpy(weights).astype(np.float64)
        summary = [int(host_routes.min()), int(host_routes.max()), int(not np.isfinite(host_weights).all())]
    low, high, bad_weights = summary
    if low < 0 or high >= total:
        raise ValueError(f"routes: expert ids must lie in [0, {total}), found {low if low < 0 else high}")
    if bad_weights:
        raise ValueError("weights: contains NaN or inf")


# ----------------------------------------------------------------------------------------------
# the CuPy kernels (kernels/moe_int4.cu)

KERNEL_FILE = "moe_int4.cu"
WARPS = 8
ROUTE_THREADS = 1024          # moe_route: one CTA, one thread per local expert at most
COMBINE_THREADS = 128
COMBINE_COLUMNS = 8 * COMBINE_THREADS  # moe_combine: a CTA's columns of one token
COMBINE_MAX_TOP_K = 16                 # moe_combine holds a token's slots in registers (kCombineMaxTopK)
SM120_SMEM_PER_BLOCK = 99 * 1024  # the RTX PRO 6000 (sm_120): 99 KB of shared memory per block


@dataclass(frozen=True)
class GemmConfig:
    """One instantiation of moe_gemm (kernels/moe_int4.cu's MOE_GEMM list)."""
    gate_up: bool
    tiles: int        # 16-row MMA tiles per warp (gate_up: half gate, half the matching up rows)
    split: int        # warps of a group splitting the inputs
    token_tiles: int  # 8-token MMA tiles per pass over the weights
    depth: int        # chunks in flight per warp

    @property
    def name(self) -> str:
        kind = "gate_up" if self.gate_up else "down"
        return f"moe_{kind}_t{self.tiles}_s{self.split}_tt{self.token_tiles}_d{self.depth}"

    @property
    def rows_per_cta(self) -> int:
        """Output rows one CTA produces (gate_up: h columns, i.e. gate rows)."""
        return TILE_ROWS * (self.tiles // 2 if self.gate_up else self.tiles) * (WARPS // self.split)

    @property
    def smem_bytes(self) -> int:
        """The cross-warp reduction buffer (kernels' reduce_bytes)."""
        return WARPS * self.tiles * self.token_tiles * 4 * 32 * 4 if self.split > 1 else 0


GEMM_CONFIGS = {c.name: c for c in (
    GemmConfig(True, 2, 8, 1, 8), GemmConfig(True, 4, 8, 2, 3), GemmConfig(True, 4, 8, 4, 2),
    GemmConfig(False, 1, 1, 1, 4), GemmConfig(False, 2, 1, 2, 4), GemmConfig(False, 2, 1, 4, 4),
    GemmConfig(False, 1, 8, 1, 4), GemmConfig(False, 1, 8, 2, 4), GemmConfig(False, 1, 8, 4, 4),
)}
SHORT_DOWN_CHUNKS = 8  # down inputs (width / 64) up to which each warp streams whole rows (no split)


@dataclass(frozen=True)
class MoePlan:
    gate_up: str
    down: str

    @property
    def name(self) -> str:
        return f"{self.gate_up}+{self.down}"


def token_tiles(tokens: int) -> int:
    """8-token tiles per pass: a verify step of M tokens gives an expert at most M of them."""
    return 1 if tokens <= 8 else 2 if tokens <= 16 else 4


def plan_moe(tokens: int, hidden: int, width: int, *, smem_per_block: int, tiles: int | None = None) -> MoePlan:
    """The gate_up and down configurations for M tokens at these sizes on a device with this much
    shared memory per block: token tiles by M, or at most `tiles` (fewer where a small layer's rows
    do not divide by a larger configuration's CTA; more passes then), down split by the width."""
    tt = token_tiles(tokens) if tiles is None else tiles
    split_down = 1 if width // CHUNK <= SHORT_DOWN_CHUNKS else WARPS

    def pick(gate_up: bool, split: int | None, rows: int) -> str:
        fits = [c for c in GEMM_CONFIGS.values() if c.gate_up == gate_up and c.token_tiles <= tt
                and (split is None or c.split == split) and c.smem_bytes <= smem_per_block
                and rows % c.rows_per_cta == 0]
        if not fits:
            raise ValueError(f"width: no {'gate_up' if gate_up else 'down'} configuration takes hidden {hidden}, "
                             f"width {width} with {smem_per_block} bytes of shared memory per block")
        return max(fits, key=lambda c: (c.token_tiles, c.depth)).name

    return MoePlan(pick(True, None, width), pick(False, split_down, hidden))


# The plan chooser from measured rows (issue 31: the fastest configuration per (M, width) as measured, not a
# formula that loses to its own alternatives). Off until a GPU run shows every plan it picks passes
# tests/test_moe.py's GPU tests on that device; then set True (docs/kernel-notes.md, the MoE section).
PLAN_FROM_ROWS = False


@dataclass(frozen=True)
class MeasuredPlans:
    """The fastest measured plan per (device, hidden, width, M), read from bench.moe_int4's rows.

    Per (device, hidden, width) only the newest run that measured that shape counts (an older run timed
    older kernels). In it, each (routing, M) is one group of timed plans (the launcher's, the 99 KB one,
    the token-tile variants; `bench.moe_int4.plan_rows`); a plan's score at M is the geometric mean over
    the groups of its time over the group's fastest, counting only plans timed in every group at that M,
    and the lowest score wins (a tie goes to the name first in order). `plan` answers for any M within
    the measured range with the nearest measured M (in log2(M); a tie goes to the smaller M).
    """
    best: dict  # (device, hidden, width) -> {tokens: MoePlan}

    @classmethod
    def from_rows(cls, rows) -> "MeasuredPlans":
        """From rows as results.read_rows gives them (every provider; the ones not timing a plan of
        this layer's call, such as EP or torch, are left out)."""
        from . import results
        from .bench.moe_int4 import plan_rows
        rows = plan_rows(rows)
        best = {}
        for key in sorted({(str(r["device"]), int(r["hidden"]), int(r["width"])) for r in rows}):
            device, hidden, width = key
            where = {"device": device, "hidden": hidden, "width": width}
            newest = plan_rows(results.select(results.latest_run(rows, **where), **where))
            times: dict = {}  # tokens -> routing -> plan -> seconds (the fastest of duplicate rows)
            for r in newest:
                plan = _parse_plan(r["plan"], hidden, width)
                if plan is None:
                    continue
                group = times.setdefault(int(r["tokens"]), {}).setdefault(str(r["routing"]), {})
                group[plan] = min(float(r["time_us"]), group.get(plan, math.inf))
            for tokens, groups in times.items():
                plan = _fastest(groups.values())
                if plan is not None:
                    best.setdefault(key, {})[tokens] = plan
        return cls(best)

    def plan(self, tokens: int, hidden: int, width: int, device: str) -> MoePlan | None:
        """The fastest measured plan at the nearest measured M on `device`, or None where no row of this
        shape and device exists or M lies outside the measured range."""
        measured = self.best.get((str(device), int(hidden), int(width)))
        if not measured or not min(measured) <= tokens <= max(measured):
            return None
        nearest = min(measured, key=lambda m: (abs(math.log2(m) - math.log2(tokens)), m))
        return measured[nearest]


def _fastest(groups) -> MoePlan | None:
    """The plan with the lowest geometric-mean time over the groups' fastest, among those in every group."""
    groups = [g for g in groups if g]
    common = set.intersection(*(set(g) for g in groups)) if groups else set()
    if not common:
        return None
    score = {plan: sum(math.log(g[plan] / min(g.values())) for g in groups) for plan in common}
    return min(sorted(common, key=lambda plan: plan.name), key=score.get)


def _parse_plan(name, hidden: int, width: int) -> MoePlan | None:
    """The MoePlan a row's `plan` cell names, or None when it names no current configuration pair that
    takes this shape (a row of an older kernel, or of another call)."""
    gate_up, _, down = str(name or "").partition("+")
    configs = GEMM_CONFIGS.get(gate_up), GEMM_CONFIGS.get(down)
    if None in configs or not configs[0].gate_up or configs[1].gate_up:
        return None
    if width % configs[0].rows_per_cta or hidden % configs[1].rows_per_cta:
        return None
    return MoePlan(gate_up, down)


@functools.lru_cache(maxsize=None)
def measured_plans() -> MeasuredPlans:
    """MeasuredPlans of the committed rows (data/results/, whatever $KDTREE_RESULTS_DIR says: that sends
    new rows elsewhere), read once a process."""
    from . import results
    from .bench.moe_int4 import TOPIC
    from .paths import RESULTS_DIR
    return MeasuredPlans.from_rows(results.read_rows(TOPIC, results_dir=RESULTS_DIR))


def choose_plan(tokens: int, hidden: int, width: int, *, smem_per_block: int, device: str | None = None,
                measured: MeasuredPlans | None = None, from_rows: bool | None = None) -> MoePlan:
    """The plan a launch runs by default: with from_rows (default PLAN_FROM_ROWS), the fastest measured
    plan for this device (`measured`, default the committed rows; `device`, default this GPU's name)
    where one exists and fits its shared memory, else plan_moe's formula."""
    if PLAN_FROM_ROWS if from_rows is None else from_rows:
        plan = (measured or measured_plans()).plan(tokens, hidden, width, device or _device_name())
        if plan is not None and max(GEMM_CONFIGS[plan.gate_up].smem_bytes,
                                    GEMM_CONFIGS[plan.down].smem_bytes) <= smem_per_block:
            return plan
    return plan_moe(tokens, hidden, width, smem_per_block=smem_per_block)


class MoeLaunch:
    """One prepared call: device views, work buffers and the four launches' arguments, built once so
    a call only enqueues (decode steps, benchmarks, CUDA graphs). Nothing here synchronises."""

    def __init__(self, plan: MoePlan, calls: list, out, keep: dict):
        self.plan, self.out = plan, out
        self._calls, self._keep = calls, keep  # keep: the arrays the raw pointers point into

    def __call__(self):
        for launch in self._calls:
            launch()
        return self.out

    def with_experts(self, experts: "Int4Experts") -> "MoeLaunch":
        """The same call over another layer's experts of the same shapes: the tokens, routes, weights,
        output and work buffers are this launch's (a model's MoE layers run one after another on one
        stream, so they share them), only the expert pointers change. Checks metadata only."""
        mine = self._keep["experts"]
        if not isinstance(experts, Int4Experts):
            raise ValueError(f"experts: expected Int4Experts, got {type(experts).__name__}")
        for name in INT4_FIELDS:
            theirs, ours = getattr(experts, name), getattr(mine, name)
            if tuple(theirs.shape) != tuple(ours.shape) or theirs.dtype != ours.dtype or theirs.device != ours.device:
                raise ValueError(f"experts.{name}: {tuple(theirs.shape)} {theirs.dtype} on {theirs.device}, but this "
                                 f"launch was prepared for {tuple(ours.shape)} {ours.dtype} on {ours.device}")
            if not theirs.is_contiguous():
                raise ValueError(f"experts.{name}: the kernel reads it as one contiguous block")
        if (experts.first_expert, experts.hidden, experts.width) != (mine.first_expert, mine.hidden, mine.width):
            raise ValueError("experts: another first expert, hidden size or width than the prepared launch's")
        keep = {**self._keep, "experts": experts}
        return MoeLaunch(self.plan, _moe_calls(keep, self.plan), self.out, keep)


def prepare_moe_launch(x, routes, weights, experts: Int4Experts, *, capacity: int | None = None, out=None,
                       plan: MoePlan | None = None, routed: bool = False) -> MoeLaunch:
    """Check (shapes, dtypes, values unless `routed` (see moe_forward), capacity), convert and allocate
    for the kernels; `out` may be given (tests poison it), `plan` forces configurations (benchmark
    variants)."""
    from . import cuda
    torch = _torch()
    _check_args(x, routes, weights, experts, capacity)
    if routes.shape[1] > COMBINE_MAX_TOP_K:
        raise ValueError(f"routes: the cupy kernel takes at most {COMBINE_MAX_TOP_K} experts per token "
                         f"(routes.shape[1]), got {routes.shape[1]}")
    if not isinstance(experts, Int4Experts):
        raise ValueError(f"experts: the cupy kernel takes Int4Experts, got {type(experts).__name__}")
    if framework(x) != "torch" or dtype_name(x) != "bfloat16" or not x.is_cuda:
        raise ValueError(f"x: the cupy kernel takes a bfloat16 torch CUDA tensor, got {dtype_name(x)} "
                         f"({framework(x)})")
    tokens, top_k = (int(s) for s in routes.shape)
    capacity = tokens * top_k if capacity is None else int(capacity)
    if experts.n_experts > ROUTE_THREADS:
        raise ValueError(f"experts: at most {ROUTE_THREADS} local experts per rank, got {experts.n_experts}")
    if experts.device != x.device:
        raise ValueError(f"experts: on {experts.device}, x on {x.device}")
    for name in INT4_FIELDS:
        if not getattr(experts, name).is_contiguous():
            raise ValueError(f"experts.{name}: the kernel reads it as one contiguous block")
    if not routed:
        _check_values(routes, weights, experts)
    hidden, width, n_experts = experts.hidden, experts.width, experts.n_experts
    plan = plan or choose_plan(tokens, hidden, width, smem_per_block=_device_smem_per_block())
    if out is None:
        out = torch.empty_like(x)
    check_array("out", out, dtypes="bfloat16", shape=(tokens, hidden))
    routes32 = as_torch(routes).to(device=x.device, dtype=torch.int32).contiguous()
    weights32 = as_torch(weights).to(device=x.device, dtype=torch.float32).contiguous()
    keep = {"x": x.contiguous(), "routes": routes32, "weights": weights32, "out": out,
            "meta": torch.empty(2 * n_experts + 2, dtype=torch.int32, device=x.device),
            "sorted_token": torch.empty(capacity, dtype=torch.int32, device=x.device),
            "inverse": torch.empty(tokens * top_k, dtype=torch.int32, device=x.device),
            "h": torch.empty(capacity, width, dtype=torch.bfloat16, device=x.device),
            "y": torch.empty(capacity, hidden, dtype=torch.bfloat16, device=x.device),
            "experts": experts}
    return MoeLaunch(plan, _moe_calls(keep, plan), out, keep)


def _moe_calls(keep: dict, plan: MoePlan) -> list:
    """The four prepared launches (route, gate_up, down, combine) over the buffers in `keep`."""
    from . import cuda
    experts, x = keep["experts"], keep["x"]
    tokens, top_k = (int(s) for s in keep["routes"].shape)
    capacity = int(keep["sorted_token"].shape[0])
    hidden, width, n_experts = experts.hidden, experts.width, experts.n_experts
    if not tokens:
        return []
    p = {name: cuda.pointer(t) for name, t in keep.items() if name != "experts"}
    hit_slots = min(n_experts, capacity)  # experts a call can hit: the grids' static height
    device = cuda.device_index(x)
    gate_up, down = GEMM_CONFIGS[plan.gate_up], GEMM_CONFIGS[plan.down]
    i32 = np.int32
    return [cuda.PreparedLaunch(function, grid, block, args, shared_mem=shared_mem, device=device)
            for function, grid, block, args, shared_mem in (
        (_function("moe_route", device), (1,), (ROUTE_THREADS,),
         (p["routes"], i32(tokens * top_k), i32(top_k), i32(experts.first_expert), i32(n_experts), p["meta"],
          p["sorted_token"], p["inverse"]), 0),
        (_function(gate_up.name, device, gate_up.smem_bytes), (width // gate_up.rows_per_cta, hit_slots),
         (32 * WARPS,), (cuda.pointer(experts.gate_up_codes), cuda.pointer(experts.gate_up_scales), p["x"],
                         p["h"], p["meta"], i32(n_experts), p["sorted_token"], i32(hidden), i32(2 * width)),
         gate_up.smem_bytes),
        (_function(down.name, device, down.smem_bytes), (hidden // down.rows_per_cta, hit_slots), (32 * WARPS,),
         (cuda.pointer(experts.down_codes), cuda.pointer(experts.down_scales), p["h"], p["y"], p["meta"],
          i32(n_experts), p["sorted_token"], i32(width), i32(hidden)), down.smem_bytes),
        (_function("moe_combine", device), (tokens, -(-hidden // COMBINE_COLUMNS)), (COMBINE_THREADS,),
         (p["y"], p["inverse"], p["weights"], p["out"], i32(hidden), i32(top_k)), 0),
    )]


@functools.lru_cache(maxsize=None)
def _function(name: str, device: int, smem_bytes: int = 0):
    """A kernel of kernels/moe_int4.cu (one NVRTC module for all), opted in to its shared memory."""
    from . import cuda
    function = cuda.get_function(KERNEL_FILE, name)
    if smem_bytes:
        function.max_dynamic_shared_size_bytes = smem_bytes
    return function


@functools.lru_cache(maxsize=None)
def _device_name() -> str:
    from .backend import device_name
    return device_name()


@functools.lru_cache(maxsize=None)
def _device_smem_per_block() -> int:
    import cupy
    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["sharedMemPerBlockOptin"])


def touched_bytes(routes, experts) -> dict:
    """The bytes a call must move at least: the codes + scales of the distinct local experts its
    routes hit, and the activations (tokens in, outputs out, bf16). Reads routes on the host."""
    ids = np.unique(to_numpy(routes).astype(np.int64) - experts.first_expert)
    hit = int(((ids >= 0) & (ids < experts.n_experts)).sum())
    per_expert = experts.nbytes() // experts.n_experts
    tokens = int(routes.shape[0])
    return {"experts_hit": hit, "weight_bytes": hit * per_expert,
            "activation_bytes": 2 * tokens * experts.hidden * 2}
