"""Column- and row-parallel linear layers with sequence parallelism (megatron-core semantics, any device).

Shape legend: B batch, T sequence, T/tp a sequence shard, I in features, O out features.
Column: input [B, T/tp, I] -> all-gather along T -> [B, T, I] @ W[O/tp rows]^T -> [B, T, O/tp].
Row:    input [B, T, I/tp] @ W[:, I/tp cols]^T -> partial [B, T, O] -> reduce-scatter -> [B, T/tp, O].
Both are built from the single-process nn.Linear by slicing its weight, so every tensor-parallel size
starts from the same master weights. Their parameters carry tensor_parallel_dim (the sliced
dimension): complete on each rank for its slice, they reduce over data parallel only, unlike
replicated parameters, whose gradients are partial over the sequence shards and also reduce over
tensor parallel.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.collectives import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel


def shard(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} cannot be split over {size} "
                         "tensor-parallel ranks")
    chunk = tensor.shape[dim] // size
    return tensor.detach().narrow(dim, rank * chunk, chunk).clone()


def mark_tensor_parallel(module: nn.Module, dim: int) -> None:
    for p in module.parameters(recurse=False):
        p.tensor_parallel_dim = dim


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(shard(linear.weight, 0, rank, size))
        self.bias = nn.Parameter(shard(linear.bias, 0, rank, size)) if linear.bias is not None else None
        mark_tensor_parallel(self, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(gather_from_sequence_parallel(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("RowParallelLinear: a bias would be added tp times; the model's row layers have none")
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.weight = nn.Parameter(shard(linear.weight, 1, rank, size))
        mark_tensor_parallel(self, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel(F.linear(x, self.weight), self.group)


def vocab_parallel_embedding(embedding: nn.Embedding, group: dist.ProcessGroup) -> nn.Module:
    """megatron-core's VocabParallelEmbedding holding this rank's rows of the given embedding.

    Its output is the whole-sequence embedding, all-reduced over tensor parallel (the model then keeps
    its sequence shard); the weight keeps the name `weight`, so state-dict keys do not change.
    """
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import VocabParallelEmbedding

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    config = ModelParallelConfig(tensor_model_parallel_size=size, use_cpu_initialization=True,
                                 perform_initialization=False, params_dtype=embedding.weight.dtype)
    layer = VocabParallelEmbedding(embedding.num_embeddings, embedding.embedding_dim,
                                   init_method=lambda weight: None, config=config, tp_group=group)
    with torch.no_grad():
        layer.weight.copy_(shard(embedding.weight, 0, rank, size))
    mark_tensor_parallel(layer, 0)
    return layer
