"""Where a step's compute goes: each launch the op census counts (planning/op_census.py) filed under the line of
the project's code that made it, and the lines grouped into the model's components (COMPONENTS).

A forward op's line is the innermost frame of the project's packages on the stack. A backward op runs under
the line that started the backward (training/): it is filed under the forward line that made its autograd
node instead, which this mode writes into each node's metadata as the forward makes it. A backward whose
stack holds a line of the model's own code (a recomputed forward, a custom autograd function's backward, a
kernel's backward) is filed under that line. Counts are of tensor sizes and the roofline, the same on every
machine.
"""

import collections
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from moe_pretrain.planning.host_reads import project_site

_ROOT = Path(__file__).resolve().parents[2]
_PASSED_OVER = (str(_ROOT / "moe_pretrain" / "planning") + "/", str(_ROOT / "moe_pretrain" / "ops" / "norms.py"),
                str(_ROOT / "moe_pretrain" / "model" / "linear.py"))
"""Frames never a site: the meters' own (planning/), and code every component calls (ops/norms.py: a norm is
filed under the module that normalises, RMSNorm's model/norm.py or a mixer's own line; model/linear.py: a
projection's product under the module that projects; its weight's cast stays step_reuse.py's)."""
BACKWARD_CALLERS = ("moe_pretrain/training/", "parallel/torch_compat.py")
"""Where a backward is started: a backward op whose innermost line is here takes its node's forward line."""

COMPONENTS = {
    "KDA mixer": ("moe_pretrain/model/kda.py", "moe_pretrain/ops/kda.py", "moe_pretrain/model/short_conv.py",
                  "gpu_kernels/short_conv.py", "gpu_kernels/kda/"),
    "MLA mixer": ("moe_pretrain/model/mla.py", "moe_pretrain/ops/document_attention.py",
                  "moe_pretrain/ops/latent_attention.py", "moe_pretrain/model/qk_clip.py",
                  "gpu_kernels/flex_attention.py"),
    "context-parallel mixers": ("parallel/context_parallel",),
    "AttnRes mixing": ("moe_pretrain/model/attn_res.py", "moe_pretrain/ops/attn_res.py", "gpu_kernels/attn_res.py"),
    "norms": ("moe_pretrain/model/norm.py", "gpu_kernels/rms_norm.py"),
    "MoE routing and balancing": ("moe_pretrain/model/router.py", "moe_pretrain/model/balancing.py",
                                  "moe_pretrain/ops/routing.py", "moe_pretrain/ops/margin_histogram.py",
                                  "moe_pretrain/ops/statistics.py"),
    "MoE experts and dispatch": ("moe_pretrain/model/moe.py", "moe_pretrain/model/experts.py",
                                 "moe_pretrain/model/token_dispatch.py", "moe_pretrain/ops/grouped_mm.py",
                                 "moe_pretrain/ops/permute.py", "gpu_kernels/permute.py",
                                 "moe_pretrain/fp8/", "parallel/node_dispatch.py", "parallel/all_to_all_dispatch.py",
                                 "parallel/fp8_dispatch.py", "parallel/chunk_pipeline.py"),
    "MLPs (SiTU-GLU)": ("moe_pretrain/model/mlp.py", "moe_pretrain/ops/situ.py", "gpu_kernels/situ_glu.py"),
    "weight casts and their gradients": ("moe_pretrain/step_reuse.py",),
    "tensor-parallel layers": ("parallel/tensor_parallel.py", "parallel/sequence.py", "parallel/collectives.py"),
    "embedding, head and loss": ("moe_pretrain/model/transformer.py", "moe_pretrain/model/mtp.py",
                                 "parallel/vocab_parallel_loss.py", "moe_pretrain/training/step_runner.py"),
    "layer residuals and recomputation": ("moe_pretrain/model/decoder_layer.py", "moe_pretrain/model/recompute.py",
                                          "moe_pretrain/model/saved_inputs.py"),
    "optimizer": ("parallel/optimizer.py", "parallel/muon.py", "parallel/flat_shards.py",
                  "moe_pretrain/ops/newton_schulz.py", "moe_pretrain/training/optim.py"),
}
"""The model's components by the files (or folders) whose lines they own; a line elsewhere is its own file's."""


def component(site: str) -> str:
    """The component of a site 'file:line' (COMPONENTS), or its file."""
    path = site.rsplit(":", 1)[0]
    for name, prefixes in COMPONENTS.items():
        if path.startswith(prefixes):
            return name
    return path


class ComputeSites(TorchFunctionMode):
    """with ComputeSites() as sites, OpCensus(gpu, sites=sites): ... ; sites.by_site and sites.by_component:
    {name: [launches, bytes, roofline seconds, estimated seconds]}."""

    def __init__(self):
        super().__init__()
        self.by_site: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled():
            # The nodes this call made: its outputs', those inside a composite op (matmul's bmm under its view)
            # and an in-place op's new node on its argument; the walk stops at the nodes made before.
            untagged = [t.grad_fn for t in tree_leaves((out, args, kwargs)) if isinstance(t, torch.Tensor)
                        and t.grad_fn is not None and "site" not in t.grad_fn.metadata]
            site = project_site(_PASSED_OVER) if untagged else ""
            while untagged:
                node = untagged.pop()
                if "site" not in node.metadata:
                    node.metadata["site"] = site
                    untagged.extend(n for n, _ in node.next_functions if n is not None and "site" not in n.metadata)
        return out

    @staticmethod
    def current_site() -> str:
        """The site of the op running now: its innermost project line, or in a backward started by the training
        loop the forward line that made its autograd node."""
        site = project_site(_PASSED_OVER)
        node = torch._C._current_autograd_node()
        if node is not None and site.startswith((*BACKWARD_CALLERS, "?")):
            site = node.metadata.get("site", f"backward of {type(node).__name__}")
        return site

    def launched(self, moved: int, seconds: float, estimate: float = 0.0) -> None:
        """A launch the op census counted, now: its bytes, roofline time and estimate to its site."""
        row = self.by_site[self.current_site()]
        row[0] += 1
        row[1] += moved
        row[2] += seconds
        row[3] += estimate

    def by_component(self) -> dict[str, list]:
        totals: dict[str, list] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
        for site, counts in self.by_site.items():
            row = totals[component(site)]
            for i, value in enumerate(counts):
                row[i] += value
        return dict(sorted(totals.items(), key=lambda item: -item[1][2]))
