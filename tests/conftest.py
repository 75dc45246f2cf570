"""Session set-up: the embedded corpus is built into a cache private to this test session (inherited by
the processes tests start), so tests neither read nor write a user's ~/.cache; Triton interprets on CPU."""

import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    # Our Triton kernels run on CPU tensors only in Triton's interpreter, which is chosen when a kernel is
    # defined (kernels/ import triton lazily, so setting it here, before any test runs, is early enough).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def private_data_cache():
    if "MOE_PRETRAIN_CACHE" in os.environ:
        yield os.environ["MOE_PRETRAIN_CACHE"]
        return
    with tempfile.TemporaryDirectory(prefix="moe-pretrain-cache-") as cache:
        os.environ["MOE_PRETRAIN_CACHE"] = cache
        yield cache
        del os.environ["MOE_PRETRAIN_CACHE"]
