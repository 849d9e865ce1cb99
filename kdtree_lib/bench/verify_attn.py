"""Benchmark of the CuPy verify-attention kernel against the torch paths serving engines fall back to.

    python -m kdtree_lib.bench.verify_attn                 # the grid, rows appended to data/results/verify_attn.csv
    python -m kdtree_lib.bench.verify_attn --quick         # a few shapes
    python -m kdtree_lib.bench.verify_attn --smoke         # a tiny correctness run (for compute-sanitizer)

Providers, all on the same inputs in the same run:
- kernel:          kdtree_lib.verify_attn's CuPy kernel (prepared once, launched per rep)
- torch_fallback:  (a) the absorbed path as serving fallbacks do it: score bmm, dense additive
                   mask, fp32 softmax, value bmm, in bf16 (the mask is built outside the timing)
- sdpa:            (b) torch scaled_dot_product_attention on the absorbed form, explicit bool mask
- roofline:        (c) max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured here
                   (bench.ceilings);
  roofline_mma:    the same with the mma.sync ceiling (a register-only m16n8k16 loop) as the rate.

Napkin math per call (rows = N·H, keys = L + N): the KV cache is read once, 1152 bytes a key; Q
is read and O written once; FLOPs = 2 · B · rows · keys · (576 + 512). FLOP/byte ≈ 1.9 · rows,
so rows ≳ 64-128 is compute-bound on an H200.

Times are bench.timing.gpu_seconds: medians over reps, each after an L2 flush (a 256 MB memset, as
triton's do_bench), by CUDA events. flush_study times the kernel after a flush by reading (clean L2)
and with no flush too: on the H200 the write-back of the memset's dirty lines costs the kernel next
to nothing except on the short memory-bound decode shapes (N = 1).
"""
from __future__ import annotations

import statistics

import numpy as np

from .. import cli, precision, results
from . import command_parser
from ..contracts import tree_from_parents
from ..verify_attn import (CACHE_DIM, DEFAULT_SCALE, LATENT_DIM, ROPE_DIM, key_mask, prepare_verify_launch,
                           runnable_configs, verify_attention)
from .ceilings import measure_ceilings
from .timing import FLUSHES, gpu_seconds

TOPIC = "verify_attn"
MEMORY_LIMIT = 40e9        # bytes: skip a provider whose working set would exceed this
KERNEL_TIME_LIMIT = 0.05   # s: skip shapes the kernel would need longer than this for (estimate)
BASELINE_TIME_LIMIT = 0.5  # s: skip a baseline whose estimate exceeds this

# The grid: heads per GPU, tree nodes, committed length, batch.
HEADS = (8, 16, 64)
NODES = (1, 8, 16, 32, 64, 128)
LENGTHS = (1024, 4096, 32768, 131072)
BATCHES = (1, 8, 64)
# The targets (summary reads them): >= TARGET_PCT_ROOFLINE % of the roofline at rows = N·H >=
# TARGET_ROWS and L >= TARGET_LENGTH; >= TARGET_SPEEDUP x the torch fallback at L >= TARGET_LENGTH.
TARGET_ROWS = 128
TARGET_LENGTH = 32768
TARGET_PCT_ROOFLINE = 60
TARGET_SPEEDUP = 3
# A few shapes spanning the regimes (memory-bound decode, the K2.6 tree, compute-bound batches).
QUICK_SHAPES = [(1, 1, 8, 131072), (1, 8, 8, 32768), (1, 16, 8, 32768), (1, 64, 8, 32768), (8, 16, 16, 32768),
                (1, 128, 8, 131072), (64, 16, 8, 4096)]


# ----------------------------------------------------------------------------------------------
# inputs

def random_tree(batch: int, nodes: int, rng: np.random.Generator, *, n_nodes=None):
    """A random tree per request (parent of node i uniform in [0, i)), padded after n_nodes[b]."""
    parents = np.full((batch, nodes), -1, np.int32)
    for b in range(batch):
        live = nodes if n_nodes is None else int(n_nodes[b])
        for i in range(1, live):
            parents[b, i] = rng.integers(0, i)
    return tree_from_parents(parents, np.zeros((batch, nodes), np.int32))


