"""Tree acceptance: walk a verified tree with the target's posterior tokens, then compact the cache.

The walk starts at the root; at node v the target's token posterior[v] is compared with v's
children; a child carrying that token becomes the next node, otherwise the walk stops and
posterior[v] is the bonus token (the next round's root). The emitted tokens are always the
target's own tokens at each step, so the walk is lossless: greedy DDTree equals greedy
autoregressive decoding, and with posterior tokens sampled from the target at T > 0 the output
has exactly the target's sampling distribution (tests check both).

Layouts (docs/DESIGN.md §3): posterior int32 [B, N]; AcceptResult path int32 [B, D+1] (accepted node
indices from the root, -1 padded), n_accepted int32 [B] (>= 1, the root counts), bonus int32 [B].
"""
from __future__ import annotations

import functools

import numpy as np

from . import backend as _backend
from . import cuda
from .checks import (check_array, check_finite, check_positive_int, check_same_device, check_temperature,
                     check_token_ids, dtype_name, framework, to_numpy)
from .contracts import MAX_BUDGET, AcceptResult, Tree


def posterior_tokens(target_logits, *, temperature: float = 0.0, generator=None):
    """The target's token at every tree node: argmax at T=0, a sample from softmax(logits/T) at T>0.

    target_logits [B, N, V] (numpy or torch); returns int32 [B, N] in the same framework. NaN logits
    are refused (an argmax would return a NaN's index as a token); for a GPU tensor that check reads
    one flag back, so the decode loop's own sampler (decode.sample_posterior) does not come here.
    """
    check_array("target_logits", target_logits, ndim=3,
                dtypes=("float32", "float16", "bfloat16", "float64"))
    temperature = check_temperature(temperature)
    if framework(target_logits) == "torch":
        import torch
        if bool(torch.isnan(target_logits).any()):
            raise ValueError("target_logits: contains NaN")
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


def accept(tree: Tree, posterior, *, vocab: int | None = None, backend: str = "auto") -> AcceptResult:
    """Walk each request's tree with its posterior tokens (see the module docstring).

    posterior [B, N] holds token ids: on the host they must be >= 0 (and < vocab when given), since a
    negative id would come back as the bonus token; device ids are not read back (that would
    synchronise the step).
    """
    _check_accept_args(tree, posterior, vocab)
    chosen = _backend.resolve(backend, ("numpy", "cupy"), tree.tokens, posterior)
    if chosen == "cupy":
        return _accept_launch(tree, posterior, None)()
    tree = tree.to_numpy()
    posterior = to_numpy(posterior)
    check_token_ids("posterior", posterior, vocab)
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


def _check_accept_args(tree: Tree, posterior, vocab) -> None:
    if not isinstance(tree, Tree):
        raise ValueError(f"tree: expected a Tree, got {type(tree).__name__}")
    check_array("posterior", posterior, dtypes=("int32", "int64"), shape=(tree.batch, tree.capacity))
    check_same_device(**{"tree.tokens": tree.tokens, "posterior": posterior})
    if vocab is not None:
        check_positive_int("vocab", vocab)


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


def check_compaction_values(lengths, result: AcceptResult) -> None:
    """The value checks of a compaction: lengths >= 0 (a negative one would overwrite another slot)
    and a walk's result that holds together (check_accept_result). Reads the values on the host:
    compact_cache runs it on host data; for device data call it explicitly (it synchronises)."""
    lengths = to_numpy(lengths)
    if lengths.size and int(lengths.min()) < 0:
        raise ValueError(f"lengths: expected committed lengths >= 0, got {int(lengths.min())}")
    check_accept_result(result)


def check_accept_result(result: AcceptResult) -> None:
    """A walk's result holds together: each path starts at the root, its node indices increase, its
    live entries are a prefix (-1 after) and n_accepted counts them. Reads the values on the host."""
    path, n_accepted = to_numpy(result.path), to_numpy(result.n_accepted)
    live = path >= 0
    counted = live.sum(axis=1)
    if not np.array_equal(live, np.arange(path.shape[1])[None, :] < counted[:, None]) or (path[:, 0] != 0).any():
        raise ValueError("result.path: expected each row to start at the root (node 0), its nodes first, -1 after")
    if (np.diff(np.where(live, path, np.iinfo(np.int32).max), axis=1)[live[:, 1:]] <= 0).any():
        raise ValueError("result.path: a path's node indices must increase (a parent precedes its children)")
    if not np.array_equal(n_accepted, counted):
        raise ValueError(f"result.n_accepted: {n_accepted.tolist()} disagrees with the paths' lengths "
                         f"{counted.tolist()}")


