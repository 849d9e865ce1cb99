"""A drop-in for SGLang's DDTree tree build (sgl-project/sglang, python/sglang/srt/speculative/ddtree_utils.py).

Entry points, each with its SGLang original's arguments and outputs (same dtypes, shapes, node order,
left-child/right-sibling arrays), element for element:
- `build_ddtree_tree` and `build_eagle_tree_format`: SGLang main's, under its defaults and its
  environment knobs (SGLANG_DDTREE_MAX_TOPK, SGLANG_DDTREE_DEPTH_BONUS; the defaults 6 and 0.2 are
  those its source documents): the "sglang" policy (tree_build.SGLangPolicy);
- `build_ddtree_tree_from_topk` (one request's [D, K] top-k log-probabilities and ids, and the budget)
  and `pr29907_build_ddtree_tree` ([D, V] logits, budget): SGLang PR #29907's, the paper's heap in pop
  order; `build_ddtree_tree_from_topk_batched` is its batched form on the GPU (padded tensors).

On a CUDA device main's build_ddtree_tree runs: the draft top-k, then one kernel (tree_build.SGLangBuildLaunch) that
builds the policy's tree and writes SGLang's tensors (and the EAGLE arrays) on the GPU. The top-k is
draft_topk's fused multi-CTA kernel ("fused_v3": one launch, one read of the logits, log-softmax fused) where it
applies (the width at most FAST_MAX_K = 128 and B * L rows on its grid; logits of another floating
dtype, non-contiguous or misaligned, are first made float32 as SGLang's own `.float()` does), else
torch's exact formula (draft_topk.torch_topk_logprobs, SGLang's own ops). KDTREE_SGLANG_TOPK=exact
selects the exact formula always (SGLang's log-probabilities to the bit). What the fused path changes:
the ids and their order are the same (ties in the logits by ascending id; torch's order among exactly
equal logits is its own), the log-probabilities within a few ulps of torch's (its own float32 sum for
the normaliser; <= 1.9e-6 on Kimi's vocabulary), nearly one constant shift per draft position. None of
SGLang's outputs carries a log-probability (tokens, depths, parents, child maps, visibility, sizes,
EAGLE arrays), so a tree can differ only where the policy compares two numbers within a few ulps of
each other: two candidates' weights (at different depths, or exactly tied logits), or a weight and the
early-stop threshold; and of those only the comparisons that decide which nodes are taken (the last
node taken against the first left out, a candidate against the threshold): the order in which two
taken nodes pop changes nothing (each node's pushes are its own, and the breadth-first relabel orders
a parent's children by rank, which is their pop order). tests/test_integration_sglang.py counts such
differences on peaked, Zipf-like and drafter-like logits.

Per call: each call key (the logits' type, shape, dtype and device, the budget, the device argument, and
the knobs' raw text, read from os.environ's own table) gets a PreparedCall the first time its checks
pass; a later call with that key skips them (nothing they read can differ) and costs the key, the
allocation of what it returns fresh (one torch.empty per output shape: the four [B, N] int64 outputs
share one), its parameter writes (raw addresses; the logits' slot only when the address moved) and two
launches (fused top-k, build). What it returns is the caller's to keep: no later call writes into it;
the caller's _out_* buffers are written in place, as SGLang's are (SGLang's worker passes all four, so
its call allocates only the sizes and the EAGLE arrays; a PreparedCall holds the last four it was
handed, with their rows' views, so the same buffers next step cost no slicing). The shape's launches
(`prepared_build`: the fused top-k and its buffers, the build, the outputs' layout) are shared by its
keys. The fused top-k's log-probabilities and ids live in the prepared launch's buffers, rewritten by
the next call of that shape (calls of one shape are ordered on torch's current stream); it keeps no
reference to any call's logits (a worker prepares a shape per batch size: each holding a logits tensor
would hold gigabytes). The per-request child maps are built on the host only when a caller reads them.
Nothing on this path reads a device value, except the value check below; it is capturable in a CUDA
graph (the check is skipped while capturing).

KDTREE_SGLANG_GRAPH=1 (opt-in): the call copies its logits into a static float32 buffer and replays
one CUDA graph of the top-k and the build (captured on a side stream at the shape's first such call,
which synchronises once), then copies the outputs into its own (fresh, or the caller's buffers), so
it returns what the eager call returns. Bounded: static logits at most GRAPH_LOGITS_BYTES (a larger
batch runs eagerly), at most GRAPH_LIMIT graphs (the least recently used dropped). Inside a caller's
own capture the launches run eagerly (into that capture).

Checks, before any launch and without reading device values: the arguments' types, dtypes, shapes, devices,
the budget (1..1024) and depth (1..32), and the knobs (SGLANG_DDTREE_MAX_TOPK an integer >= 1,
SGLANG_DDTREE_DEPTH_BONUS a finite number, KDTREE_SGLANG_CHECK_VALUES 0 or 1, KDTREE_SGLANG_TOPK fused or
exact, KDTREE_SGLANG_GRAPH 0 or 1): a ValueError naming the argument or knob. Values: NaN or +inf logits, or a
row entirely -inf, make NaN log-probabilities on both top-k paths (torch's formula by arithmetic; the fused
kernel flags the row on the device and writes it as NaN). The build kernel flags such a request and builds its
root alone: by default (KDTREE_SGLANG_CHECK_VALUES=0) nothing is read back, so the worker's step keeps no host
synchronisation, and a flagged request gets a root-only tree (no speculation for it; verification still
commits the target's own token, so the output stays exact). With KDTREE_SGLANG_CHECK_VALUES=1 the call reads
that flag after the launches (one host synchronisation) and raises a ValueError naming draft_logits: for
debugging a worker, not for serving. On the CPU the build is kdtree's host reference (tree_build.build_tree,
policy "sglang") on torch's exact top-k, values checked first.

`install()` patches SGLang's module (and every loaded module that imported these functions by name);
`python -m kdtree_lib.integrations.sglang install|uninstall|status --site-packages DIR` makes every
process of an environment patch it (a .pth file), `launch ARGS` starts SGLang's server with the patch
in every worker process (README: "The SGLang drop-in on the box").
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import runpy
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import cli
from ..checks import check_positive_int
from ..contracts import MAX_BUDGET, MAX_DEPTH, MAX_TOPK, DraftTopK, unpack_mask
from ..draft_topk import FAST_MAX_K, LOGIT_DTYPES, MAX_GRID_Y, prepare_draft_topk, torch_topk_logprobs
from ..tree_build import (PaperPolicy, SGLangBuildLaunch, EagleFormatLaunch, SGLangPolicy, best_first_pops,
                          build_tree)

SGLANG_MODULE = "sglang.srt.speculative.ddtree_utils"
MAIN_NAMES = ("build_ddtree_tree", "build_eagle_tree_format")  # SGLang main's ddtree_utils
PR_NAMES = ("build_ddtree_tree", "build_ddtree_tree_from_topk")  # PR #29907's ddtree_utils
INSTALL_ENV = "KDTREE_SGLANG_PATCH"  # "1": every process importing this module patches SGLang's build
CHECK_ENV = "KDTREE_SGLANG_CHECK_VALUES"
TOPK_ENV = "KDTREE_SGLANG_TOPK"  # "fused" (default): draft_topk's fused kernel; "exact": torch's formula, SGLang's bits
TOPK_CHOICES = ("fused", "exact")
GRAPH_ENV = "KDTREE_SGLANG_GRAPH"  # "1": one CUDA graph of top-k + build per shape, replayed (logits copied in)
GRAPH_LOGITS_BYTES = 64 << 20  # a graphed shape's static float32 logits at most this; a larger batch runs eagerly
GRAPH_LIMIT = 8  # graphs kept (the least recently used is dropped)
DEFAULT_MAX_TOPK = 6
DEFAULT_DEPTH_BONUS = 0.2
PREPARED_LIMIT = 64  # prepared shapes kept (a worker sees a handful: its batch sizes x one budget)


KNOBS = ("SGLANG_DDTREE_MAX_TOPK", "SGLANG_DDTREE_DEPTH_BONUS", CHECK_ENV, TOPK_ENV, GRAPH_ENV)

# The knobs are read per call (SGLang reads its own per call), straight from os.environ's own table
# (bytes on POSIX): os.environ.get encodes the key and decodes the value, 1.1-1.7 us a knob on a 2-core
# CPU host, five knobs a call. The raw values key the prepared calls; _knobs_from parses each text once.
_ENVIRON = getattr(os.environ, "_data", None)
if isinstance(_ENVIRON, dict):
    _KNOB_KEYS = tuple(os.environ.encodekey(name) for name in KNOBS)
    _knob_value = os.environ.decodevalue
else:  # another Python's os.environ: its public mapping
    _ENVIRON, _KNOB_KEYS, _knob_value = os.environ, KNOBS, str


def knob_text() -> tuple:
    """The knobs' raw values now, in KNOBS order (None where unset): what a prepared call is keyed on."""
    return tuple(map(_ENVIRON.get, _KNOB_KEYS))


