"""Host copies of the training state for a background save, into buffers kept from one save to the next.

A background save must write a snapshot: the next step updates the parameters and moments in place. The
copy is the only part of an asynchronous save the training waits for, so it is kept to one memcpy per
tensor into host buffers allocated at the first save and reused after (fresh allocations would fault in
every page again, costing more than the copy). DCP's own staging is not used: it deep-copies the state
dict's structure and allocates anew every time. The buffers cost one host copy of the rank's state, as
in megatron-core's and torchtitan's async checkpointing (pinned there, for the device-to-host copy).
DTensors (tensor-parallel parameters) still get a fresh copy each save: reusing their buffers needs the
device mesh rebuilt around host memory, not done yet.
"""

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from parallel.flat_shards import BoxedTensor

StateDict = dict[str, torch.Tensor | BoxedTensor]


class ReusedHostStager(AsyncStager):
    """Stages into the same host buffers every save; only one save may use them at a time (AsyncSaver
    waits for the previous save before staging the next)."""

    _synchronize_after_execute = False  # stage() copies synchronously: nothing to wait for afterwards

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def _copy(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
            self._buffers[key] = buffer
        return buffer.copy_(tensor.detach())

    def stage(self, state_dict: StateDict) -> StateDict:
        staged: StateDict = {}
        for key, value in state_dict.items():
            if isinstance(value, DTensor):  # tensor-parallel shards: a fresh copy, as DCP's stager makes
                staged[key] = value.detach().to("cpu", copy=True)
            elif isinstance(value, BoxedTensor):
                staged[key] = BoxedTensor(value.global_size, [(offset, self._copy(f"{key}[{i}]", box))
                                                              for i, (offset, box) in enumerate(value.boxes)])
            else:
                staged[key] = self._copy(key, value)
        return staged

    def close(self) -> None:
        self._buffers.clear()