def compact_cache(caches, lengths, result: AcceptResult, *, backend: str = "auto"):
    """Move the accepted nodes' entries to the committed end of every layer's cache.

    caches: a list of per-layer tensors [B, L_max, C] (torch, cupy or numpy; modified in place);
    lengths int32 [B]. Returns the new lengths (lengths + n_accepted), same framework. Values are
    checked (check_compaction_values) where they are on the host: always on the NumPy path, and the
    walk's result when it comes from the host; device values are not read back (that would
    synchronise the step), so validate them explicitly with check_compaction_values.
    """
    if not caches:
        raise ValueError("caches: expected a non-empty list of per-layer caches [B, L_max, C]")
    batch = int(result.n_accepted.shape[0])
    for layer, cache in enumerate(caches):
        check_array(f"caches[{layer}]", cache, shape=(batch, None, None))
    check_array("lengths", lengths, dtypes=("int32", "int64"), shape=(batch,))
    check_same_device(**{"caches[0]": caches[0], "lengths": lengths})
    chosen = _backend.resolve(backend, ("numpy", "cupy"), caches[0], lengths)
    if chosen == "cupy":
        if framework(result.path) == "numpy":  # a host walk's result: checked before it is copied over
            check_accept_result(result)
        return _compact_cache_cupy(caches, lengths, result)
    check_compaction_values(lengths, result)
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


# ----------------------------------------------------------------------------------------------
# CuPy kernels (kernels/tree_accept.cu): the walk (one launch), then the compaction of every layer
# (one more), both on torch's current stream; the compaction reads the walk's outputs on the
# device, so a decode step never waits for the host.

_ACCEPT_THREADS = 128   # __launch_bounds__ of accept_kernel
_COMPACT_THREADS = 128  # KD_COMPACT_THREADS
_MAX_PATH = 64          # s_source in compact_rows: paths of at most 64 nodes (D + 1 <= 33)
_MAX_LAYERS = 65535     # gridDim.y


class AcceptLaunch:
    """One prepared walk: checked and allocated once, so a call costs only the launch.

    Calling it enqueues one CTA per request on torch's current stream over the tree and posterior it
    was prepared with (refill them in place between calls) and returns `out`; passing `posterior`
    checks that it is that same buffer. Nothing here synchronises.
    """

    def __init__(self, tree: Tree, posterior, out: AcceptResult):
        self.out = out
        tokens, parents, n_nodes, posterior = (cuda.contiguous(x) for x in
                                               (tree.tokens, tree.parents, tree.n_nodes, posterior))
        self._inputs = tokens, parents, n_nodes, posterior  # kept alive: the arguments hold their addresses
        self._posterior = cuda.buffer_signature(posterior)
        device = cuda.device_index(tokens)
        self._launch = cuda.PreparedLaunch(
            cuda.device_function("tree_accept.cu", "accept_kernel", device), (tree.batch,), (_ACCEPT_THREADS,),
            (cuda.pointer(tokens), cuda.pointer(parents), cuda.pointer(n_nodes), cuda.pointer(posterior),
             np.int32(dtype_name(posterior) == "int64"), np.int32(tree.capacity), np.int32(out.path.shape[1]),
             cuda.pointer(out.path), cuda.pointer(out.n_accepted), cuda.pointer(out.bonus)),
            shared_mem=8 * tree.capacity, device=device)

    def __call__(self, posterior=None) -> AcceptResult:
        if posterior is not None and cuda.buffer_signature(posterior) != self._posterior:
            raise ValueError("posterior: not the buffer this launch was prepared with (same address, shape and dtype)")
        self._launch()
        return self.out


def prepare_accept_launch(tree: Tree, posterior, *, out: AcceptResult | None = None) -> AcceptLaunch:
    """The kernel walk of accept's arguments on device arrays, prepared once; `out` may be given
    (tests poison it)."""
    _check_accept_args(tree, posterior, None)
    _backend.resolve("cupy", ("cupy",), tree.tokens, posterior)
    return _accept_launch(tree, posterior, out)


