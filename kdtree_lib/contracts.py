"""The data contracts every backend shares (docs/DESIGN.md, "Data contracts").

One layout per concept, so a reference and a kernel are compared array for array:

    DraftTopK     logp float32 [B, D, K] (log-softmax, rows sorted descending), ids int32 [B, D, K]
    Tree          tokens/parents/depths/first_child/next_sibling int32 [B, N], n_nodes int32 [B],
                  mask uint32 [B, N, ceil(N/32)] (bit j of row i: node j is node i or an ancestor),
                  log_weights float64 [B, N] (log-probability of the root-to-node path)
    AcceptResult  path int32 [B, D+1] (accepted node indices from the root, -1 padded),
                  n_accepted int32 [B] (>= 1, the root counts), bonus int32 [B] (the next root)

Node 0 is the root (the last committed token); nodes are numbered in the build's pop order, so a
parent always precedes its children. Slots past n_nodes are padding: token 0, parent -1, depth 0,
log-weight -inf, no children, and a mask row holding only the node itself (so every attention row
has at least one key).

The limits are the kernels' capacities; the references keep them too, so both accept the same inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .checks import check_array, framework, to_numpy

MAX_BUDGET = 1024  # draft nodes per tree: the tree-build and accept kernels' capacity
MAX_DEPTH = 32     # draft positions D (block size - 1)
MAX_TOPK = 1024    # candidates K per position
TREE_MODES = ("tree", "chain")


CAPACITY_ROUND = 64  # cache capacities are rounded up so prompts of similar length share a decoder (and its graph)


def capacity_margin(nodes: int, depth: int) -> int:
    """Cache slots a decode step may write past the committed tokens: one tree of `nodes` and the
    drafter's D + 1 context rows."""
    return nodes + depth + 1


def cache_capacity(tokens: int, nodes: int, depth: int) -> int:
    """The caches' capacity for `tokens` committed tokens (prompt and new tokens) and a step's
    margin, rounded up to CAPACITY_ROUND: the one owner of a decode's cache size (the Decoder, the
    server's decoders and the memory plan all size with it)."""
    return -(-(tokens + capacity_margin(nodes, depth)) // CAPACITY_ROUND) * CAPACITY_ROUND


def tree_nodes(budget: int, *, mode: str = "tree", depth: int | None = None) -> int:
    """Capacity N of a tree: budget + 1 (the root) for DDTree, min(budget, D) + 1 for the chain."""
    if mode == "tree":
        return budget + 1
    if mode == "chain":
        if depth is None:
            raise ValueError("depth: the chain's capacity needs the draft depth D")
        return min(budget, depth) + 1
    raise ValueError(f"mode: expected one of {TREE_MODES}, got {mode!r}")


@dataclass
class DraftTopK:
    """The drafter's top-k log-probabilities per draft position."""
    logp: object  # float32 [B, D, K], rows sorted descending
    ids: object   # int32   [B, D, K]

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.logp.shape)


@dataclass
class Tree:
    """A batch of draft trees at fixed capacity N (see the module docstring)."""
    tokens: object        # int32   [B, N]
    parents: object       # int32   [B, N]
    depths: object        # int32   [B, N]
    n_nodes: object       # int32   [B]
    mask: object          # uint32  [B, N, ceil(N/32)]
    first_child: object   # int32   [B, N]
    next_sibling: object  # int32   [B, N]
    log_weights: object   # float64 [B, N]
    max_depth: int        # D: the deepest a node can be (paths have at most D+1 nodes)

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.tokens.shape[1])

    def to_numpy(self) -> "Tree":
        return self._map(to_numpy)

    def to_torch(self, device) -> "Tree":
        """The same tree as torch tensors on `device` (what the model and the kernels take)."""
        import torch
        return self._map(lambda x: x.to(device) if framework(x) == "torch"
                         else torch.as_tensor(np.ascontiguousarray(to_numpy(x)), device=device))

    def _map(self, convert) -> "Tree":
        return Tree(**{f.name: (getattr(self, f.name) if f.name == "max_depth"
                                else convert(getattr(self, f.name))) for f in fields(self)})


