"""A tensor-parallel DDTree verify step of K2.6 at its real shapes, timed per layer and component
(notebook 12); the router-overlap model; and the CT200 projection calibrated on it (notebook 13).

Each rank (launched by kdtree_lib.model.tp.launch, or by torchrun) builds `layers` K2.6 layers with
kdtree_lib.model from the config, with random weights generated on its own device: a weight's full
tensor comes from a generator seeded by its name and the rank keeps its slice, so the values are
the same at every TP degree (no checkpoint is read). It holds a latent cache of L committed tokens
per request and verifies best-first trees of N nodes built with kdtree_lib.tree_build from a
synthetic draft. One verify step is cut into segments with a clock mark (CUDA event) between them:

    rest       the input RMSNorm; the residual adds and the post-attention RMSNorm
    attention  MLA projections, cache write, absorbed tree attention (verify_attn), o_proj
    allreduce  after attention and after the MoE (none at TP=1)
    moe        router, routed experts (grouped GEMM), shared expert; the dense MLP of layer 0
    head       final norm and this rank's LM-head slice (the logits all-gather is left out: a
               serving engine reduces to the posterior token on each rank first)

run eagerly and as CUDA graphs (each segment its own graph, replayed in order so the marks can sit
between them; the whole step also as one graph, for its total). Beside it: one forward of an
assumed K2.6-sized DFlash drafter (replicated per rank, with the target's sharded LM head), and
the GPU tree kernels (draft top-k over the vocabulary, tree build, accept + KV compaction).

Rows go to data/results/tp_verify_step.csv, keyed by scope, tp, batch, nodes, context, graph:
    scope "layer": attention/moe/allreduce/rest_seconds (+ router/experts/shared), layer_seconds,
                   moe_layer, experts_touched: what projection.calibrate reads
    scope "step":  step_seconds (all `layers` layers and the head, timed in one piece), head_seconds
    scope "draft": drafter_seconds (eager), drafter_graph_seconds, draft_topk/tree_build/accept_compact_seconds

Run on GPUs (rank r on cuda:r, NCCL):   python -m kdtree_lib.bench_tp --tp 1 2 --layers 3
or under torchrun:  torchrun --nproc-per-node 8 -m kdtree_lib.bench_tp --layers 3
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import results
from .backend import resolve
from .dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids
from .model import KVCache, ModelConfig, TensorParallel, Transformer, launch, load_config
from .model.checkpoint import empty_target, load_weights
from .model.model import MoE
from .projection import (CT200, Efficiency, Hardware, _roofline, allreduce_time, calibrate,
                         expected_distinct_experts, projected_speedup, step_costs)
from .synthetic import zipf_draft_logits
from .contracts import DraftTopK, Tree, tree_from_parents
from .tree_build import build_tree, draft_topk
from .paths import BF16_BYTES, K26_CONFIG

TOPIC = "tp_verify_step"
COMPONENTS = ("attention", "moe", "allreduce", "rest")
MOE_PARTS = ("router", "experts", "shared")
TREE_KERNEL_COLUMNS = ("draft_topk_seconds", "tree_build_seconds", "accept_compact_seconds")


@dataclass(frozen=True)
class BenchSettings:
    """One sweep: the architecture, what to vary, how to time, where rows go."""
    config: ModelConfig                       # the target; num_hidden_layers is replaced by `layers`
    layers: int = 3                           # layer 0 is dense (first_k_dense_replace), the rest MoE
    batches: tuple[int, ...] = (1, 8)
    nodes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)  # tree nodes N, root included (1 = AR step)
    contexts: tuple[int, ...] = (4096, 32768)              # committed tokens L per request
    device: str = "cuda"                      # "cuda": rank r on cuda:r (NCCL); "cpu": gloo
    dtype: str = "bfloat16"
    graphs: bool = True                       # also time CUDA graphs (GPU only)
    repeats: int = 8
    warmup: int = 2
    attention_backend: str = "auto"
    verify_step: bool = True                  # False: only the drafter and tree kernels (scope "draft" rows)
    drafter: DFlashConfig | None = None       # None: no drafter timing
    drafter_new_tokens: int = 5               # tokens the drafter's cache takes in per round
    draft_depth: int = 15                     # D of the synthetic draft the trees come from
    draft_vocab: int = 4096                   # its vocabulary (only the tree's shape matters)
    seed: int = 0
    topic: str | None = TOPIC                 # None: rows are returned, not written
    results_dir: str | None = None
    check: bool = False                       # also return logits: segmented step vs Transformer.verify
    deadline: float | None = None             # time.time() after which no (context, batch) block starts
    run: str = ""                             # stamp shared by the rows of one command (all TP degrees)


def k26_settings(**overrides) -> BenchSettings:
    """The real K2.6 sweep (data/configs/kimi-k2.6.json) with the assumed drafter."""
    config = load_config(K26_CONFIG)
    return BenchSettings(config=config, drafter=drafter_config(config), **overrides)


def drafter_config(config: ModelConfig, *, layers: int = 6, heads: int = 64, kv_heads: int = 8, head_dim: int = 128,
                   intermediate: int = 2048, block_size: int = 16, feature_layers: int = 6) -> DFlashConfig:
    """An ASSUMED DFlash drafter for `config`'s target (its real one is not public here): Qwen3-style
    layers at the target's hidden size, z-lab's layout; the defaults follow the K2.x DFlash drafters
    published (6 layers, 64 heads, MLP 2048, 6 target layers) with 8 KV heads."""
    return DFlashConfig(hidden_size=config.hidden_size, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        vocab_size=config.vocab_size, block_size=block_size, mask_token_id=config.vocab_size - 1,
                        target_layer_ids=build_target_layer_ids(config.num_hidden_layers, feature_layers),
                        rope_theta=config.rope_theta)


# ----------------------------------------------------------------------------------------------
# the model with random weights, sharded per rank

class RandomWeights:
    """Stands in for CheckpointReader in load_weights: each tensor is drawn whole from a generator
    seeded by its name (std 1/sqrt(fan-in); norms 1, router biases 0) and the requested slice is
    returned, so every TP degree shards the same model."""

    def __init__(self, device, dtype: torch.dtype, seed: int = 0):
        self.device, self.dtype, self.seed = torch.device(device), dtype, seed

    def read(self, name: str, shape: tuple[int, ...], dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        if name.endswith("e_score_correction_bias"):
            full = torch.zeros(shape, device=self.device)
        elif name.endswith("norm.weight"):
            full = torch.ones(shape, device=self.device, dtype=self.dtype)
        else:
            digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
            generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:7], "little"))
            full = torch.randn(shape, generator=generator, device=self.device, dtype=self.dtype)
            full.mul_(shape[-1] ** -0.5)
        return full if dim is None else full.narrow(dim, start, stop - start)


def random_target(config: ModelConfig, tp: TensorParallel, *, device, dtype: torch.dtype,
                  attention_backend: str = "auto", seed: int = 0) -> Transformer:
    """This rank's shard of `config`'s model (absorbed attention, TP experts), random weights."""
    model = empty_target(config, tp, device=device, dtype=dtype, attention_backend=attention_backend)
    load_weights(model, RandomWeights(device, dtype, seed))
    return model.eval()


def random_drafter(config: DFlashConfig, target: Transformer, *, seed: int = 0) -> DFlashDrafter:
    """A DFlash drafter with random weights on the target's device, bound to its embedding and LM head."""
    with torch.device("meta"):
        drafter = DFlashDrafter(config).to(target.embed_tokens.weight.dtype)
    drafter = drafter.to_empty(device=target.device).requires_grad_(False)
    torch.manual_seed(seed)
    drafter.init_weights()
    return drafter.bind(target).eval()