def make_inputs(batch: int, nodes: int, heads: int, length: int, *, seed: int = 0, device="cuda",
                dtype="bfloat16", lengths=None, slack: int = 0, n_nodes=None, poison: bool = False):
    """Random q_latent, q_rope, cache (L_max = max length + N + slack), lengths, tree, all on `device`.

    Values are N(0, 1), so scores have a std of about scale·√576 ≈ 3.5 (a peaked but not one-hot
    softmax). With poison, cache slots past lengths + N hold NaN, which must never reach an output
    (compare against the reference on torch.nan_to_num(cache): the fp32 reference multiplies every
    slot's value by its zero weight).
    """
    import torch
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = getattr(torch, dtype)
    lengths = np.full(batch, length, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    l_max = int(lengths.max()) + nodes + slack
    q_latent = torch.randn(batch, nodes, heads, LATENT_DIM, generator=gen, device=device, dtype=dt)
    q_rope = torch.randn(batch, nodes, heads, ROPE_DIM, generator=gen, device=device, dtype=dt)
    cache = torch.randn(batch, l_max, CACHE_DIM, generator=gen, device=device, dtype=dt)
    if poison:
        for b in range(batch):
            cache[b, int(lengths[b]) + nodes:] = float("nan")
    tree = random_tree(batch, nodes, rng, n_nodes=n_nodes)
    tree.mask = torch.from_numpy(tree.mask).to(device)
    return q_latent, q_rope, cache, torch.as_tensor(lengths, device=device), tree


# ----------------------------------------------------------------------------------------------
# baselines

def fallback_mask(lengths, tree, slots: int, device):
    """Dense additive float32 mask [B, N, slots] (0 or -inf), as a serving fallback builds it."""
    import torch
    allowed = key_mask(lengths, tree, slots, device=device)
    return torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill_(~allowed, float("-inf"))


def torch_fallback(q_latent, q_rope, cache, additive_mask, scale: float = DEFAULT_SCALE):
    """(a) score bmm, dense additive mask, fp32 softmax, value bmm; inputs' precision (bf16)."""
    import torch
    batch, nodes, heads, _ = q_latent.shape
    slots = additive_mask.shape[-1]
    q = torch.cat([q_latent, q_rope], dim=-1).reshape(batch, nodes * heads, CACHE_DIM)  # (B, NH, 576)
    kv = cache[:, :slots]                                                                # (B, S, 576)
    scores = torch.bmm(q, kv.transpose(1, 2)).float().view(batch, nodes, heads, slots) * scale
    probs = torch.softmax(scores + additive_mask[:, :, None, :], dim=-1)               # (B, N, H, S)
    out = torch.bmm(probs.to(q.dtype).view(batch, nodes * heads, slots), kv[..., :LATENT_DIM])
    return out.view(batch, nodes, heads, LATENT_DIM)


def sdpa(q_latent, q_rope, cache, bool_mask, scale: float = DEFAULT_SCALE):
    """(b) torch SDPA on the absorbed form: q [B, H, N, 576], K/V one head expanded, mask [B, 1, N, S]."""
    import torch
    batch, nodes, heads, _ = q_latent.shape
    slots = bool_mask.shape[-1]
    q = torch.cat([q_latent, q_rope], dim=-1).transpose(1, 2)          # (B, H, N, 576)
    k = cache[:, None, :slots].expand(batch, heads, slots, CACHE_DIM)  # (B, H, S, 576), a view
    v = k[..., :LATENT_DIM]                                            # (B, H, S, 512)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, scale=scale)
    return out.transpose(1, 2)                                         # (B, N, H, 512)


def errors(out, lse, ref_out, ref_lse) -> dict:
    """Relative Frobenius error of O and max |Δ lse| against the fp32 reference (float64 on host)."""
    out, ref_out = _host64(out), _host64(ref_out)
    lse, ref_lse = _host64(lse), _host64(ref_lse)
    return {"rel_err": float(np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)),
            "lse_err": float(np.abs(lse - ref_lse).max()),
            "finite": bool(np.isfinite(out).all() and np.isfinite(lse).all())}


def same_precision_error(q_latent, q_rope, cache, lengths, tree, ref_out, ref_lse, scale: float = DEFAULT_SCALE) -> float:
    """The relative error, against the float32 reference, of the same-precision baseline: torch attention in the
    kernel's own precision steps (16-bit inputs, float32 scores and softmax sums, P rounded to the 16-bit dtype
    for P @ V with float32 accumulation, O rounded to it), so its error is what those roundings cost."""
    import torch
    slots = int(lengths.max()) + q_latent.shape[1]
    clean = torch.nan_to_num(cache)[:, :slots].float()
    additive = fallback_mask(lengths, tree, slots, q_latent.device)
    q = torch.cat([q_latent, q_rope], dim=-1).float()
    scores = torch.einsum("bnhd,bld->bnhl", q, clean) * scale + additive[:, :, None, :]
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    out = torch.einsum("bnhl,blc->bnhc", p.to(q_latent.dtype).float(), clean[..., :LATENT_DIM]) / p.sum(-1, keepdim=True)
    return errors(out.to(q_latent.dtype), ref_lse, ref_out, ref_lse)["rel_err"]


