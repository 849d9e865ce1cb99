"""Where the DFlash drafter lives under tensor parallelism, timed per draft on `tp` ranks: whole on
every rank ("replicated": each rank reads every drafter weight, no collective) or its layers split
("sharded": 1/tp of the attention and MLP weights, two all-reduces of [B, Q, D] per layer).

Which wins is weight bytes against the link's all-reduce latency, so the answer belongs to the
machine that runs it: gloo over a CPU's cores here, NCCL over the box's PCIe there. The drafter is
the real one's shape scaled down (DEFAULT_SHAPE), with random weights and a small stand-in vocabulary
(the LM head is the target's, alike in both placements, and not timed apart); each row is the
slowest rank's median time of one block draft over `context` committed tokens.

    python -m kdtree_lib.bench.drafter_placement [--tp 2] [--batch 1 8] [--context 512] [--device cpu]

Rows are printed; --append adds them to data/results/drafter_placement.csv.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import cli, results
from . import command_parser
from ..dflash import DFlashConfig, DFlashDrafter, TargetHead
from ..model.tp import TensorParallel, launch
from .timing import Clock, time_segments

TOPIC = "drafter_placement"
REPEATS = 20   # the same count on every rank: a sharded draft's all-reduces pair up across ranks
# the real drafter (hidden 7168, 6 layers, 64/8 heads of 128, MLP 18432) with a 7x narrower hidden
DEFAULT_SHAPE = dict(hidden_size=1024, intermediate_size=2624, num_hidden_layers=6, num_attention_heads=16,
                     num_key_value_heads=2, head_dim=64, vocab_size=1024, block_size=8, mask_token_id=1023,
                     target_layer_ids=(1, 2, 3, 4, 5, 6))


def time_placements(tp: TensorParallel, shape: dict, batches, context: int, device: str) -> list[dict]:
    """One row per (batch, placement): the slowest rank's median seconds per draft."""
    on_gpu = device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not on_gpu:
        torch.set_num_threads(max(1, torch.get_num_threads() // tp.size))
    config = DFlashConfig(**shape)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    embedding = nn.Embedding(config.vocab_size, config.hidden_size).to(device, dtype)
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False).to(device, dtype)
    rows = []
    for placement, layout in (("replicated", TensorParallel()), ("sharded", tp)):
        torch.manual_seed(0)
        drafter = DFlashDrafter(config, layout)
        drafter.init_weights()
        drafter = drafter.bind(TargetHead(embed=embedding, lm_head=head, weight=embedding.weight)).to(device, dtype)
        for batch in batches:
            cache = drafter.new_cache(batch, context + config.block_size)
            drafter.extend(cache, torch.randn(batch, context, config.feature_size, device=device, dtype=dtype))
            nothing = torch.zeros(batch, 0, config.feature_size, device=device, dtype=dtype)
            bonus = torch.zeros(batch, dtype=torch.long, device=device)

            trials = time_segments([lambda: drafter.draft(cache, nothing, bonus)], Clock(device), repeats=REPEATS,
                                   warmup=2)
            seconds = torch.tensor([float(np.median(trials))], dtype=torch.float64)
            if tp.size > 1:
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=tp.group)
            weights = sum(p.numel() * p.element_size() for p in drafter.parameters())
            rows.append({"placement": placement, "tp": tp.size, "batch": batch, "context": context,
                         "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                         "weight_bytes_per_rank": weights, "ms_per_draft": 1e3 * float(seconds)})
    return rows


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__)
    parser.add_argument("--tp", type=cli.positive_int, default=2)
    parser.add_argument("--batch", type=cli.positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=cli.positive_int, default=512)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--append", action="store_true", help=f"append the rows to --results-dir's {TOPIC}.csv")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        cli.require_cuda()
    rows = launch(time_placements, args.tp, DEFAULT_SHAPE, args.batch, args.context, args.device,
                  backend="nccl" if args.device == "cuda" else "gloo")
    for row in rows:
        print(json.dumps(row))
    if args.append:
        print(results.append_rows(TOPIC, rows, results_dir=args.results_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
