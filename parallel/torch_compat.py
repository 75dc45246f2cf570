"""torch.distributed collectives whose names changed within the torch versions we support.

torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
reduce_scatter_single and deprecated the old names (a FutureWarning per call); the GPU image's torch
(NGC PyTorch 25.12: 2.10) has only the old ones. pyproject's floor (torch>=2.9) holds because every
call goes through these two names (tests/test_version_floors.py checks that nothing else uses them).
"""

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""all_gather_single(output, input, group=None, async_op=False): concatenate every rank's input along dim 0."""
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""reduce_scatter_single(output, input, op=SUM, group=None, async_op=False): reduce, then keep this rank's slice."""
