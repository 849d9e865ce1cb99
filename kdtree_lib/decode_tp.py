"""Tensor-parallel decode: every rank runs decode.generate over its shard, in lockstep (DESIGN.md §9).

The target's layers end in all-reduces and its LM head in an all-gather, so every rank holds the
same hidden states, features and logits (bitwise: a collective hands every rank the same result).
The drafter (whole on every rank, or its layers sharded: DEFAULT_DRAFTER_PLACEMENT) reads those, so
the draft, the tree, the accept and the commit are computed identically on every rank without a
broadcast; at T > 0 each rank's sampler is seeded alike. check_lockstep compares the ranks' tokens
once, at the end. generate_tp spawns the ranks; `python -m kdtree_lib.decode` (decode.main) is the
launcher, alone or under torchrun, and calls decode_rank on each.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .checks import check_positive_int
from .decode import DecodeResult, clear_decoders, generate, prompt_list
from .dflash import DEFAULT_DRAFTER_PLACEMENT
from .model.tp import TensorParallel, launch


def generate_tp(target_path, drafter_path, prompt_ids, *, tp: int = 2, device: str = "cpu",
                dtype: torch.dtype = torch.float32, runs=None, yarn_attention: str = "transformers",
                drafter_placement: str = DEFAULT_DRAFTER_PLACEMENT, gpu_bytes: int | None = None, **options):
    """generate over the checkpoint at target_path sharded on `tp` spawned ranks (gloo on CPUs;
    device "cuda": rank r on cuda:r over NCCL), the drafter at drafter_path on each:
    whole ("replicated") or its layers split over the ranks ("sharded").

    options: generate's keywords; runs: a list of such dicts, all decoded by the same ranks (one
    load), returning a list of DecodeResults (else one DecodeResult). tp=1 runs in this process.
    Before loading, every rank plans its memory (memory.plan, printed by rank 0) and on a GPU
    refuses to load what does not fit in gpu_bytes (default: the GPU's free memory).
    """
    tp = check_positive_int("tp", tp)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    args = (str(target_path), None if drafter_path is None else str(drafter_path), prompt_ids,
            [options] if runs is None else list(runs), device, dtype, yarn_attention, drafter_placement, gpu_bytes)
    check_paths(*args[:2])
    results = (decode_rank(TensorParallel(), *args) if tp == 1 else
               launch(decode_rank, tp, *args, backend="nccl" if device == "cuda" else "gloo"))
    return results[0] if runs is None else results


def decode_rank(tp: TensorParallel, target_path: str, drafter_path: str | None, prompt_ids, runs: list[dict],
                device: str, dtype: torch.dtype, yarn_attention: str, drafter_placement: str,
                gpu_bytes: int | None) -> list[DecodeResult]:
    """One rank's work: plan memory, load its shard of the target and the drafter (whole or its
    shard), run each of `runs` through generate, check the ranks stayed in lockstep."""
    from .dflash import DFlashConfig, load_drafter
    from .model import load_config, load_target
    from .memory import plan
    check_paths(target_path, drafter_path)
    on_gpu = device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    config = load_config(target_path)
    drafter_config = DFlashConfig.load(drafter_path, yarn_attention=yarn_attention) if drafter_path else None
    prompts = prompt_list(prompt_ids, config.vocab_size)
    defaults = generate.__kwdefaults__
    longest = max(len(p) for p in prompts) + max(run.get("max_new_tokens", defaults["max_new_tokens"]) for run in runs)
    budget = max(run.get("budget", defaults["budget"]) for run in runs)
    free = torch.cuda.mem_get_info(device)[0] if on_gpu else None
    memory = plan(config, tp.size, len(prompts), longest, budget, drafter_config, drafter_placement=drafter_placement,
                  **({"gpu_bytes": gpu_bytes or free} if on_gpu or gpu_bytes else {}))
    if tp.rank == 0:
        print(memory.table(), flush=True)
    if on_gpu or gpu_bytes:
        memory.check()
    if not on_gpu:  # gloo ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // tp.size))
    target = load_target(target_path, device=device, dtype=dtype, tp_group=tp.group)
    drafter = (load_drafter(drafter_path, target, yarn_attention=yarn_attention, placement=drafter_placement)
               if drafter_path else None)
    results = [generate(target, drafter, prompts, **run) for run in runs]
    for result in results:
        check_lockstep(tp, result)
    clear_decoders()  # they hold this rank's shard, and through it the process group
    return results


def check_lockstep(tp: TensorParallel, result: DecodeResult) -> None:
    """Every rank emitted the same tokens and acceptance lengths (one all-gather, after the run)."""
    if tp.size == 1:
        return
    import torch.distributed as dist
    mine = [[t.tolist() for t in result.tokens], [a.tolist() for a in result.acceptance]]
    everyone = [None] * tp.size
    dist.all_gather_object(everyone, mine, group=tp.group)
    parted = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if parted:
        raise RuntimeError(f"ranks {parted} decoded other tokens than rank 0: the ranks left lockstep")


def check_paths(target_path, drafter_path, names=("target_path", "drafter_path")) -> None:
    for name, path in zip(names, (target_path, drafter_path)):
        if path is not None and not (Path(path) / "config.json").is_file():
            raise ValueError(f"{name}: no checkpoint at {path} (its config.json is missing)")


