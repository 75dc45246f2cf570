"""Newton-Schulz orthogonalisation, Muon's update direction (the report's Per-Head Muon, §2.5).

Muon replaces a matrix's momentum M = U S V^T by (nearly) U V^T: every direction of the update moves the weight
by about the same amount. The quintic iteration X <- a X + b (X X^T) X + c (X X^T)^2 X, five times from X = M /
||M||_F, with the coefficients (3.4445, -4.7750, 2.0315) public Muon implementations use (Keller Jordan's), pushes
every singular value into a band around 1 (not exactly 1: the coefficients trade exactness for speed) without
an SVD. It works on the wide orientation (rows <= columns) so X X^T is the smaller Gram matrix.

The update is then scaled so its RMS matches AdamW's typical update (Moonlight's rule, 0.2 sqrt(max(rows,
columns))): Muon takes AdamW's learning rate and weight decay unchanged.

Per-head (Per-Head Muon): a projection holding H heads' rows is orthogonalised head block by head block (a batch
of [rows / H, columns] matrices), so one head's scale does not set another's; a stacked expert weight is a batch
of experts the same way.
"""

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
UPDATE_RMS = 0.2
"""Muon's update RMS after scaling: about AdamW's on the same parameters (Moonlight)."""


def orthogonalize(m: torch.Tensor, steps: int = STEPS, eps: float = 1e-7) -> torch.Tensor:
    """[..., rows, columns] -> the Newton-Schulz orthogonalisation of each matrix, in m's dtype (the iteration
    runs in float32 for float32 / bfloat16 inputs, in float64 for float64)."""
    work = m.to(torch.float64 if m.dtype == torch.float64 else torch.float32)
    tall = work.shape[-2] > work.shape[-1]
    x = work.mT if tall else work
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])  # a batch of matrices: baddbmm's form
    a, b, c = COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        # b gram + c gram^2, then a x + (that) x: each a product with its sum in one kernel, no elementwise pass
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.reshape(shape)
    return (x.mT if tall else x).to(m.dtype)


def muon_update(m: torch.Tensor, heads: int = 1) -> torch.Tensor:
    """The scaled Muon update of a momentum matrix [..., rows, columns], orthogonalised per head block when
    heads > 1 (rows split into `heads` equal blocks)."""
    rows, columns = m.shape[-2:]
    if rows % heads:
        raise ValueError(f"muon_update: {rows} rows do not split into {heads} heads")
    blocks = m.unflatten(-2, (heads, rows // heads))
    scale = UPDATE_RMS * max(rows // heads, columns) ** 0.5
    return (orthogonalize(blocks) * scale).flatten(-3, -2)
