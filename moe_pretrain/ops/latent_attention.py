"""Causal attention within packed documents whose keys and values are expanded, block by block, from a
compact per-key latent: MLA's context parallelism by the latent.

Shape legend: N queries (this rank's positions, any order), M keys (every position of the flattened
packed batch, in sequence order), H heads, D query-key dims, Dv value dims, C latent width (MLA's
kv_lora_rank + rope dims: 576 at full size, against H x (D + Dv) expanded values per key).

A rank holding a share of the queries gathers the latent of every key (C values per key, not H x (D + Dv))
and calls this. Keys are processed in blocks of `key_block`: each block's keys and values are expanded
by `expand` (MLA's kv norm and up-projection, the rotary embedding), the scores of each tile of
`query_block` queries against them are masked to the same document and the past, and an online softmax
(running max and log-sum-exp) merges the blocks. Only the output and the log-sum-exp are saved: the
backward expands each block again and follows flash attention's backward (P = exp(S - lse),
dS = P (dP - rowsum(dO O))), pushing dK and dV back through `expand` into the latent and the
parameters. So memory is the latent, the queries and one block's expansion and scores, never the
expanded K / V of the whole sequence (64 GB for one full-size layer at 1M tokens in bf16).
Tiles that no query of the tile can see (all keys in the future, or in other documents) are skipped,
from host-side positions (no device reads).
"""

import bisect
import itertools
from collections.abc import Callable, Sequence

import torch

Expand = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
"""expand(latent block [n, C], start, end) -> (keys [n, H, D], values [n, H, Dv]) of keys start..end."""


def _tiles(count: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, count)) for start in range(0, count, size)]


class _Visibility:
    """Which query tiles see which key blocks, from host integers only.

    query_index: each query's position in the key sequence; bounds: cu_seqlens of the key sequence."""

    def __init__(self, query_index: Sequence[int], bounds: Sequence[int], query_block: int, key_block: int,
                 keys: int):
        self.query_tiles = _tiles(len(query_index), query_block)
        self.key_blocks = _tiles(keys, key_block)
        self.tiles_seeing: list[list[int]] = [[] for _ in self.key_blocks]
        """Per key block, the query tiles that may see some of its keys (a superset: exact masks follow)."""
        for tile, (q0, q1) in enumerate(self.query_tiles):
            positions = query_index[q0:q1]
            latest = max(positions)
            first_doc_start = bounds[bisect.bisect_right(bounds, min(positions)) - 1]
            for b, (k0, k1) in enumerate(self.key_blocks):
                if k0 <= latest and k1 > first_doc_start:
                    self.tiles_seeing[b].append(tile)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, scale: float, q_index: torch.Tensor, q_doc: torch.Tensor,
                   k_index: torch.Tensor, k_doc: torch.Tensor) -> torch.Tensor:
    """[n_q, H, n_k] scores, -inf where the key is in the future or in another document."""
    scores = torch.einsum("qhd,khd->qhk", q, k) * scale
    visible = (k_index[None, :] <= q_index[:, None]) & (k_doc[None, :] == q_doc[:, None])
    return scores.masked_fill(~visible[:, None, :], float("-inf"))