def out_error_bound(q_latent, q_rope, cache, lengths, tree, ref_out, ref_lse) -> float:
    """How far the kernel's O may be from the float32 reference (relative Frobenius): flash-attention's criterion,
    twice the same-precision baseline's error, plus the unit roundoff eps/2 of the output's dtype (rounding the exact
    O to it moves every element by at most eps/2 of itself: the floor where the baseline happens to be exact)."""
    baseline = same_precision_error(q_latent, q_rope, cache, lengths, tree, ref_out, ref_lse)
    return 2 * baseline + precision.eps(q_latent.dtype) / 2


def lse_error_bound(q_latent, q_rope, cache, lengths, tree, ref_lse, scale: float = DEFAULT_SCALE) -> float:
    """How far the kernel's LSE (float32) may be from the float32 reference's: both compute, from the same 16-bit
    inputs (exact products in float32), lse = log sum_j exp(s_j), in different orders, so twice the first-order
    rounding bound of one evaluation:
    - a score s_j sums CACHE_DIM products of magnitude up to `score_magnitude` (scale x max_j sum_i |q_i k_ji|), plus
      the scale's rounding, the log2-domain fma and the subtracted maximum (4 more terms); lse moves by at most
      max_j |delta s_j| (a softmax-weighted mean of them);
    - the denominator sums `keys` positive terms, each with exp2's own error (ex2.approx: within 2 eps) and the
      running-maximum rescales, so its relative error is at most eps x (keys + 4) and log moves by as much;
    - the LSE itself and the split merge round values of size |lse| (2 terms)."""
    import torch
    q = torch.cat([q_latent, q_rope], dim=-1).float().abs()
    magnitudes = torch.einsum("bnhd,bld->bnhl", q, torch.nan_to_num(cache).float().abs())  # every slot: a bound
    score_magnitude = scale * float(magnitudes.max())
    keys = int(lengths.max()) + q_latent.shape[1]
    one_run = (precision.rounding_bound(np.float32, terms=CACHE_DIM + 4, magnitude=score_magnitude)
               + precision.rounding_bound(np.float32, terms=keys + 4, magnitude=1.0)
               + precision.rounding_bound(np.float32, terms=2, magnitude=float(ref_lse.abs().max())))
    return 2 * one_run


def error_bounds(q_latent, q_rope, cache, lengths, tree, ref_out, ref_lse) -> dict:
    """{"rel_err": out_error_bound, "lse_err": lse_error_bound}: what `errors` of a kernel run may reach against
    the float32 reference on these inputs (NaN-poisoned cache slots are zeroed first, as the reference reads them)."""
    return {"rel_err": out_error_bound(q_latent, q_rope, cache, lengths, tree, ref_out, ref_lse),
            "lse_err": lse_error_bound(q_latent, q_rope, cache, lengths, tree, ref_lse)}


def _host64(x) -> np.ndarray:
    from ..checks import to_numpy
    return np.asarray(to_numpy(x), np.float64)


# ----------------------------------------------------------------------------------------------
# napkin math

def traffic_bytes(batch: int, nodes: int, heads: int, length: int) -> int:
    """KV read once + Q read + O (bf16) and LSE written."""
    rows = nodes * heads
    return batch * ((length + nodes) * CACHE_DIM * 2 + rows * (CACHE_DIM * 2 + LATENT_DIM * 2 + 4))


def flops(batch: int, nodes: int, heads: int, length: int) -> int:
    return 2 * batch * nodes * heads * (length + nodes) * (CACHE_DIM + LATENT_DIM)


def roofline_seconds(batch, nodes, heads, length, *, bandwidth: float, rate: float) -> float:
    return max(traffic_bytes(batch, nodes, heads, length) / bandwidth, flops(batch, nodes, heads, length) / rate)


def baseline_bytes(batch: int, nodes: int, heads: int, length: int) -> int:
    """Peak working set of (a): bf16 scores, fp32 scores, fp32 probs, bf16 probs, the fp32 mask."""
    slots = length + nodes
    return batch * nodes * slots * (heads * (2 + 4 + 4 + 2) + 4) + input_bytes(batch, nodes, heads, length)


def input_bytes(batch: int, nodes: int, heads: int, length: int) -> int:
    rows = nodes * heads
    return batch * ((length + nodes) * CACHE_DIM * 2 + rows * (CACHE_DIM + LATENT_DIM) * 2)


def benchmark_shapes(heads=HEADS, nodes=NODES, lengths=LENGTHS, batches=BATCHES, *,
                     assumed_bandwidth: float = 4.0e12, assumed_rate: float = 2.5e14):
    """The grid minus shapes over MEMORY_LIMIT or whose kernel estimate exceeds KERNEL_TIME_LIMIT,
    batch 1 first (the common case and the plots), then H = 8 (K2.6 at TP8) before other heads."""
    shapes = []
    for b in batches:
        for h in heads:
            for n in nodes:
                for length in lengths:
                    if input_bytes(b, n, h, length) > MEMORY_LIMIT:
                        continue
                    if roofline_seconds(b, n, h, length, bandwidth=assumed_bandwidth,
                                        rate=assumed_rate) > KERNEL_TIME_LIMIT:
                        continue
                    shapes.append((b, n, h, length))
    return shapes


