"""Which parameters Muon updates, and how (Per-Head Muon, the report's §2.5).

Muon takes the 2-D weight matrices of the blocks (and of the vision tower and projector); each is orthogonalised
whole, except Q / K / V, which are orthogonalised head block by head block: KDA's q / k / v projections
(head_dim rows per head) and MLA's query and key / value up-projections (qk_nope + qk_rope, and qk_nope + v rows
per head). A stacked expert weight [E, out, in] is a batch of E matrices; the patch embedding's [D, C, p, p]
convolution is the matrix [D, C p p]. Rules are by rows per block, not head counts, so a tensor-parallel shard
(whole heads) follows the same rule.

AdamW keeps what is not a matrix of a linear map: the embeddings and the output head (as public Muon setups
do), vectors (norms, biases, A_log, dt_bias), the depthwise short convolutions' filters, the AttnRes
pseudo-queries and the vision position table.
"""

from dataclasses import dataclass

import torch

from moe_pretrain.config import ModelConfig

ADAMW_NAMES = ("embedding.weight", "head.weight")
ADAMW_SUFFIXES = ("pseudo_query.weight", "_conv.weight", "pos_emb.weight")


@dataclass(frozen=True)
class MuonRule:
    head_rows: int
    """Rows per orthogonalised block (one head's); 0: the whole matrix."""


def muon_rule(name: str, param: torch.Tensor, m: ModelConfig) -> MuonRule | None:
    """How Muon updates the parameter `name` (our model's state-dict key), or None: AdamW's."""
    if param.dim() < 2 or name in ADAMW_NAMES or name.endswith(ADAMW_SUFFIXES):
        return None
    if name.endswith(("mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight")):
        return MuonRule(m.kda.head_dim)
    if name.endswith("mixer.q_up.weight"):
        return MuonRule(m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim)
    if name.endswith("mixer.kv_up.weight"):
        return MuonRule(m.mla.qk_nope_head_dim + m.mla.v_head_dim)
    return MuonRule(0)


def as_matrices(param: torch.Tensor) -> torch.Tensor:
    """The parameter as [..., rows, columns]: a matrix, a batch of experts, or a convolution's [out, in p p]."""
    return param.flatten(1) if param.dim() == 4 else param
