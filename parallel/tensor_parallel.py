"""Column- and row-parallel linear layers with sequence parallelism (megatron-core semantics, any device).

Shape legend: B batch, T sequence, T/tp a sequence shard, I in features, O out features.
Column: input [B, T/tp, I] -> all-gather along T -> [B, T, I] @ W[O/tp rows]^T -> [B, T, O/tp].
Row:    input [B, T, I/tp] @ W[:, I/tp cols]^T -> partial [B, T, O] -> reduce-scatter -> [B, T/tp, O].
Both take this rank's slice of the weight as it is (parallel/plan.py says which slice, and the model's
initialisation draws its values): they add only the communication around the matmul.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.collectives import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        """linear: holding this rank's rows, weight [O/tp, I] and bias [O/tp]."""
        super().__init__()
        self.group = group
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(gather_from_sequence_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        """linear: holding this rank's columns, weight [O, I/tp]."""
        super().__init__()
        if linear.bias is not None:
            raise ValueError("RowParallelLinear: a bias would be added tp times; the model's row layers have none")
        self.group = group
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.group)


def vocab_parallel_embedding(embedding: nn.Embedding, group: dist.ProcessGroup) -> nn.Module:
    """megatron-core's VocabParallelEmbedding around this rank's rows (embedding.weight [V/tp, D]).

    Its output is the whole-sequence embedding, all-reduced over tensor parallel (the model then keeps
    its sequence shard); the weight keeps the name `weight`, so state-dict keys do not change. It is built
    on the meta device and then takes the given weight, so it never allocates a table of its own.
    """
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    size = dist.get_world_size(group)
    rows, dim = embedding.weight.shape
    config = ModelParallelConfig(tensor_model_parallel_size=size, use_cpu_initialization=True,
                                 perform_initialization=False, params_dtype=embedding.weight.dtype)
    with torch.device("meta"):
        layer = VocabParallelEmbedding(rows * size, dim, init_method=lambda weight: None, config=config,
                                       tp_group=group)
    layer.weight = embedding.weight
    return layer
