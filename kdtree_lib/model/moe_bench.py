"""How to shard the routed experts: tensor parallel inside every expert ("tp") or expert
parallel ("ep"), timed per rank at K2.6's real shapes on one GPU.

Activations are replicated across ranks in both schemes (they follow attention's all-reduce), so
both end in the same all-reduce of [tokens, hidden]: communication does not decide. What does:
- weight bytes: a verify step touches the weights of every expert it hits. "tp" reads the hit
  experts' 1/tp slices on every rank alike; "ep" reads whole hit experts, and the step waits for
  the rank whose experts were hit most (load imbalance);
- GEMM shapes and launches: "tp" runs up to E thin GEMMs per rank (width W/tp), "ep" E/tp wide ones.
Each rank is simulated in turn on one GPU with random bf16 weights and balanced random routing.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .model import Experts
from .tp import TensorParallel


def balanced_routing(config: ModelConfig, tokens: int, generator: torch.Generator):
    """ids [tokens, k] (k distinct experts per token, uniform) and weights [tokens, k] fp32."""
    ids = torch.rand(tokens, config.n_routed_experts, generator=generator).topk(config.num_experts_per_tok).indices
    weights = torch.rand(tokens, config.num_experts_per_tok, generator=generator)
    return ids, weights


def time_ms(fn, repeats: int) -> float:
    """Median time of fn() in milliseconds, on the GPU's clock."""
    fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def compare_moe_parallel(config: ModelConfig, token_counts, *, tp_size: int = 8, repeats: int = 5,
                         device: str = "cuda") -> list[dict]:
    """One row per (tokens, scheme, implementation): the step time (slowest rank), the mean rank
    time, and the weight bytes the slowest rank touched."""
    generator = torch.Generator().manual_seed(0)
    routings = {n: balanced_routing(config, n, generator) for n in token_counts}
    inputs = {n: torch.randn(n, config.hidden_size, generator=generator).to(device, torch.bfloat16)
              for n in token_counts}
    ranks = {"tp": [0], "ep": range(tp_size)}  # "tp" ranks are identical: time one
    times = {}
    for scheme, rank_list in ranks.items():
        for rank in rank_list:
            experts = Experts(config, TensorParallel(rank=rank, size=tp_size), scheme).to(device, torch.bfloat16)
            for weight in experts.parameters():
                weight.data.normal_(0, 0.02)
            per_expert = 3 * config.hidden_size * (experts.width_range[1] - experts.width_range[0]) * 2
            for n in token_counts:
                ids, weights = (t.to(device) for t in routings[n])
                hit = sum(int(e in experts.expert_ids) for e in torch.unique(ids).tolist())
                for impl in ("grouped", "looped"):
                    ms = time_ms(lambda: getattr(experts, impl)(inputs[n], ids, weights), repeats)
                    times.setdefault((n, scheme, impl), []).append((ms, hit * per_expert))
            experts = None  # frees this rank's experts before the next scheme
            torch.cuda.empty_cache()
    return [{"tokens": n, "moe_parallel": scheme, "impl": impl, "tp_size": tp_size,
             "step_ms": max(ms for ms, _ in runs), "mean_rank_ms": sum(ms for ms, _ in runs) / len(runs),
             "max_rank_weight_bytes": max(b for _, b in runs)}
            for (n, scheme, impl), runs in times.items()]
