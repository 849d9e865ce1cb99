"""Tensor parallelism over torch.distributed: the rank's view of its group, and a launcher.

Megatron-style: a column-parallel linear holds a slice of the output features and needs no
communication; a row-parallel linear holds a slice of the input features and its partial outputs
are summed with one all-reduce. Each transformer block therefore does two all-reduces (after
o_proj, after the MLP/MoE), the embedding one and the LM head one all-gather.

`launch` runs an importable function on `world_size` processes (torch.multiprocessing spawn), so
a notebook can start a TP run: functions defined in a notebook cell cannot be spawned, which is
why every worker lives in kdtree_lib. Under torchrun, pass dist.group.WORLD as load_target's
tp_group instead.
"""
from __future__ import annotations

import contextlib

import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (group None: a single process)."""
    group: object = None
    rank: int = 0
    size: int = 1

    @classmethod
    def from_group(cls, group) -> "TensorParallel":
        if group is None:
            return cls()
        return cls(group=group, rank=dist.get_rank(group), size=dist.get_world_size(group))

    def split(self, total: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of `total`; ValueError naming `what` if uneven."""
        if total % self.size:
            raise ValueError(f"{what}: {total} is not divisible by the tensor-parallel degree {self.size}")
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the group (in place; the identity for one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def launch(worker, world_size: int, *args, backend: str = "gloo"):
    """Run worker(tp, *args) on world_size spawned ranks; return rank 0's return value.

    `worker` must be importable (a module-level function in kdtree_lib). backend "gloo" runs on
    CPUs, "nccl" puts rank r on cuda:r.
    """
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size: {world_size} ranks need as many GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as rendezvous:
        result_path = os.path.join(rendezvous, "rank0.pt")
        mp.spawn(_entry, args=(world_size, backend, rendezvous, result_path, worker, args),
                 nprocs=world_size, join=True)
        return torch.load(result_path, weights_only=False)


def _entry(rank, world_size, backend, rendezvous, result_path, worker, args):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}/store", rank=rank,
                            world_size=world_size)
    try:
        result = worker(TensorParallel.from_group(dist.group.WORLD), *args)
        if rank == 0:
            torch.save(result, result_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_cpu_thread():
    """One torch intra-op thread inside: on a shared or busy CPU an OpenMP pool spinning for a core
    turns a microsecond op (index_add_ in the expert loop) into tens of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
