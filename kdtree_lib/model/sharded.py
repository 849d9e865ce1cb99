"""Tensor-parallel runs a notebook or test can start: `tp_logits` spawns the ranks (tp.launch),
each loads its shard of a checkpoint and runs a prefill then a tree verify step; rank 0's
logits come back. With world_size 1 it runs in-process, which is the TP=1 reference."""
from __future__ import annotations

import torch

from .checkpoint import load_target
from .tp import TensorParallel, launch


def tp_logits(path, prompt, tree, *, world_size: int = 2, device: str = "cpu",
              dtype: torch.dtype = torch.float32, moe_parallel: str = "tp", attention: str = "absorbed",
              attention_backend: str = "auto") -> dict:
    """{"prefill": float32 [B, P, V], "verify": float32 [B, N, V]} on the CPU, from `world_size` ranks.

    device "cpu": ranks on CPUs over gloo; "cuda": rank r on cuda:r over NCCL.
    """
    args = (str(path), torch.as_tensor(prompt), tree, device, dtype, moe_parallel, attention, attention_backend)
    if world_size == 1:
        return prefill_and_verify(TensorParallel(), *args)
    return launch(prefill_and_verify, world_size, *args, backend="nccl" if device == "cuda" else "gloo")


def prefill_and_verify(tp: TensorParallel, path, prompt, tree, device, dtype, moe_parallel, attention,
                       attention_backend) -> dict:
    """One rank's work: load its shard, prefill the prompt, verify the tree."""
    device = f"cuda:{tp.rank}" if device == "cuda" else device
    model = load_target(path, device=device, dtype=dtype, tp_group=tp.group, moe_parallel=moe_parallel,
                        attention=attention, attention_backend=attention_backend)
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + tree.capacity)
    prefill = model.prefill(prompt.to(device), cache).logits
    verify = model.verify(tree, cache).logits
    return {"prefill": prefill.cpu(), "verify": verify.cpu()}
