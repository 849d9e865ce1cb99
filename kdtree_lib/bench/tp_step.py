"""A tensor-parallel DDTree verify step of K2.6 at its real shapes, timed per layer and component
(notebook 12). What the rows are read for (calibration, the CT200 model) is kdtree_lib.projection's;
the router-overlap study is kdtree_lib.routing's.

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

Run on GPUs (rank r on cuda:r, NCCL):   python -m kdtree_lib.bench.tp_step --tp 1 2 --layers 3
or under torchrun:  torchrun --nproc-per-node 8 -m kdtree_lib.bench.tp_step --layers 3
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

import numpy as np
import torch

from .. import cli, results
from . import command_parser
from ..backend import resolve
from ..contracts import DraftTopK, Tree
from ..dflash import DFlashConfig, DFlashDrafter, build_target_layer_ids
from ..draft_topk import draft_topk
from ..model import KVCache, ModelConfig, TensorParallel, Transformer, launch, load_config
from ..model.tp import one_cpu_thread
from ..paths import K26_CONFIG
from ..projection import COMPONENTS, expected_distinct_experts
from ..tree_accept import accept, compact_cache
from ..tree_build import build_tree
from .inputs import follow_posterior, random_cache, random_drafter, random_target, synthetic_tree
from .timing import Clock, graph_seconds, time_segments

TOPIC = "tp_verify_step"
MOE_PARTS = ("router", "experts", "shared")


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
    int4_experts: bool = False                # routed experts INT4-resident in the kernel layout, as the box runs them
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
    """Block.pieces as segments: the layer reads the residual stream x{layer} and writes x{layer + 1},
    so a rerun starts from x0; the router's ids are kept as ids{layer} (the experts it touched)."""
    segments = []
    for component, part, run in block.pieces(step, kv, path="absorbed", backend=backend, layer=layer,
                                             given=f"x{layer}", out=f"x{layer + 1}"):
        if part == "router":
            run = partial(_keep_ids, run, f"ids{layer}")
        segments.append(Segment(component, part, layer, run))
    return segments


def _keep_ids(route, name: str, state: dict) -> None:
    route(state)
    state[name] = state["ids"]


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
    timed = {False: (time_segments(runs, clock, repeats=settings.repeats, warmup=settings.warmup),
                     time_segments([lambda: [run() for run in runs]], clock, repeats=settings.repeats, warmup=0))}
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
            timed[True] = (time_segments([g.replay for g in segment_graphs], clock, repeats=settings.repeats,
                                     warmup=settings.warmup),
                           time_segments([whole.replay], clock, repeats=settings.repeats, warmup=1))
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
        cache.lengths.copy_(committed)  # draft() advances lengths in place; every run starts from `context`
        drafter.draft(cache, features, bonus, static=static)

    def median_seconds(run) -> float:
        return float(np.median(time_segments([run], clock, repeats=settings.repeats, warmup=settings.warmup)))

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
    """GPU seconds (timing.graph_seconds: a CUDA graph of 20 calls) of the public kernel calls of one
    round: draft top-k over the vocabulary (k = budget), tree build, accept + compaction of every layer."""
    budget, depth = nodes - 1, settings.draft_depth
    logits = torch.randn(batch, depth, vocab, device=cache.lengths.device) * 3                # (B, D, V)
    draft = draft_topk(logits, budget, backend="cupy")
    tree = build_tree(draft, budget, backend="cupy")
    host = build_tree(DraftTopK(draft.logp.cpu().numpy(), draft.ids.cpu().numpy()), budget, backend="numpy")
    posterior = torch.as_tensor(follow_posterior(host, np.random.default_rng(settings.seed)), device=logits.device)
    timings = {"draft_topk": graph_seconds(lambda: draft_topk(logits, budget, backend="cupy")),
               "tree_build": graph_seconds(lambda: build_tree(draft, budget, backend="cupy")),
               "accept_compact": graph_seconds(lambda: compact_cache(cache.kv, cache.lengths, accept(tree, posterior)))}
    row = {f"{name}_seconds": seconds for name, (seconds, _) in timings.items()}
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


def _sweep(tp: TensorParallel, settings: BenchSettings, device: torch.device) -> dict:
    dtype = getattr(torch, settings.dtype)
    config = replace(settings.config, num_hidden_layers=settings.layers)
    model = random_target(config, tp, device=device, dtype=dtype, attention_backend=settings.attention_backend,
                          seed=settings.seed, int4_experts=settings.int4_experts)
    drafter = random_drafter(settings.drafter, model, seed=settings.seed) if settings.drafter else None
    clock, rows, check = Clock(device), [], {}
    common = {"run": settings.run, "tp": tp.size, "gpus": tp.size if device.type == "cuda" else 0,
              "layers": settings.layers,
              "dtype": settings.dtype, "expert_bits": 4.5 if settings.int4_experts else 16, **_ceilings(device)}
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
    from .ceilings import measure_ceilings
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


# ----------------------------------------------------------------------------------------------
# command line

@cli.command
def main(argv=None) -> int:
    parser = command_parser(__spec__.name, __doc__.split("\n")[0])
    parser.add_argument("--tp", type=cli.positive_int, nargs="+", default=[2], help="TP degrees to run, one after another")
    parser.add_argument("--layers", type=cli.positive_int, default=3)
    parser.add_argument("--batches", type=cli.positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--nodes", type=cli.positive_int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--contexts", type=cli.positive_int, nargs="+", default=[4096, 32768])
    parser.add_argument("--repeats", type=cli.positive_int, default=8)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-drafter", action="store_true")
    parser.add_argument("--int4-experts", action="store_true", help="routed experts INT4 in the kernel layout (the box's)")
    parser.add_argument("--drafter-only", action="store_true",
                        help="time only the drafter and the tree kernels (refreshes the scope 'draft' rows)")
    parser.add_argument("--max-minutes", type=cli.positive_float, default=None, help="for the whole command; blocks left are skipped")
    args = parser.parse_args(argv)
    cli.require_cuda()
    settings = k26_settings(layers=args.layers, batches=tuple(args.batches), nodes=tuple(args.nodes),
                            contexts=tuple(args.contexts), repeats=args.repeats, graphs=not args.no_graphs,
                            int4_experts=args.int4_experts,
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
        return 0
    for degree in args.tp:
        print(f"--- TP={degree}: {settings.layers} layers of {K26_CONFIG.name}", flush=True)
        launch(verify_step_worker, degree, settings, backend="nccl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
