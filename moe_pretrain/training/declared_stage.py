"""The pipeline stage this project runs: torch's PipelineStage with declared boundaries, receive buffers made
just in time, and a warm-up vote a dry run can answer.

Receive buffers. torch 2.13's stage makes a receive buffer for every micro-batch of the step, for the
activations and for their gradients, when the schedule first runs, and keeps them for the stage's lifetime
(pytorch/pytorch#136380): at configs/stages/full.yaml's 64 micro-batches a middle pipeline rank would hold
64 x 2 boundaries, about 34 GB, through every step and the optimizer's update, and a schedule kept per step
shape (training/pipeline.Pipeline) keeps its own set. Here a buffer is made when its receive is posted and
handed to the computation that consumes it (the forward's input, the backward's output gradient), so only
the micro-batches in flight hold one, and they are freed with the computation's tensors.

The last stage's losses. The schedule keeps each micro-batch's loss until the step ends (it returns them),
and with it the loss's autograd graph: after the backward its saved tensors are gone, but the graph still
reaches the stage's input (a leaf: its accumulator holds it) and that input's gradient, the two boundaries a
micro-batch received, 0.6 GB per micro-batch on the last rank of configs/stages/full.yaml (38 GB over 64).
Once a micro-batch's whole backward has run, its loss is detached in place, as torch detaches the last
stage's outputs, so the graph and what it holds are freed.

The warm-up vote. Before its first step, torch >= 2.13's schedule polls the stages: each votes static (its
shapes declared) or dynamic, the product passes to the last stage and back in 4-byte sends, and each stage
reads the result on the host (schedules._warmup_p2p). Under the dry run's fake backend (launch/dryrun.py)
the sends are made and nothing arrives: the result is then the vote every stage here casts, static, as a
tensor literal (which the fake-tensor mode keeps as a readable constant).

tests/unit/test_version_floors.py holds the torch names this relies on; where a torch lacks the descriptors'
metadata (tensor_meta), its own buffers are left as they are.
"""

import copy

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

RecvInfo = object
"""torch's private receive descriptor (pipelining.stage._RecvInfo): is_root_arg, buffer, tensor_meta (shape,
stride, dtype) are read here."""


def _unallocated(info: RecvInfo) -> RecvInfo:
    """A copy of the descriptor without its buffer (a root argument, or a gradient never sent, as it is)."""
    if info.is_root_arg or info.tensor_meta is None:
        return info
    unallocated = copy.copy(info)
    unallocated.buffer = None
    return unallocated


def _allocate(infos: tuple[RecvInfo, ...], device: torch.device) -> None:
    for info in infos:
        meta = getattr(info, "tensor_meta", None)
        if not info.is_root_arg and info.buffer is None and meta is not None:
            info.buffer = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)


def _release(infos: tuple[RecvInfo, ...]) -> None:
    """The consuming computation owns the received tensors now: the descriptors drop them."""
    for info in infos:
        if not info.is_root_arg and getattr(info, "tensor_meta", None) is not None:
            info.buffer = None


def _free_graph(loss: torch.Tensor) -> None:
    """Detach the loss the schedule keeps, in place (a view cannot be: it keeps its graph)."""
    if not loss._is_view():
        loss.detach_()


class DeclaredStage(PipelineStage):
    """A stage whose boundaries are declared (input_args / output_args), which allocates a receive buffer per
    receive posted, not per micro-batch of the step, and which a dry run can play (module docstring)."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(1, has_backward)  # one micro-batch's descriptors, then each its own
        template = self.args_recv_info[0]
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = tuple(_unallocated(info) for info in template)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[RecvInfo, ...]:
        return tuple(_unallocated(info) for info in super()._create_grad_recv_info(act_send_info))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        activations = super()._retrieve_recv_activations(fwd_chunk_id)
        _release(self.args_recv_info[fwd_chunk_id])
        return activations

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        grads = super()._retrieve_recv_grads(bwd_chunk_id)
        _release(self.grad_recv_info[bwd_chunk_id])
        return grads

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._losses_awaiting_weights: dict[int, torch.Tensor] = {}
        """Zero bubble: each micro-batch's loss until its weight gradients' pass, which needs its graph."""

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        result = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                            last_backward=last_backward)
        if loss is not None and full_backward:
            _free_graph(loss)
        elif loss is not None:
            self._losses_awaiting_weights[bwd_chunk_id] = loss
        return result

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        result = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if (loss := self._losses_awaiting_weights.pop(bwd_chunk_id, None)) is not None:
            _free_graph(loss)
        return result

    def _warmup_backward_result(self, received_result: torch.Tensor | None = None) -> torch.Tensor:
        result = super()._warmup_backward_result(received_result)
        if dist.get_backend(self.group) != "fake":
            return result
        return torch.tensor([1], dtype=result.dtype, device=result.device)