class _LatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_NHD, latent_MC, q_index, q_doc, k_doc, visibility, expand, scale, maxima, *params):
        compute = torch.promote_types(q_NHD.dtype, torch.float32)
        N, H, _ = q_NHD.shape
        k_index = torch.arange(latent_MC.shape[0], device=latent_MC.device)
        out = running_max = total = None  # [N, H, Dv], [N, H], [N, H]: the online softmax of every query
        for b, (k0, k1) in enumerate(visibility.key_blocks):
            tiles = visibility.tiles_seeing[b]
            if not tiles:
                continue
            k, v = (t.to(compute) for t in expand(latent_MC[k0:k1], k0, k1))  # once per block
            if out is None:
                out = q_NHD.new_zeros((N, H, v.shape[-1]), dtype=compute)
                running_max = q_NHD.new_full((N, H), float("-inf"), dtype=compute)
                total = q_NHD.new_zeros((N, H), dtype=compute)
            for tile in tiles:
                q0, q1 = visibility.query_tiles[tile]
                scores = _masked_scores(q_NHD[q0:q1].to(compute), k, scale, q_index[q0:q1], q_doc[q0:q1],
                                        k_index[k0:k1], k_doc[k0:k1])
                new_max = torch.maximum(running_max[q0:q1], scores.amax(-1))
                safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
                p = torch.exp(scores - safe_max[..., None])
                rescale = torch.exp(running_max[q0:q1] - safe_max)  # 0 where nothing was seen yet
                out[q0:q1] = out[q0:q1] * rescale[..., None] + torch.einsum("qhk,khd->qhd", p, v)
                total[q0:q1] = total[q0:q1] * rescale + p.sum(-1)
                running_max[q0:q1] = safe_max
        out = (out / total[..., None]).to(q_NHD.dtype)  # every query sees at least itself: total > 0
        lse = running_max + torch.log(total)
        if maxima is not None:  # each head's largest score over these queries (QK-clip's record)
            maxima.append(running_max.amax(0).detach())
        ctx.save_for_backward(q_NHD, latent_MC, q_index, q_doc, k_doc, out, lse, *params)
        ctx.visibility, ctx.expand, ctx.scale, ctx.compute = visibility, expand, scale, compute
        device = latent_MC.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return out

    @staticmethod
    def backward(ctx, dout_NHDv):
        q_NHD, latent_MC, q_index, q_doc, k_doc, out, lse, *params = ctx.saved_tensors
        visibility, expand, scale, compute = ctx.visibility, ctx.expand, ctx.scale, ctx.compute
        k_index = torch.arange(latent_MC.shape[0], device=latent_MC.device)
        dout = dout_NHDv.to(compute)
        delta = (dout * out.to(compute)).sum(-1)  # [N, H]
        dq = torch.zeros_like(q_NHD, dtype=compute)
        dlatent = torch.zeros_like(latent_MC)
        dparams = [torch.zeros_like(p) if p.requires_grad else None for p in params]
        wanted = [p for p in params if p.requires_grad]
        wanted_index = [i for i, p in enumerate(params) if p.requires_grad]
        for b, (k0, k1) in enumerate(visibility.key_blocks):
            tiles = visibility.tiles_seeing[b]
            if not tiles:
                continue
            device, dtype, enabled = ctx.autocast  # the forward's expansion, in the forward's precision
            with torch.enable_grad(), torch.autocast(device, dtype, enabled=enabled):
                block = latent_MC[k0:k1].detach().requires_grad_(latent_MC.requires_grad)
                k_raw, v_raw = expand(block, k0, k1)
            k, v = k_raw.detach().to(compute), v_raw.detach().to(compute)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            for tile in tiles:
                q0, q1 = visibility.query_tiles[tile]
                q = q_NHD[q0:q1].to(compute)
                scores = _masked_scores(q, k, scale, q_index[q0:q1], q_doc[q0:q1], k_index[k0:k1], k_doc[k0:k1])
                p = torch.exp(scores - lse[q0:q1, :, None])
                dv += torch.einsum("qhk,qhd->khd", p, dout[q0:q1])
                dp = torch.einsum("qhd,khd->qhk", dout[q0:q1], v)
                ds = p * (dp - delta[q0:q1, :, None]) * scale
                dq[q0:q1] += torch.einsum("qhk,khd->qhd", ds, k)
                dk += torch.einsum("qhk,qhd->khd", ds, q)
            inputs = ([block] if block.requires_grad else []) + wanted
            if inputs:
                grads = torch.autograd.grad((k_raw, v_raw), inputs, (dk.to(k_raw.dtype), dv.to(v_raw.dtype)),
                                            allow_unused=True)
                if block.requires_grad:
                    dlatent[k0:k1] = grads[0]
                    grads = grads[1:]
                for index, grad in zip(wanted_index, grads, strict=True):
                    if grad is not None:
                        dparams[index] += grad
        return (dq.to(q_NHD.dtype), dlatent if latent_MC.requires_grad else None, None, None, None, None, None,
                None, None, *dparams)


def latent_causal_attention(q_NHD: torch.Tensor, query_index: Sequence[int], latent_MC: torch.Tensor,
                            bounds: Sequence[int], expand: Expand, params: Sequence[torch.Tensor], scale: float,
                            *, query_block: int = 1024, key_block: int = 1024, max_logits: bool = False
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each query's softmax attention over the keys of its document at or before its position -> [N, H, Dv];
    with max_logits also each head's largest score over these queries, [H] (from the online softmax's running
    maximum: no extra pass).

    query_index: each query's position in the key sequence (host integers); bounds: the key sequence's
    cu_seqlens (host integers, [0, ..., M]); params: every tensor `expand` reads that needs a gradient (its
    weights), so that autograd sees them."""
    M = latent_MC.shape[0]
    if len(query_index) != q_NHD.shape[0]:
        raise ValueError(f"latent_causal_attention: {len(query_index)} query positions for {q_NHD.shape[0]} queries")
    if bounds[0] != 0 or bounds[-1] != M:
        raise ValueError(f"latent_causal_attention: bounds must run from 0 to M={M}")
    device = latent_MC.device
    index = torch.tensor(list(query_index), device=device)
    key_doc = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=device),  # M given: no device read
                                      torch.tensor([e - s for s, e in itertools.pairwise(bounds)], device=device),
                                      output_size=M)
    query_doc = key_doc[index]
    visibility = _Visibility(query_index, bounds, query_block, key_block, M)
    maxima = [] if max_logits else None
    out = _LatentAttention.apply(q_NHD, latent_MC, index, query_doc, key_doc, visibility, expand, scale, maxima,
                                 *params)
    return (out, maxima[0]) if max_logits else out