# ----------------------------------------------------------------------------------------------
# the run

def run(shapes=None, *, reps: int = 10, baselines: bool = True, variants=(), time_budget: float = float("inf"),
        run_stamp: str | None = None, results_dir=None, log=print) -> list[dict]:
    """Time every provider on every shape, appending each shape's rows to `results_dir` (default
    data/results) as it goes; stops starting new shapes after `time_budget` seconds. Returns the rows.
    `run_stamp` (default: now) marks every row of the run, so parts of one grid measured on several GPUs
    form one run.
    `variants`: kernel configs also timed on every shape (provider kernel_variant, its `config`
    column naming it), next to the launcher's own choice (provider kernel)."""
    import time
    import torch
    started = time.monotonic()
    run_stamp = run_stamp or results.stamp()["date"]  # every row of this run carries it (results.latest_run)
    shapes = benchmark_shapes() if shapes is None else shapes
    ceilings = measure_ceilings()
    log(f"ceilings: copy {ceilings['copy_tbps']:.2f} TB/s, cuBLAS bf16 {ceilings['matmul_tflops']:.0f} TFLOP/s, "
        f"mma.sync {ceilings['mma_sync_tflops']:.0f} TFLOP/s, empty launch {ceilings['launch_floor_us']:.1f} us")
    bandwidth, rate = ceilings["copy_tbps"] * 1e12, ceilings["matmul_tflops"] * 1e12
    mma_rate = ceilings["mma_sync_tflops"] * 1e12
    rows = []
    for done, (batch, nodes, heads, length) in enumerate(shapes):
        if time.monotonic() - started > time_budget:
            log(f"time budget spent: {done} of {len(shapes)} shapes measured")
            break
        shape_rows = []
        q_latent, q_rope, cache, lengths, tree = make_inputs(batch, nodes, heads, length, seed=length + nodes)
        launch = prepare_verify_launch(q_latent, q_rope, cache, lengths, tree)
        n_bytes, n_flops = traffic_bytes(batch, nodes, heads, length), flops(batch, nodes, heads, length)
        common = {"run": run_stamp, "batch": batch, "nodes": nodes, "heads": heads, "length": length, "rows": nodes * heads,
                  "bytes": n_bytes, "flops": n_flops, **{k: round(v, 3) for k, v in ceilings.items()}}
        roof = roofline_seconds(batch, nodes, heads, length, bandwidth=bandwidth, rate=rate)
        roof_mma = roofline_seconds(batch, nodes, heads, length, bandwidth=bandwidth, rate=mma_rate)
        times = {"kernel": gpu_seconds(launch, reps=reps)}
        plan = launch.plan
        variant_times = {}
        for name in variants:
            variant = prepare_verify_launch(q_latent, q_rope, cache, lengths, tree, config=name)
            variant_times[name] = (gpu_seconds(variant, reps=reps), variant.plan.splits)
        if baselines:
            times.update(_time_baselines(q_latent, q_rope, cache, lengths, tree, reps=reps))
        sdpa_backend = times.pop("sdpa_backend", None)

        def timed(provider, seconds):
            return {**common, "provider": provider, "time_us": round(seconds * 1e6, 2),
                    "tbps": round(n_bytes / seconds / 1e12, 3), "tflops": round(n_flops / seconds / 1e12, 2)}

        def kernel_fields(seconds, config, splits):
            return {"pct_roofline": round(100 * roof / seconds, 1), "pct_roofline_mma": round(100 * roof_mma / seconds, 1),
                    "config": config, "splits": splits}

        for provider, seconds in (("roofline", roof), ("roofline_mma", roof_mma), *times.items()):
            if seconds is None:
                continue
            row = timed(provider, seconds)
            if provider == "kernel":
                row.update(kernel_fields(seconds, plan.config_name, plan.splits))
                if times.get("torch_fallback"):
                    row["speedup_vs_fallback"] = round(times["torch_fallback"] / seconds, 2)
            if provider == "sdpa":
                row["sdpa_backend"] = sdpa_backend
            shape_rows.append(row)
        for name, (seconds, splits) in variant_times.items():
            shape_rows.append({**timed("kernel_variant", seconds), **kernel_fields(seconds, name, splits)})
        results.append_rows(TOPIC, shape_rows, results_dir=results_dir)
        rows += shape_rows
        kernel_row = next(r for r in shape_rows if r["provider"] == "kernel")
        log(f"B={batch:3d} N={nodes:4d} H={heads:3d} L={length:7d}: kernel {kernel_row['time_us']:9.1f} us "
            f"{kernel_row['tflops']:7.1f} TFLOP/s {kernel_row['tbps']:5.2f} TB/s "
            f"{kernel_row['pct_roofline']:5.1f}% roof ({kernel_row['pct_roofline_mma']:5.1f}% mma roof) "
            f"x{kernel_row.get('speedup_vs_fallback', float('nan'))} vs fallback  [{plan.config_name}, {plan.splits} splits]"
            + "".join(f"; {r['config']} {r['time_us']:.1f} us {r['pct_roofline']:.1f}%"
                      for r in shape_rows if r["provider"] == "kernel_variant")
            + f"  t={time.monotonic() - started:.0f}s")
        del q_latent, q_rope, cache, lengths, tree, launch
        torch.cuda.empty_cache()
    return rows


