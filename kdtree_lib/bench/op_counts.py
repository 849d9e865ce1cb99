"""Torch ops per eager decode step, by stage and module, counted on the CPU.

An eager step on a GPU is host-bound: each torch op is one kernel launch (a few for some: topk, sort)
at roughly 20-35 us of host time on the H200 machine, against a graph replay of the whole step in
1-2 ms (docs/kernel-notes.md "Launching from Python"). So the number of torch ops per step is what an
eager step costs, and it can be counted without a GPU:

- OpCounter is a TorchDispatchMode: it sees every ATen op below autograd (composite ops already
  decomposed, as a GPU runs them) and counts those that would launch work: not views and other
  metadata-only ops (OpOverload.is_view, METADATA_OPS), not bare allocations (ALLOCATIONS); the host
  reads (`_local_scalar_dense`: .item(), bool(), .tolist()) are counted apart.
- In bf16/fp16 each RMSNorm (with its fused residual add) counts as the one kernel launch a GPU makes
  (kernels/rms_norm.cu, norms_as_kernels); in fp32 a GPU runs torch's ops, and so are they counted.
- The step counted is the GPU's: a Decoder on the host backend whose PreparedStep's launches (draft
  top-k, tree build, per layer the verify attention, accept, compaction) are host stand-ins
  (HostLaunches) that compute the same results with the references, uncounted, and count one prepared
  call each. So the target takes the prepared attention path (queries into the launch's buffers, no
  key mask), a bf16 target its float MoE's grouped path, and the commit the same glue as on a GPU.
- Each op is charged to the step's stage (draft, tree, verify, accept; the step's timer) and to the
  innermost module with a part name (PARTS: rmsnorm, attention, moe router, ...; "glue" outside them).

    python -m kdtree_lib.bench.op_counts [--budgets 8 32] [--batch 1] [--dtype bfloat16] [--by-op]

prints one column per step shape (AR, chain, DDTree at each budget) on the stand-in pair (a tiny random
pair when its checkpoint is absent). tests/test_op_counts.py pins upper bounds on these counts.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import cli
from ..checks import to_numpy
from ..contracts import DraftTopK
from ..decode import Decoder, PreparedStep, shape_decoder
from ..dflash import model as dflash_model
from ..draft_topk import draft_topk
from ..model import model as target_model
from ..rms_norm import KERNEL_DTYPES
from ..tree_accept import accept, compact_cache
from ..tree_build import build_tree
from ..verify_attn import LATENT_DIM, ROPE_DIM, verify_attention

aten = torch.ops.aten
# not views by schema, but no device work either
METADATA_OPS = frozenset({aten._unsafe_view.default, aten.lift_fresh.default, aten.set_.source_Storage,
                          aten.set_.source_Storage_storage_offset, aten.resize_.default, aten._fused_sdp_choice.default,
                          aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.is_same_size.default})
ALLOCATIONS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                         aten.new_empty.default, aten.new_empty_strided.default})
HOST_READS = frozenset({aten._local_scalar_dense.default})

# module class -> part name (the innermost module on the stack that has one takes the op)
PARTS = {target_model.RMSNorm: "rmsnorm", target_model.Attention: "attention", target_model.Router: "moe router",
         target_model.Experts: "moe experts", target_model.MoE: "moe glue", target_model.MLP: "mlp",
         target_model.Block: "residual", target_model.VocabParallelEmbedding: "embedding",
         dflash_model.Attention: "attention", dflash_model.MLP: "mlp", dflash_model.Layer: "residual"}
SHARED_EXPERT = "moe shared expert"  # a target MLP inside a MoE
NAMED_LINEARS = {"lm_head": "lm head", "fc": "fc"}


def is_launch(func) -> bool:
    """Whether an ATen op does device work: not a view, metadata change or bare allocation."""
    return not (func.is_view or func in METADATA_OPS or func in ALLOCATIONS or func in HOST_READS)


class OpCounter(TorchDispatchMode):
    """Count the launching ATen ops run inside it, by label (`label()`, called per op) and by op name;
    host reads apart. Inside `prepared(name)` nothing is counted but the one prepared call."""

    def __init__(self, label=lambda: "all"):
        super().__init__()
        self.label = label
        self.counts: Counter = Counter()       # label -> ops
        self.by_op: Counter = Counter()        # (label, op) -> ops
        self.host_reads: Counter = Counter()   # label -> _local_scalar_dense calls
        self.prepared_calls: Counter = Counter()  # stand-in launch name -> calls
        self._quiet = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._quiet:
            if func in HOST_READS:
                self.host_reads[self.label()] += 1
            elif is_launch(func):
                label = self.label()
                self.counts[label] += 1
                self.by_op[label, func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def prepared(self, name: str):
        """A stand-in for one prepared launch: counted once, its own ops not at all."""
        self.prepared_calls[name] += 1
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_ops(call, *args, **kwargs) -> tuple[int, object]:
    """(launching ATen ops in call(*args, **kwargs), its result)."""
    with OpCounter() as counter:
        result = call(*args, **kwargs)
    return counter.total, result


# ----------------------------------------------------------------------------------------------
# the GPU's prepared step on the host: its launches as uncounted references

class _HostVerify:
    """Transformer.prepare_verify's PreparedVerify on the host: per layer the verify attention over the
    shared query buffers (the torch reference), no MoE launches (float experts; INT4 ones keep their
    moe_forward path here)."""

    def __init__(self, counter: OpCounter, model, tree, cache):
        batch, nodes = (int(n) for n in tree.tokens.shape)
        attention = model.layers[0].self_attn
        dtype, device = model.embed_tokens.weight.dtype, model.device
        self.q_latent = torch.zeros(batch, nodes, attention.heads, LATENT_DIM, dtype=dtype, device=device)
        self.q_rope = torch.zeros(batch, nodes, attention.heads, ROPE_DIM, dtype=dtype, device=device)
        self.attention = [self._launch(counter, kv, cache.lengths, tree, attention.scale) for kv in cache.kv]
        self.moe = [None] * len(model.layers)

    def _launch(self, counter, kv, lengths, tree, scale):
        def call():
            with counter.prepared("verify attention"):
                return verify_attention(self.q_latent, self.q_rope, kv, lengths, tree, scale=scale, backend="torch")
        return call

    def check(self, tree, cache) -> None:
        pass


class HostLaunches(PreparedStep):
    """A Decoder's PreparedStep (the GPU's step, `PreparedStep.step` itself) with host stand-ins for
    its launches: each computes what the kernel computes (the references, on the tree and result
    buffers this object holds, refilled in place) inside counter.prepared, so the step's own torch
    ops are counted as on a GPU and each launch once."""

    def __init__(self, decoder: Decoder, counter: OpCounter):
        self.decoder = d = decoder
        self.counter = counter
        self.draft_logits = self.topk = self.build = self.accept = self.compact = None
        if d.drafting:
            self.draft_logits = torch.zeros(d.batch, d.depth, d.drafter.config.vocab_size, device=d.device)
            self.topk_out = DraftTopK(logp=torch.zeros(d.batch, d.depth, d.topk, device=d.device),
                                      ids=torch.zeros(d.batch, d.depth, d.topk, dtype=torch.int32, device=d.device))
            self.topk = self._topk
        if d.tree_mode == "root":
            self.tree = d.root_tree
        else:
            self.tree = self._built()
            self.build = self._build
        self.verify = _HostVerify(counter, d.target, self.tree, d.cache)
        if d.walk and d.tree_mode != "root":
            self.new_lengths = torch.zeros_like(d.cache.lengths)
            self.result = accept(self.tree, to_numpy(d.posterior), backend="numpy")
            self.result = type(self.result)(*(torch.as_tensor(x, device=d.device) for x in fields_of(self.result)))
            self.accept, self.compact = self._accept, self._compact

    def _topk(self):
        with self.counter.prepared("draft top-k"):
            found = draft_topk(self.draft_logits, self.decoder.topk, backend="torch")
            self.topk_out.logp.copy_(found.logp)
            self.topk_out.ids.copy_(torch.as_tensor(found.ids))
        return self.topk_out

    def _built(self):
        d = self.decoder
        return build_tree(self.topk_out, d.budget, root=to_numpy(d.root), mode=d.tree_mode,
                          backend="numpy").to_torch(d.device)

    def _build(self):
        with self.counter.prepared("tree build"):
            built = self._built()
            for f in fields(built):  # refill the prepared tree's arrays (the verify reads this object)
                value = getattr(built, f.name)
                if f.name != "max_depth":
                    getattr(self.tree, f.name).copy_(value) if value.dtype != torch.uint32 else setattr(
                        self.tree, f.name, value)
        return self.tree

    def _accept(self):
        with self.counter.prepared("accept"):
            found = accept(self.tree, to_numpy(self.decoder.posterior), backend="numpy")
            for mine, value in zip(fields_of(self.result), fields_of(found)):
                mine.copy_(torch.as_tensor(value))
        return self.result

    def _compact(self):
        d = self.decoder
        with self.counter.prepared("compaction"):
            self.new_lengths.copy_(compact_cache(d.cache.kv, d.cache.lengths, self.result, backend="numpy"))
        return self.new_lengths


def fields_of(result) -> list:
    return [getattr(result, f.name) for f in fields(result)]


# ----------------------------------------------------------------------------------------------
# labels: the step's stage and the module running

class _Labels:
    """stage / part of the op running now: the stage from the step's timer, the part from a module
    stack kept by global forward hooks (installed while counting)."""

    def __init__(self, target, drafter):
        self.stage = "outside"
        self.stack: list[nn.Module] = []
        self.parts: dict[int, str] = {}
        for model in (target, drafter):
            if model is None:
                continue
            for name, module in model.named_modules():
                part = NAMED_LINEARS.get(name.rsplit(".", 1)[-1]) if isinstance(module, nn.Linear) else None
                if isinstance(module, target_model.MoE):
                    self.parts[id(module.shared_experts)] = SHARED_EXPERT
                part = part or PARTS.get(type(module))
                if part and id(module) not in self.parts:
                    self.parts[id(module)] = part

    def __call__(self) -> str:
        for module in reversed(self.stack):
            part = self.parts.get(id(module))
            if part:
                return f"{self.stage} / {part}"
        return f"{self.stage} / glue"

    @contextlib.contextmanager
    def timer(self, stage: str):
        self.stage = stage
        try:
            yield
        finally:
            self.stage = "outside"

    @contextlib.contextmanager
    def hooks(self):
        def push(module, args):
            self.stack.append(module)

        def pop(module, args, output):
            self.stack.pop()
        handles = [nn.modules.module.register_module_forward_pre_hook(push),
                   nn.modules.module.register_module_forward_hook(pop, always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.stack.clear()


@dataclass
class StepCounts:
    """One eager step's ops: by "stage / part", by ("stage / part", op), host reads, prepared calls."""
    shape: str
    counts: Counter
    by_op: Counter
    host_reads: Counter
    prepared_calls: Counter

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def stage_total(self, stage: str) -> int:
        return sum(n for label, n in self.counts.items() if label.startswith(f"{stage} /"))


