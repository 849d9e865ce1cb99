"""One MoE layer's routed experts at K2.6 shapes on one GPU: the INT4 kernel against torch's bf16
grouped matmul and the roofline, per tokens M = B·N of a verify step.

    python -m kdtree_lib.bench.moe_int4 [--quick | --tokens M ...] [--tp 1 8] [--routing ...] [--reps 10]
    python -m kdtree_lib.bench.moe_int4 --ncu [--tp 8 1] [--tokens 1 8 64 512] [--routing uniform]

The default is issue 31's whole grid in one command: M in TOKENS, uniform and correlated routing,
the TP=8 slice (width 256) and TP=1 (width 2048), the roofline measured in the same run.
Rows go to data/results/moe_int4.csv ($KDTREE_RESULTS_DIR overrides), one per (tp, routing, M,
provider), with date, commit, device, every parameter and the plan that ran (`plan`; `plan_from_rows`:
whether moe.PLAN_FROM_ROWS chose the launcher's). Providers, timed in the same run:
- `kernel`: the launcher's plan for this device;
- `kernel_99kb`: the plan for 99 KB of shared memory per block (the sm_120 box's limit);
- `kernel_tt1`, `kernel_tt2`, `kernel_tt4`: the plan forced to that many 8-token tiles per pass, where it
  differs from the launcher's (fewer tiles: fewer registers, more bytes in flight, but an expert with
  more tokens takes further passes over its weights, from L2);
- `kernel_ep` (TP > 1): the same layer sharded EP instead, tp ranks of 384/tp whole experts, each rank
  timed in turn on the same tokens; the step waits for the slowest (its hits and bytes in the row);
- `torch_bf16`: model.Experts.grouped (torch._grouped_mm) on bf16 experts of the same shapes (random
  values: a GEMM's time does not depend on them, and the weights are not zeros);
- `roofline`: the bytes a call must move (codes + scales of the distinct experts hit, tokens in and
  out in bf16) at the copy bandwidth measured in the run (bytes read plus written).
Routing: "uniform" (each token k distinct experts, uniform) or "correlated" (tokens of a tree route
alike: 1 + (M − 1)(1 − c) independent expert sets shared among the tokens, projection's model of the
union, with c = CORRELATION, an assumption until the stand-in router's fit is measured).
Each call's time is timing.gpu_seconds (L2 flushed before each repeat).

`--ncu` profiles the launcher's four kernels (route, gate_up, down, combine) of each chosen shape with
Nsight Compute instead: `ncu` runs this module's `--profile-target` (each shape prepared and warmed up,
then one call between cudaProfilerStart/Stop), collecting the sections NCU_SECTIONS and the metrics
NCU_METRICS per kernel, i.e. per pass over the experts: achieved DRAM bandwidth ((dram__bytes_read.sum +
dram__bytes_write.sum) / gpu__time_duration.sum, and dram__throughput.avg.pct_of_peak_sustained_elapsed),
achieved and theoretical occupancy (sm__warps_active.avg.pct_of_peak_sustained_active,
sm__maximum_warps_per_active_cycle_pct), the L2 hit rate (lts__t_sector_hit_rate.pct) and the stall
reasons (WarpStateStats' smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio, the three
largest named; `selected` is the issuing warp, not a stall). ncu flushes the caches before each replay
pass and locks the clocks to base, so compare its bandwidths and percentages, not its microseconds, with
the benchmark's rows. Written under the results folder's ncu/ as moe_int4-<run>.ncu-rep (the report),
.raw.csv (`ncu --import ... --csv --page raw`), .shapes.json (the shapes in launch order) and
.summary.csv (one row per kernel with its shape, plan and the numbers above).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .. import cli, moe, results
from ..paths import K26_CONFIG
from . import ceilings, command_parser, timing

TOPIC = "moe_int4"
TOKENS = (1, 4, 8, 16, 32, 64, 128, 256, 512)
QUICK_TOKENS = (1, 8, 64, 512)
ROUTINGS = ("uniform", "correlated")
TPS = (8, 1)
CORRELATION = 0.6
TOKEN_TILE_VARIANTS = (1, 2, 4)  # kernel_tt<n>: the plan with n 8-token tiles per pass, where it differs
TARGET_TP = 8           # the targets are for the TP=8 slice (the box's)
TARGET_MIN_TOKENS = 8   # >= 70% of the roofline from M = 8
TARGET_PCT = 70.0
SINGLE_TOKEN_SLACK = 1.5  # M = 1: within 1.5x of roofline + one empty launch
NCU_TOKENS = QUICK_TOKENS  # --ncu's default shapes: these M, uniform routing, both TP widths
NCU_ROUTINGS = ("uniform",)
NCU_KERNELS = ("moe_route", "gate_up", "down", "moe_combine")  # one call's launches, in order (gemm: plan's name)
NCU_SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats",
                "SchedulerStats")
NCU_METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
               "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_sector_hit_rate.pct",
               "sm__warps_active.avg.pct_of_peak_sustained_active", "sm__maximum_warps_per_active_cycle_pct")
NCU_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")


def make_routing(tokens: int, n_experts: int, top_k: int, kind: str, *, seed: int, device="cuda",
                 correlation: float = CORRELATION):
    """routes int32 [tokens, k] and fp32 weights [tokens, k] of one of ROUTINGS."""
    import torch
    if kind not in ROUTINGS:
        raise ValueError(f"kind: expected one of {ROUTINGS}, got {kind!r}")
    generator = torch.Generator(device=device).manual_seed(seed)
    independent = tokens if kind == "uniform" else max(1, round(1 + (tokens - 1) * (1 - correlation)))
    sets = torch.rand(independent, n_experts, generator=generator, device=device).topk(top_k, dim=-1).indices
    owner = torch.randperm(tokens, generator=generator, device=device) % independent
    weights = torch.rand(tokens, top_k, generator=generator, device=device) * 2.5 / top_k
    return sets[owner].to(torch.int32).contiguous(), weights


def torch_baseline(config, tp: int, device="cuda"):
    """model.Experts of the TP=tp slice (rank 0, "tp" sharding) with random bf16 weights."""
    import torch
    from ..model.model import Experts
    from ..model.tp import TensorParallel
    with torch.device(device):
        experts = Experts(config, TensorParallel(rank=0, size=tp), "tp").to(torch.bfloat16).requires_grad_(False)
    for weight in experts.parameters():
        weight.normal_(0, 0.02)
    return experts


def plan_rows(rows) -> list[dict]:
    """The rows that time this layer's call (the TP slice) under the plan they name: the launcher's, the
    99 KB plan and the token-tile variants; not EP, torch or the roofline. What moe.MeasuredPlans
    chooses the launcher's plan from."""
    providers = {"kernel", "kernel_99kb", *(f"kernel_tt{tiles}" for tiles in TOKEN_TILE_VARIANTS)}
    return [r for r in rows if r.get("provider") in providers and r.get("plan")]


