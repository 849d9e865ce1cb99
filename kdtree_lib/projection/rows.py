"""Row readers: which rows of data/results/*.csv the projection reads (the newest runs of the kernels the box runs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import results
from .roofline import expected_distinct_experts

if TYPE_CHECKING:
    from ..model import ModelConfig


COMPONENTS = ("attention", "moe", "allreduce", "rest")


TREE_KERNEL_COLUMNS = ("draft_topk_seconds", "tree_build_seconds", "accept_compact_seconds")


def latest_rows(rows: list[dict]) -> list[dict]:
    """The verify-step rows (scopes layer and step) of the newest run that has them, and the draft
    rows of the newest run that has them (a --drafter-only run refreshes those alone)."""
    return (results.latest_run([r for r in rows if r.get("scope") != "draft"])
            + results.latest_run([r for r in rows if r.get("scope") == "draft"]))


@dataclass(frozen=True)
class TimingRows:
    """The verify-step and draft rows the calibration and the drafter fit read, and what they are."""
    rows: list[dict]
    source: str
    real_drafter: bool    # draft rows of the real drafter's shapes (the kit's), not bench.tp_step's assumed drafter


def real_shape_rows(rows: list[dict]) -> list[dict]:
    """The box kit's rows (box_verify_step.csv) of K2.6's real-shape pair measured on a GPU (their ceilings in
    the row), the newest run of each scope as latest_rows takes them."""
    from ..bench.inputs import K26_SHAPE_NAMES  # a real-shape pair's name ends with its configs' (real_shape_name)
    k26 = ":" + "+".join(K26_SHAPE_NAMES)
    return latest_rows([r for r in rows if results.matches(r.get("real_shape"), True)
                        and str(r.get("pair", "")).endswith(k26) and r.get("copy_bandwidth") not in (None, "")])


def timing_rows(tp_step_rows: list[dict], kit_rows: list[dict], *, kit_file: str) -> TimingRows:
    """The box kit's real-shape rows (real_shape_rows of kit_rows, read from kit_file) when they have layer rows,
    else bench.tp_step's newest (data/results/tp_verify_step.csv, latest_rows): the kit times the real drafter's
    shapes and INT4 experts as the box holds them, so its rows replace the sweep's as they land."""
    kit = real_shape_rows(kit_rows)
    layers = [r for r in kit if r.get("scope") == "layer"]
    if layers:
        first = layers[0]
        return TimingRows(kit, f"{kit_file}: the box kit's real-shape run {first['run']} ({first['layers']} layers of "
                               f"K2.6, the real drafter's shapes, expert_bits {first['expert_bits']}, {first['device']}, "
                               f"commit {first['commit']})", True)
    return TimingRows(latest_rows(tp_step_rows), "data/results/tp_verify_step.csv: bench.tp_step's newest rows "
                                                 "(its drafter an ASSUMED one)", False)


def moe_layer_split(rows: list[dict], batch: int, context: int, graph: bool) -> dict[int, np.ndarray]:
    """nodes -> mean over the MoE layer rows of (attention, moe, allreduce, rest) seconds."""
    split: dict[int, list[list[float]]] = {}
    for r in results.select(rows, scope="layer", moe_layer=True, graph=graph, batch=batch, context=context):
        split.setdefault(int(r["nodes"]), []).append([float(r[f"{c}_seconds"]) for c in COMPONENTS])
    return {n: np.mean(v, axis=0) for n, v in sorted(split.items())}


def touched_vs_uniform(rows: list[dict], config) -> tuple[np.ndarray, np.ndarray, float]:
    """(tokens B·N, experts touched, largest relative gap to uniform independent routing) of the
    eager MoE layer rows (routing does not depend on graphs)."""
    moe_rows = results.select(rows, scope="layer", moe_layer=True, graph=False)
    tokens = np.array([int(r["batch"]) * int(r["nodes"]) for r in moe_rows])
    touched = np.array([float(r["experts_touched"]) for r in moe_rows])
    expected = np.array([expected_distinct_experts(int(t), config.n_routed_experts, config.num_experts_per_tok)
                         for t in tokens])
    return tokens, touched, float(np.max(np.abs(touched - expected) / expected))


