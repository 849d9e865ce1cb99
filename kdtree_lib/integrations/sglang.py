"""A drop-in for SGLang's DDTree tree build (sgl-project/sglang, python/sglang/srt/speculative/ddtree_utils.py).

`build_ddtree_tree` and `build_eagle_tree_format` take SGLang's arguments and return its tensors (same
dtypes, shapes, node order and left-child/right-sibling arrays), element for element, under its
defaults and its environment knobs (SGLANG_DDTREE_MAX_TOPK, SGLANG_DDTREE_DEPTH_BONUS; the defaults 6
and 0.2 are those its source documents). They compute with kdtree_lib:
- the draft top-k is the official formula in one batched torch call on the logits' device
  (draft_topk.torch_topk_logprobs, what SGLang computes);
- the tree is build_tree's "sglang" policy (tree_build.SGLangPolicy). The kernel builds only the paper's
  policy, so this policy runs on the host from one copy of the small top-k, as SGLang's does;
- the outputs are filled by whole-tensor copies, and the per-request child maps are built only when a
  caller reads them;
- the EAGLE-format conversion is torch ops on the parents' device, with no host synchronisation.

Within kdtree_lib's limits (budget <= 1024, L <= 32) and on valid logits (no NaN or +inf, no row entirely
-inf: those raise a ValueError where SGLang would build from NaN weights) the outputs are SGLang's.

`install()` patches SGLang's module (and every loaded module that imported these functions by name);
`python -m kdtree_lib.integrations.sglang launch ARGS` starts SGLang's server with the patch in every
worker process (README: "The SGLang drop-in on the box").
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence

import numpy as np

from ..checks import check_array, check_positive_int
from ..contracts import MAX_BUDGET, DraftTopK, unpack_mask
from ..draft_topk import LOGIT_DTYPES, torch_topk_logprobs
from ..tree_build import SGLangPolicy, build_tree

SGLANG_MODULE = "sglang.srt.speculative.ddtree_utils"
PATCHED_NAMES = ("build_ddtree_tree", "build_eagle_tree_format")
INSTALL_ENV = "KDTREE_SGLANG_PATCH"  # "1": every process importing this module patches SGLang's build
DEFAULT_MAX_TOPK = 6
DEFAULT_DEPTH_BONUS = 0.2


def policy_from_environment() -> SGLangPolicy:
    """SGLang's policy with its environment knobs applied, as its build reads them per call."""
    return SGLangPolicy(max_topk=int(os.environ.get("SGLANG_DDTREE_MAX_TOPK", DEFAULT_MAX_TOPK)),
                        depth_bonus=float(os.environ.get("SGLANG_DDTREE_DEPTH_BONUS", DEFAULT_DEPTH_BONUS)))


class ChildMaps(Sequence):
    """SGLang's per-request child maps ({node: {token: child}} for every node), built on first read."""

    def __init__(self, tokens: np.ndarray, parents: np.ndarray, n_nodes: np.ndarray):
        self._tokens, self._parents, self._n_nodes = tokens, parents, n_nodes
        self._maps: dict[int, dict[int, dict[int, int]]] = {}

    def __len__(self) -> int:
        return len(self._n_nodes)

    def __getitem__(self, b):
        if isinstance(b, slice):
            return [self[i] for i in range(*b.indices(len(self)))]
        b = range(len(self))[b]
        if b not in self._maps:
            n = int(self._n_nodes[b])
            maps: dict[int, dict[int, int]] = {node: {} for node in range(n)}
            for node in range(1, n):
                maps[int(self._parents[b, node])][int(self._tokens[b, node])] = node
            self._maps[b] = maps
        return self._maps[b]