@contextlib.contextmanager
def norms_as_kernels(counter: OpCounter, dtype):
    """While counting a step in a dtype the RMSNorm kernel takes (rms_norm.KERNEL_DTYPES), each norm (with
    its fused residual add) is what a GPU runs: one prepared launch, its torch ops uncounted."""
    if str(dtype).removeprefix("torch.") not in KERNEL_DTYPES:
        yield
        return
    norm = target_model.RMSNorm
    forward, add_forward = norm.forward, norm.add_forward

    def one_launch(method):
        def run(self, *args):
            with counter.prepared("rms norm"):
                return method(self, *args)
        return run
    norm.forward, norm.add_forward = one_launch(forward), one_launch(add_forward)
    try:
        yield
    finally:
        norm.forward, norm.add_forward = forward, add_forward


def host_decoder(target, drafter, prompts, *, method: str, budget: int, new_tokens: int = 32,
                 counter: OpCounter) -> Decoder:
    """A Decoder of this step shape on the host backend, its step the GPU's (HostLaunches), reset with `prompts`."""
    decoder = shape_decoder(target, drafter, prompts, method=method, budget=budget, new_tokens=new_tokens,
                            backend="numpy")
    decoder.prepared = HostLaunches(decoder, counter)
    return decoder


@torch.no_grad()
def step_counts(target, drafter, prompts, *, method: str, budget: int = 1, warmup: int = 1) -> StepCounts:
    """The ops of one eager step of this shape (after `warmup` steps), by stage and part."""
    labels = _Labels(target, drafter if method != "ar" else None)
    counter = OpCounter(labels)
    decoder = host_decoder(target, drafter, prompts, method=method, budget=budget, counter=counter)
    for _ in range(warmup):
        decoder.step()
    counter.prepared_calls.clear()
    with labels.hooks(), norms_as_kernels(counter, target.embed_tokens.weight.dtype), counter:
        decoder.step(labels.timer)
    shape = "ar" if method == "ar" else "chain" if method == "chain" else f"ddtree-{budget}"
    return StepCounts(shape, counter.counts, counter.by_op, counter.host_reads, counter.prepared_calls)


