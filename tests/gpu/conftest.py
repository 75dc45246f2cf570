"""GPU-only tests: skipped without CUDA (bench/gpu_check.sh runs them on a GPU machine)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bench/gpu_check.sh on one)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