def _accept_launch(tree: Tree, posterior, out: AcceptResult | None) -> AcceptLaunch:
    """prepare_accept_launch past the argument checks accept shares."""
    _check_tree_arrays(tree)
    path_len = tree.max_depth + 1
    if out is None:
        out = AcceptResult(path=cuda.device_empty(tree.tokens, (tree.batch, path_len), "int32"),
                           n_accepted=cuda.device_empty(tree.tokens, (tree.batch,), "int32"),
                           bonus=cuda.device_empty(tree.tokens, (tree.batch,), "int32"))
    else:
        for name, shape in (("path", (tree.batch, path_len)), ("n_accepted", (tree.batch,)), ("bonus", (tree.batch,))):
            check_array(f"out.{name}", getattr(out, name), dtypes="int32", shape=shape)
            if not cuda.is_contiguous(getattr(out, name)):
                raise ValueError(f"out.{name}: expected a C-contiguous array (the kernel writes it in place)")
    return AcceptLaunch(tree, posterior, out)


def _check_tree_arrays(tree: Tree) -> None:
    """The Tree fields the walk reads: dtypes, shapes, one device, a capacity the kernel holds."""
    batch, capacity = tree.batch, tree.capacity
    check_array("tree.tokens", tree.tokens, dtypes="int32", ndim=2)
    check_array("tree.parents", tree.parents, dtypes="int32", shape=(batch, capacity))
    check_array("tree.n_nodes", tree.n_nodes, dtypes="int32", shape=(batch,))
    check_same_device(**{"tree.tokens": tree.tokens, "tree.parents": tree.parents, "tree.n_nodes": tree.n_nodes})
    if capacity > MAX_BUDGET + 1:
        raise ValueError(f"tree: capacity N is at most {MAX_BUDGET + 1} nodes on the GPU, got {capacity}")
    if not 0 <= tree.max_depth < _MAX_PATH:
        raise ValueError(f"tree.max_depth: expected 0..{_MAX_PATH - 1}, got {tree.max_depth}")


def _compact_cache_cupy(caches, lengths, result: AcceptResult):
    """The kernel compaction (argument shapes checked by compact_cache); returns the new lengths.

    A host AcceptResult (from the NumPy walk) is copied to the caches' device first; a device one
    is used in place, so the walk-then-compact step never waits for the host.
    """
    if framework(result.path) == "numpy":
        result = AcceptResult(*(cuda.to_device_like(caches[0], to_numpy(x))
                                for x in (result.path, result.n_accepted, result.bonus)))
    return prepare_compact_launch(caches, lengths, result)()


