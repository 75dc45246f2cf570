"""What the system knows of one sequence mixer, in one place: the contract a mixer's spec fulfils.

A decoder layer's sequence mixer (KDA, gated MLA, ...) is named by its letter in model.layer_pattern; its spec
(model/mixers.py looks it up by the layer's kind) says how to build the module and everything the rest of the
system reads about it without building it: its parameter and FLOP counts, what its backward keeps and what
each recomputed region gives back, what it sends over tensor parallelism, how its tensors are sharded (the
sharding plan's rows), which of its matrices Muon orthogonalises head by head, its tensors' names in the
released checkpoint, and its fast path in words. The module itself implements `SequenceMixer` (forward over a
DocumentLayout, its recomputation regions, the stage's RoPE base).

Context parallelism is a strategy the mixer holds (its cross-rank steps: KDA's split, MLA's exchange and key
gather); which one a rank's layout sets, and what it costs, are the parallel room's and the planner's, keyed by
the same kind (parallel/context_parallel_mixers.PLACEMENTS, planning/context_parallel_costs.py). A mixer
without them runs where the layout has no context parallelism, and is refused with a message elsewhere.

Peers: megatron-core's ModuleSpec names a layer's parts in one spec; torchtitan keeps a model's args, module and
parallelize rows in its own folder. docs/extension.md ("A sequence mixer") walks through adding one.
"""

from dataclasses import dataclass

from torch import nn

from gpu_kernels.choice import Kernels
from moe_pretrain.config import ModelConfig


@dataclass(frozen=True)
class Region:
    """What one recomputed region no longer keeps per token: fp32 core elements (KDA's chunk states), and the
    rest in the activation dtype (of which `mixer` are the sequence mixer's)."""

    core: float = 0.0
    rest: float = 0.0
    mixer: float = 0.0


@dataclass(frozen=True)
class ReleaseTensor:
    """One tensor of a mixer in the released checkpoint: our name and the release's (both under the layer's
    mixer / self_attn), its shape there, and how it converts (checkpoint/kimi_k3.HFTensor's kinds)."""

    ours: str
    theirs: str
    shape: tuple[int, ...]
    kind: str = "same"


class SequenceMixer(nn.Module):
    """A decoder layer's sequence mixer: forward(x [B, T, d] as this rank holds it, layout) -> [B, T, d].

    Besides its forward, the model sets two things on it: which of its recomputation regions run again in
    backward (set_recompute: train.recompute's module names) and the stage's RoPE base (rope_theta; a mixer
    that rotates nothing ignores it)."""

    rope_theta: float | None = None

    def set_recompute(self, modules: frozenset[str]) -> None:
        """Turn on the recomputation regions train.recompute names ("core" and the mixer's own)."""
        self.recompute_core = "core" in modules


class MixerSpec:
    """One sequence mixer, everything but its module's code (see the module docstring). Subclasses give the
    class attributes and the formulas; the defaults are those of a mixer without a softmax score matrix, own
    recomputation regions or release names."""

    kind: str
    """Its name: model.layer_pattern's letter maps to it (config/model.MIXER_LETTERS)."""
    module: type[SequenceMixer]
    plan: tuple[tuple[str, str], ...] = ()
    """Sharding-plan rows (parallel/plan.py): (module or parameter under the mixer, style: column, row, heads)."""
    replicated: tuple[str, ...] = ()
    """Modules or parameters under the mixer that stay whole on every tensor-parallel rank."""
    release_layers: str | None = None
    """The released config's list of this kind's layers (text_config.linear_attn_config); None: the release
    format has no such layers (export refuses them)."""

    def build(self, d: int, m: ModelConfig, *, init_std: float, out_std: float, kernels: Kernels) -> SequenceMixer:
        raise NotImplementedError

    def params(self, m: ModelConfig) -> int:
        """Its parameters (tests compare with the built module's)."""
        raise NotImplementedError

    def mixing_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        """Training FLOPs per token of its mixing beyond the projections (model/counts.py: keys, the keys a
        query attends to on average; None: seq_len / 2)."""
        raise NotImplementedError

    def rescoring_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        """FLOPs per token its backward spends recomputing what its forward did not keep (softmax attention's
        scores); none for a mixer that keeps what its backward reads."""
        return 0.0

    def recompute_flops(self, m: ModelConfig, seq_len: int, modules: frozenset[str], exchange: str,
                        keys: float | None) -> float:
        """FLOPs per token train.recompute's modules run again (a recomputed core's forward by default)."""
        return self.mixing_flops(m, seq_len, keys) / 3 if "core" in modules else 0.0

    def tp_widths(self, m: ModelConfig) -> int:
        """Per position, the values it gathers or reduce-scatters over tensor parallelism in one forward."""
        raise NotImplementedError

    def activations(self, m: ModelConfig, exchange: str, cp: int, tp: int) -> tuple[float, float]:
        """(fp32 core, other) elements its backward keeps per token without recomputation (all heads;
        planning/step_activations.py divides by tp); exchange and cp: the context-parallel exchange in force."""
        raise NotImplementedError

    def regions(self, m: ModelConfig, modules: frozenset[str], exchange: str, core: float) -> list[Region]:
        """The regions train.recompute's modules make in it, each with what it no longer keeps (core: its
        fp32 core elements, from activations)."""
        raise NotImplementedError

    def muon_head_rows(self, m: ModelConfig) -> dict[str, int]:
        """Its matrices Muon orthogonalises head block by head block (parameter name under the mixer -> rows
        per head); its other matrices are orthogonalised whole (training/muon_params.py)."""
        return {}

    def release_tensors(self, m: ModelConfig) -> list[ReleaseTensor]:
        """Its tensors in the released checkpoint, in the release's order."""
        return []

    def fast_paths(self, module: SequenceMixer, off) -> dict[str, str]:
        """Its fast paths' states in words, as `module` was built (gpu_kernels/fast_paths.py; off(key, text):
        the reference's words with the reason the fast path is off)."""
        return {}
