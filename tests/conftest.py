"""Shared test fixtures: GPU tests skip cleanly where CuPy sees no device; xdist workers share the cores."""
import os

import pytest
import torch

from kdtree_lib.backend import cuda_available


def pytest_configure(config):
    """Under pytest-xdist, give each of the n workers (and the notebook kernels it starts, through
    OMP_NUM_THREADS) cores // n threads: oversubscribed OpenMP threads made torch's small ops 5-10x
    slower on the 2-core CI box."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def drafter_logits() -> list:
    """Every draft's logits [B, D, V] (float32, on the GPU) of the stand-in pair decoding held-out
    prompts (8 prompts, budget 64, 48 new tokens): realistic drafts for the fused-vs-exact tree counts
    of test_draft_topk and test_integration_sglang. Skips where the trained pair is not here."""
    from kdtree_lib import decode
    from kdtree_lib.pairs import pair_with_prompts
    pair = pair_with_prompts(8, prompts_per_package=2, prompt_tokens=48, device="cuda")
    if not pair.stand_in:
        pytest.skip(pair.description)
    recorded = []
    original = decode.draft_topk

    def recording(logits, k, **kwargs):
        recorded.append(logits.detach().float().clone())
        return original(logits, k, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "draft_topk", recording)
        decode.generate(pair.target, pair.drafter, pair.prompts[:8], budget=64, max_new_tokens=48, backend="torch",
                        cuda_graph=False)
    assert recorded
    return recorded
