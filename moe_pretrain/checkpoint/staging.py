"""Host copies of the training state for a background save, into buffers kept from one save to the next.

A background save must write a snapshot: the next step updates the parameters and moments in place. The
copy is the only part of an asynchronous save the training waits for, so it is kept to one memcpy per
tensor into host buffers allocated at the first save and reused after (fresh allocations would fault in
every page again, costing more than the copy). DCP's own staging is not used: it deep-copies the state
dict's structure and allocates anew every time. The buffers cost one host copy of the rank's state, as
in megatron-core's and torchtitan's async checkpointing (pinned there, for the device-to-host copy).
DTensors (tensor-parallel parameters) still get a fresh copy each save: reusing their buffers needs the
device mesh rebuilt around host memory, not done yet.

On CUDA the copies run on a side stream of their own, ordered after an event the training thread records
when it asks for the save (ready_event: everything the step wrote is enqueued before it), as non-blocking
copies into the pinned buffers with one synchronisation at the end. Copies on the training's stream would
queue behind the next step's kernels and each blocking copy would wait for them. Nothing of this path has
run on a GPU yet (docs/gpu.md); on a CPU the copies are plain memcpys.
"""

import contextlib

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
        return buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)

    @staticmethod
    def ready_event(state_dict: StateDict) -> "torch.cuda.Event | None":
        """Call on the training thread when the save is asked for: an event after everything enqueued so
        far on the CUDA stream of the state (None when no tensor is on CUDA)."""
        device = next((t.device for t in _tensors(state_dict) if t.is_cuda), None)
        return None if device is None else torch.cuda.current_stream(device).record_event()

    def stage(self, state_dict: StateDict, after: "torch.cuda.Event | None" = None) -> StateDict:
        """Host copies of state_dict, complete on return; `after` (ready_event's) orders CUDA copies after
        the step that wrote the state."""
        stream = None if after is None else torch.cuda.Stream(device=after.device)
        with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
            if stream is not None:
                stream.wait_event(after)
            staged: StateDict = {}
            for key, value in state_dict.items():
                if isinstance(value, DTensor):  # tensor-parallel shards: a fresh copy, as DCP's stager makes
                    staged[key] = value.detach().to("cpu", copy=True)
                elif isinstance(value, BoxedTensor):
                    staged[key] = BoxedTensor(value.global_size, [(offset, self._copy(f"{key}[{i}]", box))
                                                                  for i, (offset, box) in enumerate(value.boxes)])
                else:
                    staged[key] = self._copy(key, value)
        if stream is not None:
            stream.synchronize()  # the one wait: every non-blocking copy has landed in its host buffer
        return staged

    def close(self) -> None:
        self._buffers.clear()


def _tensors(state_dict: StateDict):
    for value in state_dict.values():
        if isinstance(value, BoxedTensor):
            yield from (box for _, box in value.boxes)
        elif isinstance(value, DTensor):
            yield value.to_local()
        else:
            yield value
