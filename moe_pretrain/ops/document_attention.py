"""Causal attention within each packed document, with memory linear in the sequence (no T x T mask).

Shape legend: N positions of the flattened packed batch ([B, T] -> B*T; documents never cross rows), H heads,
D / Dv query-key / value dims. Documents are the cu_seqlens segments (fla's convention). Each document is
one causal SDPA call on [1, H, L, D]: with 4-D inputs and no mask, PyTorch picks its flash kernel on CPU
(and on CUDA), which tiles the scores and saves only the log-sum-exp for the backward, so memory grows with
T, never with T^2 (bench/attention.py measures it against the dense [T, T] mask this replaced). The flash
kernel needs one head dim for q, k and v; MLA's values are narrower (128 against 192 at full size), and
with unequal dims SDPA silently takes its math path, which saves each document's [L, L] probabilities
(measured: ~doc length x heads floats per token). So the narrower of q/k and v is zero-padded to the
wider and the output sliced back to Dv.
This is the CPU path and the reference; on CUDA MLA does all documents in one FlexAttention call
(gpu_kernels/flex_attention.py, kernels.attention).
"""

import itertools

import torch
import torch.nn.functional as F


def document_causal_attention(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor,
                              bounds: list[int], scale: float, *, causal: bool = True) -> torch.Tensor:
    """Softmax attention of each position over the earlier positions of its document -> [N, H, Dv].
    bounds: cu_seqlens as host integers, [0, ..., N]. causal=False: over every position of its document
    (the vision tower's images, attended bidirectionally)."""
    if not (q_NHD.shape[:2] == k_NHD.shape[:2] == v_NHD.shape[:2]):
        raise ValueError(f"document_causal_attention: q {tuple(q_NHD.shape)}, k {tuple(k_NHD.shape)} and "
                         f"v {tuple(v_NHD.shape)} must agree on [N, H]")
    if bounds[0] != 0 or bounds[-1] != q_NHD.shape[0]:
        raise ValueError(f"document_causal_attention: bounds must run from 0 to N={q_NHD.shape[0]}")
    Dv, width = v_NHD.shape[-1], max(q_NHD.shape[-1], v_NHD.shape[-1])
    # Zero dims change neither q . k nor the output's first Dv dims (the scale is explicit).
    q_NHD, k_NHD, v_NHD = (F.pad(t, (0, width - t.shape[-1])) for t in (q_NHD, k_NHD, v_NHD))
    # One split per tensor, not a slice per document: a slice's backward writes a zero tensor of the whole
    # sequence per document, a split's backward one concatenation of the documents' gradients.
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    q, k, v = (t.transpose(0, 1).unsqueeze(0).split(lengths, dim=2) for t in (q_NHD, k_NHD, v_NHD))  # [1, H, L, D]
    outputs = [F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=causal, scale=scale)
               for q_doc, k_doc, v_doc in zip(q, k, v, strict=True)]
    return torch.cat(outputs, dim=2)[0].transpose(0, 1)[..., :Dv]