def whole_model_rows(rows: list[dict], config: ModelConfig) -> list[dict]:
    """Seconds per verify round of the whole model, per (tp, graph, batch, nodes, context): the
    dense layer rows times first_k_dense_replace and the mean MoE layer row times the MoE layers
    (per component), plus the head and, for a tree (N > 1), the drafter and the tree kernels."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    drafts: dict[tuple, list[dict]] = {}
    for row in rows:
        where = (int(row["tp"]), int(row["batch"]), int(row["nodes"]), int(row["context"]))
        if row["scope"] == "draft":
            drafts.setdefault(where, []).append(row)
        else:
            groups.setdefault((results.matches(row["graph"], True), *where), {}).setdefault(row["scope"], []).append(row)
    out = []
    for (graph, tp, batch, nodes, context), scoped in sorted(groups.items()):
        layers = scoped.get("layer", [])
        dense = [r for r in layers if not results.matches(r["moe_layer"], True)]
        moe = [r for r in layers if results.matches(r["moe_layer"], True)]
        if not dense or not moe or "step" not in scoped:
            continue
        counts = {config.first_k_dense_replace: dense, len(config.moe_layers): moe}
        row = {"tp": tp, "graph": graph, "batch": batch, "nodes": nodes, "context": context}
        for name in COMPONENTS:
            row[name] = sum(count * float(np.mean([float(r[f"{name}_seconds"]) for r in picked]))
                            for count, picked in counts.items())
        row["head"] = float(np.mean([float(r["head_seconds"]) for r in scoped["step"]]))
        draft = drafts.get((tp, batch, nodes, context), [])
        row["draft"] = float(np.mean([draft_round_seconds(r, graph=graph) for r in draft])) if draft else 0.0
        row["total"] = sum(row[name] for name in (*COMPONENTS, "head", "draft"))
        out.append(row)
    return out


def select_rows(rows: list[dict], scope: str, *, tp: int | None = None, graph: bool | None = None) -> list[dict]:
    """Rows of one scope; of TP degree `tp` (default: the largest present) and graph flag."""
    picked = [r for r in rows if r.get("scope") == scope]
    if not picked:
        return []
    tp = max(int(r["tp"]) for r in picked) if tp is None else tp
    return [r for r in picked if int(r["tp"]) == tp and (graph is None or results.matches(r.get("graph"), graph))]


def draft_round_seconds(row: dict, *, graph: bool) -> float:
    """What a draft row adds to a round: the drafter forward (its CUDA-graph time in a graph round,
    where measured) and the tree kernels."""
    drafter = (row.get("drafter_graph_seconds") if graph else None) or row.get("drafter_seconds")
    return float(drafter or 0.0) + sum(float(row[n]) for n in TREE_KERNEL_COLUMNS if row.get(n) not in (None, ""))


PORTABLE_VERIFY_CONFIGS = {16: "rows16_keys32_stages2", 32: "rows32_keys32_stages2"}  # the 99 KB variants, by CTA rows


BOX_MOE_PROVIDER = "kernel_99kb"      # kdtree_lib.bench.moe_int4: the plan for 99 KB of shared memory (sm_120)


def portable_verify_rows(rows: list[dict], *, heads: int) -> list[dict]:
    """The verify_attn rows of the portable (99 KB) kernel at `heads` heads per rank, the variant the
    sm_120 plan picks for each shape (CTA of 32 rows from 32 rows up), of the newest run that has them."""
    def picked(row) -> bool:
        size = 32 if int(row["rows"]) >= 32 else 16
        return row.get("config") == PORTABLE_VERIFY_CONFIGS[size] and results.matches(row.get("heads"), heads)
    return results.latest_run([r for r in rows if r.get("provider") in ("kernel", "kernel_variant") and picked(r)])



# draft_topk rows of the path the box runs: the fused kernel (decode's GPU step and the SGLang drop-in
# launch it), whichever version the newest run timed; which path a row ran is bench.tree_build's
# topk_path_of (its `topk_path` column, or inferred for rows written before it)
BOX_TOPK_PATH_PREFIX = "fused"


def box_topk_rows(rows: list[dict]) -> list[dict]:
    """The newest run's CUDA-graph draft_topk rows of the fused path (BOX_TOPK_PATH_PREFIX)."""
    from ..bench.tree_build import topk_path_of
    return results.latest_run([r for r in results.select(rows, stage="draft_topk", timing="cuda_graph")
                               if r.get("method") in ("kernel", "torch")
                               and topk_path_of(r).startswith(BOX_TOPK_PATH_PREFIX)])


