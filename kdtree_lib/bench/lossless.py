"""Where greedy DDTree and the DFlash chain part from greedy autoregressive decoding, and why.

Every token a round emits is the target's argmax at its context, so the three methods give the same
tokens as long as the tree step and the one-node step agree on every argmax:
- in float32 they compute each logit to within float32 rounding, far below the top-2 gaps a greedy path
  meets, so DDTree (any budget) and the chain equal AR token for token;
- in bf16 each run's logits carry bf16's error (8 significant bits, accumulated through the layers) along
  different paths, so two runs may pick different tokens where the float32 top-2 gap is within that error,
  and only there (`within_bf16_resolution`): within 4 x a bf16 prefill's logit error at that position (two tokens' errors,
  and a run erring up to twice as much as the prefill that measures it: flash-attention's criterion), or
  within 2 bf16 spacings at the logit (each of the two compared logits rounded to bf16 at least once; a
  tree-shaped forward rounds along other paths than the prefill that measures the error, so the measured
  error alone can understate it). One spacing alone is not a bound: gaps up to 1.7 spacings parted on the H200.

`lossless_rows` decodes held-out prompts with AR, the chain and DDTree at `budgets` and writes one row per
(method, budget, prompt): whether the tokens equal AR's and, at the first difference, the float32 top-2 gap,
bf16's spacing at the top logit and the bf16 logit error there (a float32 copy of the same checkpoint and a
bf16 prefill score the common prefix).

    python -m kdtree_lib.bench.lossless [--results-dir DIR]     # on a GPU; rows -> data/results/lossless.csv
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import cli, results
from . import command_parser
from ..checks import dtype_name
from ..decode import generate
from ..pairs import pair_with_prompts
from ..verify_attn import KERNEL_DTYPES

TOPIC = "lossless"
BUDGETS = (8, 32, 128)
BF16_MANTISSA_BITS = 7  # stored bits; 8 significant


def bf16_spacing(value: float) -> float:
    """The distance between adjacent bf16 numbers at |value|: what bf16 cannot tell apart there."""
    return 2.0 ** (math.floor(math.log2(abs(value))) - BF16_MANTISSA_BITS) if value else 0.0


def within_bf16_resolution(top2_gap: float, spacing: float, error: float | None) -> bool:
    """Whether a float32 top-2 gap is within what bf16 can flip (see the module docstring): 4 x the
    measured bf16 logit error there, or 2 bf16 spacings at the top logit."""
    return top2_gap <= max(4 * (error or 0.0), 2 * spacing)


def first_difference(want, got) -> int | None:
    """The first position where two token lists differ (a shorter list differs where it ends); None if equal."""
    for position, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return position
    return None if len(want) == len(got) else min(len(want), len(got))


def next_token_logits(target, context) -> torch.Tensor:
    """float32 [V]: the target's logits for the token after `context` (a fresh prefill)."""
    context = torch.as_tensor(np.asarray(context), device=target.device)[None]
    return target.prefill(context, target.new_cache(1, context.shape[1])).logits[0, -1].float()


def divergence(fp32_target, prompt, want, got, bf16_target=None) -> dict:
    """At the first difference of `got` from `want` (the AR tokens): the float32 logits of the common
    prefix's next token, as the top-2 gap and bf16's spacing at the top logit, and with `bf16_target` the
    bf16 logit error there (the largest |bf16 - float32| over the top two and the two parted tokens, of a
    bf16 prefill); {} when the lists are equal."""
    position = first_difference(want, got)
    if position is None:
        return {}
    context = np.concatenate([prompt, want[:position]])
    logits = next_token_logits(fp32_target, context)
    top2 = logits.topk(2)
    top = float(top2.values[0])
    found = {"position": position, "top_logit": top, "top2_gap": top - float(top2.values[1]),
             "bf16_spacing": bf16_spacing(top)}
    if bf16_target is not None:
        tokens = torch.cat([top2.indices, torch.tensor([t[position] for t in (want, got) if position < len(t)],
                                                       device=logits.device)])
        found["bf16_error"] = float((next_token_logits(bf16_target, context) - logits)[tokens].abs().max())
    return found


