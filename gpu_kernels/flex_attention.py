"""MLA's document-causal attention as one FlexAttention call per layer, the GPU path beside the per-document
SDPA reference (moe_pretrain/ops/document_attention.py).

The reference launches one SDPA per document of the micro-batch, with the bounds read on the host; here the
flattened sequence [1, N] (documents are cu_seqlens segments, as fla and Transformer Engine's THD layout
take them) is one call whose block mask says which 128 x 128 tiles to visit: a key block is visited by a
query block at or after it when their documents overlap, and skipped whole otherwise; a tile inside one
document and strictly below the diagonal is full (no mask evaluated). The mask is built from cu_seqlens on
the device, with no host read and no N x N tensor (blocks x blocks only), once per micro-batch
(DocumentLayout.attention_mask) and shared by every MLA layer. FlexAttention takes q / k head dim 192 and
v head dim 128 as they are (no padding). Its forward compiles and runs on a CPU too (tests compare it with
the reference there); its backward runs on CUDA only, so training takes it on CUDA alone.
"""

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128
"""FlexAttention's default tile (queries and keys)."""

WIDE_FLOAT32_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}
"""The forward's tiles for float32 heads wider than 128: inductor's default float32 tiles for MLA's 192-wide
q / k overflow an H200's 227 KiB of shared memory per block (seen on one); these take a quarter of it. bf16
keeps inductor's choice (the backward's float32 default tiles are already 16 x 16)."""


MIN_HEAD_DIM = 16
"""FlexAttention's GPU lowering takes query / key and value heads of 16 or more (narrower ones are a lowering
error when the first call compiles)."""


def flex_unavailable_reason(device: torch.device, training: bool, qk_head_dim: int = MIN_HEAD_DIM,
                            v_head_dim: int = MIN_HEAD_DIM) -> str | None:
    """Why FlexAttention cannot run this attention (MLA's query / key and value head widths) on this device;
    None when it can."""
    if training and device.type != "cuda":
        return f"FlexAttention has no backward on {device.type}"
    if min(qk_head_dim, v_head_dim) < MIN_HEAD_DIM:
        return (f"FlexAttention takes heads of {MIN_HEAD_DIM} or more, not {qk_head_dim} (model.mla.qk_nope_head_dim"
                f" + qk_rope_head_dim) / {v_head_dim} (model.mla.v_head_dim)")
    return None


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(cu_seqlens: torch.Tensor, length: int) -> BlockMask:
    """The causal same-document mask of the flattened sequence of `length` positions, cu_seqlens [D + 1]."""
    device = cu_seqlens.device
    positions = torch.arange(length, device=device)
    doc = torch.searchsorted(cu_seqlens, positions, right=True) - 1  # [N] document of each position
    blocks = -(-length // BLOCK)
    starts = torch.arange(blocks, device=device) * BLOCK
    first, last = doc[starts], doc[(starts + BLOCK - 1).clamp_max(length - 1)]  # docs rise along the sequence
    q_first, q_last = first[:, None], last[:, None]
    below = starts[None, :] <= starts[:, None]  # [q block, kv block]: key block at or before the query block
    visited = below & (last[None, :] >= q_first)  # some key of the block shares a document with some query
    full = (starts[None, :] < starts[:, None]) & (first[None, :] == last[None, :]) & (q_first == q_last) \
        & (first[None, :] == q_first)
    full &= (starts[:, None] + BLOCK <= length)  # a ragged last query block is never full
    partial = visited & ~full

    def as_kv_blocks(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = chosen.sum(-1, dtype=torch.int32)
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # chosen first
        return counts[None, None], order[None, None]

    def same_document_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return BlockMask.from_kv_blocks(*as_kv_blocks(partial), *as_kv_blocks(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=same_document_causal, seq_lengths=(length, length))


def flex_document_attention(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, mask: BlockMask,
                            scale: float) -> torch.Tensor:
    """[N, H, D] q / k and [N, H, Dv] v -> [N, H, Dv], one FlexAttention call over every document."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q_NHD, k_NHD, v_NHD))  # [1, H, N, D]
    wide_float32 = q.dtype == torch.float32 and q.shape[-1] > 128
    return _compiled()(q, k, v, block_mask=mask, scale=scale,
                       kernel_options=WIDE_FLOAT32_TILES if wide_float32 else None)[0].transpose(0, 1)