class Knobs(NamedTuple):
    """What the knobs' text means (_knobs_from)."""
    policy: SGLangPolicy
    check_values: bool  # KDTREE_SGLANG_CHECK_VALUES=1: read the bad-row flags back (one synchronisation)
    topk: str           # KDTREE_SGLANG_TOPK: "fused" or "exact"
    graph: bool         # KDTREE_SGLANG_GRAPH=1: replay one CUDA graph per shape (logits copied in)


@functools.lru_cache(maxsize=64)
def _knobs_from(text: tuple) -> Knobs:
    """The knobs' raw values -> their meaning, parsed once per text (a refusal raises, naming the knob,
    and is not cached)."""
    raw = dict(zip(KNOBS, (None if value is None else _knob_value(value) for value in text)))
    topk, bonus = raw["SGLANG_DDTREE_MAX_TOPK"], raw["SGLANG_DDTREE_DEPTH_BONUS"]
    policy = _policy_from(str(DEFAULT_MAX_TOPK) if topk is None else topk,
                          str(DEFAULT_DEPTH_BONUS) if bonus is None else bonus)
    choices = {CHECK_ENV: ("0", "1"), TOPK_ENV: TOPK_CHOICES, GRAPH_ENV: ("0", "1")}
    defaults = {CHECK_ENV: "0", TOPK_ENV: "fused", GRAPH_ENV: "0"}
    values = {}
    for name, allowed in choices.items():
        value = defaults[name] if raw[name] is None else raw[name]
        if value not in allowed:
            raise ValueError(f"{name}: expected {' or '.join(allowed)}, got {value!r}")
        values[name] = value
    return Knobs(policy, values[CHECK_ENV] == "1", values[TOPK_ENV], values[GRAPH_ENV] == "1")


def knobs_from_environment() -> Knobs:
    """Every knob now, checked (a ValueError naming the first unusable one)."""
    return _knobs_from(knob_text())


def policy_from_environment() -> SGLangPolicy:
    """SGLang's policy with its environment knobs applied, as its build reads them per call; a knob
    SGLang could not use (not an integer >= 1, not a finite number) is refused by name."""
    text = knob_text()
    return _knobs_from((text[0], text[1]) + (None,) * (len(KNOBS) - 2)).policy


def _policy_from(raw_topk: str, raw_bonus: str) -> SGLangPolicy:
    """The two policy knobs' text -> the policy."""
    try:
        max_topk = int(raw_topk)
    except ValueError:
        max_topk = 0
    if max_topk < 1:
        raise ValueError(f"SGLANG_DDTREE_MAX_TOPK: expected an integer >= 1, got {raw_topk!r}")
    try:
        depth_bonus = float(raw_bonus)
    except ValueError:
        depth_bonus = math.nan
    if not math.isfinite(depth_bonus):
        raise ValueError(f"SGLANG_DDTREE_DEPTH_BONUS: expected a finite number, got {raw_bonus!r}")
    # widths are at most budget // D + 1 <= MAX_BUDGET + 1 and ranks >= budget never pop: the cap changes nothing
    return SGLangPolicy(max_topk=min(max_topk, MAX_TOPK), depth_bonus=depth_bonus)


def check_values_from_environment() -> bool:
    return knobs_from_environment().check_values


class ChildMaps(Sequence):
    """Per-request child maps, built on first read from the tree tensors (copied to the host then):
    SGLang main's {node: {token: child}} for every node, or PR #29907's [ {token: child} ] by node
    (as_list). node_tokens [B, budget] (node j + 1's token), parents [B, N], sizes [B]."""

    def __init__(self, node_tokens, parents, sizes, *, as_list: bool = False):
        self._tensors = (node_tokens, parents, sizes)
        self._host = None
        self._as_list = as_list
        self._maps: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self._tensors[2].shape[0])

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        b = range(len(self))[b]
        if b not in self._maps:
            if self._host is None:
                self._host = tuple(np.asarray(t.cpu()) if hasattr(t, "cpu") else np.asarray(t) for t in self._tensors)
            tokens, parents, sizes = self._host
            n = int(sizes[b])
            maps = [{} for _ in range(n)] if self._as_list else {node: {} for node in range(n)}
            for node in range(1, n):
                maps[int(parents[b, node])][int(tokens[b, node - 1])] = node
            self._maps[b] = maps
        return self._maps[b]


# ----------------------------------------------------------------------------------------------
# argument checks (metadata only: no device value is read)

