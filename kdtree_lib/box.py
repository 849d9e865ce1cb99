"""The box kit: measure on the box, with the real pair, what the CT200 projection assumes.

Run it with the service stopped (the real pair at TP=8 needs the GPUs' memory). Every rank loads its
shard of the target and the drafter as the decode places it (sharded over the ranks by default, or
replicated: --drafter-placement), then, in this order:

    acceptance  the pair's oracle acceptance vs budget (tree and chain, T = 0) on the committed held-out
                prompts, plus live decodes at a few budgets           -> box_acceptance.csv
                and, from the same oracle records, where a tree's extra tokens come from: per depth the
                drafter's rank-0 nodes against their siblings, at depth_budgets -> box_acceptance_depth.csv
    verify      one verify step of the loaded model vs tree nodes N by component (attention, moe,
                allreduce, rest; bench.tp_step's segments), per batch and context -> box_verify_step.csv
    union       the experts each MoE layer's router picks on held-out text, unions vs N -> box_expert_union.csv
    drafter     the drafter's forward (its placement in every row) and the tree stage (top-k, build, accept + compaction) per
                batch, context and budget (scope "draft" rows)        -> box_verify_step.csv

Each step's wall time goes to box_steps.csv (with the pair's load time, load_seconds). Rows are stamped
(date, commit, device, run) and appended atomically (results.append_rows) to --results-dir after each step.
On the box:

    torchrun --nproc-per-node 8 -m kdtree_lib.box --target /models/Kimi-K2.6 --drafter /models/Kimi-K2.6-DFlash \
        --results-dir runs/box --device cuda
    python -m kdtree_lib.box --target PATH --drafter PATH --tp 2 --device cpu ...   # a dry run over gloo

`python -m kdtree_lib.results merge runs/box/*.csv` brings the rows home; notebook 13 reads them.

At real shapes on one GPU, no checkpoint (--real-shapes LAYERS): the pair is bench.inputs.real_shape_pair,
K2.6's layer shapes cut to LAYERS layers with INT4 experts and the real drafter's shapes, random weights made
on the device (--target/--drafter then name the config files or folders whose shapes it takes; default K2.6's
and the real drafter's in data/configs). The timing steps run (verify, union on random token ids, drafter);
acceptance is skipped, with the reason printed: on random weights it means nothing. Every row says what ran
(real_shape, layers). docs/box-kit.md lists what the operator runs, in order, and how long each part took:

    python -m kdtree_lib.box --real-shapes 4 --device cuda --results-dir runs/box-real-shapes
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import cli, results
from .acceptance import DEPTH_BUDGETS, depth_rows, live_rows, oracle_rows, record_oracle
from .bench.inputs import (random_cache, real_shape_configs, real_shape_name, real_shape_pair, shape_configs,
                           synthetic_tree)
from .bench.timing import Clock
from .bench.tp_step import BenchSettings, time_drafter, time_tree_kernels, time_verify_step
from .corpus import PROMPTS_PATH
from .dflash import DEFAULT_DRAFTER_PLACEMENT, DRAFTER_PLACEMENTS
from .draft_topk import draft_topk
from .model import TensorParallel, launch
from .model.tp import one_cpu_thread
from .routing import routed_experts, union_curve
from .tree_accept import accept
from .tree_build import build_tree

TOPICS = {"acceptance": "box_acceptance", "depth": "box_acceptance_depth", "verify": "box_verify_step",
          "union": "box_expert_union", "drafter": "box_verify_step", "steps": "box_steps"}
STEPS = ("acceptance", "verify", "union", "drafter")
TIMING_STEPS = ("verify", "union", "drafter")  # what a real-shape pair (random weights) can measure
RANDOM_WEIGHTS = "random weights (--real-shapes): acceptance means nothing on them, so it is not measured"


@dataclass(frozen=True)
class KitSettings:
    """What the kit measures and where its rows go (defaults: the box's sizes)."""
    target: str                                # its checkpoint folder; with real_shapes its config (file or folder), "" K2.6's
    drafter: str                               # the drafter's folder; with real_shapes its config, "" the real drafter's
    results_dir: str | None                    # None: data/results/ (results' default)
    real_shapes: int = 0                       # > 0: bench.inputs.real_shape_pair with this many layers, no checkpoint
    tokenizer: str | None = None               # default: the target's folder
    device: str = "cuda"                       # "cuda": rank r on cuda:r (NCCL); "cpu": gloo
    dtype: str = "bfloat16"
    drafter_placement: str = DEFAULT_DRAFTER_PLACEMENT  # as decode_tp.generate_tp places it; or "replicated"
    steps: tuple[str, ...] = STEPS
    budgets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    live_budgets: tuple[int, ...] = (8, 32, 128)
    depth_budgets: tuple[int, ...] = DEPTH_BUDGETS  # budgets whose accepted paths are split (within budgets' top-k)
    prompts_per_package: int = 8
    prompt_tokens: int = 256
    new_tokens: int = 256
    batches: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (4096, 32768)
    nodes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
    union_sequences: int = 16
    union_length: int = 512
    union_windows: int = 48
    repeats: int = 8
    warmup: int = 2
    graphs: bool = True
    progress: bool = True
    run: str = ""                              # stamp shared by the rows of one command


def check_settings(settings: KitSettings, tp: int = 1) -> KitSettings:
    """ValueError naming what is wrong before anything loads: checkpoints (or configs), tokenizer, steps, and
    `tp` ranks for a real-shape pair (one device's: its drafter is replicated)."""
    results.check_writable(settings.results_dir, topics=sorted(set(TOPICS.values())))  # before any step is measured
    unknown = sorted(set(settings.steps) - set(STEPS))
    if unknown or not settings.steps:
        raise ValueError(f"steps: expected some of {STEPS}, got {list(settings.steps)}")
    if settings.real_shapes < 0:
        raise ValueError(f"real_shapes: expected a number of layers >= 1 (0: the checkpoints), got {settings.real_shapes}")
    if settings.real_shapes:
        if tp > 1:
            raise ValueError(f"tp: a real-shape pair is made on one device (its drafter replicated); got {tp} ranks")
        kit_configs(settings)  # the config files exist and parse
        if not set(settings.steps) & set(TIMING_STEPS):
            raise ValueError(f"steps: with real_shapes only {TIMING_STEPS} measure anything ({RANDOM_WEIGHTS}), "
                             f"got {list(settings.steps)}")
    else:
        for name in ("target", "drafter"):
            if not (Path(getattr(settings, name)) / "config.json").is_file():
                raise ValueError(f"{name}: no checkpoint at {getattr(settings, name)} (its config.json is missing)")
        tokenizer = Path(settings.tokenizer or settings.target)
        if not ((tokenizer / "tiktoken.model").is_file() or (tokenizer / "tokenizer.json").is_file()):
            raise ValueError(f"tokenizer: neither tiktoken.model nor tokenizer.json in {tokenizer}")
    if settings.drafter_placement not in DRAFTER_PLACEMENTS:
        raise ValueError(f"drafter_placement: expected one of {DRAFTER_PLACEMENTS}, got {settings.drafter_placement!r}")
    if settings.device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {settings.device!r}")
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' asked but torch sees no GPU")
    return settings


def held_out_prompts(settings: KitSettings) -> dict[str, list[np.ndarray]]:
    """{package: prompts}: the committed held-out documents encoded by the pair's tokenizer, cut to
    prompt_tokens, prompts_per_package of each package."""
    from .tokenizer import load_text_tokenizer
    tokenizer = load_text_tokenizer(settings.tokenizer or settings.target)
    packages: dict[str, list[np.ndarray]] = {}
    for line in Path(PROMPTS_PATH).read_text().splitlines():
        document = json.loads(line)
        chosen = packages.setdefault(document["package"], [])
        if len(chosen) < settings.prompts_per_package:
            chosen.append(np.asarray(tokenizer.encode(document["text"])[:settings.prompt_tokens], np.int64))
    return packages


def union_text(settings: KitSettings, vocab: int) -> np.ndarray:
    """int64 [S, T]: union_sequences held-out documents of at least union_length tokens, cut to it; with
    real_shapes (no tokenizer, random weights) random ids below `vocab`, seeded."""
    if settings.real_shapes:
        return np.random.default_rng(0).integers(0, vocab, (settings.union_sequences, settings.union_length))
    long_enough = [p for prompts in held_out_prompts(replace(settings, prompts_per_package=settings.union_sequences,
                                                             prompt_tokens=settings.union_length)).values()
                   for p in prompts if len(p) == settings.union_length]
    if not long_enough:
        raise ValueError(f"union_length: no held-out document has {settings.union_length} tokens")
    return np.stack(long_enough[:settings.union_sequences])


# ----------------------------------------------------------------------------------------------
# the steps (each rank runs them in lockstep; rank 0 writes the rows)

def measure_acceptance(target, drafter, settings: KitSettings, pair: str, rank: int) -> dict[str, list[dict]]:
    """{topic: rows}: oracle rows (tree and chain) per package and budget and live rows at live_budgets
    (box_acceptance), and from the same records the depth structure at depth_budgets (box_acceptance_depth)."""
    k_max = min(max(settings.budgets), target.config.vocab_size)
    rows, depth = [], []
    show = settings.progress and rank == 0
    for package, prompts in held_out_prompts(settings).items():
        records = record_oracle(target, drafter, prompts, settings.new_tokens, k_max)
        for mode in ("tree", "chain"):
            rows += oracle_rows(records, settings.budgets, package=package, block_size=drafter.config.block_size,
                                mode=mode, n_new_tokens=settings.new_tokens, pair=pair, progress=show)
        depth += depth_rows(records, settings.depth_budgets, package=package, block_size=drafter.config.block_size,
                            pair=pair, n_new_tokens=settings.new_tokens, progress=show)
        rows += live_rows(target, drafter, prompts, settings.live_budgets, package=package,
                          max_new_tokens=settings.new_tokens, pair=pair, progress=show)
    sized = {"prompt_tokens": settings.prompt_tokens, "new_tokens": settings.new_tokens}
    return {TOPICS["acceptance"]: [{**row, **sized} for row in rows], TOPICS["depth"]: [{**row, **sized} for row in depth]}


def measure_verify_step(target, drafter, settings: KitSettings, common: dict) -> list[dict]:
    """bench.tp_step's layer and step rows of the loaded model, per context, batch and N (trees as deep as the
    drafter drafts)."""
    bench, clock = _bench_settings(target, drafter, settings), Clock(target.device)
    graphs = settings.graphs and target.device.type == "cuda"
    rows = []
    for context in settings.contexts:
        for batch in settings.batches:
            cache = random_cache(target, batch, context, context + max(settings.nodes))
            for nodes in _progress(settings.nodes, f"verify B={batch} L={context}", settings):
                tree = synthetic_tree(batch, nodes, depth=bench.draft_depth, vocab=min(bench.draft_vocab,
                                                                                       target.config.vocab_size))
                where = {**common, "batch": batch, "nodes": nodes, "context": context}
                step_rows, _ = time_verify_step(target, cache, tree, bench, clock, where, graphs=graphs)
                rows += step_rows
            del cache
    return rows


def measure_union(target, settings: KitSettings, common: dict) -> list[dict]:
    """routing.union_curve of the real router on held-out text, for each batch the text allows."""
    text = union_text(settings, target.config.vocab_size)
    with torch.no_grad():
        routes = routed_experts(target, text)
    nodes = [n for n in settings.nodes if n <= text.shape[1]]
    return [{**common, **row} for batch in settings.batches if batch <= len(text)
            for row in union_curve(routes, nodes, batch=batch, windows=settings.union_windows)]


def measure_drafter(target, drafter, settings: KitSettings, common: dict) -> list[dict]:
    """Scope "draft" rows: the drafter's forward per (batch, context) and the tree stage per budget
    (the GPU kernels on CUDA; on a CPU the NumPy references, tree_timing "host_reference")."""
    bench, clock = _bench_settings(target, drafter, settings), Clock(target.device)
    on_gpu = target.device.type == "cuda"
    rows = []
    for context in settings.contexts:
        for batch in settings.batches:
            forward = time_drafter(drafter, batch, context, bench, clock, graph=on_gpu and settings.graphs)
            # the compaction moves only the accepted nodes: a short cache times it as a long one would
            cache = random_cache(target, batch, 1, 1 + max(settings.nodes)) if on_gpu else None
            for nodes in [n for n in settings.nodes if n > 1]:
                stage = (time_tree_kernels(cache, batch, nodes, bench, target.config.vocab_size) if on_gpu else
                         host_tree_stage(batch, nodes - 1, depth=bench.draft_depth,
                                         vocab=min(bench.draft_vocab, target.config.vocab_size)))
                rows.append({**common, "scope": "draft", "batch": batch, "nodes": nodes, "context": context,
                             **forward, **stage})
    return rows


def host_tree_stage(batch: int, budget: int, *, depth: int, vocab: int, repeats: int = 3) -> dict:
    """Median host seconds of the NumPy reference tree stage (top-k, build, accept): the CPU dry run's
    stand-in for time_tree_kernels, labelled tree_timing "host_reference" so no one reads it as the GPU's."""
    logits = np.random.default_rng(0).standard_normal((batch, depth, vocab)).astype(np.float32) * 3
    times = {"draft_topk": [], "tree_build": [], "accept_compact": []}
    for _ in range(repeats):
        begin = time.perf_counter()
        draft = draft_topk(logits, min(budget, vocab), backend="numpy")
        built = time.perf_counter()
        tree = build_tree(draft, budget, backend="numpy")
        walked = time.perf_counter()
        accept(tree, tree.tokens, backend="numpy")
        times["draft_topk"].append(built - begin)
        times["tree_build"].append(walked - built)
        times["accept_compact"].append(time.perf_counter() - walked)
    return {**{f"{name}_seconds": float(np.median(v)) for name, v in times.items()}, "tree_timing": "host_reference"}


def _bench_settings(target, drafter, settings: KitSettings) -> BenchSettings:
    """bench.tp_step's settings for the loaded pair: its layers, and drafts as deep as its drafter's (the
    sweep's default depth is another drafter's)."""
    return BenchSettings(config=target.config, layers=target.config.num_hidden_layers, repeats=settings.repeats,
                         warmup=settings.warmup, graphs=settings.graphs, topic=None, run=settings.run,
                         draft_depth=drafter.config.draft_depth)


def _progress(items, description: str, settings: KitSettings):
    from tqdm.auto import tqdm
    # disabled only when asked: an explicit disable=False would override the headless TQDM_DISABLE (notebooks.py)
    return tqdm(list(items), desc=description, file=sys.stderr, leave=False,
                **({} if settings.progress else {"disable": True}))


# ----------------------------------------------------------------------------------------------
# one rank's run, and the command

def kit_rank(tp: TensorParallel, settings: KitSettings) -> dict[str, int]:
    """Load this rank's shard and the drafter (or make the real-shape pair), run the steps in order; rank 0
    appends each step's rows as it ends. Returns {topic: rows written}."""
    on_gpu = settings.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = getattr(torch, settings.dtype)
    if on_gpu:  # refuse before loading what would not fit (the decode's memory plan at the kit's largest sizes)
        memory = memory_plan(settings, tp.size, gpu_bytes=torch.cuda.mem_get_info(device)[0])
        if tp.rank == 0:
            print(memory.table(), flush=True)
        memory.check()
    begin = time.perf_counter()
    target, drafter, pair = load_kit_pair(tp, settings, device, dtype)
    load_seconds = time.perf_counter() - begin  # kept on every box_steps row: what the operator waits before step 1
    if tp.rank == 0:
        print(f"pair {pair}: {'made' if settings.real_shapes else 'loaded'} in {load_seconds:.1f} s", flush=True)
    common = {"run": settings.run, "pair": pair, "tp": tp.size, "gpus": tp.size if on_gpu else 0,
              "drafter_placement": settings.drafter_placement, "real_shape": bool(settings.real_shapes),
              "layers": target.config.num_hidden_layers, "dtype": settings.dtype, "expert_bits": _expert_bits(target),
              **(_ceilings() if on_gpu else {})}
    written: dict[str, int] = {}
    for step in settings.steps:
        begin = time.perf_counter()
        skipped = RANDOM_WEIGHTS if settings.real_shapes and step not in TIMING_STEPS else ""
        with torch.no_grad():
            if skipped:
                measured = {}
            elif step == "acceptance":
                measured = {topic: [{"run": settings.run, "tp": tp.size, **row} for row in rows]
                            for topic, rows in measure_acceptance(target, drafter, settings, pair, tp.rank).items()}
            elif step == "verify":
                measured = {TOPICS[step]: measure_verify_step(target, drafter, settings, common)}
            elif step == "union":
                measured = {TOPICS[step]: measure_union(target, settings, common)}
            else:
                measured = {TOPICS[step]: measure_drafter(target, drafter, settings, common)}
        seconds = time.perf_counter() - begin
        if tp.rank == 0:
            paths = [results.append_rows(topic, rows, results_dir=settings.results_dir)
                     for topic, rows in measured.items() if rows]
            count = sum(len(rows) for rows in measured.values())
            results.append_rows(TOPICS["steps"], [{"run": settings.run, "pair": pair, "tp": tp.size, "step": step,
                                                   "real_shape": bool(settings.real_shapes),
                                                   "layers": target.config.num_hidden_layers, "rows": count,
                                                   "wall_seconds": seconds, "load_seconds": load_seconds,
                                                   "skipped": skipped,
                                                   "settings": json.dumps(asdict(settings))}],
                                results_dir=settings.results_dir)
            print(f"{step}: skipped: {skipped}" if skipped else
                  f"{step}: {count} rows in {seconds:.1f} s -> {', '.join(map(str, paths))}", flush=True)
        for topic, rows in measured.items():
            written[topic] = written.get(topic, 0) + len(rows)
    if tp.rank == 0:  # what docs/box-kit.md's timing table takes, as it reads there
        runs = [r for r in results.read_rows(TOPICS["steps"], results_dir=settings.results_dir) if r["run"] == settings.run]
        print("\n".join(steps_table(runs)), flush=True)
    return written


def steps_table(rows: list[dict]) -> list[str]:
    """Markdown lines of one run's box_steps rows: the pair's load, then each step's rows and wall seconds (or why
    it was skipped), and the total."""
    if not rows:
        raise ValueError("rows: expected the box_steps rows of one run")
    first = rows[0]
    load = float(first.get("load_seconds") or 0.0)
    lines = [f"kit run {first['run']}, pair {first['pair']}, TP={first['tp']}, {first['device']}, commit {first['commit']}:",
             "", "| part | rows | seconds |", "|---|---|---|",
             f"| {'make' if results.matches(first.get('real_shape'), True) else 'load'} the pair | | {load:.1f} |"]
    for row in rows:
        lines.append(f"| {row['step']} | {row['rows']} | "
                     + (f"skipped: {row['skipped']} |" if row.get("skipped") else f"{float(row['wall_seconds']):.1f} |"))
    total = load + sum(float(r["wall_seconds"]) for r in rows)
    return lines + [f"| total | | {total:.1f} |"]


def load_kit_pair(tp: TensorParallel, settings: KitSettings, device: torch.device, dtype: torch.dtype):
    """(target, drafter, the rows' pair name): this rank's shard of the checkpoints by path, or with real_shapes
    bench.inputs.real_shape_pair at kit_configs' shapes (random weights made on the device, nothing read)."""
    if settings.real_shapes:
        config, drafter_config = kit_configs(settings)
        target, drafter = real_shape_pair(settings.real_shapes, device=device, dtype=dtype, tp=tp, config=config,
                                          drafter_config=drafter_config)
        return target, drafter, real_shape_name(settings.real_shapes, settings.target, settings.drafter)
    from .dflash import load_drafter
    from .model import load_target
    target = load_target(settings.target, device=device, dtype=dtype, tp_group=tp.group)
    drafter = load_drafter(settings.drafter, target, placement=settings.drafter_placement)
    return target, drafter, f"{Path(settings.target).name}+{Path(settings.drafter).name}"


def kit_configs(settings: KitSettings):
    """(target config, drafter config) of what the kit loads: the checkpoints' own, or with real_shapes the
    configs named by target/drafter (files or folders; "" K2.6's and the real drafter's) cut to real_shapes layers."""
    if settings.real_shapes:
        return real_shape_configs(settings.real_shapes, *shape_configs(settings.target or None, settings.drafter or None))
    from .dflash import DFlashConfig
    from .model import load_config
    return load_config(settings.target), DFlashConfig.load(settings.drafter)


def memory_plan(settings: KitSettings, tp: int, *, gpu_bytes: int):
    """memory.plan for the kit's largest batch, context + tree and budget, with its drafter placement."""
    from .memory import plan
    context = max(settings.contexts) + max(settings.nodes)
    if "acceptance" in settings.steps and not settings.real_shapes:
        context = max(context, settings.prompt_tokens + settings.new_tokens)
    config, drafter_config = kit_configs(settings)
    return plan(config, tp, max(settings.batches), context, max(max(settings.budgets), max(settings.nodes) - 1),
                drafter_config, drafter_placement=settings.drafter_placement, gpu_bytes=gpu_bytes)


def _expert_bits(target) -> float:
    """Bits per routed-expert weight as loaded: 4.5 when INT4-resident, else the dtype's."""
    int4 = any(getattr(getattr(block.mlp, "experts", None), "int4", False) for block in target.layers)
    return 4.5 if int4 else torch.finfo(target.embed_tokens.weight.dtype).bits


def _ceilings() -> dict:
    from .bench.ceilings import measure_ceilings
    measured = measure_ceilings()
    return {"copy_bandwidth": measured["copy_tbps"] * 1e12, "matmul_flops": measured["matmul_tflops"] * 1e12}


def run_kit(settings: KitSettings, tp: int = 1) -> dict[str, int]:
    """The kit on `tp` ranks (in this process for one; spawned, gloo on CPUs or NCCL, for more)."""
    settings = check_settings(replace(settings, run=settings.run or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                              tp)
    if tp == 1:
        if settings.device == "cpu":
            with one_cpu_thread():
                return kit_rank(TensorParallel(), settings)
        return kit_rank(TensorParallel(), settings)
    return launch(kit_rank, tp, settings, backend="nccl" if settings.device == "cuda" else "gloo")


@cli.command
def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.box", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = KitSettings(target="", drafter="", results_dir="")
    parser.add_argument("--target", default=None,
                        help="the target's checkpoint folder; with --real-shapes its config (default: K2.6's)")
    parser.add_argument("--drafter", default=None,
                        help="the DFlash drafter's folder; with --real-shapes its config (default: the real drafter's)")
    parser.add_argument("--real-shapes", type=cli.positive_int, default=0, metavar="LAYERS",
                        help="no checkpoint: bench.inputs.real_shape_pair with LAYERS layers made on the device "
                             "(random weights; the timing steps run, acceptance is skipped)")
    parser.add_argument("--results-dir", required=True, type=Path, help="where the rows go (e.g. runs/box)")
    parser.add_argument("--tokenizer", default=None, help="default: --target")
    parser.add_argument("--tp", type=cli.positive_int, default=1, help="ranks to spawn (under torchrun: the world)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=defaults.device)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--drafter-placement", choices=DRAFTER_PLACEMENTS, default=defaults.drafter_placement)
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    for name in ("budgets", "live_budgets", "depth_budgets", "batches", "contexts", "nodes"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=cli.positive_int, nargs="+",
                            default=list(getattr(defaults, name)))
    for name in ("prompts_per_package", "prompt_tokens", "new_tokens", "union_sequences", "union_length",
                 "union_windows", "repeats", "warmup"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=cli.nonnegative_int if name == "warmup" else cli.positive_int,
                            default=getattr(defaults, name))
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not args.real_shapes and (args.target is None or args.drafter is None):
        parser.error("--target and --drafter are required (or --real-shapes LAYERS: no checkpoint)")
    args.target, args.drafter = args.target or "", args.drafter or ""
    values = {k: v for k, v in vars(args).items() if k not in ("tp", "no_graphs", "no_progress")}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    values["dtype"] = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    settings = KitSettings(**{**values, "results_dir": str(args.results_dir)}, graphs=not args.no_graphs,
                           progress=not args.no_progress)
    if "LOCAL_RANK" in os.environ:  # under torchrun: this process is one rank of WORLD
        import torch.distributed as dist
        settings = check_settings(replace(settings, run=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                                  int(os.environ.get("WORLD_SIZE", "1")))
        if settings.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if settings.device == "cuda" else "gloo")
        try:
            kit_rank(TensorParallel.from_group(dist.group.WORLD), settings)
        finally:
            dist.destroy_process_group()
    else:
        run_kit(settings, tp=args.tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