def run(tps=TPS, tokens=TOKENS, routings=ROUTINGS, *, reps: int = 10, results_dir=None, log=print) -> list[dict]:
    """Time every provider on every (tp, routing, M), appending each tp's rows as it goes."""
    import torch
    from ..model.config import load_config
    config = load_config(K26_CONFIG)
    run_stamp = results.stamp()["date"]
    started = time.perf_counter()
    bandwidth = ceilings.copy_bandwidth()
    floor = ceilings.launch_floor_seconds()
    log(f"copy {bandwidth / 1e12:.2f} TB/s, empty launch {floor * 1e6:.2f} us")
    rows = []
    for tp in tps:
        width = config.moe_intermediate_size // tp
        experts = moe.random_experts(config.n_routed_experts, config.hidden_size, width, seed=tp, device="cuda")
        # EP: tp ranks of n/tp whole experts; one set of weights serves every rank (times do not depend on values)
        ep_share = None if tp == 1 else moe.random_experts(config.n_routed_experts // tp, config.hidden_size,
                                                            config.moe_intermediate_size, seed=tp + 1, device="cuda")
        baseline = torch_baseline(config, tp)
        tp_rows = []
        for routing in routings:
            for m in tokens:
                routes, weights = make_routing(m, config.n_routed_experts, config.num_experts_per_tok, routing,
                                               seed=m)
                x = torch.randn(m, config.hidden_size, device="cuda").to(torch.bfloat16)
                need = moe.touched_bytes(routes, experts)
                n_bytes = need["weight_bytes"] + need["activation_bytes"]
                roofline = n_bytes / bandwidth
                common = {"run": run_stamp, "tp": tp, "hidden": experts.hidden, "width": width,
                          "experts": experts.n_experts, "top_k": config.num_experts_per_tok, "routing": routing,
                          "correlation": CORRELATION if routing == "correlated" else 0.0, "tokens": m,
                          "experts_hit": need["experts_hit"], "weight_bytes": need["weight_bytes"],
                          "activation_bytes": need["activation_bytes"], "bytes": n_bytes, "reps": reps,
                          "copy_tbps": round(bandwidth / 1e12, 3), "launch_floor_us": round(floor * 1e6, 2),
                          "plan_from_rows": moe.PLAN_FROM_ROWS}
                times = _time_providers(x, routes, weights, experts, baseline, ep_share, reps=reps)
                times["roofline"] = (roofline, None, {})
                for provider, (seconds, plan, extra) in times.items():
                    tp_rows.append({**common, "provider": provider, "plan": plan, "time_us": round(seconds * 1e6, 2),
                                    "tbps": round(n_bytes / seconds / 1e12, 3),
                                    "pct_roofline": round(100 * roofline / seconds, 1), **extra})
                log(f"tp={tp} {routing:10s} M={m:4d} hit={need['experts_hit']:3d} {n_bytes / 1e6:8.1f} MB: "
                    + ", ".join(f"{provider} {seconds * 1e6:.1f} us" for provider, (seconds, _, _) in times.items())
                    + f" ({100 * roofline / times['kernel'][0]:.1f}% roof) [{times['kernel'][1]}]")
        results.append_rows(TOPIC, tp_rows, results_dir=results_dir)
        rows += tp_rows
        del experts, ep_share, baseline
        torch.cuda.empty_cache()
        log(f"tp={tp} done, {time.perf_counter() - started:.0f} s since the start")
    return rows


