"""Stable LatentMoE (docs/model.md): route in d, compute routed experts in the latent l, return to d.

x -> router (top-k of sigmoid scores + bias) ; z = W_down x (d -> l) ; routed experts on z ;
weighted sum -> RMSNorm(l) -> W_up (l -> d) ; + shared SiTU-GLU experts on x (full d).
Expert parallelism therefore moves l-dim rows, half the bytes of d-dim ones at full size.
"""

import torch
from torch import nn

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config import MoEConfig
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.model.linear import make_linear
from moe_pretrain.model.mlp import SiTUGLUMLP
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.model.recompute import maybe_recompute
from moe_pretrain.model.router import Router
from moe_pretrain.model.token_dispatch import LocalTokenDispatcher


class LatentMoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig, *, norm_eps: float, init_std: float, out_std: float,
                 kernels: Kernels = REFERENCES):
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg, init_std, kernels.host)
        self.latent_down = make_linear(dim, cfg.latent_size, init_std=init_std)
        self.experts = GroupedExperts(
            cfg.num_experts, cfg.latent_size, cfg.expert_intermediate, beta=cfg.situ_beta,
            linear_beta=cfg.situ_linear_beta, init_std=init_std, out_std=out_std, kernels=kernels,
        )
        self.latent_norm = RMSNorm(cfg.latent_size, norm_eps, kernels)
        self.latent_up = make_linear(cfg.latent_size, dim, init_std=out_std)
        self.shared = None
        if cfg.num_shared_experts > 0:
            self.shared = SiTUGLUMLP(
                dim, cfg.num_shared_experts * cfg.shared_intermediate, beta=cfg.situ_beta,
                linear_beta=cfg.situ_linear_beta, init_std=init_std, out_std=out_std, kernels=kernels,
            )
        self.dispatcher = LocalTokenDispatcher(cfg.num_experts, fused=kernels.triton)
        self.recompute_experts = False
        """Recompute the routed experts' MLP in backward (train.recompute=selective)."""
        self.recompute_around_exchanges = False
        """Recompute around the dispatcher's exchanges, which run once and keep what they received: the
        layer up to them, the routed experts, the way back to d each recomputed (train.recompute=full with
        train.recompute_exchanges=false; model/decoder_layer.py)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, D] -> (y [B, T, D], balancing loss or None)."""
        topk_idx, topk_weight, balance_loss, z_TL = self.to_experts(x)
        y = self.from_experts(self.exchange(z_TL, topk_idx, topk_weight), x.shape)
        if self.shared is not None:
            y = y + self.shared(x)  # [B, T, D]: under sequence parallelism the shared MLP gathers along T
        return y, balance_loss

    def to_experts(self, x: torch.Tensor):
        """x [B, T, D] -> (top-k ids [T, k], weights [T, k], balancing loss or None, latent rows [T, L])."""
        x_TD = x.reshape(-1, x.shape[-1])
        topk_idx, topk_weight, balance_loss = self.router(x_TD)
        return topk_idx, topk_weight, balance_loss, self.latent_down(x_TD)

    def exchange(self, z_TL: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Each latent row through its routed experts and back, weighted and summed -> [T, L]."""
        return self.dispatcher.exchange(z_TL, topk_idx, topk_weight, self._routed_experts)

    def from_experts(self, routed_TL: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The routed experts' sum back to d -> [B, T, D] (shape)."""
        return self.latent_up(self.latent_norm(routed_TL)).reshape(shape)

    def _routed_experts(self, grouped: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The routed experts on rows grouped by local expert (a dispatcher may call this once per chunk)."""
        self.router.record_processed(grouped.shape[0])
        recompute = self.recompute_experts or self.recompute_around_exchanges
        return maybe_recompute(recompute, self.experts, grouped, counts)
