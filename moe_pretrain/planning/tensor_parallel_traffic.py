"""Bytes one GPU sends over tensor parallelism in one micro-batch, collective by collective as the code issues
them (parallel/tensor_parallel.py, parallel/sequence.py, megatron-core's VocabParallelEmbedding).

Per layer and pass (the forward; the backward sends each collective's dual, the same bytes; full
recomputation sends the forward's again), in the activation dtype:
- the sequence mixer: what its spec's tp_widths says (model/kda_spec.py, model/mla_spec.py);
- a dense MLP or the MoE's shared experts: the input gathered, the output reduce-scattered (the routed
  experts exchange over expert parallelism instead). Full recomputation's second forward stops at the layer's
  last saved input (torch.utils.checkpoint's early stop), before that reduce-scatter.
The first pipeline rank also all-reduces each embedding lookup over the vocabulary shards, the backbone's and
one per multi-token-prediction block, in the embedding's dtype (fp32 master weights: 4 bytes), and gathers
its gradient backward; the last gathers the final hidden state for the head once per head call (the backbone
and each block) and reduce-scatters its gradient. The loss's per-position all-reduces (T values, not T x D)
are left out.
"""

from moe_pretrain.config import ModelConfig
from moe_pretrain.model.mixers import mixer_spec
from moe_pretrain.planning.step_time import sent_share

EMBEDDING_BYTES = 4
"""The embedding lookup's dtype under every training dtype but float64: its fp32 weight's (autocast leaves
lookups alone)."""


def ring_share(size: int, nbytes: float) -> float:
    """What one of `size` ranks sends of a gathered or reduce-scattered payload of nbytes (the dry run's
    rule for the same collectives, so plan and trace count alike)."""
    return nbytes * sent_share("allgather", size)


def layer_widths_of_mixer(m: ModelConfig, index: int) -> int:
    """Per position, the values a layer's sequence mixer gathers or reduce-scatters over tensor parallelism."""
    return mixer_spec(m, index).tp_widths(m)


def layer_widths(m: ModelConfig, index: int) -> int:
    """Per position, the values a layer's forward gathers or reduce-scatters over tensor parallelism: its
    mixer's, and a dense MLP's or the shared experts' input gather and output reduce-scatter."""
    mlp = 2 * m.hidden_size if not m.is_moe_layer(index) or m.moe.num_shared_experts else 0
    return layer_widths_of_mixer(m, index) + mlp


def tensor_parallel_bytes(m: ModelConfig, layers: list[int], tokens: float, tp: int, act_bytes: int,
                          passes: int, first: bool, last: bool) -> float:
    """Sent by one GPU in one micro-batch of `tokens` positions (the whole sequence of this rank's rows)."""
    if tp == 1:
        return 0.0
    d = m.hidden_size
    widths = sum(layer_widths(m, i) for i in layers)
    sent = passes * ring_share(tp, tokens * act_bytes * widths)
    if passes == 3:  # full recomputation stops at the last saved input, before the MLP's reduce-scatter
        sent -= ring_share(tp, tokens * act_bytes * d * sum(layer_widths(m, i) > layer_widths_of_mixer(m, i)
                                                             for i in layers))
    lookups = 1 + m.mtp.layers
    embedding_bytes = act_bytes if act_bytes > EMBEDDING_BYTES else EMBEDDING_BYTES
    if first:  # an all-reduce sends twice a ring share; the backward gathers the gradient
        sent += lookups * 3 * ring_share(tp, tokens * d * embedding_bytes)
    if last:
        sent += lookups * 2 * ring_share(tp, tokens * d * act_bytes)
    return sent
