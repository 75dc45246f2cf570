"""What every collective checks before it runs (the device its group's backend carries, named by call site), and the
rule that nothing else calls torch.distributed's collectives."""

import ast
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from moe_pretrain.log import PACKAGES
from parallel.collectives import (
    CollectiveDeviceError,
    all_gather_into_async,
    all_reduce_max,
    all_reduce_sum,
    all_to_all_counts,
    all_to_all_rows,
    gather_from_sequence_parallel,
    gather_objects,
    reduce_scatter_into_async,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    served_devices,
)

ROOT = Path(__file__).resolve().parents[2]


class _Group:
    """Stands for a process group: the device check only asks the backend's name (patched below)."""


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl", "gloo"])
def test_collectives_refuse_tensors_their_backend_does_not_carry(backend):
    """Host tensors for a group reported as NCCL are refused, naming the call site, by every collective, before
    anything is sent; a mixed backend carries both devices; gloo carries the host only."""
    group = _Group()
    cpu, meta = torch.ones(4), torch.empty(4, device="meta")
    calls = {
        "all_reduce_sum": lambda x: all_reduce_sum(x, group),
        "all_reduce_max": lambda x: all_reduce_max(x, group),
        "all_to_all_rows": lambda x: all_to_all_rows(x, [4], [4], group),
        "all_to_all_counts": lambda x: all_to_all_counts(x, group),
        "all_gather_into_async": lambda x: all_gather_into_async(x, x, group),
        "reduce_scatter_into_async": lambda x: reduce_scatter_into_async(x, x, group),
        "gather_from_sequence_parallel": lambda x: gather_from_sequence_parallel(x.view(1, 4), group),
        "reduce_scatter_to_sequence_parallel": lambda x: reduce_scatter_to_sequence_parallel(x.view(1, 4), group),
        "scatter_to_sequence_parallel": lambda x: scatter_to_sequence_parallel(x.view(1, 4), group),
    }
    with mock.patch.object(dist, "get_backend", lambda group=None: backend):
        assert served_devices(group) == {"nccl": ("cuda",), "gloo": ("cpu",)}.get(backend, ("cpu", "cuda"))
        refused = cpu if backend == "nccl" else meta
        for name, call in calls.items():
            with pytest.raises(CollectiveDeviceError) as error:
                call(refused)
            message = str(error.value)
            assert message.startswith("tests/unit/test_collectives.py:") and "(<lambda>)" in message, message
            assert f"{name} of a {refused.device.type} tensor (" in message and backend in message, message


def test_object_gathers_refuse_device_tensors():
    """A pickled CUDA tensor would unpickle onto the sender's GPU number on every receiver: only host tensors
    travel in gathered objects (checked here with a meta tensor, the same rule)."""
    assert gather_objects({"a": [torch.ones(2)]}, None)[0]["a"][0].tolist() == [1.0, 1.0]
    with pytest.raises(CollectiveDeviceError, match=r"gather_objects of an object holding a meta tensor"):
        gather_objects({"state": (torch.empty(2, device="meta"),)}, None)


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
               "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
               "monitored_barrier"}


def collective_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every call of a torch.distributed collective: dist.x(...), torch.distributed.x(...),
    or a name imported from torch.distributed or parallel.torch_compat."""
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in ("torch.distributed", "parallel.torch_compat") for alias in node.names
                if alias.name in COLLECTIVES}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES and ast.unparse(func.value) in (
                "dist", "torch.distributed"):
            found.append((node.lineno, func.attr))
        elif isinstance(func, ast.Name) and func.id in imported:
            found.append((node.lineno, func.id))
    return found


def test_every_collective_goes_through_parallel_collectives():
    """The device check cannot be bypassed: no source but parallel/collectives.py calls a collective itself."""
    assert collective_calls(ast.parse("dist.all_reduce(x)\nfrom parallel.torch_compat import all_gather_single\n"
                                      "all_gather_single(a, b)")) == [(1, "all_reduce"), (3, "all_gather_single")]
    direct = []
    for package in (*PACKAGES, "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if relative != "parallel/collectives.py":
                direct += [f"{relative}:{line} {name}" for line, name in collective_calls(ast.parse(path.read_text()))]
    assert not direct, "call these through parallel/collectives.py:\n" + "\n".join(direct)