def box_build_rows(rows: list[dict], *, depth: int) -> list[dict]:
    """The newest run's CUDA-graph build rows at `depth` of the newest kernel version in it (what build_tree launches)."""
    run = results.latest_run(results.select(rows, stage="build", method="kernel", timing="cuda_graph", depth=depth))
    versions = [int(float(r["version"])) for r in run if r.get("version") not in (None, "")]
    return [r for r in run if not versions or r.get("version") not in (None, "") and int(float(r["version"])) == max(versions)]


# a count of distinct experts is an integer: against a non-integer expectation it cannot come closer than
# the nearest integer, so it sits "on" the uniform curve when within half an expert of it
COUNT_RESOLUTION = 0.5


def uniform_sides(touched, uniform) -> dict[str, int]:
    """How many measured expert counts lie below, on (within COUNT_RESOLUTION) and above the uniform curve."""
    gap = np.asarray(touched, float) - np.asarray(uniform, float)
    return {"below": int(np.sum(gap < -COUNT_RESOLUTION)), "on": int(np.sum(np.abs(gap) <= COUNT_RESOLUTION)),
            "above": int(np.sum(gap > COUNT_RESOLUTION))}


def layer_spread(rows: list[dict], component: str, *, graph: bool) -> dict[tuple[int, int, int], float]:
    """(batch, context, nodes) -> (max − min) / mean of `component`_seconds over the MoE layer rows of that
    shape (the layers and ranks timed alike): how far apart two timings of the same work land."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for r in results.select(rows, scope="layer", moe_layer=True, graph=graph):
        groups.setdefault((int(r["batch"]), int(r["context"]), int(r["nodes"])), []).append(float(r[f"{component}_seconds"]))
    return {key: float((max(v) - min(v)) / np.mean(v)) for key, v in groups.items()}


def growth_lines(rows: list[dict], rounds: list[dict], *, graph: bool, components=("attention", "moe")) -> list[str]:
    """Per (batch, context) and component of whole-model rounds (whole_model_rows): its ms from the smallest
    to the largest N, and whether it still grows over the last step of N, judged against the layer rows' own
    spread at those two shapes (a change within it is not a change the rows can show)."""
    lines = []
    for batch, context in sorted({(r["batch"], r["context"]) for r in rounds}):
        series = sorted((r for r in rounds if (r["batch"], r["context"]) == (batch, context)), key=lambda r: r["nodes"])
        if len(series) < 2:
            continue
        for name in components:
            spread = layer_spread(rows, name, graph=graph)
            first, before, last = series[0], series[-2], series[-1]
            step = last[name] / before[name] - 1
            noise = max(spread.get((batch, context, r["nodes"]), 0.0) for r in (before, last))
            verdict = ("still grows" if step > noise else "shrinks" if step < -noise else "flat within the rows' spread")
            lines.append(f"B={batch}, L={context}: {name} {first[name] * 1e3:.1f} -> {last[name] * 1e3:.1f} ms from N={first['nodes']} "
                         f"to N={last['nodes']} (x{last[name] / first[name]:.2f}); from N={before['nodes']} to N={last['nodes']} "
                         f"{step:+.0%} against the layers' spread {noise:.1%} there: {verdict}")
    return lines
