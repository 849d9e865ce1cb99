"""Tree acceptance: walk a verified tree with the target's posterior tokens, then compact the cache.

The walk starts at the root; at node v the target's token posterior[v] is compared with v's
children; a child carrying that token becomes the next node, otherwise the walk stops and
posterior[v] is the bonus token (the next round's root). The emitted tokens are always the
target's own tokens at each step, so the walk is lossless: greedy DDTree equals greedy
autoregressive decoding, and with posterior tokens sampled from the target at T > 0 the output
has exactly the target's sampling distribution (tests check both).

Layouts (DESIGN.md §3): posterior int32 [B, N]; AcceptResult path int32 [B, D+1] (accepted node
indices from the root, -1 padded), n_accepted int32 [B] (>= 1, the root counts), bonus int32 [B].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import backend as _backend
from .checks import check_array, check_finite, check_same_device, framework, to_numpy
from .tree_build import Tree


@dataclass
class AcceptResult:
    path: object        # int32 [B, D+1]
    n_accepted: object  # int32 [B]
    bonus: object       # int32 [B]


def posterior_tokens(target_logits, *, temperature: float = 0.0, generator=None):
    """The target's token at every tree node: argmax at T=0, a sample from softmax(logits/T) at T>0.

    target_logits [B, N, V] (numpy or torch); returns int32 [B, N] in the same framework.
    """
    check_array("target_logits", target_logits, ndim=3,
                dtypes=("float32", "float16", "bfloat16", "float64"))
    if not temperature >= 0:
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    if framework(target_logits) == "torch":
        import torch
        if temperature == 0:
            return target_logits.argmax(dim=-1).to(torch.int32)
        probs = torch.softmax(target_logits.float() / temperature, dim=-1)
        flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        return flat.reshape(probs.shape[:-1]).to(torch.int32)
    logits = np.asarray(to_numpy(target_logits), np.float64)
    check_finite("target_logits", logits, allow_neg_inf=True)
    if temperature == 0:
        return logits.argmax(axis=-1).astype(np.int32)
    rng = generator if generator is not None else np.random.default_rng()
    scaled = logits / temperature
    probs = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    cumulative = np.cumsum(probs, axis=-1)
    draws = rng.random(logits.shape[:-1] + (1,)) * cumulative[..., -1:]
    return (cumulative < draws).sum(axis=-1).astype(np.int32)


def accept(tree: Tree, posterior, *, backend: str = "auto") -> AcceptResult:
    """Walk each request's tree with its posterior tokens (see the module docstring)."""
    if not isinstance(tree, Tree):
        raise ValueError(f"tree: expected a Tree, got {type(tree).__name__}")
    check_array("posterior", posterior, dtypes=("int32", "int64"), shape=(tree.batch, tree.capacity))
    check_same_device(**{"tree.tokens": tree.tokens, "posterior": posterior})
    chosen = _backend.resolve(backend, ("numpy", "cupy"), tree.tokens, posterior)
    if chosen == "cupy":
        return _accept_cupy(tree, posterior)
    tree = tree.to_numpy()
    posterior = to_numpy(posterior)
    path = np.full((tree.batch, tree.max_depth + 1), -1, np.int32)
    n_accepted = np.zeros(tree.batch, np.int32)
    bonus = np.zeros(tree.batch, np.int32)
    for b in range(tree.batch):
        node, length = 0, 1
        path[b, 0] = 0
        while True:
            child = tree.first_child[b, node]
            while child >= 0 and tree.tokens[b, child] != posterior[b, node]:
                child = tree.next_sibling[b, child]
            if child < 0:
                break
            node = child
            path[b, length] = node
            length += 1
        n_accepted[b] = length
        bonus[b] = posterior[b, node]
    return AcceptResult(path=path, n_accepted=n_accepted, bonus=bonus)


def compaction_plan(result: AcceptResult, lengths) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination cache slots [B, D+1] (-1 where unused) of the accepted nodes.

    Tree node i sits at slot lengths[b] + i during verify; accepted node k moves to lengths[b] + k.
    Along a path node indices grow at least as fast as k, so copying in increasing k in place is
    safe (a slot is read before any later step writes it).
    """
    path = to_numpy(result.path)
    lengths = to_numpy(lengths).astype(np.int64)
    live = path >= 0
    steps = np.arange(path.shape[1])[None, :]
    source = np.where(live, lengths[:, None] + path, -1)
    destination = np.where(live, lengths[:, None] + steps, -1)
    return source.astype(np.int32), destination.astype(np.int32)


def compact_cache(caches, lengths, result: AcceptResult, *, backend: str = "auto"):
    """Move the accepted nodes' entries to the committed end of every layer's cache.

    caches: a list of per-layer tensors [B, L_max, C] (torch, cupy or numpy; modified in place);
    lengths int32 [B]. Returns the new lengths (lengths + n_accepted), same framework.
    """
    if not caches:
        raise ValueError("caches: expected a non-empty list of per-layer caches [B, L_max, C]")
    batch = int(result.n_accepted.shape[0])
    for layer, cache in enumerate(caches):
        check_array(f"caches[{layer}]", cache, shape=(batch, None, None))
    check_array("lengths", lengths, dtypes=("int32", "int64"), shape=(batch,))
    check_same_device(**{"caches[0]": caches[0], "lengths": lengths, "result.path": result.path})
    chosen = _backend.resolve(backend, ("numpy", "cupy"), caches[0], lengths)
    if chosen == "cupy":
        return _compact_cache_cupy(caches, lengths, result)
    source, destination = compaction_plan(result, lengths)
    slots = int(caches[0].shape[1])
    if (source >= slots).any():
        raise ValueError(f"caches: an accepted node's slot lies past L_max={slots}")
    for cache in caches:
        for b in range(batch):
            for src, dst in zip(source[b], destination[b]):
                if src >= 0 and src != dst:
                    cache[b, int(dst)] = cache[b, int(src)]
    new_lengths = to_numpy(lengths) + to_numpy(result.n_accepted)
    if framework(lengths) == "torch":
        import torch
        return torch.as_tensor(new_lengths, dtype=lengths.dtype, device=lengths.device)
    return new_lengths.astype(to_numpy(lengths).dtype)