def _time_providers(x, routes, weights, experts, baseline, ep_share, *, reps: int) -> dict:
    """{provider: (seconds, plan name, extra row fields)} on one input: the kernel at this TP slice,
    its 99 KB plan, torch's bf16 grouped matmul and, with ep_share, the EP step: the slowest of the
    ranks holding ep_share's whole experts, each timed in turn."""
    import dataclasses
    launch = moe.prepare_moe_launch(x, routes, weights, experts)
    box_plan = moe.plan_moe(len(x), experts.hidden, experts.width, smem_per_block=moe.SM120_SMEM_PER_BLOCK)
    box = moe.prepare_moe_launch(x, routes, weights, experts, plan=box_plan)
    long_routes = routes.long()
    times = {"kernel": (timing.gpu_seconds(launch, reps=reps), launch.plan.name, {}),
             "kernel_99kb": (timing.gpu_seconds(box, reps=reps), box_plan.name, {}),
             "torch_bf16": (timing.gpu_seconds(lambda: baseline.grouped(x, long_routes, weights), reps=reps), None, {})}
    for tiles in TOKEN_TILE_VARIANTS:  # the same call with other token tiles per pass (more or fewer passes)
        plan = moe.plan_moe(len(x), experts.hidden, experts.width, smem_per_block=moe.SM120_SMEM_PER_BLOCK,
                            tiles=tiles)
        if plan != launch.plan:
            variant = moe.prepare_moe_launch(x, routes, weights, experts, plan=plan)
            times[f"kernel_tt{tiles}"] = (timing.gpu_seconds(variant, reps=reps), plan.name, {})
    if ep_share is not None:
        ranks = experts.n_experts // ep_share.n_experts
        steps = []
        for rank in range(ranks):
            shard = dataclasses.replace(ep_share, first_expert=rank * ep_share.n_experts,
                                        total_experts=experts.n_experts)
            rank_launch = moe.prepare_moe_launch(x, routes, weights, shard)
            steps.append((timing.gpu_seconds(rank_launch, reps=reps), moe.touched_bytes(routes, shard), rank_launch))
        seconds, need, rank_launch = max(steps, key=lambda step: step[0])
        slowest = {"ep_ranks": ranks, "ep_rank_experts_hit": need["experts_hit"],
                   "ep_rank_weight_bytes": need["weight_bytes"]}
        times["kernel_ep"] = (seconds, rank_launch.plan.name, slowest)
    return times