def _time_baselines(q_latent, q_rope, cache, lengths, tree, *, reps: int) -> dict:
    """Seconds of (a) and (b); None where skipped (memory or time estimate) or where torch fails."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    batch, nodes, heads, _ = q_latent.shape
    length = int(lengths.max())
    slots = length + nodes
    out = {"torch_fallback": None, "sdpa": None, "sdpa_backend": None}
    working_set = baseline_bytes(batch, nodes, heads, length)
    est = working_set * 3 / 3e12 + flops(batch, nodes, heads, length) / 4e14
    if working_set > MEMORY_LIMIT or est > BASELINE_TIME_LIMIT:
        return out
    additive = fallback_mask(lengths, tree, slots, q_latent.device)
    bool_mask = (additive == 0)[:, None]  # (B, 1, N, S)
    out["torch_fallback"] = gpu_seconds(lambda: torch_fallback(q_latent, q_rope, cache, additive), reps=reps)
    expanded_kv = batch * heads * slots * (CACHE_DIM + LATENT_DIM) * 2  # if a backend materialises K/V per head
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        if backend == SDPBackend.MATH and working_set + expanded_kv > MEMORY_LIMIT:
            break
        try:
            with sdpa_kernel(backend):
                out["sdpa"] = gpu_seconds(lambda: sdpa(q_latent, q_rope, cache, bool_mask), reps=reps)
            out["sdpa_backend"] = backend.name.lower()
            break
        except RuntimeError:  # backend refuses these shapes (or runs out of memory): try the next
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# reading the results (notebook 05)

SHAPE_COLUMNS = ("batch", "nodes", "heads", "length")


def _shape(row) -> tuple:
    return tuple(row[column] for column in SHAPE_COLUMNS)


def variant_ratios(rows, config: str) -> list[dict]:
    """Per shape of one run: the launcher's kernel and variant `config` timed beside it, and the
    variant's speed-up (kernel time / variant time)."""
    variants = {_shape(r): r for r in results.select(rows, provider="kernel_variant", config=config)}
    found = []
    for r in results.select(rows, provider="kernel"):
        v = variants.get(_shape(r))
        if v:
            found.append({"batch": r["batch"], "nodes": r["nodes"], "heads": r["heads"], "length": r["length"],
                          "kernel": r["config"], "kernel_us": r["time_us"], "variant": config,
                          "variant_us": v["time_us"], "speedup": round(r["time_us"] / v["time_us"], 3)})
    return found


def grid_runs(all_rows, count: int = 2) -> list[list[dict]]:
    """The `count` newest runs that timed the launcher's kernel on the whole grid, newest first
    (runs of a few A/B shapes are skipped)."""
    grid = len(benchmark_shapes())
    return [run for run in results.recent_runs(all_rows) if len(results.select(run, provider="kernel")) >= grid][:count]


def run_over_run(new, old, **fixed) -> list[dict]:
    """The launcher's kernel per shape in two runs (`fixed` narrows the shapes): time before and
    after and the speed-up (old time / new time). Across runs, so run-to-run noise is in it."""
    before = {_shape(r): r for r in results.select(old, provider="kernel", **fixed)}
    return [{"batch": r["batch"], "nodes": r["nodes"], "heads": r["heads"], "length": r["length"], "rows": r["rows"],
             "old_us": before[_shape(r)]["time_us"], "new_us": r["time_us"],
             "speedup": round(before[_shape(r)]["time_us"] / r["time_us"], 3)}
            for r in results.select(new, provider="kernel", **fixed) if _shape(r) in before]


