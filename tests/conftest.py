"""Shared test fixtures: GPU tests skip cleanly where CuPy sees no device."""
import pytest

from kdtree_lib.backend import cuda_available


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
