"""Benchmark of the tree stage's second half: the accept walk and the compaction of K2.6's 61 MLA caches.

Rows go to data/results/tree_accept.csv, one per (configuration, method), stamped by results.append_rows.
GPU times (CUDA graphs of 20 calls, timing.graph_seconds) of the prepared walk ("accept_kernel"), the
prepared compaction of every layer ("compact_kernel") and both ("accept_compact_kernel"); host time per
call of the eager entry points together ("accept_compact_call"), of the eager accept alone
("accept_call") and of a prepared walk ("accept_prepared_call"). Caches [B, L_max, 576] bf16, lengths
uniform in [0, 1024), a posterior that follows the drafter's best child with probability 0.8.

    python -m kdtree_lib.bench.tree_accept [--quick] [--results-dir DIR]
"""
from __future__ import annotations


import numpy as np

from .. import cli, results
from . import command_parser
from ..contracts import DraftTopK
from ..tree_accept import accept, compact_cache, prepare_accept_launch, prepare_compact_launch
from ..tree_build import build_tree
from .inputs import follow_posterior, random_draft
from .timing import graph_seconds, host_seconds

BATCHES = (1, 64, 256)
BUDGETS = (64, 256)
K26_LAYERS = 61
MLA_WIDTH = 576          # c_kv 512 + k_rope 64, bf16
COMMITTED_MAX = 1024     # committed tokens per request before the step (uniform in [0, this))


