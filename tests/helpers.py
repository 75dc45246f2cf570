"""Shared test helpers: relative-RMS comparison with the tolerance stated at each call site, reading a run
directory's metrics, and counting host reads."""

import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_rms / max(||expected||_rms, tiny): the fla-style per-tensor error."""
    actual, expected = actual.detach(), expected.detach()
    diff = (actual.double() - expected.double()).pow(2).mean().sqrt()
    scale = expected.double().pow(2).mean().sqrt().clamp_min(1e-30)
    return float(diff / scale)


def steps_done(run_dir: Path) -> int:
    """Steps recorded in run_dir/metrics.jsonl so far (0 before the file exists)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"]


class HostReads(TorchDispatchMode):
    """Counts, while active, what makes a CUDA run wait for its stream, on the code path a CPU run shares: reads
    of tensor values on the host (item / int / float / bool: aten._local_scalar_dense; Tensor.tolist, which
    bypasses the dispatcher and is counted by a patch) and ops whose CUDA kernels read their input on the host
    (bincount; repeat_interleave without output_size; nonzero and the other data-dependent shapes)."""

    SYNCING = frozenset({"aten.bincount.default", "aten.nonzero.default", "aten.masked_select.default",
                         "aten._unique2.default", "aten.unique_consecutive.default"})

    def __init__(self):
        super().__init__()
        self.scalar_reads = 0
        self.tolist_calls = 0
        self.syncing_ops: list[str] = []

    @property
    def reads(self) -> int:
        return self.scalar_reads + self.tolist_calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self.scalar_reads += 1
        elif name in self.SYNCING or (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None):
            self.syncing_ops.append(name)
        return func(*args, **kwargs)

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.tolist_calls += 1
            return original(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
