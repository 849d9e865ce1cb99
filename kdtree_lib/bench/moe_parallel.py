"""How to shard the routed experts: tensor parallel inside every expert ("tp") or expert
parallel ("ep"), timed per rank at K2.6's real shapes on one GPU.

Activations are replicated across ranks in both schemes (they follow attention's all-reduce), so
both end in the same all-reduce of [tokens, hidden]: communication does not decide. What does:
- weight bytes: a verify step touches the weights of every expert it hits. "tp" reads the hit
  experts' 1/tp slices on every rank alike; "ep" reads whole hit experts, and the step waits for
  the rank whose experts were hit most (load imbalance);
- GEMM shapes and launches: "tp" runs up to E thin GEMMs per rank (width W/tp), "ep" E/tp wide ones.
Each rank is simulated in turn on one GPU with random bf16 weights and balanced random routing.

    python -m kdtree_lib.bench.moe_parallel [--tokens 16 72 288 1088 2112] [--tp 8]    # on a GPU

Rows go to data/results/model_moe_parallel.csv (notebook 08 plots them).
"""
from __future__ import annotations


import torch

from .. import cli, results
from . import command_parser
from ..model import ModelConfig, TensorParallel, load_config
from ..model.model import Experts
from ..paths import K26_CONFIG
from .timing import gpu_seconds

TOPIC = "model_moe_parallel"


def balanced_routing(config: ModelConfig, tokens: int, generator: torch.Generator):
    """ids [tokens, k] (k distinct experts per token, uniform) and weights [tokens, k] fp32."""
    ids = torch.rand(tokens, config.n_routed_experts, generator=generator).topk(config.num_experts_per_tok).indices
    weights = torch.rand(tokens, config.num_experts_per_tok, generator=generator)
    return ids, weights


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
                    ms = 1e3 * gpu_seconds(lambda: getattr(experts, impl)(inputs[n], ids, weights), reps=repeats,
                                          flush="none")
                    times.setdefault((n, scheme, impl), []).append((ms, hit * per_expert))
            experts = None  # frees this rank's experts before the next scheme
            torch.cuda.empty_cache()
    return [{"tokens": n, "moe_parallel": scheme, "impl": impl, "tp_size": tp_size,
             "step_ms": max(ms for ms, _ in runs), "mean_rank_ms": sum(ms for ms, _ in runs) / len(runs),
             "max_rank_weight_bytes": max(b for _, b in runs)}
            for (n, scheme, impl), runs in times.items()]


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__)
    parser.add_argument("--tokens", type=cli.positive_int, nargs="+", default=[16, 72, 288, 1088, 2112], help="routed tokens per step")
    parser.add_argument("--tp", type=cli.positive_int, default=8, help="ranks the experts are sharded over")
    parser.add_argument("--repeats", type=cli.positive_int, default=5)
    args = parser.parse_args(argv)
    cli.require_cuda()
    rows = compare_moe_parallel(load_config(K26_CONFIG), args.tokens, tp_size=args.tp, repeats=args.repeats)
    print(results.append_rows(TOPIC, rows, results_dir=args.results_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
