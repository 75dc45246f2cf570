"""The version floors in pyproject.toml are true: no code uses a torch API newer than the floor, the GPU
image's torch meets it, and the GPU extra stays inside megatron-core's supported range."""

import re
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.version import Version

from moe_pretrain.log import PACKAGES

ROOT = Path(__file__).resolve().parents[2]
SOURCES = PACKAGES

FIRST_TORCH = {
    # pattern in our source -> first torch release that has it (PyTorch release notes / pull requests)
    r"dist\.all_gather_single\b": "2.13",       # renamed from all_gather_into_tensor in 2.13
    r"dist\.reduce_scatter_single\b": "2.13",   # renamed from reduce_scatter_tensor in 2.13
    r"--shutdown-timeout": "2.11",              # pytorch#172596, merged 2026-03-03 (after 2.10)
    r"--signals-to-handle": "2.9",              # pytorch#160690, merged 2025-08
    r"from torch\.distributed\.tensor import": "2.5",  # public DTensor module (2.4: torch.distributed._tensor)
    r"ScheduleInterleavedZeroBubble": "2.5",
    r"from torch\.distributed\.pipelining import": "2.4",
    r"fused=True": "2.4",                       # fused AdamW on CPU
    r"torch\.get_autocast_dtype\(": "2.4",      # pytorch#124479, device-generic autocast queries (2024-04)
    r"torch\.is_autocast_enabled\(\w": "2.4",   # the same PR: is_autocast_enabled(device_type)
    r"dcp\.async_save": "2.3",
    r"\bF\.scaled_mm\b|functional\.scaled_mm\b": "2.10",  # pytorch#164142; we use torch._scaled_mm instead
    r"torch\._grouped_mm\b": "2.8",          # CUDA; its CPU support is probed at run time (ops/grouped_mm.py)
    r"torch\.float8_e8m0fnu\b": "2.7",
    r"register_custom_function|_PipelineContext\b": "2.10",  # pytorch#162016 (2025-10): a schedule's own
                                                          # function for an action (OVERLAP_F_B)
    r"\b(input|output)_grads=": "2.12",        # PipelineStage(input_grads=, output_grads=): read in the 2.10,
                                                # 2.11 and 2.12 wheels' pipelining/stage.py (first in 2.12)
}
ALLOWED_ANYWHERE = {"parallel/torch_compat.py"}
"""The one module allowed to name newer APIs: it picks whichever name the running torch has."""

NGC_TORCH = {"25.09": "2.9.0a0", "25.12": "2.10.0a0"}
"""NGC PyTorch container tag -> the torch it ships (NVIDIA's release notes for the container)."""


def torch_floor() -> Version:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    (floor,) = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    return floor


def test_no_source_uses_a_torch_api_newer_than_the_floor():
    floor = torch_floor()
    too_new = []
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if relative in ALLOWED_ANYWHERE:
                continue
            text = path.read_text()
            for pattern, first in FIRST_TORCH.items():
                if Version(first) > floor and re.search(pattern, text):
                    too_new.append(f"{relative}: {pattern} needs torch {first}, the floor is {floor}")
    assert not too_new, "\n".join(too_new)


def test_the_floor_is_met_by_the_gpu_image_and_by_this_machine():
    floor = torch_floor()
    tag = re.search(r"^FROM nvcr\.io/nvidia/pytorch:(\d+\.\d+)-py3", (ROOT / "Dockerfile").read_text(), re.M)
    assert tag, "Dockerfile must start FROM an NGC PyTorch image"
    assert tag.group(1) in NGC_TORCH, f"add NGC {tag.group(1)}'s torch version to NGC_TORCH"
    assert Version(NGC_TORCH[tag.group(1)]) >= floor
    assert Version(torch.__version__.split("+")[0]) >= floor


def test_compat_names_resolve_on_this_torch():
    from parallel.torch_compat import all_gather_single, reduce_scatter_single

    assert all_gather_single is getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    assert reduce_scatter_single is getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def test_the_last_pipeline_stage_keeps_no_outputs_where_torch_lets_it():
    """torch 2.10 and later take step(return_outputs=False) (read in the 2.10 and 2.13 wheels); without it the
    last stage kept every micro-batch's logits until the step ended (the dry run counted 2.7 GB per micro-batch
    at full size). An older step gets no keyword, which it would pass on to the model."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    from parallel.torch_compat import without_outputs

    for schedule in (PipelineScheduleSingle, PipelineScheduleMulti):
        assert without_outputs(schedule.step) == ({"return_outputs": False} if Version(torch.__version__.split("+")[0])
                                                  >= Version("2.10") else {})

    def older_step(*args, target=None, losses=None, **kwargs):
        return kwargs

    assert without_outputs(older_step) == {}


def test_gpu_extra_stays_within_megatron_cores_transformer_engine_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu = {Requirement(r).name: Requirement(r) for r in project["optional-dependencies"]["gpu"]}
    assert "nvidia-nccl-cu12" not in gpu  # the image's NCCL is the one its torch loads
    te = gpu["transformer-engine"]
    # megatron-core 0.16.1's own pin (its "dev" extra): transformer-engine>=2.9.0a0,<2.12.0
    assert te.specifier, "pin transformer-engine"
    for version in ("2.9.0", "2.10.0", "2.11.0"):
        assert te.specifier.contains(version, prereleases=True)
    for version in ("2.8.0", "2.12.0"):
        assert not te.specifier.contains(version, prereleases=True)
    assert re.search(r"megatron-core==0\.16\.1", (ROOT / "Dockerfile").read_text())


def test_torch_api_table_matches_this_torch():
    """The renamed collectives really are new in this torch (the table's reason to exist)."""
    assert hasattr(dist, "all_gather_single") == (Version(torch.__version__.split("+")[0]) >= Version("2.13"))


def test_what_the_dry_run_relies_on_is_where_it_was():
    """The dry run (launch/dryrun.py) stands in for torch at named places; a torch that moves them fails here,
    not in a dry run at full size."""
    import inspect

    from torch._subclasses import fake_tensor
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    from torch.utils.flop_counter import flop_registry

    # training/declared_stage.DeclaredStage: the schedule reads the stages' warm-up vote on the host.
    assert hasattr(PipelineStage, "_warmup_backward_result")
    assert "_warmup_backward_result" in inspect.getsource(schedules)
    # ... and its receive buffers, made when each receive is posted: the hooks it overrides, and the
    # descriptor's fields it reads (a torch without tensor_meta keeps its own buffers).
    for hook in ("_setup_forward_recv_info", "_create_grad_recv_info", "get_fwd_recv_ops", "get_bwd_recv_ops",
                 "_retrieve_recv_activations", "_retrieve_recv_grads"):
        assert hasattr(PipelineStage, hook), hook
    from torch.distributed.pipelining.stage import _RecvInfo
    assert {"self.buffer", "self.tensor_meta", "self.is_root_arg"} <= set(
        re.findall(r"self\.\w+", inspect.getsource(_RecvInfo.__init__)))
    # ops/host_values.py: fake tensors are told apart, and the data's values computed outside the mode.
    assert callable(fake_tensor.is_fake) and callable(fake_tensor.unset_fake_temporarily)
    # planning/op_census.py: torch's FLOP formulas by op; it adds the grouped product's, which torch lacks.
    assert {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm} <= set(flop_registry)
