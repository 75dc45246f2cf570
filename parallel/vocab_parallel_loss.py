"""Cross-entropy over logits whose vocabulary is split across tensor-parallel ranks.

Shape legend: N tokens, V vocabulary, each rank holding columns [rank * V/tp, (rank + 1) * V/tp).
Forward: global max, sum of exponentials and the target's logit, each one all-reduce over the
tensor-parallel group; loss = log(sum exp) - target logit. Backward: softmax minus one-hot, on this
rank's columns only. Written here rather than taken from megatron-core, whose version casts the
logits to fp32: that caps float64 layout-equivalence tests at ~1e-8 relative.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_pretrain.data import IGNORE_INDEX
from parallel.collectives import all_reduce_max, all_reduce_sum


def _global_max(logits_NV: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return all_reduce_max(logits_NV.max(dim=-1).values, group)


def _target_logit(logits_NV: torch.Tensor, target_N: torch.Tensor, group: dist.ProcessGroup
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(every target's logit, from the rank holding its column; this rank's column index; held here)."""
    local_vocab = logits_NV.shape[-1]
    local_target = target_N - dist.get_rank(group) * local_vocab
    mine = (local_target >= 0) & (local_target < local_vocab)
    safe_target = local_target.clamp(0, local_vocab - 1)
    target_logit = all_reduce_sum(logits_NV.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1) * mine, group)
    return target_logit, safe_target, mine


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, target_N, group):
        logits_max = _global_max(logits_NV, group)
        shifted = logits_NV - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce_sum(exp.sum(dim=-1), group)
        target_logit, safe_target, mine = _target_logit(shifted, target_N, group)
        ctx.save_for_backward(exp, sum_exp, safe_target, mine)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_N):
        exp, sum_exp, safe_target, mine = ctx.saved_tensors
        grad = exp / sum_exp.unsqueeze(-1)
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        return grad * grad_N.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token loss [...] from this rank's vocabulary slice of logits [..., V/tp] and global targets [...]."""
    shape = target.shape
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), group)
    return loss.reshape(shape)


def vocab_parallel_top1(logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[...] bool: is the target the highest logit over the whole vocabulary (split over the group)?"""
    logits_NV = logits.reshape(-1, logits.shape[-1])
    target_logit, _, _ = _target_logit(logits_NV, target.reshape(-1), group)
    return (target_logit >= _global_max(logits_NV, group)).reshape(target.shape)


class VocabularySplit:
    """The head's logits as the sharding plan places them (its COLUMN style): this rank's slice of the
    vocabulary over the tensor-parallel group, or the whole of it (group None). The two scores a run reads from
    logits, each summed over the tokens whose label is not IGNORE_INDEX."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def cross_entropy_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed next-token loss of logits [..., V or V/tp] (in their dtype) against labels [...]."""
        if self.group is None:
            return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                                   reduction="sum")
        per_token = vocab_parallel_cross_entropy(logits, labels.clamp(min=0), self.group)
        return (per_token * (labels != IGNORE_INDEX)).sum()

    def top1_count(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """How many labels are the highest logit over the whole vocabulary (float64)."""
        if self.group is None:
            top1 = logits.argmax(dim=-1) == labels
        else:
            top1 = vocab_parallel_top1(logits, labels.clamp(min=0), self.group)
        return (top1 & (labels != IGNORE_INDEX)).sum().to(torch.float64)