def kernel_rows(rows, config: str | None = None) -> list[dict]:
    """One row per shape timing the kernel: the launcher's choice (provider kernel), or `config`
    wherever it was timed (the launcher's row where it chose it, else its kernel_variant row)."""
    if config is None:
        return results.select(rows, provider="kernel")
    by_shape = {}
    for r in rows:
        if r["provider"] in ("kernel_variant", "kernel") and r.get("config") == config:
            if r["provider"] == "kernel" or _shape(r) not in by_shape:
                by_shape[_shape(r)] = r
    return list(by_shape.values())


def variant_configs(rows) -> list[str]:
    """The kernel variants timed alongside the launcher's choice in these rows."""
    return sorted({r["config"] for r in results.select(rows, provider="kernel_variant")})


TABLE_COLUMNS = (*SHAPE_COLUMNS, "time_us", "tflops", "tbps", "pct_roofline", "pct_roofline_mma", "speedup_vs_fallback",
                 "config", "splits")


def kernel_table(rows) -> list[dict]:
    """The launcher's kernel on every shape of a run, by heads, batch, nodes, length: the run's stamp
    (date, commit, device of the measurement) and TABLE_COLUMNS."""
    kernel = sorted(results.select(rows, provider="kernel"),
                    key=lambda r: (r["heads"], r["batch"], r["nodes"], r["length"]))
    return [{key: r.get(key) for key in (*results.STAMP_COLUMNS, *TABLE_COLUMNS)} for r in kernel]


def is_target_shape(row) -> bool:
    return row["rows"] >= TARGET_ROWS and row["length"] >= TARGET_LENGTH


def below_target(rows) -> list[dict]:
    """The launcher's kernel rows at target shapes under TARGET_PCT_ROOFLINE % of the roofline, worst first."""
    return sorted((r for r in results.select(rows, provider="kernel") if is_target_shape(r)
                   and r["pct_roofline"] < TARGET_PCT_ROOFLINE), key=lambda r: r["pct_roofline"])


def format_table(rows) -> str:
    """Kernel rows as notebook 05 prints them: shape, time, rates, % of both rooflines, x fallback, config."""
    lines = [f"{'B':>3s} {'N':>4s} {'H':>3s} {'L':>7s} {'us':>9s} {'TFLOP/s':>8s} {'TB/s':>6s} {'%roof':>6s} "
             f"{'%mma':>6s} {'xfallback':>9s}  config"]
    for r in rows:
        lines.append(f"{r['batch']:3d} {r['nodes']:4d} {r['heads']:3d} {r['length']:7d} {r['time_us']:9.1f} "
                     f"{r['tflops']:8.1f} {r['tbps']:6.2f} {r['pct_roofline']:6.1f} {r['pct_roofline_mma']:6.1f} "
                     f"{str(r.get('speedup_vs_fallback') or '-'):>9s}  {r['config']} x{r['splits']}")
    return "\n".join(lines)


def target_comparison(rows) -> list[dict]:
    """Per target shape, the % of roofline of every kernel the run timed there (the launcher's configs
    and the variants): {date, commit, device (the run's), batch, nodes, heads, length, <config>: pct or None}."""
    configs = sorted({r["config"] for r in results.select(rows, provider="kernel")} | set(variant_configs(rows)))
    timed = {c: {_shape(r): r for r in kernel_rows(rows, c)} for c in configs}
    targets = sorted({s for by_shape in timed.values() for s, r in by_shape.items() if is_target_shape(r)})
    shown = [c for c in configs if any(s in timed[c] for s in targets)]
    stamp = {key: rows[0].get(key) for key in results.STAMP_COLUMNS} if rows else {}
    return [{**stamp, **dict(zip(SHAPE_COLUMNS, s)),
             **{c: timed[c][s]["pct_roofline"] if s in timed[c] else None for c in shown}} for s in targets]


def _kernels_compared(comparison) -> list[str]:
    return [c for c in (comparison[0] if comparison else {}) if c not in (*results.STAMP_COLUMNS, *SHAPE_COLUMNS)]


def comparison_spread(comparison) -> list[dict]:
    """Per kernel of a target_comparison: min, median and max % of roofline over the shapes it was timed on."""
    spread = []
    for config in _kernels_compared(comparison):
        timed = [shape[config] for shape in comparison if shape[config] is not None]
        spread.append({"config": config, "min": min(timed), "median": statistics.median(timed), "max": max(timed),
                       "shapes": len(timed)})
    return spread


def leads(comparison, config: str) -> tuple[int, int]:
    """(shapes where `config` beats every other kernel timed there, shapes where it ran beside another)."""
    ahead = compared = 0
    for shape in comparison:
        others = [shape[c] for c in _kernels_compared(comparison) if c != config and shape[c] is not None]
        if shape.get(config) is not None and others:
            compared += 1
            ahead += shape[config] > max(others)
    return ahead, compared