# ----------------------------------------------------------------------------------------------
# the Nsight Compute profile (--ncu)

def profile_shapes(tps, tokens, routings) -> list[tuple[int, str, int]]:
    """(tp, routing, M) in the order the profile target runs them (and ncu records their kernels)."""
    return [(int(tp), str(routing), int(m)) for tp in tps for routing in routings for m in tokens]


def profile_target(tps, tokens, routings, shapes_file: Path) -> list[dict]:
    """What ncu runs: per shape the launcher's prepared call with the plan it picks for 99 KB of shared
    memory per block (the box's, which the targets are for: moe.choose_plan), warmed up, then one call
    between cudaProfilerStart and Stop. Writes the shapes, in order, with their plan and bytes to
    shapes_file (JSON) for the summary."""
    import torch
    from ..backend import device_name
    from ..model.config import load_config
    config = load_config(K26_CONFIG)
    shapes, experts, tp_of = [], None, None
    for tp, routing, m in profile_shapes(tps, tokens, routings):
        if tp != tp_of:
            experts, tp_of = None, tp
            torch.cuda.empty_cache()
            experts = moe.random_experts(config.n_routed_experts, config.hidden_size,
                                         config.moe_intermediate_size // tp, seed=tp, device="cuda")
        routes, weights = make_routing(m, config.n_routed_experts, config.num_experts_per_tok, routing, seed=m)
        x = torch.randn(m, config.hidden_size, device="cuda").to(torch.bfloat16)
        plan = moe.choose_plan(m, experts.hidden, experts.width, smem_per_block=moe.SM120_SMEM_PER_BLOCK)
        launch = moe.prepare_moe_launch(x, routes, weights, experts, plan=plan)
        for _ in range(2):
            launch()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        launch()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        need = moe.touched_bytes(routes, experts)
        per_expert = {name: (getattr(experts, f"{name}_codes").nbytes + getattr(experts, f"{name}_scales").nbytes)
                      // experts.n_experts for name in ("gate_up", "down")}
        shapes.append({"tp": tp, "routing": routing, "tokens": m, "width": experts.width, "plan": plan.name,
                       "experts_hit": need["experts_hit"], "weight_bytes": need["weight_bytes"],
                       "gate_up_bytes": need["experts_hit"] * per_expert["gate_up"],
                       "down_bytes": need["experts_hit"] * per_expert["down"], "device": device_name(),
                       "commit": results.git_commit()})
    _write_atomically(Path(shapes_file), json.dumps(shapes, indent=1))
    return shapes


def ncu_command(ncu: str, export: Path, shapes_file: Path, tps, tokens, routings) -> list[str]:
    """The ncu command line of one profile: this module's --profile-target under ncu, only the range
    between cudaProfilerStart/Stop, only the MoE's kernels, NCU_SECTIONS and NCU_METRICS."""
    sections = [arg for section in NCU_SECTIONS for arg in ("--section", section)]
    return [ncu, "--target-processes", "all", "--profile-from-start", "off", "--kernel-name", "regex:^moe_",
            *sections, "--metrics", ",".join(NCU_METRICS), "--export", str(export),
            sys.executable, "-m", __spec__.name, "--profile-target", "--shapes-file", str(shapes_file),
            "--tp", *map(str, tps), "--tokens", *map(str, tokens), "--routing", *map(str, routings)]


def profile(tps, tokens, routings, *, results_dir=None, log=print) -> Path:
    """Run ncu over profile_target and write the report, its raw CSV and the summary (see the module's
    docstring) under <results folder>/ncu/; returns the summary's path."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise cli.Refused("ncu (Nsight Compute's command line) is not on PATH")
    folder = results.check_writable(results_dir) / "ncu"
    folder.mkdir(parents=True, exist_ok=True)
    # the run id without its colons: the report's files are copied between machines and file systems
    base = folder / f"{TOPIC}-{results.new_run_id().replace(':', '')}"
    partial, shapes_file = Path(f"{base}.partial"), Path(f"{base}.shapes.json")
    command = ncu_command(ncu, partial, shapes_file, tps, tokens, routings)
    log(" ".join(command))
    done = subprocess.run(command)
    if done.returncode != 0:
        raise cli.Refused(f"ncu exited with status {done.returncode} (its output is above)")
    report = Path(f"{base}.ncu-rep")
    Path(f"{partial}.ncu-rep").replace(report)  # a finished report only ever has the final name
    raw = subprocess.run([ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"],
                         capture_output=True, text=True)
    if raw.returncode != 0:
        raise cli.Refused(f"ncu --import {report} failed: {raw.stderr.strip()}")
    _write_atomically(Path(f"{base}.raw.csv"), raw.stdout)
    shapes = json.loads(shapes_file.read_text())
    rows = ncu_summary(raw.stdout, shapes)
    summary = Path(f"{base}.summary.csv")
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    _write_atomically(summary, text.getvalue())
    for r in rows:
        log(f"tp={r['tp']} {r['routing']} M={r['tokens']} {r['kernel']}: {r['duration_us']} us, DRAM "
            f"{r['dram_tbps']} TB/s ({r['dram_pct_peak']}% of peak), L2 hit {r['l2_hit_pct']}%, occupancy "
            f"{r['achieved_occupancy_pct']}/{r['theoretical_occupancy_pct']}%, stalls {r['top_stalls']}")
    log(f"wrote {summary} (report {report.name})")
    return summary


def ncu_summary(raw_csv: str, shapes: list[dict]) -> list[dict]:
    """One row per profiled kernel from `ncu --import --csv --page raw --print-units base` (a header, a
    units row, then a row per kernel in launch order), matched to `shapes` (profile_target's, 4 kernels
    each: NCU_KERNELS)."""
    table = list(csv.reader(io.StringIO(raw_csv)))
    table = [row for row in table if row and not row[0].startswith("==")]  # ncu's own ==PROF== lines
    if len(table) < 2:
        raise ValueError("raw_csv: expected a header, a units row and a row per kernel")
    header, units, kernels = table[0], table[1], table[2:]
    if len(kernels) != len(NCU_KERNELS) * len(shapes):
        raise ValueError(f"raw_csv: {len(kernels)} kernels profiled, expected {len(NCU_KERNELS) * len(shapes)} "
                         f"({len(NCU_KERNELS)} for each of the {len(shapes)} shapes)")
    rows = []
    for index, cells in enumerate(kernels):
        shape, role = shapes[index // len(NCU_KERNELS)], NCU_KERNELS[index % len(NCU_KERNELS)]
        value = {name: _ncu_value(cell, unit) for name, unit, cell in zip(header, units, cells)}
        name = str(value.get("Kernel Name") or value.get("Function Name") or "").split("(")[0]
        gate_up, down = shape["plan"].split("+")
        expected = {"gate_up": gate_up, "down": down}.get(role, role)
        if name != expected:
            raise ValueError(f"raw_csv: kernel {index} is {name!r}, expected {expected!r} (shape {shape})")
        seconds = value.get("gpu__time_duration.sum")
        moved = (value.get("dram__bytes_read.sum") or 0) + (value.get("dram__bytes_write.sum") or 0)
        stalls = sorted(((v, m[1]) for k, v in value.items()
                         if (m := NCU_STALL.match(k)) and m[1] != "selected" and isinstance(v, float)), reverse=True)
        needed = shape.get(f"{role}_bytes")
        rows.append({"device": shape.get("device"), "commit": shape.get("commit"), "tp": shape["tp"],
                     "width": shape.get("width"), "routing": shape["routing"], "tokens": shape["tokens"],
                     "experts_hit": shape["experts_hit"],
                     "plan": shape["plan"], "kernel": name,
                     "grid": value.get("Grid Size"), "block": value.get("Block Size"),
                     "registers": value.get("launch__registers_per_thread"),
                     "duration_us": _round(seconds, 1e6, 2),
                     "dram_read_mb": _round(value.get("dram__bytes_read.sum"), 1e-6, 3),
                     "dram_write_mb": _round(value.get("dram__bytes_write.sum"), 1e-6, 3),
                     "expert_mb": _round(needed, 1e-6, 3),
                     "dram_tbps": _round(moved / seconds if seconds else None, 1e-12, 3),
                     "dram_pct_peak": _round(value.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"), 1, 1),
                     "l2_hit_pct": _round(value.get("lts__t_sector_hit_rate.pct"), 1, 1),
                     "achieved_occupancy_pct": _round(value.get("sm__warps_active.avg.pct_of_peak_sustained_active"),
                                                      1, 1),
                     "theoretical_occupancy_pct": _round(value.get("sm__maximum_warps_per_active_cycle_pct"), 1, 1),
                     "top_stalls": "; ".join(f"{reason} {v:.2f}" for v, reason in stalls[:3])})
    return rows


_UNIT_SCALE = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
# ncu prints times as "ns"/"us"/"ms"/"s" (some versions "nsecond"), sizes as "byte"/"Kbyte"/..., rates as
# "<size>/s": the prefix, then the base unit
_UNIT = re.compile(r"(?P<prefix>[numKMGT]?)(?P<base>second|s|byte)")


def _ncu_value(cell: str, unit: str):
    """A raw-page cell as a float in base units (seconds, bytes, bytes/second; % and ratios as they are)
    where it is a number, else the text."""
    text = cell.strip()
    if not re.fullmatch(r"-?[\d,]*\.?\d+(e[-+]?\d+)?", text):
        return text
    number = float(text.replace(",", ""))
    unit = unit.strip()
    head, _, per = unit.partition("/")
    if (m := _UNIT.fullmatch(head)) and (not per or m["base"] == "byte"):
        # a rate's denominator is always plain seconds ("byte/s"), so only the numerator scales it
        return number * _UNIT_SCALE[m["prefix"]]
    return number


def _round(value, scale: float, digits: int):
    return None if value is None or isinstance(value, str) else round(value * scale, digits)


def _write_atomically(path: Path, text: str) -> None:
    """path's text, written to a temporary name beside it and renamed: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    partial.replace(path)


# ----------------------------------------------------------------------------------------------
# reading the rows (notebook 07)

def summary(rows, provider: str = "kernel") -> dict:
    """The targets read from one run: % of roofline for M >= 8 at the TP=8 slice (min and
    median), and at M = 1 the time against 1.5x (roofline + one empty launch)."""
    kernel = results.select(rows, provider=provider, tp=TARGET_TP)
    roof = {(r["routing"], r["tokens"]): r["time_us"] for r in results.select(rows, provider="roofline", tp=TARGET_TP)}
    targets = [r["pct_roofline"] for r in kernel if r["tokens"] >= TARGET_MIN_TOKENS]
    single = [r for r in kernel if r["tokens"] == 1]
    bounds = [SINGLE_TOKEN_SLACK * (roof[(r["routing"], 1)] + r["launch_floor_us"]) for r in single]
    return {"provider": provider,
            "pct_roofline_min": min(targets, default=None),
            "pct_roofline_median": round(statistics.median(targets), 1) if targets else None,
            "shapes_at_target": sum(p >= TARGET_PCT for p in targets), "target_shapes": len(targets),
            "single_token_us": [r["time_us"] for r in single], "single_token_bound_us": [round(b, 2) for b in bounds],
            "single_token_ok": all(r["time_us"] <= b for r, b in zip(single, bounds)) if single else None}


def best_plans(rows, *, tp: int = TARGET_TP) -> list[dict]:
    """Per (routing, M) at TP=tp: the fastest of the kernel's plans timed (the launcher's and the
    token-tile variants) against the launcher's."""
    best = []
    for r in sorted(results.select(rows, provider="kernel", tp=tp), key=lambda r: (r["routing"], r["tokens"])):
        timed = [v for v in rows if v.get("tp") == tp and v["routing"] == r["routing"] and v["tokens"] == r["tokens"]
                 and (v["provider"] == "kernel" or str(v["provider"]).startswith("kernel_tt"))]
        fastest = min(timed, key=lambda v: v["time_us"])
        best.append({"routing": r["routing"], "tokens": r["tokens"], "launcher_plan": r["plan"],
                     "launcher_us": r["time_us"], "best_plan": fastest["plan"], "best_us": fastest["time_us"]})
    return best


def parallel_comparison(rows, *, tp: int = TARGET_TP) -> list[dict]:
    """Per (routing, M) at TP=tp: the TP slice's kernel time against the EP step's (slowest rank)."""
    tp_times = {(r["routing"], r["tokens"]): r["time_us"] for r in results.select(rows, provider="kernel", tp=tp)}
    return [{"routing": r["routing"], "tokens": r["tokens"], "tp_us": tp_times[(r["routing"], r["tokens"])],
             "ep_us": r["time_us"], "ep_over_tp": round(r["time_us"] / tp_times[(r["routing"], r["tokens"])], 3),
             "ep_rank_experts_hit": r["ep_rank_experts_hit"]}
            for r in sorted(results.select(rows, provider="kernel_ep", tp=tp), key=lambda r: (r["routing"], r["tokens"]))
            if (r["routing"], r["tokens"]) in tp_times]


def union_growth(rows, *, tp: int = TARGET_TP, provider: str = "kernel") -> list[dict]:
    """Per routing at TP=tp, from M = TARGET_MIN_TOKENS to the largest M: how time per expert hit grew against
    tokens per expert hit (time that follows the union grows far less than the tokens per expert)."""
    growth = []
    for routing in ROUTINGS:
        line = sorted((r for r in results.select(rows, provider=provider, tp=tp, routing=routing)
                       if r["tokens"] >= TARGET_MIN_TOKENS), key=lambda r: r["tokens"])
        if len(line) < 2:
            continue
        first, last = line[0], line[-1]
        per_hit = [r["time_us"] / r["experts_hit"] for r in (first, last)]
        tokens_per_hit = [r["tokens"] * r["top_k"] / r["experts_hit"] for r in (first, last)]
        growth.append({"routing": routing, "tokens": [first["tokens"], last["tokens"]],
                       "us_per_expert_hit": [round(v, 2) for v in per_hit],
                       "tokens_per_expert_hit": [round(v, 1) for v in tokens_per_hit],
                       "time_growth": round(per_hit[1] / per_hit[0], 2),
                       "token_growth": round(tokens_per_hit[1] / tokens_per_hit[0], 2)})
    return growth


def takeaway(rows, provider: str = "kernel") -> tuple[str, dict]:
    """The benchmark's verdict from one run's rows: the run, each target met or missed with its numbers, where a
    token-tile variant beat the launcher's plan and by how much, and TP against EP. Returns (text, facts);
    the facts are what the text states (a notebook records them and its check asserts them)."""
    run = rows[0]
    facts = summary(rows, provider)
    facts["run"] = {key: run[key] for key in ("device", "date", "commit")}
    facts["roofline_target_met"] = facts["target_shapes"] > 0 and facts["shapes_at_target"] == facts["target_shapes"]
    lines = [f"{provider} on {run['device']}, run of {run['date']} (commit {run['commit']}):"]
    verdict = lambda ok: "met" if ok else "missed"  # noqa: E731
    if facts["target_shapes"]:
        lines.append(f"* >= {TARGET_PCT:.0f}% of the roofline for M >= {TARGET_MIN_TOKENS} at TP={TARGET_TP}: "
                     f"{verdict(facts['roofline_target_met'])}, {facts['shapes_at_target']} of "
                     f"{facts['target_shapes']} shapes; {facts['pct_roofline_min']}% at worst, "
                     f"median {facts['pct_roofline_median']}%.")
    if facts["single_token_ok"] is not None:
        worst = max(t / b for t, b in zip(facts["single_token_us"], facts["single_token_bound_us"]))
        facts["single_token_over_bound"] = round(worst, 2)
        lines.append(f"* M = 1 within {SINGLE_TOKEN_SLACK}x (roofline + one empty launch) = "
                     f"{max(facts['single_token_bound_us'])} us: {verdict(facts['single_token_ok'])}, "
                     f"{', '.join(f'{t} us' for t in facts['single_token_us'])} ({worst:.2f}x the bound at worst).")
    growth = union_growth(rows, provider=provider)
    facts["union_growth"] = growth
    if growth:  # met: time per expert hit grows by less than half of what tokens per expert hit grow by
        facts["union_target_met"] = all(g["time_growth"] < 0.5 * g["token_growth"] for g in growth)
        lines.append("* time follows the union of experts, not the tokens: "
                     f"{verdict(facts['union_target_met'])}; " + "; ".join(
                         f"{g['routing']} M={g['tokens'][0]}->{g['tokens'][1]}: time per expert hit "
                         f"x{g['time_growth']} while tokens per expert hit x{g['token_growth']}" for g in growth) + ".")
    better = [b for b in best_plans(rows) if b["best_us"] < b["launcher_us"]]
    facts["plan_beaten_at"] = len(better)
    facts["plan_beaten_by_pct"] = round(max((100 * (1 - b["best_us"] / b["launcher_us"]) for b in better),
                                            default=0.0), 1)
    if better:
        top = max(better, key=lambda b: 1 - b["best_us"] / b["launcher_us"])
        lines.append(f"* the launcher's own plan is beaten by a token-tile variant at {len(better)} of "
                     f"{len(best_plans(rows))} TP={TARGET_TP} shapes, by up to {facts['plan_beaten_by_pct']}% "
                     f"({top['routing']} M={top['tokens']}: {top['launcher_us']:.1f} -> {top['best_us']:.1f} us): "
                     f"its token-tile choice is not yet tuned.")
    comparison = parallel_comparison(rows)
    if comparison:
        facts["tp_faster_than_ep"] = sum(c["ep_over_tp"] > 1 for c in comparison)
        facts["tp_ep_shapes"] = len(comparison)
        lines.append(f"* the TP=8 slice is faster than EP (its slowest rank) at {facts['tp_faster_than_ep']} of "
                     f"{len(comparison)} shapes.")
    return "\n".join(lines), facts


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; shapes default to the whole grid (TOKENS x ROUTINGS x TPS), with --ncu to NCU_TOKENS x
    NCU_ROUTINGS x TPS."""
    parser = command_parser(__spec__.name, __doc__.splitlines()[0])
    parser.add_argument("--reps", type=cli.positive_int, default=10)
    shapes = parser.add_mutually_exclusive_group()
    shapes.add_argument("--quick", action="store_true", help=f"M in {QUICK_TOKENS} only")
    shapes.add_argument("--tokens", type=cli.positive_int, nargs="+", default=None, metavar="M",
                        help=f"tokens per call (default {TOKENS}; with --ncu {NCU_TOKENS})")
    parser.add_argument("--tp", type=cli.positive_int, nargs="+", default=list(TPS), choices=(1, 8))
    parser.add_argument("--routing", nargs="+", default=None, choices=ROUTINGS,
                        help=f"default {ROUTINGS} (with --ncu {NCU_ROUTINGS})")
    parser.add_argument("--ncu", action="store_true", help="profile the chosen shapes with Nsight Compute instead")
    parser.add_argument("--profile-target", action="store_true", help=argparse.SUPPRESS)  # what --ncu runs
    parser.add_argument("--shapes-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    profiling = args.ncu or args.profile_target
    if args.tokens is None:
        args.tokens = list(QUICK_TOKENS if args.quick else NCU_TOKENS if profiling else TOKENS)
    if args.routing is None:
        args.routing = list(NCU_ROUTINGS if profiling else ROUTINGS)
    if args.profile_target and args.shapes_file is None:
        parser.error("--profile-target needs --shapes-file")
    return args


@cli.command
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ncu:
        profile(args.tp, args.tokens, args.routing, results_dir=args.results_dir)
        return 0
    cli.require_cuda(kernels=True)
    if args.profile_target:
        profile_target(args.tp, args.tokens, args.routing, args.shapes_file)
        return 0
    results.check_writable(args.results_dir, [TOPIC])
    run(args.tp, args.tokens, args.routing, reps=args.reps, results_dir=args.results_dir)
    for provider in ("kernel", "kernel_99kb"):
        print(summary(results.latest_run(results.read_rows(TOPIC, results_dir=args.results_dir)), provider))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
