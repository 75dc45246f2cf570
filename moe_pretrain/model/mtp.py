"""Multi-token prediction blocks (model.mtp; the K3 report's §4.1.4, DeepSeek-V3's sequential MTP modules).

Shape legend: B batch, T positions, D hidden.
Block k (1-based) at position t: x = W [RMSNorm(h_{k-1}); RMSNorm(e_{t+k})], h_k = x + Layer([x]), where h_0 is
the backbone's last hidden state (the final AttnRes mix, before the final norm), e_{t+k} the embedding of token
t + k and Layer one decoder layer of the backbone's structure (the kind of its last layer; its AttnRes mixes
see the block's input only). Its logits head(RMSNorm_k(h_k)), through the backbone's shared output head, predict
token t + k + 1. A position whose token t + k + 1 is in another document or past the row has no target.

The embeddings e_{t+k} are looked up where the embedding lives (the first pipeline stage) from the tokens shifted
by k (every rank holds every position's tokens, so no exchange is needed under context or sequence parallelism)
and travel to the last stage beside the bank's embeddings.
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.data import IGNORE_INDEX
from moe_pretrain.model.decoder_layer import DecoderLayer
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.norm import RMSNorm


class MTPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int, kernels: Kernels = REFERENCES):
        """depth: k, the block's place in the chain (1-based); its layer's index is num_layers + k - 1."""
        super().__init__()
        d = cfg.hidden_size
        self.hidden_norm = RMSNorm(d, cfg.norm_eps, kernels)
        self.embedding_norm = RMSNorm(d, cfg.norm_eps, kernels)
        self.projection = make_linear(2 * d, d, init_std=cfg.init_std)
        self.layer = DecoderLayer(cfg, cfg.num_layers + depth - 1, kernels)
        self.norm = RMSNorm(d, cfg.norm_eps, kernels)
        """The block's own norm in front of the shared head."""

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, layout: DocumentLayout
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden h_{k-1}, embedded e_{t+k} [B, T, D] (this rank's positions) -> (h_k, balancing loss or None)."""
        x = self.projection(torch.cat([self.hidden_norm(hidden), self.embedding_norm(embedded)], dim=-1))
        partial, balance_loss = self.layer([x], None, layout)
        return x + partial, balance_loss


def tokens_ahead(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T] -> token t + k at position t (the last k positions repeat the row's last token: no target reads
    them)."""
    return torch.cat([tokens[:, k:], tokens[:, -1:].expand(-1, k)], dim=1)


def mtp_labels(labels: torch.Tensor, doc_ids: torch.Tensor | None, depth: int) -> torch.Tensor:
    """labels [B, T] (token t + 1 at t, or IGNORE_INDEX) -> [B, depth, T]: block k's target at t is token
    t + k + 1, labels[t + k], when position t + k is in t's document; IGNORE_INDEX otherwise."""
    targets = []
    for k in range(1, depth + 1):
        ahead = tokens_ahead(labels, k)
        valid = torch.arange(labels.shape[1], device=labels.device) < labels.shape[1] - k
        if doc_ids is not None:
            valid = valid & (tokens_ahead(doc_ids, k) == doc_ids)
        targets.append(torch.where(valid, ahead, IGNORE_INDEX))
    return torch.stack(targets, dim=1)