def summary(rows, config: str | None = None) -> dict:
    """The targets, read from one run's rows: for the launcher's choice, or for `config`."""
    kernel = kernel_rows(rows, config)
    fallback = {_shape(r): r["time_us"] for r in results.select(rows, provider="torch_fallback")}
    big = [r for r in kernel if is_target_shape(r)]
    speedups = [fallback[_shape(r)] / r["time_us"] for r in kernel
                if r["length"] >= TARGET_LENGTH and _shape(r) in fallback]
    ratios = []
    for r in [r for r in kernel if r["length"] == 131072]:
        short = [s for s in kernel if _shape(s) == (r["batch"], r["nodes"], r["heads"], 32768)]
        if short:
            ratios.append(r["time_us"] / short[0]["time_us"])
    med = statistics.median
    out = {"kernel": config or "launcher's choice", "shapes": len(kernel),
           "device": kernel[0]["device"] if kernel else None, "date": kernel[0]["date"] if kernel else None}
    if big:
        out.update({"compute_shapes": len(big), "pct_roofline_min": min(r["pct_roofline"] for r in big),
                    "pct_roofline_median": med(r["pct_roofline"] for r in big),
                    "pct_roofline_mma_median": med(r["pct_roofline_mma"] for r in big),
                    "best_tflops": max(r["tflops"] for r in big)})
    if speedups:
        out.update({"speedup_min": round(min(speedups), 2), "speedup_median": round(med(speedups), 2)})
    if ratios:
        out.update({"time_128k_over_32k_median": med(ratios), "ideal_ratio": 131072 / 32768})
    return out


def fixed_cost(rows, config: str | None = None) -> list[dict]:
    """Where batch-1 target shapes (N·H >= TARGET_ROWS, L >= TARGET_LENGTH) lose to the roofline.

    The same call at the run's shortest length does about one KV tile per CTA; its time beyond its
    own roofline time estimates the call's fixed cost (launches, the first loads, the epilogue, the
    split merge). Per shape: that fixed cost, the rate of the work past the short call (marginal
    TFLOP/s), the best % of roofline a call with this fixed cost could reach if all of its work ran
    at the roofline (bound_pct), and the empty launch of the same run (launch_floor_us; None in runs
    from before it was measured).
    """
    kernel = kernel_rows(rows, config)
    roofline = {_shape(r): r["time_us"] for r in results.select(rows, provider="roofline")}
    table = []
    for r in kernel:
        if r["batch"] != 1 or not is_target_shape(r):
            continue
        short = min((s for s in kernel if _shape(s)[:3] == _shape(r)[:3]), key=lambda s: s["length"])
        if short["length"] >= r["length"]:
            continue
        roof = roofline[_shape(r)]
        fixed = short["time_us"] - roofline[_shape(short)]
        table.append({"nodes": r["nodes"], "heads": r["heads"], "length": r["length"], "time_us": r["time_us"],
                      "pct_roofline": r["pct_roofline"], "short_length": short["length"], "fixed_us": round(fixed, 2),
                      "marginal_tflops": round((r["flops"] - short["flops"]) / (r["time_us"] - short["time_us"]) / 1e6, 1),
                      "bound_pct": round(100 * roof / (fixed + roof), 1),
                      "launch_floor_us": r.get("launch_floor_us")})
    return sorted(table, key=lambda t: (t["length"], t["nodes"] * t["heads"], t["nodes"]))


def smoke(log=print) -> bool:
    """Every variant, one and several splits, a ragged batch with a zero length: the sanitizer case."""
    import torch
    ok = True
    inputs = make_inputs(2, 9, 8, 0, lengths=[70, 0], seed=0, slack=5, poison=True)
    ref_out, ref_lse = verify_attention(*inputs[:2], torch.nan_to_num(inputs[2]), *inputs[3:], backend="torch")
    for config in runnable_configs():
        for splits in (1, 3):
            launch = prepare_verify_launch(*inputs, config=config, splits=splits)
            launch()
            err = errors(launch.out, launch.lse, ref_out, ref_lse)
            ok &= err["finite"] and err["rel_err"] <= 1e-2 and err["lse_err"] <= 1e-3
            log(f"smoke {config} splits={launch.plan.splits}: {err}")
    torch.cuda.synchronize()
    return ok