class CompactLaunch:
    """One prepared compaction of every layer: checked once (layout, copy unit, the layers' address
    table), so a call costs only the launch. Calling it enqueues one CTA per (request, layer) on
    torch's current stream, reading the walk's result and lengths it was prepared with, and returns
    `new_lengths`. Nothing here synchronises.
    """

    def __init__(self, caches, lengths, result: AcceptResult, new_lengths):
        slots, row_bytes, unit = _compaction_layout(caches, lengths, result)
        batch, path_len = (int(n) for n in result.path.shape)
        path, n_accepted, lengths = (cuda.contiguous(x) for x in (result.path, result.n_accepted, lengths))
        table = _layer_table(tuple(int(cuda.pointer(cache)) for cache in caches), cuda.device_index(caches[0]))
        self.new_lengths = new_lengths
        self._inputs = path, n_accepted, lengths, table  # kept alive: the arguments hold their addresses
        device = cuda.device_index(caches[0])
        self._launch = cuda.PreparedLaunch(
            cuda.device_function("tree_accept.cu", f"compact_cache_{unit}", device), (batch, len(caches)),
            (_COMPACT_THREADS,),
            (np.uint64(table.data.ptr), np.int64(slots), np.int32(row_bytes // unit), cuda.pointer(path),
             np.int32(path_len), cuda.pointer(n_accepted), cuda.pointer(lengths),
             np.int32(dtype_name(lengths) == "int64"), cuda.pointer(new_lengths)), device=device)

    def __call__(self):
        self._launch()
        return self.new_lengths


def prepare_compact_launch(caches, lengths, result: AcceptResult, *, new_lengths=None) -> CompactLaunch:
    """The kernel compaction of compact_cache's arguments on device arrays (result on the device too),
    prepared once; `new_lengths` may be given (tests poison it)."""
    if not caches:
        raise ValueError("caches: expected a non-empty list of per-layer caches [B, L_max, C]")
    _backend.resolve("cupy", ("cupy",), caches[0], lengths, result.path)
    check_array("lengths", lengths, dtypes=("int32", "int64"), shape=(int(caches[0].shape[0]),))
    if new_lengths is None:
        new_lengths = cuda.device_empty(lengths, (int(lengths.shape[0]),), dtype_name(lengths))
    check_array("new_lengths", new_lengths, dtypes=dtype_name(lengths), shape=tuple(lengths.shape))
    return CompactLaunch(caches, lengths, result, new_lengths)


def _compaction_layout(caches, lengths, result: AcceptResult) -> tuple[int, int, int]:
    """Host checks of the kernel compaction; returns (L_max slots, bytes per row, copy unit in bytes).

    Every layer must be a C-contiguous [B, L_max, C] array of one dtype on one device; the unit is
    the widest of 16/4/2/1 bytes dividing the row size and every layer's address. The per-layer
    part is remembered per set of layers (address, shape, strides, dtype): a decode loop passes the
    same 61 caches every step, and checking them one by one costs hundreds of microseconds.
    """
    batch = int(caches[0].shape[0])
    signature = tuple((type(cache), int(cuda.pointer(cache)), tuple(cache.shape), _strides(cache), cache.dtype)
                      for cache in caches)
    layout = _LAYOUTS.get(signature)
    if layout is None:
        layout = _check_layers(caches)
        if len(_LAYOUTS) >= 16:
            _LAYOUTS.clear()
        _LAYOUTS[signature] = layout
    check_same_device(**{"caches[0]": caches[0], "result.path": result.path,
                         "result.n_accepted": result.n_accepted, "lengths": lengths})
    check_array("result.path", result.path, dtypes="int32", shape=(batch, None))
    check_array("result.n_accepted", result.n_accepted, dtypes="int32", shape=(batch,))
    slots, _, _ = layout
    path_len = int(result.path.shape[1])
    if not 1 <= path_len <= min(_MAX_PATH, slots):
        raise ValueError(f"result.path: expected 1..{min(_MAX_PATH, slots)} columns (D + 1 <= L_max), "
                         f"got {path_len}")
    return layout


_LAYOUTS: dict = {}  # layer signature -> (slots, row bytes, unit), see _compaction_layout


def _strides(x) -> tuple:
    return tuple(x.stride()) if framework(x) == "torch" else tuple(x.strides)


def _check_layers(caches) -> tuple[int, int, int]:
    """The per-layer checks of _compaction_layout, and the layout they establish."""
    first = caches[0]
    batch, slots, width = (int(n) for n in first.shape)
    if len(caches) > _MAX_LAYERS:
        raise ValueError(f"caches: at most {_MAX_LAYERS} layers, got {len(caches)}")
    for layer, cache in enumerate(caches):
        check_array(f"caches[{layer}]", cache, dtypes=dtype_name(first), shape=(batch, slots, width))
        if framework(cache) != framework(first):
            raise ValueError(f"caches[{layer}]: expected a {framework(first)} array like caches[0]")
        if not cuda.is_contiguous(cache):
            raise ValueError(f"caches[{layer}]: expected a C-contiguous array")
    check_same_device(**{f"caches[{layer}]": cache for layer, cache in enumerate(caches)})
    row_bytes = width * first.element_size() if framework(first) == "torch" else width * first.itemsize
    addresses = [int(cuda.pointer(cache)) for cache in caches]
    unit = next(u for u in (16, 4, 2, 1) if row_bytes % u == 0 and all(a % u == 0 for a in addresses))
    return slots, row_bytes, unit


@functools.lru_cache(maxsize=16)
def _layer_table(addresses: tuple[int, ...], device: int):
    """The layers' addresses as a device uint64 array, built once per set of caches (a decode loop
    reuses the same caches every step, so later steps copy nothing to the device)."""
    import cupy
    with cupy.cuda.Device(device), cuda.current_stream():
        return cupy.asarray(np.asarray(addresses, dtype=np.uint64))
