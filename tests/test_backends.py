"""Every entry point takes the four backends "numpy", "torch", "cupy" and "auto" (kdtree_lib.backend):
on host inputs "numpy", "torch" and "auto" give the same answer, and "cupy" is refused with a ValueError
naming `backend` (no kernel runs on host inputs), never a silent fallback; "auto" on a GPU picks the kernel
only for the dtypes it takes.
"""
import numpy as np
import pytest
import torch

from kdtree_lib import backend as _backend
from kdtree_lib.decode import generate
from kdtree_lib.draft_topk import draft_topk
from kdtree_lib.moe import DenseExperts, moe_forward
from kdtree_lib.pairs import random_pair
from kdtree_lib.tree_accept import accept, compact_cache
from kdtree_lib.tree_build import build_tree
from kdtree_lib.verify_attn import CACHE_DIM, LATENT_DIM, ROPE_DIM, verify_attention

HOST_BACKENDS = ("numpy", "torch", "auto")
RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(2, 4, 40)).astype(np.float32)
DRAFT = draft_topk(LOGITS, 8, backend="numpy")
TREE = build_tree(DRAFT, 8, backend="numpy")
POSTERIOR = RNG.integers(0, 40, size=TREE.tokens.shape).astype(np.int32)
LENGTHS = np.array([5, 11], np.int32)


def verify_case():
    cache = RNG.normal(size=(2, 11 + TREE.capacity, CACHE_DIM)).astype(np.float32)
    q_latent = 0.05 * RNG.normal(size=(2, TREE.capacity, 2, LATENT_DIM)).astype(np.float32)
    q_rope = RNG.normal(size=(2, TREE.capacity, 2, ROPE_DIM)).astype(np.float32)
    return q_latent, q_rope, cache


def moe_case():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=generator)
    routes = torch.tensor(RNG.integers(0, 4, size=(5, 2)))
    weights = torch.rand(5, 2, generator=generator)
    experts = DenseExperts(gate_up=torch.randn(4, 2 * 8, 16, generator=generator) * 0.1,
                           down=torch.randn(4, 16, 8, generator=generator) * 0.1)
    return x, routes, weights, experts


def arrays_of(value) -> list[np.ndarray]:
    """An entry point's output (a tuple, a contract, tensors) as a flat list of NumPy arrays."""
    if isinstance(value, torch.Tensor):
        return [value.detach().cpu().numpy()]
    if isinstance(value, (tuple, list)):
        return [array for item in value for array in arrays_of(item)]
    if hasattr(value, "__dataclass_fields__"):
        return arrays_of([getattr(value, name) for name in value.__dataclass_fields__])
    return [np.asarray(value)]


def pair_output(backend):
    target, drafter = random_pair(vocab=32, block_size=4, seed=1)
    target.attention_backend = backend
    return generate(target, drafter, [3, 1, 4, 1, 5], budget=6, max_new_tokens=6, backend=backend).tokens


def caches_after_compaction(backend):
    caches = [RNG.normal(size=(2, 11 + TREE.capacity, 8)).astype(np.float32) for _ in range(2)]
    copies = [c.copy() for c in caches]
    lengths = compact_cache(copies, LENGTHS, accept(TREE, POSTERIOR, backend="numpy"), backend=backend)
    return [lengths, *copies]


ENTRY_POINTS = {
    "draft_topk": lambda backend: draft_topk(LOGITS, 8, backend=backend),
    "build_tree": lambda backend: build_tree(DRAFT, 8, backend=backend),
    "accept": lambda backend: accept(TREE, POSTERIOR, backend=backend),
    "compact_cache": caches_after_compaction,
    "verify_attention": lambda backend: verify_attention(*verify_case(), LENGTHS, TREE, backend=backend),
    "moe_forward": lambda backend: moe_forward(*moe_case(), backend=backend),
    "generate": pair_output,
}


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_host_backends_agree(name):
    outputs = {}
    for backend in HOST_BACKENDS:
        RNG.bit_generator.state = np.random.default_rng(7).bit_generator.state  # the same inputs each time
        outputs[backend] = arrays_of(ENTRY_POINTS[name](backend))
    for backend in HOST_BACKENDS[1:]:
        assert len(outputs[backend]) == len(outputs["numpy"])
        for got, want in zip(outputs[backend], outputs["numpy"]):
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: backend {backend!r} differs from 'numpy'")


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_cupy_on_host_inputs_is_refused_by_name(name):
    with pytest.raises(ValueError, match="backend: 'cupy'"):
        ENTRY_POINTS[name]("cupy")


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_an_unknown_backend_is_refused_by_name(name):
    with pytest.raises(ValueError, match="backend: expected one of"):
        ENTRY_POINTS[name]("gpu")


def test_auto_runs_the_kernel_only_for_the_dtypes_it_takes(monkeypatch):
    monkeypatch.setattr(_backend, "is_on_gpu", lambda x: True)  # as if the inputs lived on a GPU CuPy sees
    monkeypatch.setattr(_backend, "cuda_available", lambda: True)
    kernel_dtypes = ("bfloat16", "float16")
    for dtype, chosen in ((torch.bfloat16, "cupy"), (torch.float16, "cupy"), (torch.float32, "torch")):
        assert _backend.resolve("auto", ("torch", "cupy"), torch.zeros(1, dtype=dtype),
                                kernel_dtypes=kernel_dtypes) == chosen, dtype
    assert _backend.resolve("auto", ("torch", "cupy"), torch.zeros(1)) == "cupy"  # no dtype limit given
