"""Column- and row-parallel linear layers with sequence parallelism (megatron-core semantics, any device).

Shape legend: B batch, T sequence, T/tp a sequence shard, I in features, O out features.
Column: input [B, T/tp, I] -> all-gather along T -> [B, T, I] @ W[O/tp rows]^T -> [B, T, O/tp].
Row:    input [B, T, I/tp] @ W[:, I/tp cols]^T -> partial [B, T, O] -> reduce-scatter -> [B, T/tp, O].
Both take this rank's slice of the weight as it is (parallel/plan.py says which slice, and the model's
initialisation draws its values): they add only the communication around the matmul.
The column layers of one model share an InputGather, so an input several of them read (KDA's q, k, v, beta
and gate projections; the MLP's gate and up) crosses the wire once each way, as megatron-core's fused QKV
projection does.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from moe_pretrain.step_reuse import autocast_weight
from parallel.collectives import gather_from_sequence_parallel, reduce_scatter_to_sequence_parallel


class InputGather:
    """All-gathers each sequence shard once, however many column-parallel layers read it.

    The gathered tensor is remembered while its shard lives (keyed by identity, checked against the shard's
    version, grad mode and autocast dtype, so an in-place change or a re-forward under recompute gathers
    afresh); autograd sums the readers' gradients before the gather's single reduce-scatter. Under autocast
    the shard is cast to the autocast dtype before it is sent: the matmul would cast it anyway, so the wire
    carries bf16 (the precision megatron-core sends) instead of the fp32 residual stream.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._gathered = WeakIdKeyDictionary()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        key = (x._version, torch.is_grad_enabled(), dtype)
        hit = self._gathered.get(x)
        if hit is not None and hit[0] == key:
            return hit[1]
        wire = x.to(dtype) if x.is_floating_point() else x
        gathered = gather_from_sequence_parallel(wire, self.group)
        self._gathered[x] = (key, gathered)
        return gathered


class ColumnParallelLinear(nn.Module):
    cast_weights = ("weight", "bias")
    """Read only through autocast_weight, as the Linear it replaces (model/linear.py cast_weight_names)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup, gather: InputGather | None = None):
        """linear: holding this rank's rows, weight [O/tp, I] and bias [O/tp]; gather: shared by the model's
        column layers (a private one if not given)."""
        super().__init__()
        self.group = group
        self.gather = gather or InputGather(group)
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.gather(x), autocast_weight(self.weight), autocast_weight(self.bias))


class RowParallelLinear(nn.Module):
    cast_weights = ("weight", "bias")
    """Read only through autocast_weight, as the Linear it replaces (model/linear.py cast_weight_names)."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup):
        """linear: holding this rank's columns, weight [O, I/tp]."""
        super().__init__()
        if linear.bias is not None:
            raise ValueError("RowParallelLinear: a bias would be added tp times; the model's row layers have none")
        self.group = group
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_parallel(F.linear(x, autocast_weight(self.weight)), self.group)


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
