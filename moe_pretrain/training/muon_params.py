"""Which parameters Muon updates, and how (Per-Head Muon, the report's §2.5).

Muon takes the 2-D weight matrices of the blocks (and of the vision tower and projector); each is orthogonalised
whole, except Q / K / V, which are orthogonalised head block by head block, as each sequence mixer's spec names
them (muon_head_rows): KDA's q / k / v projections (head_dim rows per head) and MLA's query and key / value
up-projections (qk_nope + qk_rope, and qk_nope + v rows per head). A stacked expert weight [E, out, in] is a
batch of E matrices; the patch embedding's [D, C, p, p] convolution is the matrix [D, C p p]. Rules are by rows
per block, not head counts, so a tensor-parallel shard (whole heads) follows the same rule.

AdamW keeps what is not a matrix of a linear map: the embeddings and the output head (as public Muon setups
do), vectors (norms, biases, A_log, dt_bias), the depthwise short convolutions' filters, the AttnRes
pseudo-queries and the vision position table.
"""

import re
from dataclasses import dataclass

import torch

from moe_pretrain.config import ModelConfig
from moe_pretrain.model.mixers import mixer_spec

ADAMW_NAMES = ("embedding.weight", "head.weight")
ADAMW_SUFFIXES = ("pseudo_query.weight", "_conv.weight", "pos_emb.weight")
MIXER_PARAM = re.compile(r"(?:^|\.)(?:layers\.(?P<layer>\d+)|mtp\.(?P<block>\d+)\.layer)\.mixer\.(?P<param>.+)$")
"""A sequence mixer's parameter: a backbone layer's, or a multi-token-prediction block's layer's (it mirrors the
backbone's last layer: any index from num_layers on)."""


@dataclass(frozen=True)
class MuonRule:
    head_rows: int
    """Rows per orthogonalised block (one head's); 0: the whole matrix."""


def muon_rule(name: str, param: torch.Tensor, m: ModelConfig) -> MuonRule | None:
    """How Muon updates the parameter `name` (our model's state-dict key), or None: AdamW's."""
    if param.dim() < 2 or name in ADAMW_NAMES or name.endswith(ADAMW_SUFFIXES):
        return None
    mixer = MIXER_PARAM.search(name)
    if mixer:
        layer, block = mixer.group("layer"), mixer.group("block")
        index = int(layer) if layer is not None else m.num_layers + int(block)
        return MuonRule(mixer_spec(m, index).muon_head_rows(m).get(mixer.group("param"), 0))
    return MuonRule(0)


def as_matrices(param: torch.Tensor) -> torch.Tensor:
    """The parameter as [..., rows, columns]: a matrix, a batch of experts, or a convolution's [out, in p p]."""
    return param.flatten(1) if param.dim() == 4 else param
