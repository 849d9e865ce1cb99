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