def lossless_rows(*, dtype=torch.bfloat16, device="cuda", block_size: int = 8, prompts_per_package: int = 4,
                  prompt_tokens: int = 64, new_tokens: int = 64, budgets=BUDGETS, models_dir=None) -> list[dict]:
    """One row per (method, budget, prompt): the run at `dtype` with default settings against AR at `dtype`."""
    chosen = pair_with_prompts(block_size, prompts_per_package=prompts_per_package, prompt_tokens=prompt_tokens,
                               models_dir=models_dir, device=device, dtype=dtype)
    fp32 = chosen if dtype == torch.float32 else pair_with_prompts(
        block_size, prompts_per_package=prompts_per_package, prompt_tokens=prompt_tokens, models_dir=models_dir,
        device=device, dtype=torch.float32)
    prompts = [prompt for group in chosen.packages.values() for prompt in group]
    packages = [name for name, group in chosen.packages.items() for _ in group]
    ar = [t.tolist() for t in generate(chosen.target, chosen.drafter, prompts, method="ar",
                                       max_new_tokens=new_tokens).tokens]
    depth = chosen.drafter.config.draft_depth
    attention = "cupy" if chosen.target.device.type == "cuda" and dtype_name(
        chosen.target.embed_tokens.weight) in KERNEL_DTYPES else "torch"
    rows = []
    for method, budget in [("chain", depth)] + [("ddtree", b) for b in budgets]:
        run = generate(chosen.target, chosen.drafter, prompts, method=method, budget=budget, max_new_tokens=new_tokens)
        for index, (prompt, want, got) in enumerate(zip(prompts, ar, run.tokens)):
            parted = divergence(fp32.target, prompt, want, got.tolist(),
                                bf16_target=chosen.target if dtype != torch.float32 else None)
            rows.append({"pair": chosen.name, "dtype": dtype_name(chosen.target.embed_tokens.weight),
                         "backend": run.backend, "attention_backend": attention, "cuda_graph": run.cuda_graph,
                         "method": method, "budget": budget, "prompt": index, "package": packages[index],
                         "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "equal": not parted,
                         "mean_acceptance": run.mean_acceptance, **parted})
    return rows


def summary(rows: list[dict]) -> dict:
    """The two facts the rows hold, per dtype: prompts, runs equal to AR, prompts that part from AR under
    some method, and the first partings' float32 top-2 gaps against bf16's spacing there."""
    facts = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype]
        parted = [r for r in mine if not _true(r["equal"])]
        facts[dtype] = {"prompts": len({r["prompt"] for r in mine}),
                        "settings": sorted({f"{r['method']}/{int(float(r['budget']))}" for r in mine}),
                        "runs": len(mine), "runs_equal": len(mine) - len(parted),
                        "prompts_parted": len({r["prompt"] for r in parted}),
                        "top2_gaps": [float(r["top2_gap"]) for r in parted],
                        "bf16_spacings": [float(r["bf16_spacing"]) for r in parted],
                        "bf16_errors": [float(r["bf16_error"]) for r in parted if r.get("bf16_error") not in (None, "")],
                        "device": mine[0].get("device", "this run"), "commit": mine[0].get("commit", "")}
    return facts


def _true(cell) -> bool:
    return cell is True or str(cell) == "True"


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=cli.positive_int, default=64)
    args = parser.parse_args(argv)
    cli.require_cuda()
    rows = (lossless_rows(dtype=torch.float32, prompts_per_package=8, new_tokens=args.new_tokens)
            + lossless_rows(dtype=torch.bfloat16, prompts_per_package=4, new_tokens=args.new_tokens))
    for dtype, facts in summary(rows).items():
        print(dtype, facts)
    print(f"{len(rows)} rows -> {results.append_rows(TOPIC, rows, results_dir=args.results_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