def shapes(budgets, depth: int) -> list[tuple[str, int]]:
    """(method, budget) of each step counted: AR, the chain (the drafter's depth), DDTree at `budgets`."""
    return [("ar", 1), ("chain", depth)] + [("ddtree", b) for b in budgets]


def table(steps: list[StepCounts], *, by_op: bool = False) -> str:
    """The counts as a text table: a row per "stage / part" (and per op with by_op), a column per shape."""
    labels = sorted({label for step in steps for label in step.counts}, key=_order)
    width = max(len(label) for label in labels) + 2 if labels else 20
    head = f"{'ops per eager step':<{width}}" + "".join(f"{step.shape:>11}" for step in steps)
    lines = [head, "-" * len(head)]
    for label in labels:
        lines.append(f"{label:<{width}}" + "".join(f"{step.counts.get(label, 0):>11}" for step in steps))
        if by_op:
            ops = sorted({op for step in steps for (lab, op) in step.by_op if lab == label})
            for op in ops:
                counts = "".join(f"{step.by_op.get((label, op), 0):>11}" for step in steps)
                lines.append(f"{'    ' + op:<{width}}" + counts)
    lines.append("-" * len(head))
    for stage in ("draft", "tree", "verify", "accept"):
        lines.append(f"{stage + ' (all parts)':<{width}}" + "".join(f"{s.stage_total(stage):>11}" for s in steps))
    lines.append(f"{'torch ops':<{width}}" + "".join(f"{step.total:>11}" for step in steps))
    lines.append(f"{'prepared calls (kernels)':<{width}}"
                 + "".join(f"{sum(step.prepared_calls.values()):>11}" for step in steps))
    lines.append(f"{'host reads':<{width}}" + "".join(f"{sum(step.host_reads.values()):>11}" for step in steps))
    return "\n".join(lines)


