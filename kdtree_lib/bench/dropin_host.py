"""A CPU proxy of the SGLang drop-in's host cost: what one warm call pair (build_ddtree_tree, then
build_eagle_tree_format on its parents and sizes) costs the worker's Python, measured without a GPU.

What runs: the drop-in's module source (this checkout's, or another commit's with --rev) loaded as a
separate module whose CUDA device-type tests say "cpu" where they say "cuda", so CPU tensors take the
GPU path; CuPy's driver calls stubbed (kdtree_lib.cuda: no compile, the CUfunction bind, the current
context, cuLaunchKernel, the stream read), so every launch packs and hands over its parameters as on a
GPU and the driver returns at once. The checks, the prepared-call lookup, the knob reads, the parameter
writes and the torch allocations (torch's CPU allocator standing in for the CUDA caching allocator)
are the real code. It is a proxy: the driver's own launch cost (a few microseconds per launch on a
GPU host) is not in it, and this host's speed is not the GPU host's; compare revisions on one host.

    python -m kdtree_lib.bench.dropin_host [--rev REV] [--budgets 8,32,128] [--batch 1] [--out-buffers]

(--rev loads that revision's drop-in module over this checkout's other modules; to measure a whole older
revision, run this file from an export of it, as docs/kernel-notes.md's before figures were.)
"""
from __future__ import annotations

import contextlib
import importlib.util
import statistics
import subprocess
import sys
import timeit
import types
from pathlib import Path

from .. import cli, cuda, draft_topk

MODULE_PATH = "kdtree_lib/integrations/sglang.py"
VOCAB = 163_840
DEPTH = 7


_BY_PARAMS: dict[int, cuda.PreparedLaunch] = {}  # kernelParams address -> its launch (for a recording stub)


class _ProxyLaunch(cuda.PreparedLaunch):
    """A PreparedLaunch on a CPU tensor's device (index None: device 0), findable by its parameters."""

    __slots__ = ()

    def __init__(self, function, grid, block, args, *, device, **options):
        super().__init__(function, grid, block, args, device=device or 0, **options)
        _BY_PARAMS[self.params.address] = self


def _launch_kernel(ptr, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra):
    """cuLaunchKernel stubbed: its arguments are packed and handed over; nothing is enqueued."""


def _recording(record: list):
    """A cuLaunchKernel stub appending (kernel name, [each parameter slot as an int]) to `record`."""
    def launch_kernel(ptr, gx, gy, gz, bx, by, bz, shared_mem, stream, params, extra):
        launch = _BY_PARAMS[params]
        record.append((launch.name, [int(value) for value in launch.params.slots[:len(launch.params)]]))
    return launch_kernel


def _device_index(x) -> int:
    return int(x.device.index or 0) if cuda.framework(x) == "torch" else int(x.device.id)


@contextlib.contextmanager
def stubbed_driver(record: list | None = None):
    """kdtree_lib.cuda's driver calls and CuPy-only helpers stubbed (restored on exit); with `record`,
    every launch appends its kernel's name and parameter slots to it (tests)."""
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    patches = [(cuda, "_bind", lambda function, device, shared_mem, name: (function, 0xF00, 7)),
               (cuda, "_current_context", lambda: 7),
               (cuda, "_launch_kernel", _launch_kernel if record is None else _recording(record)),
               (cuda, "stream_pointer", lambda device: 0x5000), (cuda, "PreparedLaunch", _ProxyLaunch),
               (cuda, "device_function",
                lambda file_name, kernel_name, device: types.SimpleNamespace(name=kernel_name)),
               (cuda, "device_index", _device_index), (draft_topk, "_multiprocessors", lambda device: 132),
               (draft_topk, "_backend", types.SimpleNamespace(resolve=lambda backend, *args, **kw: backend))]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    saved_cupy = sys.modules.get("cupy")
    sys.modules["cupy"] = fake_cupy
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _BY_PARAMS.clear()
        if saved_cupy is None:
            sys.modules.pop("cupy", None)
        else:
            sys.modules["cupy"] = saved_cupy


def module_source(rev: str | None) -> str:
    """The drop-in's source: this checkout's file, or `git show REV:kdtree_lib/integrations/sglang.py`."""
    root = Path(__file__).resolve().parents[2]
    if rev is None:
        return (root / MODULE_PATH).read_text()
    done = subprocess.run(["git", "show", f"{rev}:{MODULE_PATH}"], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"--rev: git show {rev}:{MODULE_PATH} failed: {done.stderr.strip()}")
    return done.stdout


def proxy_module(source: str):
    """The drop-in's source as a module whose CUDA device-type tests take CPU tensors."""
    spec = importlib.util.spec_from_loader("kdtree_lib.integrations._dropin_host_proxy", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "kdtree_lib.integrations"
    exec(compile(source.replace('"cuda"', '"cpu"'), MODULE_PATH, "exec"), module.__dict__)
    return module


def call_pair_seconds(module, batch: int, budget: int, *, out_buffers: bool, number: int = 200,
                      repeat: int = 50) -> float:
    """Seconds of one warm call pair, after one cold pair: the least over `repeat` timeit runs of `number`
    pairs (the least: a loaded host only ever adds time)."""
    import torch
    logits = torch.randn(batch, DEPTH, VOCAB)
    device = logits.device
    nodes = budget + 1
    buffers = ((torch.zeros(2 * batch, budget, dtype=torch.long), torch.zeros(2 * batch, budget, dtype=torch.long),
                torch.zeros(2 * batch, nodes, dtype=torch.long), torch.zeros(2 * batch, nodes, nodes, dtype=torch.bool))
               if out_buffers else ())

    def pair():
        tree = module.build_ddtree_tree(logits, budget, device, *buffers)
        return module.build_eagle_tree_format(tree[2], tree[5], nodes, device)

    pair()
    return min(timeit.repeat(pair, number=number, repeat=repeat)) / number


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(cli.positive_int(part) for part in text.split(","))


@cli.command
def main(argv=None) -> int:
    # no --results-dir: a CPU proxy writes no rows beside the GPU's (the notes quote its printout)
    parser = cli.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default=None, help="measure this git revision's kdtree_lib/integrations/sglang.py, "
                        "with this checkout's other modules (default: the checkout's)")
    parser.add_argument("--budgets", type=_int_list, default=(8, 32, 128))
    parser.add_argument("--batch", type=cli.positive_int, default=1)
    parser.add_argument("--out-buffers", action="store_true", help="pass the four _out_* buffers, as the worker does")
    parser.add_argument("--number", type=cli.positive_int, default=200, help="call pairs per timeit repeat")
    args = parser.parse_args(argv)
    with stubbed_driver():
        module = proxy_module(module_source(args.rev))
        for budget in args.budgets:
            seconds = call_pair_seconds(module, args.batch, budget, out_buffers=args.out_buffers, number=args.number)
            outputs = "_out_* buffers" if args.out_buffers else "fresh outputs"
            print(f"CPU proxy, {args.rev or 'checkout'}: B={args.batch} D={DEPTH} budget={budget:4d} {outputs}: "
                  f"{seconds * 1e6:7.2f} us per warm call pair", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
