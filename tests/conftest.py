"""Session set-up: the embedded corpus is built into a cache private to this test session (inherited by
the processes tests start), so tests neither read nor write a user's ~/.cache; Triton interprets on CPU;
under pytest-xdist each worker takes its share of the cores."""

import os
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Our Triton kernels run on CPU tensors only in Triton's interpreter, which is chosen when a kernel is
    # defined (gpu_kernels/ import triton lazily, so setting it here, before any test runs, is early enough).
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # fla's autotuned kernels cannot autotune there: each reads its pinned config (read when fla is imported;
    # tests/fla_interpreter.py shims the rest).
    os.environ.setdefault("FLA_CACHE_MODE", "default")
    os.environ.setdefault("FLA_CONFIG_DIR", str(Path(__file__).resolve().parents[1] / "gpu_kernels" / "kda" /
                                                "fla_configs"))


WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    # make test runs one pytest worker per core (pytest-xdist): each worker's ops, and the processes its tests
    # start, get their share of the cores instead of all of them each.
    THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


@pytest.fixture(scope="session", autouse=True)
def private_data_cache():
    if "MOE_PRETRAIN_CACHE" in os.environ:
        yield os.environ["MOE_PRETRAIN_CACHE"]
        return
    with tempfile.TemporaryDirectory(prefix="moe-pretrain-cache-") as cache:
        os.environ["MOE_PRETRAIN_CACHE"] = cache
        yield cache
        del os.environ["MOE_PRETRAIN_CACHE"]