def random_cache(model: Transformer, batch: int, context: int, capacity: int, *, seed: int = 0) -> KVCache:
    """Every request holds `context` committed tokens of random latent entries; room for `capacity`."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    dtype = model.embed_tokens.weight.dtype
    kv = [torch.randn(batch, capacity, model.config.cache_dim, generator=generator, device=model.device, dtype=dtype)
          for _ in model.layers]
    return KVCache(kv=kv, lengths=torch.full((batch,), context, dtype=torch.int32, device=model.device))


def synthetic_tree(batch: int, nodes: int, *, depth: int, vocab: int, seed: int = 0) -> Tree:
    """A best-first tree of `nodes` nodes (root included) per request from a Zipf-like draft;
    nodes = 1 is the root alone (an autoregressive step)."""
    if nodes == 1:
        return tree_from_parents(np.full((batch, 1), -1), np.zeros((batch, 1), np.int32), max_depth=depth)
    draft = draft_topk(zipf_draft_logits(batch, depth, vocab, seed=seed), min(nodes - 1, vocab), backend="numpy")
    return build_tree(draft, nodes - 1, root=np.zeros(batch, np.int32), backend="numpy")


# ----------------------------------------------------------------------------------------------
# one verify step, cut into timed segments

@dataclass
class Segment:
    """A piece of the verify step: reads and writes the shared state dict (x0, h, a, m, ...)."""
    component: str     # one of COMPONENTS, or "head"
    part: str          # finer name: router/experts/shared, dense_mlp, norm, residual, ...
    layer: int         # -1 for the head
    run: Callable[[dict], None]


def step_segments(model: Transformer, step, cache: KVCache, backend: str) -> list[Segment]:
    """The verify step of every layer and the head, in order: what Transformer.forward computes."""
    segments = []
    for index, block in enumerate(model.layers):
        segments += layer_segments(block, index, step, cache.kv[index], backend)

    def head(state):
        state["logits"] = model.lm_head(model.norm(state[f"x{len(model.layers)}"]))    # (B, N, V/tp)
    return segments + [Segment("head", "head", -1, head)]


def layer_segments(block, layer: int, step, kv, backend: str) -> list[Segment]:
    """Block.forward (and MoE.forward) in segments; all-reduces only when there is a group. The
    layer reads the residual stream x{layer} and writes x{layer + 1}, so a rerun starts from x0."""
    tp = block.tp
    given, mid, out = f"x{layer}", f"r{layer}", f"x{layer + 1}"

    def norm_in(state):
        state["h"] = block.input_layernorm(state[given])
    def attend(state):
        state["a"] = block.self_attn(state["h"], step, kv, path="absorbed", backend=backend)  # (B, N, D) partial
    def reduce_attention(state):
        tp.all_reduce(state["a"])
    def add_attention(state):
        state[mid] = state[given] + state["a"]
        state["h"] = block.post_attention_layernorm(state[mid])
    def reduce_mlp(state):
        tp.all_reduce(state["m"])
    def add_mlp(state):
        state[out] = state[mid] + state["m"].view_as(state[mid])

    if isinstance(block.mlp, MoE):
        moe, ids, weights = block.mlp, f"ids{layer}", f"weights{layer}"

        def route(state):
            state[weights], state[ids] = moe.gate(state["h"].flatten(0, 1))
        def experts(state):
            state["m"] = moe.experts(state["h"].flatten(0, 1), state[ids], state[weights])  # (B·N, D) partial
        def shared(state):
            state["m"] = state["m"] + moe.shared_experts(state["h"].flatten(0, 1))
        mlp = [("moe", "router", route), ("moe", "experts", experts), ("moe", "shared", shared)]
    else:
        def dense(state):
            state["m"] = block.mlp(state["h"])
        mlp = [("moe", "dense_mlp", dense)]
    reduce = tp.size > 1
    parts = [("rest", "norm", norm_in), ("attention", "attention", attend),
             *([("allreduce", "allreduce", reduce_attention)] if reduce else []), ("rest", "residual", add_attention),
             *mlp, *([("allreduce", "allreduce", reduce_mlp)] if reduce else []), ("rest", "residual", add_mlp)]
    return [Segment(component, part, layer, run) for component, part, run in parts]


class Clock:
    """Marks on the GPU's clock (CUDA events) or, on a CPU run (synchronous), the host's."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def time_runs(runs: list[Callable], clock: Clock, *, repeats: int, warmup: int) -> np.ndarray:
    """seconds [repeats, len(runs)]: the runs one after another, a clock mark between each."""
    for _ in range(warmup):
        for run in runs:
            run()
    trials = []
    for _ in range(repeats):
        marks = [clock.mark()]
        for run in runs:
            run()
            marks.append(clock.mark())
        trials.append(marks)
    clock.sync()
    return np.array([[clock.seconds(a, b) for a, b in zip(marks, marks[1:])] for marks in trials])