def _check_tensor(name: str, x, *, ndim: int, dtypes: tuple[str, ...]):
    import torch
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    dtype = _dtype_name(x.dtype)
    if dtype not in dtypes:
        raise ValueError(f"{name}: expected dtype {' or '.join(dtypes)}, got {dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    """torch.float32 -> "float32", once per dtype."""
    return str(dtype).removeprefix("torch.")


def _check_depth(name: str, depth: int) -> None:
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"{name}: depth (draft positions) must be in 1..{MAX_DEPTH}, got {depth}")


def _check_budget(name: str, budget) -> int:
    budget = check_positive_int(name, budget)
    if budget > MAX_BUDGET:
        raise ValueError(f"{name}: at most {MAX_BUDGET} nodes, got {budget}")
    return budget


def _torch_device(device):
    import torch
    if isinstance(device, torch.device):
        return device
    try:
        return _parsed_device(device)
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"device: expected a torch device, got {device!r}") from error


@functools.lru_cache(maxsize=64)
def _parsed_device(device):
    """torch.device(device) for a name or an index, made once per value (a worker passes the same one
    every call)."""
    import torch
    return torch.device(device)


def _same_device(tensor, device) -> bool:
    return tensor.device.type == device.type and (device.index is None or device.index == tensor.device.index)


INTEGER_DTYPES = ("int64", "int32")


# ----------------------------------------------------------------------------------------------
# SGLang main: build_ddtree_tree, build_eagle_tree_format

class PreparedBuild:
    """build_ddtree_tree's launches for one shape on one CUDA device: the top-k width, the top-k (the
    fused kernel where it applies, else torch's exact formula), the build kernel (SGLangBuildLaunch),
    and the layout of the outputs a call allocates. Made on a call's logits (the fused launch is
    prepared over them, then runs over each call's own through TopKLaunch.launch_at, which keeps
    none of them)."""

    def __init__(self, draft_logits, budget: int, policy: SGLangPolicy, choice: str):
        import torch
        batch, depth, vocab = (int(n) for n in draft_logits.shape)
        self.batch, self.budget = batch, budget
        self.topk = topk_width(policy, budget, depth, vocab)
        self.fused = None
        # the fused v3 kernel: k <= FAST_MAX_K and rows on its grid (v1, above, flags no bad rows)
        if choice == "fused" and self.topk <= FAST_MAX_K and batch * depth <= MAX_GRID_Y:
            self.fused = prepare_draft_topk(self._float32(draft_logits, 16), self.topk, backend="cupy")
            if self.fused.path != "fused_v3":
                self.fused = None
        self.topk_path = self.fused.path if self.fused is not None else "exact"
        self.float32 = draft_logits.dtype == torch.float32
        if self.fused is not None:  # the fused top-k's own outputs: the build's draft, every call
            self._fused_out = (self.fused.out.logp.data_ptr(), self.fused.out.ids.data_ptr())
        # links and index: the EAGLE arrays of build_eagle_tree_format(parents, sizes, budget + 1), handed
        # over without a launch when the caller passes this call's parents and sizes back unchanged
        self.launch = SGLangBuildLaunch(batch, depth, self.topk, budget, draft_logits.device.index, policy=policy,
                                        ids_int64=self.fused is None, links=True, index=True)
        self.bad = torch.empty(batch, dtype=torch.int32, device=draft_logits.device)  # read only by the value check
        self.device = draft_logits.device
        self.shape = tuple(draft_logits.shape)
        nodes = budget + 1
        # every output in SGLANG_OUTPUTS order but `bad` (prepared): the first four are also the caller's
        # _out_* buffers (OUT_NAMES), then the sizes and the EAGLE arrays
        self.layout = {"node_tokens": ((batch, budget), torch.int64), "node_depths": ((batch, budget), torch.int64),
                       "parents": ((batch, nodes), torch.int64), "visibility": ((batch, nodes, nodes), torch.bool),
                       "sizes": ((batch,), torch.int64), "next_token": ((batch, nodes), torch.int64),
                       "next_sibling": ((batch, nodes), torch.int64), "retrive_index": ((batch, nodes), torch.int64)}
        self._plans: dict[tuple, tuple] = {}
        self.graph = None  # a GraphReplay once KDTREE_SGLANG_GRAPH=1 has run this shape (None: not captured)

    @staticmethod
    def _float32(draft_logits, alignment: int):
        """The logits as the fused kernel reads them: float32 (SGLang's own `.float()`), C-contiguous,
        aligned; the caller's tensor itself when it is (the worker's draft logits are float32: no
        conversion is called then)."""
        import torch
        x = draft_logits
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        return x.clone() if x.data_ptr() % alignment else x

    def draft(self, draft_logits):
        """The top-k log-probabilities and ids [B, D, topk] (fused: the launch's buffers, rewritten by
        the next call of this shape; ids int32 there, int64 from torch)."""
        if self.fused is None:
            return torch_topk_logprobs(draft_logits, self.topk)
        out = self.fused.launch_at(self._float32(draft_logits, self.fused.alignment).data_ptr())
        return out.logp, out.ids

    def outputs(self, given: tuple) -> list:
        """The build's outputs in SGLANG_OUTPUTS order: `given` (one entry per OUT_NAMES: the caller's
        buffer the kernel writes in place, or None) where given, the prepared `bad` flags last, the rest
        fresh (the caller may keep what it is returned, as SGLang's are): one torch.empty per shape,
        unbound into the outputs of that shape (the four [B, N] int64 outputs share one)."""
        import torch
        tokens, depths, parents, visibility = given
        mask = (tokens is None, depths is None, parents is None, visibility is None)
        plan = self._plans.get(mask)
        if plan is None:
            groups: dict[tuple, list[int]] = {}
            for index, (shape, dtype) in enumerate(self.layout.values()):
                if index >= len(mask) or mask[index]:
                    groups.setdefault((shape, dtype), []).append(index)
            plan = self._plans[mask] = tuple(((len(ix),) + shape if len(ix) > 1 else shape, dtype, tuple(ix))
                                             for (shape, dtype), ix in groups.items())
        out = [tokens, depths, parents, visibility, None, None, None, None, self.bad]
        device = self.device
        for shape, dtype, indices in plan:
            block = torch.empty(shape, dtype=dtype, device=device)
            if len(indices) == 1:
                out[indices[0]] = block
            else:
                for index, tensor in zip(indices, block.unbind()):
                    out[index] = tensor
        return out

    def enqueue(self, draft_logits, out: list) -> None:
        """The launches over these logits into `out` (SGLANG_OUTPUTS order): the top-k, then the build.
        The logits fit the prepared shape, dtype and device (the call's key says so); the fused top-k
        reads them in place when they are float32, C-contiguous and aligned, else a float32 copy."""
        fused = self.fused
        if fused is None:
            logp, ids = torch_topk_logprobs(draft_logits, self.topk)
            logp_address, ids_address = logp.data_ptr(), ids.data_ptr()
        else:
            address = draft_logits.data_ptr()
            if not self.float32 or address % fused.alignment or not draft_logits.is_contiguous():
                draft_logits = self._float32(draft_logits, fused.alignment)  # held until both launches are queued
                address = draft_logits.data_ptr()
            fused.launch_at(address)
            logp_address, ids_address = self._fused_out
        self.launch.launch_at(logp_address, ids_address, [t.data_ptr() for t in out])


class GraphReplay:
    """KDTREE_SGLANG_GRAPH=1: one PreparedBuild's top-k and build captured in a CUDA graph (on a side
    stream) over static float32 logits and static outputs. A call copies its logits in (converting
    as SGLang's `.float()` does), replays the graph on the current stream and copies the outputs out
    into its own (fresh, or the caller's buffers) with one torch._foreach_copy_, so what the caller
    keeps is never rewritten by a later call. The static logits are at most GRAPH_LOGITS_BYTES; at most
    GRAPH_LIMIT graphs are kept (the least recently used dropped)."""

    def __init__(self, build: PreparedBuild):
        import torch
        self.logits = torch.zeros(build.shape, dtype=torch.float32, device=build.device)
        self.out = build.outputs(NO_BUFFERS)
        with torch.cuda.device(build.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # torch's lazy initialisation (the exact top-k) is not captured
                build.enqueue(self.logits, self.out)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=side):
                build.enqueue(self.logits, self.out)
        self.static = self._integers(self.out)  # `bad` is the build's own

    @staticmethod
    def _integers(out: list) -> list:
        """The int64 outputs (all but visibility and `bad`): one torch._foreach_copy_ takes them."""
        return out[:3] + out[4:-1]

    def replay(self, draft_logits, out: list) -> None:
        import torch
        self.logits.copy_(draft_logits)
        self.graph.replay()
        torch._foreach_copy_(self._integers(out), self.static)
        out[3].copy_(self.out[3])


_GRAPHED: OrderedDict = OrderedDict()  # id(PreparedBuild) -> PreparedBuild holding a graph, least recently used first


def graph_of(build: PreparedBuild):
    """The build's GraphReplay, captured on first use; None where a graph does not apply: logits above
    GRAPH_LOGITS_BYTES as float32, or the current stream being captured (the caller's own graph then
    captures the eager launches)."""
    import torch
    if torch.cuda.is_current_stream_capturing() or 4 * math.prod(build.shape) > GRAPH_LOGITS_BYTES:
        return None
    key = id(build)
    if build.graph is None:
        build.graph = GraphReplay(build)
        _GRAPHED[key] = build
        while len(_GRAPHED) > GRAPH_LIMIT:
            _GRAPHED.popitem(last=False)[1].graph = None
    else:
        _GRAPHED.move_to_end(key)
    return build.graph


_PREPARED: dict[tuple, object] = {}


def _prepared(key: tuple, make):
    prepared = _PREPARED.get(key)
    if prepared is None:
        if len(_PREPARED) >= PREPARED_LIMIT:
            dropped = _PREPARED.pop(next(iter(_PREPARED)))
            if _GRAPHED.pop(id(dropped), None) is not None:
                dropped.graph = None
        prepared = _PREPARED[key] = make()
    return prepared


def _check_build_args(draft_logits, tree_budget) -> tuple:
    """build_ddtree_tree's checks (metadata and knobs): (batch, depth, vocab, budget, knobs)."""
    _check_tensor("draft_logits", draft_logits, ndim=3, dtypes=LOGIT_DTYPES)
    budget = _check_budget("tree_budget", tree_budget)
    batch, depth, vocab = (int(n) for n in draft_logits.shape)
    _check_depth("draft_logits", depth)
    if vocab < 1:
        raise ValueError(f"draft_logits: expected a vocabulary of at least 1 token, got shape {tuple(draft_logits.shape)}")
    return batch, depth, vocab, budget, knobs_from_environment()


def topk_width(policy: SGLangPolicy, budget: int, depth: int, vocab: int) -> int:
    """The candidates SGLang's build_ddtree_tree takes per position (1 on its spine fast path)."""
    return 1 if budget == depth else min(policy.width(budget, depth), vocab)


def prepared_build(draft_logits, tree_budget: int) -> PreparedBuild:
    """The prepared build for these logits' shape, budget and the knobs now (checked), made once: the
    one build_ddtree_tree(draft_logits, tree_budget, draft_logits.device) runs."""
    try:
        call = _CALLS.get(_call_key(draft_logits, tree_budget, draft_logits.device))
    except (AttributeError, TypeError):
        call = None
    call = call or _prepared_call(draft_logits, tree_budget, draft_logits.device)
    if call is None:
        raise ValueError(f"draft_logits: the kernel build needs a CUDA tensor, got device {draft_logits.device}")
    return call.build


class PreparedCall:
    """build_ddtree_tree for one call key (_call_key: the logits' type, shape, dtype and device, the
    budget and its type, the device argument, the knobs' raw text), made once that key's first call
    passed every check: a later call with that key skips them (nothing they read can differ), so it
    costs the key, the outputs' allocation and the launches. Holds the shared PreparedBuild, what
    the knobs asked for, and the caller's last _out_* buffers with the views the kernel writes (a
    worker passes the same four every step; held, so no other tensor can take their addresses)."""

    __slots__ = ("build", "device", "same_device", "check_values", "graph", "_buffers")

    def __init__(self, build: PreparedBuild, device, knobs: Knobs):
        self.build, self.device, self.same_device = build, device, _same_device(build.bad, device)
        self.check_values, self.graph = knobs.check_values, knobs.graph
        self._buffers = None  # (buffers, their views, the signature of both)

    def in_place(self, buffers: tuple) -> tuple:
        """Per _out_* buffer, the rows the kernel writes directly (_in_place), else None; the last
        call's views again when handed the same buffers, unchanged (same objects, addresses, shapes)."""
        cached = self._buffers
        if cached is not None and all(a is b for a, b in zip(buffers, cached[0])):
            if _buffer_signature(buffers + cached[1]) == cached[2]:
                return cached[1]
        layout, device = self.build.layout, self.build.device
        views = tuple(None if buffer is None else _in_place(buffer, *layout[name], device)
                      for name, buffer in zip(OUT_NAMES, buffers))
        self._buffers = (buffers, views, _buffer_signature(buffers + views))
        return views

    def __call__(self, draft_logits, buffers: tuple, device) -> tuple:
        """build_ddtree_tree's answer (the tree and the sizes), recording the EAGLE arrays' hand-over."""
        build = self.build
        views = NO_BUFFERS if buffers is NO_BUFFERS or not self.same_device else self.in_place(buffers)
        out = build.outputs(views)
        graph = graph_of(build) if self.graph else None
        if graph is None:
            build.enqueue(draft_logits, out)
        else:
            graph.replay(draft_logits, out)
        if self.check_values:
            _raise_if_flagged(build.bad, "draft_logits")
        tokens, depths, parents, visibility, sizes, next_token, next_sibling, index, _ = out
        if self.same_device:
            _HANDOVER[0] = _Handover(parents, sizes, (index, next_token, next_sibling), device)
            if buffers is NO_BUFFERS:
                return tokens, depths, parents, ChildMaps(tokens, parents, sizes), visibility, sizes
        else:  # the EAGLE arrays stay on the logits' device: not handed over
            tokens, depths, parents, visibility, sizes = (t.to(self.device) for t in (tokens, depths, parents,
                                                                                       visibility, sizes))
            _HANDOVER[0] = None
        if any(buffer is not None and view is None for buffer, view in zip(buffers, views)):
            tokens, depths, parents, visibility = (
                fresh if buffer is None or view is not None else _into(buffer, fresh, fill, name)
                for buffer, view, fresh, fill, name in zip(buffers, views, (tokens, depths, parents, visibility),
                                                          OUT_FILLS, OUT_ARGUMENTS))
        return tokens, depths, parents, ChildMaps(tokens, parents, sizes), visibility, sizes


def _buffer_signature(tensors: tuple) -> list:
    return [None if t is None else (t.data_ptr(), t.shape) for t in tensors]


_CALLS: dict[tuple, PreparedCall] = {}


def _call_key(draft_logits, tree_budget, device) -> tuple:
    """What a prepared call is keyed on (AttributeError for an argument that is no tensor, TypeError for
    an unhashable one: the caller then takes the checked path)."""
    return (type(draft_logits), draft_logits.shape, draft_logits.dtype, draft_logits.device, tree_budget,
            type(tree_budget), device, knob_text())


def _prepared_call(draft_logits, tree_budget, device) -> PreparedCall | None:
    """Every check of build_ddtree_tree (a ValueError naming the argument or knob, before any launch),
    then its prepared call, made once per key; None where the logits are not on a CUDA device (the
    host build, not prepared)."""
    batch, depth, vocab, budget, knobs = _check_build_args(draft_logits, tree_budget)
    parsed = _torch_device(device)
    if draft_logits.device.type != "cuda":
        return None
    key = ("main", batch, depth, vocab, budget, draft_logits.dtype, draft_logits.device, knobs.policy, knobs.topk)
    build = _prepared(key, lambda: PreparedBuild(draft_logits, budget, knobs.policy, knobs.topk))
    call = PreparedCall(build, parsed, knobs)
    try:
        call_key = _call_key(draft_logits, tree_budget, device)
        if len(_CALLS) >= PREPARED_LIMIT:
            _CALLS.pop(next(iter(_CALLS)))
        _CALLS[call_key] = call
    except TypeError:  # an unhashable device argument: checked and run, not kept
        pass
    return call


def _raise_if_flagged(bad, name: str) -> None:
    """The value check's one host read (skipped while a CUDA graph is being captured)."""
    import torch
    if bad.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    flagged = np.flatnonzero(bad.cpu().numpy())
    if flagged.size:
        raise ValueError(f"{name}: request(s) {flagged.tolist()} hold NaN or +-inf values, or a row entirely -inf "
                         "(their log-probabilities are not finite)")


def _into(given, fresh, fill, name: str):
    """SGLang's reuse of a caller's buffer: its first rows, filled, then the tree written; fresh when
    `given` is None or holds fewer rows (as SGLang does)."""
    batch = fresh.shape[0]
    if given is None or given.shape[0] < batch:
        return fresh
    if tuple(given.shape[1:]) == tuple(fresh.shape[1:]):
        return given[:batch].copy_(fresh)
    if given.ndim != fresh.ndim or any(g < f for g, f in zip(given.shape[1:], fresh.shape[1:])):
        raise ValueError(f"{name}: expected shape (>= {batch}, {', '.join(str(n) + '+' for n in fresh.shape[1:])}), "
                         f"got {tuple(given.shape)}")
    out = given[:batch].fill_(fill)
    out[(slice(None),) + tuple(slice(0, n) for n in fresh.shape[1:])].copy_(fresh)
    return out


OUT_NAMES = ("node_tokens", "node_depths", "parents", "visibility")  # build_ddtree_tree's _out_* buffers, in order
OUT_ARGUMENTS = ("_out_node_token_ids", "_out_node_depths", "_out_parents", "_out_visibility")
OUT_FILLS = (0, 0, -1, False)  # what SGLang fills their padding with
NO_BUFFERS = (None,) * len(OUT_NAMES)


def _in_place(given, shape, dtype, device):
    """`given`'s first rows, when the kernel can write them directly (SGLang's own reuse of a caller's
    buffer, whose padding the kernel writes too): same trailing shape, dtype and device, contiguous."""
    if given.dtype != dtype or given.device != device:
        return None
    size = given.shape
    if size[0] < shape[0] or size[1:] != shape[1:]:
        return None
    rows = given if size[0] == shape[0] else given[:shape[0]]
    return rows if rows.is_contiguous() else None


def build_ddtree_tree(draft_logits, tree_budget: int, device, _out_node_token_ids=None, _out_node_depths=None,
                      _out_parents=None, _out_visibility=None):
    """SGLang's build_ddtree_tree: draft logits [bs, L, V] -> (node_token_ids [bs, budget] int64,
    node_depths [bs, budget] int64, parents [bs, budget + 1] int64 (-1 root and padding), child_maps,
    visibility [bs, budget + 1, budget + 1] bool, actual_tree_sizes [bs] int64), on `device`;
    the _out_* buffers are used when they hold at least bs rows, as SGLang's are (the kernel writes
    their first bs rows directly when their trailing shape, dtype and device are the outputs'; the
    other outputs are fresh tensors). Checks: the module's docstring; a call whose key (the logits'
    type, shape, dtype, device, the budget, the device argument, the knobs' text) passed them before
    goes straight to its PreparedCall."""
    buffers = (NO_BUFFERS if _out_node_token_ids is None and _out_node_depths is None and _out_parents is None
               and _out_visibility is None else (_out_node_token_ids, _out_node_depths, _out_parents, _out_visibility))
    try:
        call = _CALLS.get(_call_key(draft_logits, tree_budget, device))
    except (AttributeError, TypeError):
        call = None
    if call is None:
        call = _prepared_call(draft_logits, tree_budget, device)
        if call is None:
            _HANDOVER[0] = None
            return _host_tree(draft_logits, tree_budget, _torch_device(device), buffers)
    return call(draft_logits, buffers, device)


def _host_tree(draft_logits, tree_budget, device, buffers):
    """build_ddtree_tree on the host (logits on the CPU): kdtree's host reference, in SGLang's layout."""
    fresh, sizes = _host_build(draft_logits, tree_budget, device)
    tokens, depths, parents, visibility = (_into(given, t, fill, name) for given, t, fill, name in
                                           zip(buffers, fresh, OUT_FILLS, OUT_ARGUMENTS))
    return tokens, depths, parents, ChildMaps(tokens, parents, sizes), visibility, sizes


class _Handover:
    """build_eagle_tree_format's answer for one build's parents and sizes, computed by its kernel: the
    tensors returned (held, so no other tensor can take their addresses while this is kept), their
    addresses, shapes, strides and torch versions then (an in-place change through any view bumps
    the version they share), the device argument of that build, and the EAGLE arrays, handed out once."""

    __slots__ = ("parents", "sizes", "signature", "arrays", "device", "width")

    def __init__(self, parents, sizes, arrays, device):
        self.parents, self.sizes, self.arrays, self.device = parents, sizes, arrays, device
        self.signature = _handover_signature(parents, sizes)
        self.width = int(parents.shape[1])


def _handover_signature(parents, sizes) -> tuple:
    return (parents.data_ptr(), parents.shape, parents.stride(), parents._version,
            sizes.data_ptr(), sizes.shape, sizes.stride(), sizes._version)


_HANDOVER: list = [None]  # the last GPU build's _Handover (any shape: a later build may rewrite the same buffers)


def _handed(parents, sizes, draft_token_num, device):
    """The last build's EAGLE arrays for the very tensors it returned, with its node count (an int) and
    its device argument, unchanged since (the per-call path: no argument check needed); else None."""
    handover = _HANDOVER[0]
    if (handover is None or parents is not handover.parents or sizes is not handover.sizes
            or type(draft_token_num) is not int or draft_token_num != handover.width):
        return None
    try:
        same_device = device is handover.device or device == handover.device
    except Exception:  # an object whose comparison fails is no device of that build
        return None
    if not same_device or _handover_signature(parents, sizes) != handover.signature:
        return None
    _HANDOVER[0] = None
    return handover.arrays


def _take_handover(parents, sizes, width: int, device):
    """The last build's EAGLE arrays when `parents` and `sizes` are its outputs, unchanged since (same
    addresses, shapes, strides, versions), width is its node count and `device` theirs; else None
    (the caller runs the kernel). Handed out once: a second call runs the kernel, so two calls never
    share their outputs."""
    handover = _HANDOVER[0]
    if (handover is None or not width == int(parents.shape[1]) == int(handover.arrays[0].shape[1])
            or not _same_device(parents, device) or _handover_signature(parents, sizes) != handover.signature):
        return None
    _HANDOVER[0] = None
    return handover.arrays


def _host_build(draft_logits, tree_budget, device):
    """kdtree's host reference of the policy, in SGLang's layout (logits on the CPU; values checked)."""
    import torch
    batch, depth, vocab, budget, knobs = _check_build_args(draft_logits, tree_budget)
    policy = knobs.policy
    logp, ids = torch_topk_logprobs(draft_logits, topk_width(policy, budget, depth, vocab))
    draft = DraftTopK(logp=logp.cpu().numpy(), ids=ids.to(torch.int32).cpu().numpy())
    if not np.isfinite(draft.logp[..., 0]).all():
        raise ValueError("draft_logits: a row holds NaN or +inf, or is entirely -inf (its log-probabilities are NaN)")
    tree = build_tree(draft, budget, policy=policy, backend="numpy")
    nodes = budget + 1
    live = np.arange(nodes)[None, :] < tree.n_nodes[:, None]                                  # (bs, N)
    tensors = [np.where(live[:, 1:], tree.tokens[:, 1:], 0).astype(np.int64),
               np.where(live[:, 1:], tree.depths[:, 1:], 0).astype(np.int64),
               tree.parents.astype(np.int64),
               unpack_mask(tree.mask, nodes) & live[:, :, None] & live[:, None, :]]            # (bs, N, N)
    return ([torch.from_numpy(np.ascontiguousarray(t)).to(device) for t in tensors],
            torch.from_numpy(tree.n_nodes.astype(np.int64)).to(device))


def build_eagle_tree_format(parents, actual_tree_sizes, draft_token_num: int, device):
    """SGLang's build_eagle_tree_format: parents [bs, max_nodes] (-1: none) and sizes [bs] ->
    (retrive_index, retrive_next_token, retrive_next_sibling), each int64 [bs, draft_token_num] on
    `device`: node k's global slot b * D + k, its first child, its next sibling (children in ascending
    index order, -1 for none). On a GPU no launch when handed the parents and sizes the last
    build_ddtree_tree of that shape returned, unchanged (same tensors' addresses, shapes, strides
    and torch versions), with draft_token_num its node count and `device` theirs: that build's kernel
    wrote these arrays (once: a second call for the same tensors runs the kernel); else one kernel
    (torch ops on the CPU); nothing is read back. A tensor changed in place by a torch op is seen
    (its version moves); one written by a foreign kernel is not, and must not be passed back as
    unchanged. A size above min(draft_token_num, max_nodes) counts as that (SGLang's loop raises an
    IndexError)."""
    import torch
    handed = _handed(parents, actual_tree_sizes, draft_token_num, device)  # the worker's call: checked by its build
    if handed is not None:
        return handed
    _check_tensor("parents", parents, ndim=2, dtypes=INTEGER_DTYPES)
    _check_tensor("actual_tree_sizes", actual_tree_sizes, ndim=1, dtypes=INTEGER_DTYPES)
    batch, columns = (int(n) for n in parents.shape)
    if tuple(actual_tree_sizes.shape) != (batch,):
        raise ValueError(f"actual_tree_sizes: expected shape ({batch},) (one size per row of parents), "
                         f"got {tuple(actual_tree_sizes.shape)}")
    width = check_positive_int("draft_token_num", draft_token_num)
    device = _torch_device(device)
    if parents.device.type == "cuda":
        handed = _take_handover(parents, actual_tree_sizes, width, device)
        if handed is not None:
            return handed
        key = ("eagle", batch, columns, width, parents.device)
        launch = _prepared(key, lambda: EagleFormatLaunch(batch, columns, width, parents.device.index))
        outputs = launch(parents.to(torch.long).contiguous(),
                         actual_tree_sizes.to(device=parents.device, dtype=torch.long).contiguous())
    else:
        outputs = _eagle_format_torch(parents, actual_tree_sizes, width)
    return tuple(t if _same_device(t, device) else t.to(device) for t in outputs)


def _eagle_format_torch(parents, actual_tree_sizes, width: int):
    """The same arrays by torch ops on the parents' device (the host path)."""
    import torch
    batch = int(parents.shape[0])
    on = parents.device
    nodes = torch.arange(width, device=on)
    sizes = actual_tree_sizes.to(device=on, dtype=torch.long)[:, None]                         # (bs, 1)
    parent = torch.full((batch, width), -1, dtype=torch.long, device=on)
    columns = min(width, int(parents.shape[1]))
    parent[:, :columns] = parents[:, :columns].to(torch.long)
    is_child = (nodes >= 1) & (nodes < sizes) & (parent >= 0) & (parent < sizes)              # (bs, D)
    # first child: the smallest child index per parent (column `width` collects the non-children)
    first = torch.full((batch, width + 1), width, dtype=torch.long, device=on)
    first.scatter_reduce_(1, torch.where(is_child, parent, width), nodes.expand(batch, width), reduce="amin")
    next_token = torch.where(first[:, :width] < width, first[:, :width], -1)
    # next sibling: children sorted by (parent, index); each points at the next one of its parent
    key = torch.where(is_child, parent * width + nodes, width * width + nodes)
    ordered_key, order = key.sort(dim=1)
    same_parent = (ordered_key[:, 1:] < width * width) & (ordered_key[:, 1:] // width == ordered_key[:, :-1] // width)
    next_sibling = torch.full((batch, width), -1, dtype=torch.long, device=on)
    next_sibling.scatter_(1, order[:, :-1], torch.where(same_parent, order[:, 1:], -1))
    retrive_index = torch.arange(batch, device=on)[:, None] * width + nodes
    return retrive_index, next_token, next_sibling


# ----------------------------------------------------------------------------------------------
# SGLang PR #29907: build_ddtree_tree_from_topk (one request), its batched form, its build_ddtree_tree

def _empty_pr_tree():
    """PR #29907's answer to budget <= 0 or a depth of 0: the root alone, on the host."""
    import torch
    visibility = torch.ones((1, 1), dtype=torch.bool)
    return (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), [-1], [dict()], visibility,
            torch.full((1,), -1, dtype=torch.long), torch.full((1,), -1, dtype=torch.long))


def _check_topk_pair(top_log_probs, top_token_ids, ndim: int):
    _check_tensor("top_log_probs", top_log_probs, ndim=ndim, dtypes=("float32", "float16", "bfloat16", "float64"))
    _check_tensor("top_token_ids", top_token_ids, ndim=ndim, dtypes=INTEGER_DTYPES)
    if tuple(top_token_ids.shape) != tuple(top_log_probs.shape):
        raise ValueError(f"top_token_ids: expected top_log_probs' shape {tuple(top_log_probs.shape)}, "
                         f"got {tuple(top_token_ids.shape)}")
    if top_token_ids.device != top_log_probs.device:
        raise ValueError(f"top_token_ids: expected top_log_probs' device {top_log_probs.device}, got {top_token_ids.device}")
    if top_log_probs.shape[-1] < 1:
        raise ValueError(f"top_log_probs: expected at least one candidate per position, got shape {tuple(top_log_probs.shape)}")
    if top_log_probs.shape[-1] > MAX_TOPK:
        raise ValueError(f"top_log_probs: at most {MAX_TOPK} candidates per position, got {top_log_probs.shape[-1]}")


def _pr_launch(batch: int, depth: int, topk: int, budget: int, logp, ids) -> SGLangBuildLaunch:
    key = ("pr", batch, depth, topk, budget, ids.dtype, logp.device)
    return _prepared(key, lambda: SGLangBuildLaunch(batch, depth, topk, budget, logp.device.index,
                                                    policy=PaperPolicy(), ids_int64=ids.dtype.itemsize == 8,
                                                    links=True, finite_all=True))


def build_ddtree_tree_from_topk_batched(top_log_probs, top_token_ids, budget: int):
    """PR #29907's build_ddtree_tree_from_topk for a batch, on the GPU, without reading anything back:
    top_log_probs [B, D, K] (floating; sorted descending per position) and top_token_ids [B, D, K]
    -> (node_token_ids [B, budget] int64, node_depths [B, budget] int64, parents [B, N] int64,
    child_maps (per request, PR #29907's list by node, built on first read), visibility [B, N, N] bool,
    retrieve_next_token [B, N] int64, retrieve_next_sibling [B, N] int64, tree_sizes [B] int64), N =
    budget + 1. Request b's first tree_sizes[b] nodes (and budget columns) are what
    build_ddtree_tree_from_topk returns for it; the rest is padding (0 tokens and depths, -1 parents
    and links, False visibility). Values: every log-probability read must be finite (the PR would
    build NaN weights from NaN, and pops -inf entries as nodes): checked as build_ddtree_tree's are
    (KDTREE_SGLANG_CHECK_VALUES)."""
    import torch
    _check_topk_pair(top_log_probs, top_token_ids, ndim=3)
    budget = _check_budget("budget", budget)
    batch, depth, topk = (int(n) for n in top_log_probs.shape)
    _check_depth("top_log_probs", depth)
    if top_log_probs.device.type != "cuda":
        raise ValueError(f"top_log_probs: the batched build runs on a CUDA device, got {top_log_probs.device}")
    check_values = check_values_from_environment()
    logp = top_log_probs.to(torch.float32).contiguous()
    ids = top_token_ids.contiguous()
    launch = _pr_launch(batch, depth, topk, budget, logp, ids)
    out = launch(logp, ids, launch.allocate(logp))
    if check_values:
        _raise_if_flagged(out["bad"], "top_log_probs")
    return (out["node_tokens"], out["node_depths"], out["parents"],
            ChildMaps(out["node_tokens"], out["parents"], out["sizes"], as_list=True), out["visibility"],
            out["next_token"], out["next_sibling"], out["sizes"])


def build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget: int):
    """SGLang PR #29907's build_ddtree_tree_from_topk: one request's top_log_probs [D, K] and
    top_token_ids [D, K] and the budget -> (node_token_ids [n] int64, node_depths [n] int64, parents
    (a list of n + 1 ints, -1 first), child_maps (a list of n + 1 dicts {token: child}), visibility
    [n + 1, n + 1] bool, retrieve_next_token [n + 1] int64, retrieve_next_sibling [n + 1] int64), host
    tensors as the PR returns them; n <= budget nodes in pop order. budget <= 0 or D == 0 gives the
    root alone, as the PR does. On a GPU it is the batched kernel for one request, then one copy to
    the host (the outputs' lengths are the tree's: reading them back is the signature's); values
    must be finite (a ValueError naming top_log_probs otherwise, always checked)."""
    import torch
    _check_topk_pair(top_log_probs, top_token_ids, ndim=2)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget: expected an integer, got {budget!r}")
    if budget <= 0 or top_log_probs.shape[0] == 0:
        return _empty_pr_tree()
    budget = _check_budget("budget", budget)
    depth, topk = (int(n) for n in top_log_probs.shape)
    _check_depth("top_log_probs", depth)
    if top_log_probs.device.type == "cuda":
        logp = top_log_probs.to(torch.float32).contiguous()[None]
        ids = top_token_ids.contiguous()[None]
        launch = _pr_launch(1, depth, topk, budget, logp, ids)
        launch.links = True
        out = launch(logp, ids, launch.allocate(logp))
        host = {name: t[0].cpu() for name, t in out.items()}
        if int(host["bad"]):
            raise ValueError("top_log_probs: holds NaN or +-inf values (every log-probability read must be finite)")
        n = int(host["sizes"])
        parents = host["parents"][:n].tolist()
        visibility = host["visibility"][:n, :n].clone()
        tokens, depths = host["node_tokens"][: n - 1].clone(), host["node_depths"][: n - 1].clone()
        next_token, next_sibling = host["next_token"][:n].clone(), host["next_sibling"][:n].clone()
    else:
        tokens, depths, parents, visibility, next_token, next_sibling = _host_pr_tree(top_log_probs, top_token_ids,
                                                                                      budget)
    child_maps = [dict() for _ in parents]
    for node in range(1, len(parents)):
        child_maps[parents[node]][int(tokens[node - 1])] = node
    return tokens, depths, parents, child_maps, visibility, next_token, next_sibling


def _host_pr_tree(top_log_probs, top_token_ids, budget: int):
    """kdtree's host reference of PR #29907's tree: the paper's heap (tree_build.best_first_pops) over
    min(budget, K) ranks, in pop order, and its derived arrays."""
    import torch
    width = min(budget, int(top_log_probs.shape[-1]))
    logp = top_log_probs[:, :width].to(torch.float32).numpy()
    ids = top_token_ids[:, :width].to(torch.long).numpy()
    if not np.isfinite(logp).all():
        raise ValueError("top_log_probs: holds NaN or +-inf values (every log-probability read must be finite)")
    pops = best_first_pops(logp, budget)
    n = len(pops) + 1
    parents = [-1] + [parent for parent, _, _, _ in pops]
    tokens = torch.tensor([int(ids[depth - 1, rank]) for _, depth, rank, _ in pops], dtype=torch.long)
    depths = torch.tensor([depth for _, depth, _, _ in pops], dtype=torch.long)
    visibility = torch.zeros((n, n), dtype=torch.bool)
    next_token = torch.full((n,), -1, dtype=torch.long)
    next_sibling = torch.full((n,), -1, dtype=torch.long)
    visibility[0, 0] = True
    last_child = {}
    for node in range(1, n):
        parent = parents[node]
        visibility[node] = visibility[parent]
        visibility[node, node] = True
        if parent in last_child:
            next_sibling[last_child[parent]] = node
        else:
            next_token[parent] = node
        last_child[parent] = node
    return tokens, depths, parents, visibility, next_token, next_sibling


def pr29907_build_ddtree_tree(draft_logits, budget: int):
    """SGLang PR #29907's build_ddtree_tree: one request's draft logits [D, V] and the budget -> what
    build_ddtree_tree_from_topk returns for their top-min(budget, V) (the official formula)."""
    _check_tensor("draft_logits", draft_logits, ndim=2, dtypes=LOGIT_DTYPES)
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise ValueError(f"budget: expected an integer, got {budget!r}")
    if budget <= 0 or draft_logits.shape[0] == 0:
        return _empty_pr_tree()
    budget = _check_budget("budget", budget)
    if draft_logits.shape[-1] < 1:
        raise ValueError(f"draft_logits: expected a vocabulary of at least 1 token, got shape {tuple(draft_logits.shape)}")
    logp, ids = torch_topk_logprobs(draft_logits, min(budget, int(draft_logits.shape[-1])))
    return build_ddtree_tree_from_topk(logp, ids, budget)


def load_sglang_module(path):
    """A local copy of SGLang's ddtree_utils.py (main's, or PR #29907's: tests and the benchmark compare
    with it; it is never committed), loaded as a module. Where SGLang is not installed, its
    `sglang.srt.environ` is stood in for by one that reads the same two knobs with the defaults
    SGLang's source documents."""
    try:
        importlib.import_module("sglang.srt.environ")
    except ImportError:
        _stand_in_environ()
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"sglang_ddtree_utils_copy_{abs(hash(str(path)))}", path)
    if spec is None or not path.is_file():
        raise ValueError(f"path: not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not any(all(hasattr(module, name) for name in names) for names in (MAIN_NAMES, PR_NAMES)):
        raise ValueError(f"path: {path} defines neither {MAIN_NAMES} nor {PR_NAMES}")
    return module


class _Knob:
    """One of SGLang's environment knobs, read at each call as its `envs` object does."""

    def __init__(self, name: str, default):
        self.name, self.default = name, default

    def get(self):
        return os.environ.get(self.name, self.default)


def _stand_in_environ() -> None:
    import types
    for name in ("sglang", "sglang.srt"):
        sys.modules.setdefault(name, types.ModuleType(name))
    environ = types.ModuleType("sglang.srt.environ")
    environ.envs = types.SimpleNamespace(SGLANG_DDTREE_MAX_TOPK=_Knob("SGLANG_DDTREE_MAX_TOPK", DEFAULT_MAX_TOPK),
                                         SGLANG_DDTREE_DEPTH_BONUS=_Knob("SGLANG_DDTREE_DEPTH_BONUS",
                                                                         DEFAULT_DEPTH_BONUS))
    sys.modules["sglang.srt.environ"] = environ


# ----------------------------------------------------------------------------------------------
# patching a worker

def replacements(module) -> dict[str, object]:
    """This module's functions for the names SGLang's `module` defines: PR #29907's flavour (it has
    build_ddtree_tree_from_topk, and its build_ddtree_tree takes one request) or main's."""
    if hasattr(module, "build_ddtree_tree_from_topk"):
        mine = {"build_ddtree_tree": pr29907_build_ddtree_tree, "build_ddtree_tree_from_topk": build_ddtree_tree_from_topk}
    else:
        mine = {"build_ddtree_tree": build_ddtree_tree, "build_eagle_tree_format": build_eagle_tree_format}
    return {name: function for name, function in mine.items() if hasattr(module, name)}


def install(*modules) -> list[tuple[object, str, object]]:
    """Replace SGLang's tree builds with these, in `modules` (default: SGLang's ddtree_utils) and in
    every loaded sglang module that imported them by name. Returns the (module, name, original)
    replaced, for uninstall; installing twice replaces nothing."""
    if not modules:
        modules = (importlib.import_module(SGLANG_MODULE),)
    mine = replacements(modules[0])
    originals = {name: getattr(modules[0], name) for name in mine}
    if not originals:
        raise ValueError(f"modules: {modules[0].__name__} holds none of {MAIN_NAMES + PR_NAMES[1:]}")
    loaded = [m for name, m in list(sys.modules.items()) if name.startswith("sglang") and m is not None]
    replaced = []
    for module in {id(m): m for m in list(modules) + loaded}.values():
        for name, original in originals.items():
            current = getattr(module, name, None)
            if current is not None and current is not mine[name] and (module in modules or current is original):
                replaced.append((module, name, current))
                setattr(module, name, mine[name])
    return replaced


def uninstall(replaced: list[tuple[object, str, object]]) -> None:
    """Put back what install replaced."""
    for module, name, original in replaced:
        setattr(module, name, original)


def is_installed(module=None) -> bool:
    """Whether SGLang's module (or `module`) now holds these functions."""
    module = importlib.import_module(SGLANG_MODULE) if module is None else module
    mine = {"build_ddtree_tree": (build_ddtree_tree, pr29907_build_ddtree_tree),
            "build_eagle_tree_format": (build_eagle_tree_format,),
            "build_ddtree_tree_from_topk": (build_ddtree_tree_from_topk,)}
    present = [name for name in mine if hasattr(module, name)]
    return bool(present) and all(getattr(module, name) in mine[name] for name in present)


class _PatchOnImport:
    """A meta-path finder that patches SGLang's module as soon as it is imported (worker processes
    import it after this module has been imported, and spawned workers re-import this module)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != SGLANG_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        load = spec.loader.exec_module

        def exec_and_patch(module):
            load(module)
            install(module)
            print(f"kdtree: SGLang's DDTree build is kdtree_lib's in process {os.getpid()}", file=sys.stderr)

        spec.loader.exec_module = exec_and_patch
        return spec


def patch_on_import() -> None:
    """Patch SGLang's build in this process now if it is loaded, else when it is first imported."""
    if SGLANG_MODULE in sys.modules:
        install(sys.modules[SGLANG_MODULE])
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


if os.environ.get(INSTALL_ENV) == "1":
    patch_on_import()


# ----------------------------------------------------------------------------------------------
# an environment's every process: a .pth file in its site-packages

PTH_NAME = "zz_kdtree_sglang_dropin.pth"  # after an editable install's own .pth (site reads them sorted)
PTH_MARK = "# kdtree_lib.integrations.sglang: SGLang's DDTree build is kdtree_lib's in every process"


def pth_text() -> str:
    """The .pth file: this checkout's root on sys.path, then one line that patches SGLang's module when
    it is imported (site executes lines that start with `import`). A failure never stops a process:
    it prints one line and SGLang runs unpatched. KDTREE_SGLANG_PATCH=0 turns it off for one process."""
    root = Path(__file__).resolve().parents[2]
    hook = ("import os, sys; exec(\"if os.environ.get('KDTREE_SGLANG_PATCH') != '0':\\n try:\\n"
            "  from kdtree_lib.integrations.sglang import patch_on_import; patch_on_import()\\n"
            " except Exception as error:\\n"
            "  print(f'kdtree: SGLang patch not active: {error}', file=sys.stderr)\")")
    return f"{PTH_MARK}\n{root}\n{hook}\n"


def site_packages_dir(path) -> Path:
    """`path` if it is a site-packages folder holding SGLang (its ddtree_utils module), else a ValueError."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--site-packages: not a folder: {path}")
    if path.name not in ("site-packages", "dist-packages"):
        raise ValueError(f"--site-packages: expected a site-packages (or dist-packages) folder, got {path}")
    module = path / Path(*SGLANG_MODULE.split(".")).with_suffix(".py")
    if not module.is_file():
        raise ValueError(f"--site-packages: {path} holds no SGLang DDTree module ({module.relative_to(path)})")
    return path


def install_pth(site_packages) -> str:
    """Write the .pth file (idempotent); returns what was done."""
    folder = site_packages_dir(site_packages)
    target, text = folder / PTH_NAME, pth_text()
    if target.is_file() and target.read_text() == text:
        return f"already installed: {target}"
    temporary = target.with_suffix(".tmp")
    temporary.write_text(text)
    temporary.replace(target)
    return f"installed: {target} (restart the service: every new process patches {SGLANG_MODULE})"


def uninstall_pth(site_packages) -> str:
    """Remove the .pth file if it is this module's (idempotent)."""
    folder = site_packages_dir(site_packages)
    target = folder / PTH_NAME
    if not target.exists():
        return f"not installed: {folder} (nothing to remove)"
    if not target.read_text().startswith(PTH_MARK):
        raise ValueError(f"--site-packages: {target} was not written by this tool; left in place")
    target.unlink()
    return f"uninstalled: removed {target} (restart the service to run SGLang's own build)"


def pth_status(site_packages) -> tuple[bool, str]:
    """(installed, one line): whether the .pth file is there and current, and which SGLang flavour
    (main's or PR #29907's functions) its module defines."""
    folder = site_packages_dir(site_packages)
    target = folder / PTH_NAME
    source = (folder / Path(*SGLANG_MODULE.split(".")).with_suffix(".py")).read_text(errors="replace")
    flavour = ("PR #29907's (build_ddtree_tree_from_topk)" if "def build_ddtree_tree_from_topk" in source
               else "main's (build_ddtree_tree, build_eagle_tree_format)")
    if not target.is_file():
        return False, f"not installed in {folder}; its SGLang module is {flavour}"
    current = target.read_text() == pth_text()
    state = "installed" if current else "installed from another checkout or version (run install again)"
    return current, (f"{state}: {target}; its SGLang module is {flavour}; each process that loads it logs "
                     "'kdtree: SGLang's DDTree build is kdtree_lib's in process <pid>'")


@cli.command
def main(argv=None) -> int:
    """python -m kdtree_lib.integrations.sglang install|uninstall|status --site-packages DIR, or
    launch SGLANG_ARGS... (sglang.launch_server with the patch in this process and every worker)."""
    parser = cli.ArgumentParser(prog="python -m kdtree_lib.integrations.sglang",
                                description="SGLang's DDTree tree build replaced by kdtree_lib's")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("install", "patch every process of the environment (a .pth file)"),
                            ("uninstall", "remove that .pth file"), ("status", "say whether it is installed")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("--site-packages", required=True, help="the service environment's site-packages")
    commands.add_parser("launch", help="sglang.launch_server with the patch (every later argument passed on)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # SGLang's options are its own: not parsed here
        os.environ[INSTALL_ENV] = "1"
        patch_on_import()
        sys.argv = ["sglang.launch_server"] + argv[1:]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        return 0
    args = parser.parse_args(argv)
    if args.command == "install":  # refusals (ValueError, path errors): cli.command's one line, status 2
        print(install_pth(args.site_packages))
    elif args.command == "uninstall":
        print(uninstall_pth(args.site_packages))
    else:
        installed, line = pth_status(args.site_packages)
        print(line)
        return 0 if installed else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
