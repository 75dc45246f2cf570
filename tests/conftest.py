"""Session set-up: the embedded corpus is built into a cache private to this test session (inherited by
the processes tests start), so tests neither read nor write a user's ~/.cache."""

import os
import tempfile

import pytest


@pytest.fixture(scope="session", autouse=True)
def private_data_cache():
    if "MOE_PRETRAIN_CACHE" in os.environ:
        yield os.environ["MOE_PRETRAIN_CACHE"]
        return
    with tempfile.TemporaryDirectory(prefix="moe-pretrain-cache-") as cache:
        os.environ["MOE_PRETRAIN_CACHE"] = cache
        yield cache
        del os.environ["MOE_PRETRAIN_CACHE"]