def _order(label: str):
    stage, part = label.split(" / ")
    stages = ("draft", "tree", "verify", "accept", "outside")
    return stages.index(stage) if stage in stages else len(stages), part


def run(*, budgets=(8, 32), batch: int = 1, dtype=torch.bfloat16, prompt_tokens: int = 32) -> tuple[str, list]:
    """(the pair's description, StepCounts per shape) on the stand-in pair (a random pair without it)."""
    from ..pairs import pair_with_prompts
    chosen = pair_with_prompts(8, prompts_per_package=batch, prompt_tokens=prompt_tokens, dtype=dtype)
    prompts = chosen.prompts[:batch]
    return chosen.description, [step_counts(chosen.target, chosen.drafter, prompts, method=method, budget=budget)
                                for method, budget in shapes(budgets, chosen.drafter.config.draft_depth)]


@cli.command
def main(argv=None) -> int:
    """python -m kdtree_lib.bench.op_counts: torch ops per eager decode step, by stage and module (CPU)."""
    import argparse
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.bench.op_counts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", type=cli.positive_int, nargs="+", default=[8, 32], help="DDTree budgets")
    parser.add_argument("--batch", type=cli.positive_int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="bfloat16: the GPU's paths (the float MoE's grouped GEMMs); float32 loops over experts")
    parser.add_argument("--by-op", action="store_true", help="list the ATen ops under each row")
    args = parser.parse_args(argv)
    description, steps = run(budgets=args.budgets, batch=args.batch, dtype=getattr(torch, args.dtype))
    print(f"pair: {description}; batch {args.batch}, {args.dtype}")
    print(table(steps, by_op=args.by_op))
    return 0


if __name__ == "__main__":
    sys.exit(main())