def bench_accept(batches=BATCHES, budgets=BUDGETS, depth: int = 15, layers: int = K26_LAYERS) -> list[dict]:
    """The walk and the compaction of `layers` MLA caches, apart and together, and their host cost."""
    import torch
    rows = []
    rng = np.random.default_rng(0)
    for budget in budgets:
        for batch in batches:
            draft, root = random_draft(batch, depth, budget, seed=budget + batch, device="cuda")
            tree = build_tree(draft, budget, root=root, backend="cupy")
            host_tree = build_tree(DraftTopK(draft.logp.cpu().numpy(), draft.ids.cpu().numpy()), budget,
                                   root=root.cpu().numpy(), backend="numpy")
            posterior_host = follow_posterior(host_tree, rng)
            posterior = torch.as_tensor(posterior_host, device="cuda")
            lengths = torch.as_tensor(rng.integers(0, COMMITTED_MAX, size=batch).astype(np.int32), device="cuda")
            slots = COMMITTED_MAX + budget + 1
            caches = [torch.empty(batch, slots, MLA_WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
            walk = prepare_accept_launch(tree, posterior)
            move = prepare_compact_launch(caches, lengths, walk.out)
            timings = {"accept_kernel": graph_seconds(walk), "compact_kernel": graph_seconds(move),
                       "accept_compact_kernel": graph_seconds(lambda: (walk(), move())),
                       "accept_compact_call": (host_seconds(lambda: compact_cache(caches, lengths, accept(tree, posterior)),
                                                            calls=20), "host"),
                       "accept_call": (host_seconds(lambda: accept(tree, posterior)), "host"),
                       "accept_prepared_call": (host_seconds(walk), "host")}
            want = accept(host_tree, posterior_host, backend="numpy")
            walk()
            matches = all(np.array_equal(getattr(walk.out, name).cpu().numpy(), getattr(want, name))
                          for name in ("path", "n_accepted", "bonus"))
            moved_rows = int(((want.path[:, 1:] >= 0) & (want.path[:, 1:] != np.arange(1, depth + 1))).sum())
            moved_bytes = 2 * moved_rows * MLA_WIDTH * 2 * layers  # read + write
            config = dict(batch=batch, depth=depth, budget=budget, layers=layers, width=MLA_WIDTH,
                          mean_accepted=float(want.n_accepted.mean()), moved_bytes=moved_bytes,
                          matches_reference=matches)
            for name, (seconds, timing) in timings.items():
                rows.append({**config, "method": name, "backend": "cupy", "time_us": round(seconds * 1e6, 3),
                             "timing": timing})
            print(f"accept B={batch:3d} budget={budget:4d} layers={layers}: " + "  ".join(
                f"{name} {seconds * 1e6:7.2f} us" for name, (seconds, _) in timings.items())
                + f"  mean accepted {want.n_accepted.mean():.2f}  moved {moved_bytes / 1e6:.1f} MB  match={matches}",
                flush=True)
            caches = walk = move = None  # frees the layers before the next configuration
            torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# reading the rows back (notebook 06)

def accept_summary(rows: list[dict]) -> dict:
    """What notebook 06 states, from one run's rows: the range of mean acceptance lengths, the GPU time
    of a step (walk + compaction) per configuration, the walk's largest time, the host cost of the
    prepared walk, and whether every walk matched the reference."""
    steps = results.select(rows, method="accept_compact_kernel")
    accepted = [r["mean_accepted"] for r in steps]
    summary = {"mean_accepted_min": min(accepted), "mean_accepted_max": max(accepted),
               "all walks match the reference": all(r["matches_reference"] for r in steps),
               "accept_kernel_max_us": max(r["time_us"] for r in results.select(rows, method="accept_kernel"))}
    for r in sorted(steps, key=lambda r: (r["budget"], r["batch"])):
        summary[f"B={r['batch']} budget={r['budget']} accept+compact_us"] = r["time_us"]
    prepared = results.select(rows, method="accept_prepared_call")
    if prepared:
        summary["accept_prepared_call_max_us"] = max(r["time_us"] for r in prepared)
    return summary


def accept_table(rows: list[dict]) -> list[dict]:
    """One line per (budget, batch) of a run's rows: the walk, the compaction, both, the bytes moved
    and the compaction's rate, and the host cost of the calls."""
    lines = {}
    for r in rows:
        line = lines.setdefault((r["budget"], r["batch"]), dict(budget=r["budget"], batch=r["batch"],
                                                                accepted=r["mean_accepted"], moved_mb=r["moved_bytes"] / 1e6))
        line[f"{r['method']}_us"] = r["time_us"]
    for line in lines.values():
        if line.get("compact_kernel_us"):
            line["compact_gb_per_s"] = round(line["moved_mb"] / line["compact_kernel_us"] * 1e3, 1)  # MB/us -> GB/s
    return [lines[key] for key in sorted(lines)]


def walk_matches_reference(tree, posterior) -> bool:
    """The prepared kernel walk of a host tree and posterior (copied to the GPU as torch tensors, outputs
    poisoned with -7) against the reference walk."""
    import torch
    launch = prepare_accept_launch(tree.to_torch("cuda"), torch.as_tensor(posterior, device="cuda"))
    for x in (launch.out.path, launch.out.n_accepted, launch.out.bonus):
        x.fill_(-7)
    got, want = launch(), accept(tree, posterior, backend="numpy")
    return all(np.array_equal(getattr(got, name).cpu().numpy(), getattr(want, name)) for name in ("path", "n_accepted", "bonus"))


def compaction_matches_reference(result, lengths: np.ndarray, layers: int, budget: int, rng) -> bool:
    """The kernel compaction of random bf16 caches [B, L, 576] (torch, on the GPU) against the reference
    compaction of host copies, caches and new lengths."""
    import torch
    batch = result.path.shape[0]
    slots = int(lengths.max()) + budget + 8
    host_caches = [rng.integers(-2**15, 2**15, size=(batch, slots, MLA_WIDTH)).astype(np.int16) for _ in range(layers)]
    caches = [torch.as_tensor(c, device="cuda").view(torch.bfloat16) for c in host_caches]
    device_result = type(result)(*(torch.as_tensor(x, device="cuda") for x in (result.path, result.n_accepted, result.bonus)))
    new_lengths = compact_cache(caches, torch.as_tensor(lengths, device="cuda"), device_result)
    want_lengths = compact_cache(host_caches, lengths, result, backend="numpy")
    return (all(np.array_equal(c.view(torch.int16).cpu().numpy(), w) for c, w in zip(caches, host_caches))
            and np.array_equal(new_lengths.cpu().numpy(), want_lengths))


@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="batches 1 and 64, budget 64 only")
    args = parser.parse_args(argv)
    cli.require_cuda(kernels=True)
    grid = dict(batches=(1, 64), budgets=(64,)) if args.quick else {}
    results.append_rows("tree_accept", bench_accept(**grid), results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
