"""How much the routing of one tree overlaps: measured on real text, modelled with a correlation.

A verify step's tokens share their request's context, so they route alike and touch fewer experts
than independent tokens would. `routed_experts` records a router's choices over real text,
`union_curve` counts the distinct experts windows of N consecutive tokens touch, and
`fit_correlation` finds the correlation of `projection.expected_distinct_experts` that fits them.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from .model.model import MoE, Transformer
from .model.tp import one_cpu_thread
from .projection import expected_distinct_experts


def routed_experts(model: Transformer, tokens) -> list[np.ndarray]:
    """The experts each MoE layer's router picks for every token of sequences tokens [S, T] (one
    prefill through `model`): a list over MoE layers of int [S, T, k]."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    picked = []
    routers = [block.mlp.gate for block in model.layers if isinstance(block.mlp, MoE)]
    hooks = [router.register_forward_hook(lambda module, args, out: picked.append(out[1])) for router in routers]
    try:
        with one_cpu_thread() if model.device.type == "cpu" else contextlib.nullcontext():
            model.prefill(tokens.to(model.device), model.new_cache(*tokens.shape))
    finally:
        for hook in hooks:
            hook.remove()
    return [ids.reshape(*tokens.shape, -1).cpu().numpy() for ids in picked]


def union_curve(routes: list[np.ndarray], nodes, *, batch: int = 1, windows: int = 64, seed: int = 0) -> list[dict]:
    """Distinct experts per MoE layer touched by `batch` windows of N consecutive tokens (N ∈ nodes),
    each from a different sequence: a verify step's tokens share their request's context as a
    window of text does. One row per (layer, N): mean and standard deviation over `windows` draws."""
    sequences, length, _ = routes[0].shape
    if not 1 <= batch <= sequences:
        raise ValueError(f"batch: expected 1..{sequences} (the sequences routed), got {batch}")
    rng = np.random.default_rng(seed)
    rows = []
    for n in nodes:
        if not 1 <= n <= length:
            raise ValueError(f"nodes: each must be in 1..{length} (the routed sequence length), got {n}")
        draws = [(rng.choice(sequences, batch, replace=False), rng.integers(0, length - n + 1, batch))
                 for _ in range(windows)]
        for layer, ids in enumerate(routes):
            counts = [len(np.unique(np.concatenate([ids[s, t:t + n].ravel() for s, t in zip(rows_, starts)])))
                      for rows_, starts in draws]
            rows.append({"moe_layer_index": layer, "nodes": int(n), "batch": batch, "tokens": int(n) * batch,
                         "distinct_mean": float(np.mean(counts)), "distinct_std": float(np.std(counts))})
    return rows


def fit_correlation(rows: list[dict], n_experts: int, experts_per_token: int) -> float:
    """The `correlation` of projection.expected_distinct_experts that best fits measured unions
    (least squares in relative error over rows with tokens and distinct_mean), in [0, 0.999]."""
    if not rows:
        raise ValueError("rows: expected at least one measured union (tokens, distinct_mean)")
    measured = [(int(r["tokens"]), float(r["distinct_mean"])) for r in rows]

    def loss(correlation):
        return sum((expected_distinct_experts(t, n_experts, experts_per_token, correlation) / m - 1) ** 2
                   for t, m in measured)
    grid = np.linspace(0.0, 0.999, 1000)
    return float(grid[int(np.argmin([loss(c) for c in grid]))])