@dataclass
class AcceptResult:
    """The accepted path of each request, and the target's bonus token after it."""
    path: object        # int32 [B, D+1]
    n_accepted: object  # int32 [B]
    bonus: object       # int32 [B]


def tree_from_parents(parents, tokens, *, max_depth: int | None = None, log_weights=None) -> Tree:
    """A Tree from parents [B, N] (parents[:, 0] = -1, parent index < child index) and tokens.

    Nodes after the first one with parent -1 (other than the root) are padding. Used by the
    reference build and by tests and models that need a hand-made tree.
    """
    parents = np.asarray(to_numpy(parents), np.int32)
    tokens = np.asarray(to_numpy(tokens), np.int32)
    if parents.ndim != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents: expected shape (B, N) with N >= 1, got {parents.shape}")
    check_array("tokens", tokens, shape=parents.shape)
    batch, capacity = parents.shape
    words = (capacity + 31) // 32
    depths = np.zeros((batch, capacity), np.int32)
    first_child = np.full((batch, capacity), -1, np.int32)
    next_sibling = np.full((batch, capacity), -1, np.int32)
    n_nodes = np.ones(batch, np.int32)
    ancestors = np.eye(capacity, dtype=bool)[None].repeat(batch, axis=0)
    for b in range(batch):
        last_child = np.full(capacity, -1, np.int64)
        for i in range(1, capacity):
            parent = parents[b, i]
            if parent < 0:
                break
            if parent >= i:
                raise ValueError(f"parents: node {i} of request {b} has parent {parent}; "
                                 "a parent must precede its children")
            n_nodes[b] = i + 1
            depths[b, i] = depths[b, parent] + 1
            ancestors[b, i] |= ancestors[b, parent]
            if last_child[parent] < 0:
                first_child[b, parent] = i
            else:
                next_sibling[b, last_child[parent]] = i
            last_child[parent] = i
        if (parents[b, n_nodes[b]:] >= 0).any():
            raise ValueError(f"parents: request {b} has nodes after its first padding slot")
    if max_depth is None:
        max_depth = int(depths.max())
    if log_weights is None:
        log_weights = np.full((batch, capacity), np.nan)
    return Tree(tokens=tokens, parents=parents, depths=depths, n_nodes=n_nodes,
                mask=pack_mask(ancestors, words), first_child=first_child, next_sibling=next_sibling,
                log_weights=np.asarray(log_weights, np.float64), max_depth=int(max_depth))


def pack_mask(bits: np.ndarray, words: int | None = None) -> np.ndarray:
    """bool [..., N] -> uint32 [..., ceil(N/32)], bit j%32 of word j//32 (least significant first)."""
    n = bits.shape[-1]
    words = (n + 31) // 32 if words is None else words
    padded = np.zeros(bits.shape[:-1] + (words * 32,), bool)
    padded[..., :n] = bits
    packed = np.packbits(padded, axis=-1, bitorder="little")
    return packed.view("<u4").astype(np.uint32).reshape(bits.shape[:-1] + (words,))


def unpack_mask(mask, n: int) -> np.ndarray:
    """uint32 [..., W] -> bool [..., n]; the inverse of pack_mask."""
    mask = np.ascontiguousarray(to_numpy(mask), dtype="<u4")
    bits = np.unpackbits(mask.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :n].astype(bool)


def root_to_node_paths(tree: Tree, b: int) -> list[list[int]]:
    """For request b, each live node's path of node indices from the root (root first)."""
    parents = to_numpy(tree.parents)[b]
    paths: list[list[int]] = [[0]]
    for i in range(1, int(to_numpy(tree.n_nodes)[b])):
        paths.append(paths[parents[i]] + [i])
    return paths
