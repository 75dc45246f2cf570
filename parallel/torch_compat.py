"""torch.distributed names and parameters that changed within the torch versions we support.

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single and deprecated the old names (a FutureWarning per call); the GPU image's torch
(NGC PyTorch 25.12: 2.10) has only the old ones. pyproject's floor (torch>=2.9) holds because every
call goes through these two names (tests/unit/test_version_floors.py checks that nothing else uses them).
"""

import inspect
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.pipelining.schedules import OVERLAP_F_B, _PipelineScheduleRuntime

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""all_gather_single(output, input, group=None, async_op=False): concatenate every rank's input along dim 0."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""reduce_scatter_single(output, input, op=SUM, group=None, async_op=False): reduce, then keep this rank's slice."""


def without_outputs(step: Callable) -> dict[str, bool]:
    """Keyword arguments for a pipeline schedule's `step` that stop its last stage from keeping every
    micro-batch's output (the logits: [rows, T, V / tp] fp32 each) until the step ends, for a result we never
    read: return_outputs=False where `step` takes it (torch 2.13 does; pytorch#159251); {} where it does not,
    since a keyword the schedule does not know would reach the model as one of its inputs."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(step).parameters else {}


def pairs_in_pipelines() -> bool:
    """Whether pipelining's runtime schedules run a registered function for their OVERLAP_F_B actions
    (register_custom_function, pytorch#162016: torch >= 2.10), which the paired 1F1B schedule needs."""
    return hasattr(_PipelineScheduleRuntime, "register_custom_function")


def register_pair_runner(schedule: _PipelineScheduleRuntime, run_pair: Callable) -> None:
    """Have `schedule` run each OVERLAP_F_B action as run_pair(action, context)."""
    schedule.register_custom_function(OVERLAP_F_B, run_pair)
