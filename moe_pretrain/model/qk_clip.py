"""QK-clip: Kimi K2's weight clipping of attention heads whose logits grew too large (the K3 report's §3.3).

Muon lets attention logits grow without bound in a few heads (the K2 report's "MuonClip"). The forward records
each MLA head's largest pre-softmax logit (scaled q . k over pairs within a document, past and present only);
after the optimizer step the maxima are max-reduced over the data- and context-parallel group (each rank saw its
rows and positions), and every head whose maximum exceeded optim.qk_clip_threshold has its weights scaled by
gamma = threshold / max, so that the same inputs would give it exactly the threshold: the head's query rows of
q_up (its nope part) and key rows of kv_up by sqrt(gamma) each, its rope query rows by gamma (the rope key is
shared by every head and stays; K2's rule for MLA). Other heads are untouched. Everything stays on the device:
no host read. Under tensor parallelism a rank clips its own heads (q_up and kv_up are split by head).

Recording costs one more q . k pass over every causal pair of the plain and Ulysses paths (no softmax, no
values: a blockwise max, never a [T, T] tensor); the latent exchange takes it from its online softmax's running
maximum for free.
"""

import itertools
from collections.abc import Callable

import torch
from torch import nn


@torch.no_grad()
def document_max_logits(q_NHD: torch.Tensor, k_NHD: torch.Tensor, bounds: list[int], scale: float,
                        block: int = 256) -> torch.Tensor:
    """Each head's largest scale q . k over (query, key) pairs of the same document with the key at or before
    the query -> [H] (float32 or wider), a block of queries at a time."""
    compute = torch.promote_types(q_NHD.dtype, torch.float32)
    best = q_NHD.new_full((q_NHD.shape[1],), float("-inf"), dtype=compute)
    for start, end in itertools.pairwise(bounds):
        for q0 in range(start, end, block):
            q1 = min(q0 + block, end)
            scores = torch.einsum("qhd,khd->hqk", q_NHD[q0:q1].to(compute), k_NHD[start:q1].to(compute)) * scale
            causal = torch.arange(q0, q1, device=q_NHD.device)[:, None] >= torch.arange(start, q1,
                                                                                         device=q_NHD.device)
            best = torch.maximum(best, scores.masked_fill(~causal, float("-inf")).amax(dim=(1, 2)))
    return best


class MaxLogitRecord:
    """A mixer's running per-head maximum over the step's forwards (micro-batches, recomputations)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def note(self, maxima: torch.Tensor) -> None:
        maxima = maxima.detach()
        self.value = maxima if self.value is None else torch.maximum(self.value, maxima)


def _mla_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "max_logits")]


def start_recording(model: nn.Module) -> None:
    """Forget the previous step's maxima: every MLA layer records this step's."""
    for layer in _mla_layers(model):
        layer.max_logits = MaxLogitRecord()


@torch.no_grad()
def clip_heads(model: nn.Module, threshold: float,
               reduce: Callable[[torch.Tensor], torch.Tensor] = lambda maxima: maxima,
               scale_rows: Callable[[nn.Parameter, torch.Tensor], None] = (
                   lambda weight, factor: weight.mul_(factor[:, None]))) -> torch.Tensor | None:
    """Scale the weights of every head whose step maximum exceeded `threshold`; `reduce` takes this rank's
    maxima [MLA layers here, heads here] to the step's (the trainer's: a max over the data x context parallel
    ranks, training/step_hooks.py); `scale_rows` multiplies each row of a weight by its factor (the trainer's: the
    optimizer's, which scales a bf16-held weight's fp32 master too). Returns the reduced maxima (None: no MLA
    layer recorded)."""
    layers = [layer for layer in _mla_layers(model)
              if layer.max_logits is not None and layer.max_logits.value is not None]
    if not layers:
        return None
    maxima = reduce(torch.stack([layer.max_logits.value for layer in layers]))
    gamma = torch.where(maxima > threshold, threshold / maxima, torch.ones_like(maxima))
    for layer, g in zip(layers, gamma):
        cfg, heads = layer.cfg, g.shape[0]
        nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        # Per output row, head by head: the query's nope rows by sqrt(g), its rope rows by g; the key's nope rows
        # by sqrt(g), the value's rows kept.
        root = g.sqrt()[:, None]
        query = torch.cat([root.expand(heads, nope), g[:, None].expand(heads, rope)], 1)
        key_value = torch.cat([root.expand(heads, nope), torch.ones_like(root).expand(heads, cfg.v_head_dim)], 1)
        scale_rows(layer.q_up.weight, query.flatten())
        scale_rows(layer.kv_up.weight, key_value.flatten())
    return maxima