def explore(shapes, *, reps: int = 10, log=print) -> list[dict]:
    """Every variant that fits, with the planner's split and with half / double of it; the kernel
    alone and with the merge. Prints a table (tuning the planner), returns the rows."""
    found = []
    for batch, nodes, heads, length in shapes:
        inputs = make_inputs(batch, nodes, heads, length, seed=1)
        n_flops, n_bytes = flops(batch, nodes, heads, length), traffic_bytes(batch, nodes, heads, length)
        for name in runnable_configs():
            auto = prepare_verify_launch(*inputs, config=name).plan.splits
            for splits in sorted({auto, max(1, auto // 2), min(1024, 2 * auto)}):
                launch = prepare_verify_launch(*inputs, config=name, splits=splits)
                total = gpu_seconds(launch, reps=reps)
                alone = gpu_seconds(lambda: launch(merge=False), reps=reps) if launch.plan.splits > 1 else total
                row = {"batch": batch, "nodes": nodes, "heads": heads, "length": length, "config": name,
                       "splits": launch.plan.splits, "auto": splits == auto, "total_us": round(total * 1e6, 1),
                       "kernel_us": round(alone * 1e6, 1), "tflops": round(n_flops / total / 1e12, 1),
                       "tbps": round(n_bytes / total / 1e12, 2)}
                found.append(row)
                log("explore " + " ".join(f"{k}={v}" for k, v in row.items()))
    return found


def flush_study(shapes, *, reps: int = 10, log=print) -> list[dict]:
    """The kernel's time (planner's choice) after each kind of L2 flush: how much of a short call's
    time is the write-back of the flush's own dirty lines rather than the kernel."""
    found = []
    for batch, nodes, heads, length in shapes:
        launch = prepare_verify_launch(*make_inputs(batch, nodes, heads, length, seed=3))
        row = {"batch": batch, "nodes": nodes, "heads": heads, "length": length, "config": launch.plan.config_name,
               "splits": launch.plan.splits}
        for flush in FLUSHES:
            seconds = gpu_seconds(launch, reps=reps, flush=flush)
            row[f"{flush}_us"] = round(seconds * 1e6, 1)
            row[f"{flush}_tflops"] = round(flops(batch, nodes, heads, length) / seconds / 1e12, 1)
        found.append(row)
        log("flush " + " ".join(f"{k}={v}" for k, v in row.items()))
    return found


def profile_case(batch: int, nodes: int, heads: int, length: int, config=None):
    """One warm-up and one measured launch, for `ncu --launch-skip 1 --launch-count 1 -k verify_attn`."""
    import torch
    launch = prepare_verify_launch(*make_inputs(batch, nodes, heads, length, seed=2), config=config)
    launch()
    launch()
    torch.cuda.synchronize()
    print("profiled", batch, nodes, heads, length, launch.plan)


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__.splitlines()[0])
    parser.add_argument("--reps", type=cli.positive_int, default=10)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--targets", action="store_true", help="the target shapes only (N·H >= 128, L >= 32k)")
    parser.add_argument("--variants", nargs="*", default=(), metavar="CONFIG",
                        help="kernel configs also timed on every shape (provider kernel_variant)")
    parser.add_argument("--no-baselines", action="store_true", help="time the kernels only")
    parser.add_argument("--smoke", action="store_true", help="a tiny correctness run (for compute-sanitizer)")
    parser.add_argument("--explore", action="store_true", help="time every variant and split on a few shapes")
    parser.add_argument("--flush-study", action="store_true", help="kernel time after each kind of L2 flush")
    parser.add_argument("--profile", type=cli.positive_int, nargs=4, metavar=("B", "N", "H", "L"), help="one launch for ncu")
    parser.add_argument("--config", default=None, help="variant for --profile")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds before no new shape starts")
    parser.add_argument("--part", default="0/1", metavar="K/P", help="every P-th shape from the K-th (one GPU's share)")
    parser.add_argument("--run", default=None, help="run stamp shared by the parts of one grid (default: now)")
    args = parser.parse_args(argv)
    part, parts = _part(args.part)
    cli.require_cuda(kernels=True)
    if args.profile:
        profile_case(*args.profile, config=args.config)
        return 0
    if args.explore:
        explore(QUICK_SHAPES, reps=args.reps)
        return 0
    if args.flush_study:
        flush_study(QUICK_SHAPES, reps=args.reps)
        return 0
    if args.smoke:
        return 0 if smoke() else 1
    shapes = QUICK_SHAPES if args.quick else benchmark_shapes()
    if args.targets:
        shapes = [s for s in shapes if s[1] * s[2] >= TARGET_ROWS and s[3] >= TARGET_LENGTH]
    run(shapes[part::parts], reps=args.reps, baselines=not args.no_baselines, variants=args.variants,
        time_budget=args.budget, run_stamp=args.run, results_dir=args.results_dir)
    return 0


def _part(text: str) -> tuple[int, int]:
    """--part K/P as (K, P)."""
    try:
        part, parts = (int(x) for x in text.split("/"))
    except ValueError:
        part, parts = -1, 0
    if not 0 <= part < parts:
        raise ValueError(f"--part: {text!r}; expected K/P with 0 <= K < P")
    return part, parts


if __name__ == "__main__":
    raise SystemExit(main())