def capture_graphs(segments: list[Segment], x0: torch.Tensor):
    """One CUDA graph per segment, chained through a state dict, and one graph of the whole step.

    Warmed up on a side stream first (lazy initialisation must not be captured); replaying the
    segment graphs in order computes the step. Returns (segment graphs, whole-step graph, state).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = {"x0": x0}
        for segment in segments:
            segment.run(warm)
    torch.cuda.current_stream().wait_stream(side)
    state, graphs = {"x0": x0}, []
    for segment in segments:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            segment.run(state)
        graphs.append(graph)
    whole_state, whole = {"x0": x0}, torch.cuda.CUDAGraph()
    with torch.cuda.graph(whole, capture_error_mode="thread_local"):
        for segment in segments:
            segment.run(whole_state)
    return graphs, whole, state


def segment_rows(segments: list[Segment], seconds: np.ndarray, common: dict) -> tuple[list[dict], float]:
    """Layer rows (median over trials of each component's sum) and the head's median seconds."""
    rows = []
    for layer in sorted({s.layer for s in segments if s.layer >= 0}):
        picked = [i for i, s in enumerate(segments) if s.layer == layer]
        row = {**common, "scope": "layer", "layer": layer,
               "moe_layer": any(segments[i].part == "router" for i in picked)}
        for name in COMPONENTS:  # 0 when absent (no all-reduce at TP=1)
            columns = [i for i in picked if segments[i].component == name]
            row[f"{name}_seconds"] = float(np.median(seconds[:, columns].sum(axis=1)))
        for name in MOE_PARTS:   # empty in a dense layer
            columns = [i for i in picked if segments[i].part == name]
            row[f"{name}_seconds"] = float(np.median(seconds[:, columns].sum(axis=1))) if columns else ""
        row["layer_seconds"] = float(np.median(seconds[:, picked].sum(axis=1)))
        rows.append(row)
    head = [i for i, s in enumerate(segments) if s.layer < 0]
    return rows, float(np.median(seconds[:, head].sum(axis=1)))


def time_verify_step(model: Transformer, cache: KVCache, tree: Tree, settings: BenchSettings, clock: Clock,
                     common: dict, *, graphs: bool) -> tuple[list[dict], dict]:
    """Rows of one (batch, nodes, context): eager, and CUDA graphs when `graphs`; plus the state of
    the eager run (its logits and routing)."""
    tp = model.tp
    backend = resolve(model.attention_backend, ("torch", "numpy", "cupy"), cache.kv[0])
    tree = tree.to_torch(model.device)
    step = model.step(tree, cache)
    x0 = model.embed_tokens(tree.tokens.long())                                           # (B, N, D)
    segments = step_segments(model, step, cache, backend)
    common = {**common, "attention_backend": backend}
    eager = {"x0": x0}
    runs = [partial(segment.run, eager) for segment in segments]
    timed = {False: (time_runs(runs, clock, repeats=settings.repeats, warmup=settings.warmup),
                     time_runs([lambda: [run() for run in runs]], clock, repeats=settings.repeats, warmup=0))}
    batch, nodes = tree.tokens.shape
    touched = {s.layer: int(torch.unique(eager[f"ids{s.layer}"]).numel()) for s in segments if s.part == "router"}
    if graphs:
        captured = None
        try:
            captured = capture_graphs(segments, x0)
        except Exception as error:  # a capture that fails costs the graph rows of this run, never the run
            torch.cuda.set_stream(torch.cuda.default_stream())
            print(f"rank {tp.rank}: CUDA-graph capture failed, graph rows skipped: {error!r}", flush=True)
        if all_ranks(tp, captured is not None, model.device):
            segment_graphs, whole, graph_state = captured
            timed[True] = (time_runs([g.replay for g in segment_graphs], clock, repeats=settings.repeats,
                                     warmup=settings.warmup),
                           time_runs([whole.replay], clock, repeats=settings.repeats, warmup=1))
            graph_error = float((graph_state["logits"].float() - eager["logits"].float()).abs().max())
        else:
            graphs = False
        del captured
    rows = []
    for graph, (seconds, whole_seconds) in timed.items():
        layer_rows, head_seconds = segment_rows(segments, seconds, {**common, "graph": graph})
        for row in layer_rows:
            if row["moe_layer"]:
                row["experts_touched"] = touched[row["layer"]]
                row["experts_expected_uniform"] = expected_distinct_experts(
                    batch * nodes, model.config.n_routed_experts, model.config.num_experts_per_tok)
        step_row = {**common, "graph": graph, "scope": "step", "step_seconds": float(np.median(whole_seconds)),
                    "head_seconds": head_seconds}
        if graph:
            step_row["graph_vs_eager_max_abs_diff"] = graph_error
        rows += layer_rows + [step_row]
    return rows, eager


def time_drafter(drafter: DFlashDrafter, batch: int, context: int, settings: BenchSettings, clock: Clock,
                 *, graph: bool) -> dict:
    """Median seconds of one drafter forward: take in `drafter_new_tokens` committed tokens' features
    after `context` cached ones, draft one block, the target's LM head on it. Eager
    (`drafter_seconds`) and, with graph, as a CUDA graph of the fixed-shape forward a graph-captured
    decode replays (`drafter_graph_seconds`)."""
    c, weight = drafter.config, drafter.fc.weight
    new = settings.drafter_new_tokens
    cache = drafter.new_cache(batch, context + new)
    committed = torch.full((batch,), context, dtype=torch.long, device=weight.device)
    features = torch.randn(batch, new, c.feature_size, device=weight.device, dtype=weight.dtype)
    bonus = torch.zeros(batch, dtype=torch.long, device=weight.device)

    def forward(static: bool = False):
        cache.lengths = committed  # draft() rebinds lengths; every run starts from the same buffer
        drafter.draft(cache, features, bonus, static=static)

    def median_seconds(run) -> float:
        return float(np.median(time_runs([run], clock, repeats=settings.repeats, warmup=settings.warmup)))

    times = {"drafter_seconds": median_seconds(forward)}
    if graph:
        forward(static=True)
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            forward(static=True)
        times["drafter_graph_seconds"] = median_seconds(captured.replay)
    return times


def time_tree_kernels(cache: KVCache, batch: int, nodes: int, settings: BenchSettings, vocab: int) -> dict:
    """GPU time (bench_tree.gpu_us: a CUDA graph of 20 calls) of the public kernel calls of one round:
    draft top-k over the vocabulary (k = budget), tree build, accept + compaction of every layer."""
    from .bench_tree import follow_posterior, gpu_us
    from .tree_accept import accept, compact_cache
    budget, depth = nodes - 1, settings.draft_depth
    logits = torch.randn(batch, depth, vocab, device=cache.lengths.device) * 3                # (B, D, V)
    draft = draft_topk(logits, budget, backend="cupy")
    tree = build_tree(draft, budget, backend="cupy")
    host = build_tree(DraftTopK(draft.logp.cpu().numpy(), draft.ids.cpu().numpy()), budget, backend="numpy")
    posterior = torch.as_tensor(follow_posterior(host, np.random.default_rng(settings.seed)), device=logits.device)
    timings = {"draft_topk": gpu_us(lambda: draft_topk(logits, budget, backend="cupy")),
               "tree_build": gpu_us(lambda: build_tree(draft, budget, backend="cupy")),
               "accept_compact": gpu_us(lambda: compact_cache(cache.kv, cache.lengths, accept(tree, posterior)))}
    row = {f"{name}_seconds": us * 1e-6 for name, (us, _) in timings.items()}
    return {**row, "tree_timing": ",".join(sorted({method for _, method in timings.values()}))}


# ----------------------------------------------------------------------------------------------
# the rank's sweep

def verify_step_worker(tp: TensorParallel, settings: BenchSettings) -> dict:
    """One rank's sweep (launch it with run_tp_bench). Returns {"rows": [...], "check": {...}}; rank 0
    appends its rows to data/results/<topic>.csv after each (context, batch) block.

    On CPUs each rank runs one intra-op thread (see one_cpu_thread)."""
    if settings.device == "cuda":
        return _sweep(tp, settings, torch.device("cuda", torch.cuda.current_device()))
    with one_cpu_thread():
        return _sweep(tp, settings, torch.device("cpu"))


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


def _sweep(tp: TensorParallel, settings: BenchSettings, device: torch.device) -> dict:
    dtype = getattr(torch, settings.dtype)
    config = replace(settings.config, num_hidden_layers=settings.layers)
    model = random_target(config, tp, device=device, dtype=dtype, attention_backend=settings.attention_backend,
                          seed=settings.seed)
    drafter = random_drafter(settings.drafter, model, seed=settings.seed) if settings.drafter else None
    clock, rows, check = Clock(device), [], {}
    common = {"run": settings.run, "tp": tp.size, "gpus": tp.size if device.type == "cuda" else 0,
              "layers": settings.layers,
              "dtype": settings.dtype, "expert_bits": 16, **_ceilings(device)}
    graphs = settings.graphs and device.type == "cuda"
    vocab = min(settings.draft_vocab, config.vocab_size)
    for context in settings.contexts:
        for batch in settings.batches:
            late = settings.deadline is not None and time.time() > settings.deadline
            if not all_ranks(tp, not late, device):
                _log(tp, f"time limit: stopping before context {context}, batch {batch}")
                return {"rows": rows, "check": check}
            cache = random_cache(model, batch, context, context + max(settings.nodes), seed=settings.seed)
            block = []
            drafter_times = (time_drafter(drafter, batch, context, settings, clock, graph=graphs)
                             if drafter else {})
            for nodes in settings.nodes:
                where = {**common, "batch": batch, "nodes": nodes, "context": context}
                if settings.verify_step:
                    tree = synthetic_tree(batch, nodes, depth=settings.draft_depth, vocab=vocab, seed=settings.seed)
                    step_rows, eager = time_verify_step(model, cache, tree, settings, clock, where, graphs=graphs)
                    graphs = graphs and any(row["graph"] for row in step_rows)
                    block += step_rows
                    if settings.check and nodes == max(settings.nodes) and not check:
                        check = {"segmented": tp.all_gather_last(eager["logits"]).float().cpu(),
                                 "verify": model.verify(tree, cache).logits.cpu()}
                    _log(tp, _summary(step_rows))
                if nodes > 1 and (drafter is not None or device.type == "cuda"):
                    draft_row = {**where, "scope": "draft"}
                    draft_row.update(drafter_times)
                    if device.type == "cuda":
                        draft_row.update(time_tree_kernels(cache, batch, nodes, settings, config.vocab_size))
                    block.append(draft_row)
            rows += block
            if tp.rank == 0 and settings.topic:
                results.append_rows(settings.topic, block, results_dir=settings.results_dir)
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows, "check": check}


def run_tp_bench(settings: BenchSettings, world_size: int = 1) -> dict:
    """The sweep on `world_size` ranks (in this process for one; spawned, gloo or NCCL, for more)."""
    if world_size == 1:
        return verify_step_worker(TensorParallel(), settings)
    return launch(verify_step_worker, world_size, settings, backend="nccl" if settings.device == "cuda" else "gloo")


def all_ranks(tp: TensorParallel, flag: bool, device) -> bool:
    """True when `flag` holds on every rank (one all-reduce), so all ranks take the same branch."""
    if tp.size == 1:
        return flag
    missing = torch.tensor([0.0 if flag else 1.0], device=device)
    tp.all_reduce(missing)
    return bool(missing.item() == 0)


def _ceilings(device: torch.device) -> dict:
    """This GPU's measured copy bandwidth and bf16 matmul rate (what calibration divides by)."""
    if device.type != "cuda":
        return {}
    from .bench_verify_attn import measure_ceilings
    measured = measure_ceilings()
    return {"copy_bandwidth": measured["copy_tbps"] * 1e12, "matmul_flops": measured["matmul_tflops"] * 1e12}


def _summary(rows: list[dict]) -> str:
    first = rows[0]
    parts = []
    for graph in (False, True):
        layers = [r for r in rows if r["scope"] == "layer" and r["graph"] == graph]
        if layers:
            moe = [r for r in layers if r["moe_layer"]] or layers
            split = " ".join(f"{c} {np.mean([r[f'{c}_seconds'] for r in moe]) * 1e3:.3f}" for c in COMPONENTS)
            parts.append(f"{'graph' if graph else 'eager'}: MoE layer {split} ms")
    return f"tp={first['tp']} B={first['batch']} N={first['nodes']} L={first['context']}: " + "; ".join(parts)


def _log(tp: TensorParallel, text: str) -> None:
    if tp.rank == 0:
        print(text, flush=True)


def latest_rows(rows: list[dict]) -> list[dict]:
    """The verify-step rows (scopes layer and step) of the newest run that has them, and the draft
    rows of the newest run that has them (a --drafter-only run refreshes those alone)."""
    return (results.latest_run([r for r in rows if r.get("scope") != "draft"])
            + results.latest_run([r for r in rows if r.get("scope") == "draft"]))


def whole_model_rows(rows: list[dict], config: ModelConfig) -> list[dict]:
    """Seconds per verify round of the whole model, per (tp, graph, batch, nodes, context): the
    dense layer rows times first_k_dense_replace and the mean MoE layer row times the MoE layers
    (per component), plus the head and, for a tree (N > 1), the drafter and the tree kernels."""
    groups: dict[tuple, dict[str, list[dict]]] = {}
    drafts: dict[tuple, list[dict]] = {}
    for row in rows:
        where = (int(row["tp"]), int(row["batch"]), int(row["nodes"]), int(row["context"]))
        if row["scope"] == "draft":
            drafts.setdefault(where, []).append(row)
        else:
            groups.setdefault((_flag(row["graph"]), *where), {}).setdefault(row["scope"], []).append(row)
    out = []
    for (graph, tp, batch, nodes, context), scoped in sorted(groups.items()):
        layers = scoped.get("layer", [])
        dense = [r for r in layers if not _flag(r["moe_layer"])]
        moe = [r for r in layers if _flag(r["moe_layer"])]
        if not dense or not moe or "step" not in scoped:
            continue
        counts = {config.first_k_dense_replace: dense, len(config.moe_layers): moe}
        row = {"tp": tp, "graph": graph, "batch": batch, "nodes": nodes, "context": context}
        for name in COMPONENTS:
            row[name] = sum(count * float(np.mean([float(r[f"{name}_seconds"]) for r in picked]))
                            for count, picked in counts.items())
        row["head"] = float(np.mean([float(r["head_seconds"]) for r in scoped["step"]]))
        draft = drafts.get((tp, batch, nodes, context), [])
        row["draft"] = float(np.mean([draft_round_seconds(r, graph=graph) for r in draft])) if draft else 0.0
        row["total"] = sum(row[name] for name in (*COMPONENTS, "head", "draft"))
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------
# how much the routing of one tree overlaps: measured on real text, modelled with a correlation

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


# ----------------------------------------------------------------------------------------------
# the CT200 projection (notebook 13), calibrated on the rows above

def select_rows(rows: list[dict], scope: str, *, tp: int | None = None, graph: bool | None = None) -> list[dict]:
    """Rows of one scope; of TP degree `tp` (default: the largest present) and graph flag."""
    picked = [r for r in rows if r.get("scope") == scope]
    if not picked:
        return []
    tp = max(int(r["tp"]) for r in picked) if tp is None else tp
    return [r for r in picked if int(r["tp"]) == tp and (graph is None or _flag(r.get("graph")) == graph)]


def measured_hardware(rows: list[dict], *, tp: int) -> Hardware:
    """The GPU the rows ran on as a projection.Hardware: its measured copy bandwidth and bf16
    matmul rate (medians), `tp` GPUs (its all-reduce numbers are not used by calibration)."""
    bandwidth = [float(r["copy_bandwidth"]) for r in rows if r.get("copy_bandwidth") not in (None, "")]
    flops = [float(r["matmul_flops"]) for r in rows if r.get("matmul_flops") not in (None, "")]
    if not bandwidth or not flops:
        raise ValueError("rows: expected copy_bandwidth and matmul_flops columns (a GPU run)")
    return Hardware(name=rows[0].get("device", "GPU"), memory_bandwidth=float(np.median(bandwidth)),
                    matmul_flops=float(np.median(flops)), gpus=tp, allreduce_latency=0.0,
                    allreduce_bus_bandwidth=math.inf)


def calibrate_on_rows(rows: list[dict], config: ModelConfig, *, tp: int | None = None,
                      graph: bool = True) -> tuple[Efficiency, Hardware, list[dict]]:
    """projection.calibrate on the layer rows of one TP degree (random weights route uniformly, so
    correlation 0 and bf16 experts), and the head's efficiency from the step rows' head_seconds:
    (efficiency, the measured hardware, the layer rows used)."""
    layers = select_rows(rows, "layer", tp=tp, graph=graph)
    if not layers:
        raise ValueError(f"rows: no layer rows with tp={tp}, graph={graph}")
    hardware = measured_hardware(layers, tp=int(layers[0]["tp"]))
    efficiency = calibrate(layers, config, hardware, expert_bits=16, correlation=0.0)
    heads = [step_costs(config, hardware, batch=int(r["batch"]), nodes=int(r["nodes"]), context=int(r["context"]))
             ["rest"] / float(r["head_seconds"]) for r in select_rows(rows, "step", tp=hardware.gpus, graph=graph)
             if r.get("head_seconds") not in (None, "")]
    return (replace(efficiency, rest=float(np.median(heads))) if heads else efficiency), hardware, layers


def drafter_seconds(config: DFlashConfig, hardware: Hardware, *, batch: int, context: int, new_tokens: int = 5,
                    shards: int = 1, head_shards: int | None = None, efficiency: float = 1.0) -> float:
    """One drafter forward: its weights (layers split over `shards` GPUs, the target's LM head over
    `head_shards`) and its context cache read once, the FLOPs of the block and the new tokens, at
    the roofline divided by `efficiency`; with shards > 1 also two all-reduces per layer and the
    head's all-gather (latency-bound messages)."""
    c = config
    head_shards = shards if head_shards is None else head_shards
    per_layer = (c.hidden_size * c.head_dim * 2 * (c.num_attention_heads + c.num_key_value_heads)
                 + 3 * c.hidden_size * c.intermediate_size)
    body = c.num_hidden_layers * per_layer + c.feature_size * c.hidden_size
    head = c.vocab_size * c.hidden_size
    tokens = batch * (c.block_size + new_tokens)
    cache_bytes = batch * context * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * BF16_BYTES / shards
    attention_flops = 4 * batch * c.block_size * c.num_attention_heads * c.head_dim * context * c.num_hidden_layers
    weight_bytes = (body / shards + head / head_shards) * BF16_BYTES
    flops = 2 * tokens * body / shards + 2 * batch * (c.block_size - 1) * head / head_shards + attention_flops / shards
    seconds = _roofline(weight_bytes + cache_bytes, flops, hardware) / efficiency
    if shards > 1:
        group = replace(hardware, gpus=shards)
        seconds += (2 * c.num_hidden_layers + 1) * allreduce_time(tokens * c.hidden_size * BF16_BYTES, group)
    return seconds


def drafter_efficiency(rows: list[dict], config: DFlashConfig, hardware: Hardware, *, new_tokens: int = 5) -> float:
    """Roofline / measured drafter time (median over rows): its layers replicated, LM head over tp.
    The CUDA-graph time where a row has one (what a graph-captured decode pays), else the eager one."""
    def measured(row) -> float:
        return float(row.get("drafter_graph_seconds") or row["drafter_seconds"])
    ratios = [drafter_seconds(config, hardware, batch=int(r["batch"]), context=int(r["context"]),
                              new_tokens=new_tokens, head_shards=int(r["tp"])) / measured(r)
              for r in rows if r.get("drafter_seconds") not in (None, "")]
    if not ratios:
        raise ValueError("rows: no drafter_seconds measured")
    return float(np.median(ratios))


def draft_round_seconds(row: dict, *, graph: bool) -> float:
    """What a draft row adds to a round: the drafter forward (its CUDA-graph time in a graph round,
    where measured) and the tree kernels."""
    drafter = (row.get("drafter_graph_seconds") if graph else None) or row.get("drafter_seconds")
    return float(drafter or 0.0) + sum(float(row[n]) for n in TREE_KERNEL_COLUMNS if row.get(n) not in (None, ""))


def tree_kernel_seconds(rows: list[dict], batch: int) -> float:
    """Median over budgets of draft top-k + tree build + accept/compaction, for `batch` (0 if absent)."""
    sums = [sum(float(r[n]) for n in TREE_KERNEL_COLUMNS) for r in rows
            if int(r["batch"]) == batch and all(r.get(n) not in (None, "") for n in TREE_KERNEL_COLUMNS)]
    return float(np.median(sums)) if sums else 0.0


def acceptance_curve(rows: list[dict], *, column: str = "mean_acceptance", **filters) -> dict[int, float]:
    """Mean tokens per round per budget (root included) from acceptance rows, e.g.
    data/results/acceptance.csv: the mean of `column` over the rows of each budget matching filters."""
    picked = [r for r in rows if all(str(r.get(k)) == str(v) for k, v in filters.items())]
    if not picked or column not in picked[0] or "budget" not in picked[0]:
        raise ValueError(f"rows: expected rows with 'budget' and {column!r} matching {filters}")
    curve: dict[int, list[float]] = {}
    for row in picked:
        curve.setdefault(int(float(row["budget"])), []).append(float(row[column]))
    return {budget: float(np.mean(values)) for budget, values in sorted(curve.items())}


def ct200_projection(config: ModelConfig, acceptance: dict[int, float], *, efficiency: Efficiency,
                     hardware: Hardware = CT200, batches=(1, 8), contexts=(4096,), expert_bits: float = 4.5,
                     correlation: float | dict[int, float] = 0.0,
                     draft_seconds: float | Callable[[int, int], float] = 0.0) -> list[dict]:
    """Per (context, batch, budget): step time, tokens/s and speedup over AR on `hardware`
    (projection.projected_speedup). correlation may be per batch ({batch: c}); draft_seconds a
    constant or draft_seconds(batch, context): what a DDTree round adds (drafter, tree kernels)."""
    rows = []
    for context in contexts:
        for batch in batches:
            corr = correlation[batch] if isinstance(correlation, dict) else correlation
            draft = draft_seconds(batch, context) if callable(draft_seconds) else draft_seconds
            for row in projected_speedup(config, hardware, acceptance, batch=batch, context=context,
                                         draft_seconds=draft, expert_bits=expert_bits, correlation=corr,
                                         efficiency=efficiency):
                rows.append({"context": context, "batch": batch, "correlation": corr, "draft_seconds": draft, **row})
    return rows


def best_budgets(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """(context, batch) -> the projection row with the most tokens/s."""
    best: dict[tuple[int, int], dict] = {}
    for row in rows:
        key = (row["context"], row["batch"])
        if key not in best or row["tokens_per_second"] > best[key]["tokens_per_second"]:
            best[key] = row
    return best


def _flag(value) -> bool:
    return value in (True, 1, "1", "True", "true")


# ----------------------------------------------------------------------------------------------
# command line

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2], help="TP degrees to run, one after another")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-drafter", action="store_true")
    parser.add_argument("--drafter-only", action="store_true",
                        help="time only the drafter and the tree kernels (refreshes the scope 'draft' rows)")
    parser.add_argument("--max-minutes", type=float, default=None, help="for the whole command; blocks left are skipped")
    parser.add_argument("--results-dir", type=Path, default=None, help="default: data/results/")
    args = parser.parse_args(argv)
    settings = k26_settings(layers=args.layers, batches=tuple(args.batches), nodes=tuple(args.nodes),
                            contexts=tuple(args.contexts), repeats=args.repeats, graphs=not args.no_graphs,
                            results_dir=None if args.results_dir is None else str(args.results_dir))
    if args.no_drafter:
        settings = replace(settings, drafter=None)
    if args.drafter_only:
        settings = replace(settings, verify_step=False)
    settings = replace(settings, run=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if args.max_minutes is not None:
        settings = replace(settings, deadline=time.time() + 60 * args.max_minutes)
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank of WORLD
        import torch.distributed as dist
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        try:
            verify_step_worker(TensorParallel.from_group(dist.group.WORLD), settings)
        finally:
            dist.destroy_process_group()
        return
    for degree in args.tp:
        print(f"--- TP={degree}: {settings.layers} layers of {K26_CONFIG.name}", flush=True)
        launch(verify_step_worker, degree, settings, backend="nccl")


if __name__ == "__main__":
    main()
