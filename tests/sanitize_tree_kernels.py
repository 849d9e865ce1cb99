"""A small workload of every tree kernel (draft top-k, build, accept, compaction) for compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_tree_kernels.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python tests/sanitize_tree_kernels.py

CuPy's memory pool is switched off so every array is its own allocation and memcheck sees
out-of-bounds accesses at the array's edge (for the SGLang drop-in's torch tensors, run with
PYTORCH_NO_CUDA_MEMORY_CACHING=1). Exits non-zero if a result differs from the reference.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402

from kdtree_lib.contracts import AcceptResult, DraftTopK
from kdtree_lib.tree_accept import accept, compact_cache  # noqa: E402
from kdtree_lib.draft_topk import draft_topk  # noqa: E402
from kdtree_lib.tree_build import build_tree  # noqa: E402
from test_tree_kernels import (assert_fused_topk_matches, assert_same_tree, random_accept_result,  # noqa: E402
                               random_posterior, sorted_draft)


def main() -> None:
    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(3)
    for vocab in (3001, 4000):  # scalar and float4 loads
        logits = -rng.integers(0, 3, size=(2, 3, vocab)).astype(np.float32)
        assert_fused_topk_matches(draft_topk(cupy.asarray(logits), 100, backend="cupy"), logits, 100, "sanitizer")
    for k in (8, 128):  # v3's merge over 13 slices: candidates ranked directly (8), radix-selected (128)
        logits = (rng.standard_normal((2, 3, 50_003)) * 3).astype(np.float32)
        assert_fused_topk_matches(draft_topk(cupy.asarray(logits), k, backend="cupy"), logits, k, "sanitizer v3")
    for batch, depth, k, budget, style in ((3, 6, 40, 70, "ties"), (2, 4, 9, 32, "neginf"),
                                           (1, 32, 700, 700, "ties")):  # the last reads past the cache
        logp, ids = sorted_draft(rng, batch, depth, k, style)
        for mode in ("tree", "chain"):
            want = build_tree(DraftTopK(logp, ids), budget, mode=mode, backend="numpy")
            got = build_tree(DraftTopK(cupy.asarray(logp), cupy.asarray(ids)), budget, mode=mode)
            assert_same_tree(got, want, f"sanitizer {mode}")
        posterior = random_posterior(rng, want, 0.9, 4 * k + 5)
        got_accept = accept(got, cupy.asarray(posterior))
        assert np.array_equal(got_accept.path.get(), accept(want, posterior, backend="numpy").path)
    result = random_accept_result(rng, 3, 8, 20)
    lengths = np.array([0, 5, 11], np.int32)
    raw = [rng.integers(0, 2**15, size=(3, 40, 576)).astype(np.int16) for _ in range(2)]
    want_caches = [r.copy() for r in raw]
    compact_cache(want_caches, lengths, result, backend="numpy")
    caches = [cupy.asarray(r) for r in raw]
    device_result = AcceptResult(*(cupy.asarray(x) for x in (result.path, result.n_accepted, result.bonus)))
    compact_cache(caches, cupy.asarray(lengths), device_result)
    assert all(np.array_equal(c.get(), w) for c, w in zip(caches, want_caches))
    sglang_layout(rng)
    cupy.cuda.Device().synchronize()
    print("sanitizer workload: all results match")


def sglang_layout(rng) -> None:
    """The SGLang drop-in's kernels (build_tree_sglang, eagle_tree_format) against its host path."""
    import torch
    from kdtree_lib.integrations import sglang as dropin
    logits = torch.from_numpy(rng.standard_normal((3, 12, 500)).astype(np.float32) * 3)
    for budget in (12, 40, 1024):  # the chain, SGLang's policy, the PR's heap past the staged ranks (341)
        want = dropin.build_ddtree_tree(logits, budget, "cpu")
        got = dropin.build_ddtree_tree(logits.cuda(), budget, "cpu")
        assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(got, want)) if i != 3)
        want_eagle = dropin.build_eagle_tree_format(want[2], want[5], budget + 1, "cpu")
        got_eagle = dropin.build_eagle_tree_format(got[2].cuda(), got[5].cuda(), budget + 1, "cpu")
        assert all(torch.equal(a, b) for a, b in zip(got_eagle, want_eagle))
        on_device = dropin.build_ddtree_tree(logits.cuda(), budget, "cuda")  # the build's own EAGLE arrays
        handed = dropin.build_eagle_tree_format(on_device[2], on_device[5], budget + 1, "cuda")
        assert all(torch.equal(a.cpu(), b) for a, b in zip(handed, want_eagle))
        x = logits[0].float()
        logp, ids = torch.topk(x, 500, dim=-1)
        logp = logp - torch.logsumexp(x, dim=-1, keepdim=True)
        host = dropin.build_ddtree_tree_from_topk(logp, ids, budget)
        device = dropin.build_ddtree_tree_from_topk(logp.cuda(), ids.cuda(), budget)
        assert all(a == b if isinstance(a, list) else torch.equal(a, b) for a, b in zip(device, host))


if __name__ == "__main__":
    main()