def build_ddtree_tree(draft_logits, tree_budget: int, device, _out_node_token_ids=None, _out_node_depths=None,
                      _out_parents=None, _out_visibility=None):
    """SGLang's build_ddtree_tree: draft logits [bs, L, V] -> (node_token_ids [bs, budget] int64,
    node_depths [bs, budget] int64, parents [bs, budget + 1] int64 (-1 root and padding), child_maps,
    visibility [bs, budget + 1, budget + 1] bool, actual_tree_sizes [bs] int64), on `device`;
    the _out_* buffers are used when they hold at least bs rows, as SGLang's are."""
    import torch
    check_array("draft_logits", draft_logits, dtypes=LOGIT_DTYPES, ndim=3)
    tree_budget = check_positive_int("tree_budget", tree_budget)
    if tree_budget > MAX_BUDGET:
        raise ValueError(f"tree_budget: at most {MAX_BUDGET} nodes, got {tree_budget}")
    batch, depth, vocab = (int(n) for n in draft_logits.shape)
    policy = policy_from_environment()
    width = 1 if tree_budget == depth else min(policy.width(tree_budget, depth), vocab)
    logp, ids = torch_topk_logprobs(draft_logits, width)
    draft = DraftTopK(logp=logp.cpu().numpy(), ids=ids.to(torch.int32).cpu().numpy())
    if not np.isfinite(draft.logp[..., 0]).all():
        raise ValueError("draft_logits: a row holds NaN or +inf, or is entirely -inf (its log-probabilities are NaN)")
    tree = build_tree(draft, tree_budget, policy=policy, backend="numpy")
    nodes = tree_budget + 1

    def output(given, rows_shape, dtype, fill):
        if given is None or given.shape[0] < batch:
            return torch.full((batch,) + rows_shape, fill, dtype=dtype, device=device)
        return given[:batch].fill_(fill)

    node_token_ids = output(_out_node_token_ids, (tree_budget,), torch.long, 0)
    node_depths = output(_out_node_depths, (tree_budget,), torch.long, 0)
    parents = output(_out_parents, (nodes,), torch.long, -1)
    visibility = output(_out_visibility, (nodes, nodes), torch.bool, False)
    live = np.arange(nodes)[None, :] < tree.n_nodes[:, None]                                  # (bs, N)
    node_token_ids.copy_(torch.from_numpy(np.where(live[:, 1:], tree.tokens[:, 1:], 0).astype(np.int64)))
    node_depths.copy_(torch.from_numpy(np.where(live[:, 1:], tree.depths[:, 1:], 0).astype(np.int64)))
    parents.copy_(torch.from_numpy(tree.parents.astype(np.int64)))
    ancestors = unpack_mask(tree.mask, nodes) & live[:, :, None] & live[:, None, :]            # (bs, N, N)
    visibility.copy_(torch.from_numpy(ancestors))
    actual_tree_sizes = torch.from_numpy(tree.n_nodes.astype(np.int64)).to(device)
    return (node_token_ids, node_depths, parents, ChildMaps(tree.tokens, tree.parents, tree.n_nodes), visibility,
            actual_tree_sizes)


def build_eagle_tree_format(parents, actual_tree_sizes, draft_token_num: int, device):
    """SGLang's build_eagle_tree_format: parents [bs, max_nodes] (-1: none) and sizes [bs] ->
    (retrive_index, retrive_next_token, retrive_next_sibling), each int64 [bs, draft_token_num] on
    `device`: node k's global slot b * D + k, its first child, its next sibling (children in ascending
    index order, -1 for none). Torch ops on the parents' device; nothing is read back to the host."""
    import torch
    batch, width = int(parents.shape[0]), int(draft_token_num)
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
    return retrive_index.to(device), next_token.to(device), next_sibling.to(device)


def load_sglang_module(path):
    """SGLang's ddtree_utils from a local copy of the file (tests and the benchmark compare with it; it is
    never committed). Where SGLang is not installed, its `sglang.srt.environ` is stood in for by one that
    reads the same two knobs with the defaults SGLang's source documents."""
    try:
        importlib.import_module("sglang.srt.environ")
    except ImportError:
        _stand_in_environ()
    spec = importlib.util.spec_from_file_location("sglang_ddtree_utils_copy", path)
    if spec is None:
        raise ValueError(f"path: not a Python file: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not all(hasattr(module, name) for name in PATCHED_NAMES):
        raise ValueError(f"path: {path} defines none or only some of {PATCHED_NAMES}")
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

def install(*modules) -> list[tuple[object, str, object]]:
    """Replace SGLang's build_ddtree_tree and build_eagle_tree_format with these, in `modules` (default:
    SGLang's ddtree_utils) and in every loaded sglang module that imported them by name. Returns the
    (module, name, original) replaced, for uninstall."""
    if not modules:
        modules = (importlib.import_module(SGLANG_MODULE),)
    mine = {name: globals()[name] for name in PATCHED_NAMES}
    originals = {name: getattr(modules[0], name) for name in PATCHED_NAMES if hasattr(modules[0], name)}
    if not originals:
        raise ValueError(f"modules: {modules[0].__name__} holds none of {PATCHED_NAMES}")
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
    return all(getattr(module, name, None) is globals()[name] for name in PATCHED_NAMES)


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


def main(argv=None) -> int:
    """python -m kdtree_lib.integrations.sglang launch SGLANG_ARGS...: sglang.launch_server with the
    patch in this process and in every worker it starts (they inherit KDTREE_SGLANG_PATCH=1)."""
    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    parser.add_argument("command", choices=("launch",))
    parser.add_argument("sglang_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    os.environ[INSTALL_ENV] = "1"
    patch_on_import()
    sys.argv = ["sglang.launch_server"] + args.sglang_args
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
