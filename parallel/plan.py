"""The sharding plan: how every parameter of the model is placed, declared once, by module path.

Shape legend: tp tensor-parallel ranks, ep expert-parallel ranks, E experts, O / I out / in features.
A style maps a module (matched by a pattern on its path) to a placement of its parameters:
- COLUMN: nn.Linear whose output features split over tp (weight [O/tp, I], bias [O/tp]); becomes a
  ColumnParallelLinear (sequence all-gather in front);
- ROW: nn.Linear whose input features split over tp (weight [O, I/tp]); becomes a RowParallelLinear
  (reduce-scatter behind);
- VOCAB: the embedding's rows split over tp (megatron-core's VocabParallelEmbedding);
- HEADS: every parameter of the module split along dimension 0 over tp, the module unchanged (KDA's
  per-head decay parameters and short convolutions: the heads a rank holds);
- EXPERTS: every parameter split along dimension 0 (experts) over ep;
- REPLICATED lists what stays whole on every rank; a parameter neither placed nor declared replicated is a
  model change the plan has not caught up with, refused when the model is built (ShardingPlan.unplanned),
  and a rule that places nothing of the full-size model fails tests/unit/test_plan.py.
Placements use DTensor's vocabulary (Shard(dim) / Replicate() per mesh dimension tp and ep). They also fix
each gradient's reduce group: expert shards over expert-data parallel; tensor shards, complete on each
rank for their slice, over data parallel; replicated parameters, whose gradients are partial over the
sequence shards, over tensor x data parallel. Pipeline stages follow the layer index in the name.
Everything that needs the layout reads this: parallelize, the optimizer's groups, checkpoint wrapping,
full-state gathering, layout validation and per-rank sizing.
"""

import re
from dataclasses import dataclass, field
from enum import StrEnum

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from moe_pretrain.config import Config, ConfigError
from moe_pretrain.model.mixers import MIXERS


class Style(StrEnum):
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"
    HEADS = "heads"
    EXPERTS = "experts"


MODEL_PLAN: tuple[tuple[str, Style], ...] = (
    ("embedding", Style.VOCAB),
    ("head", Style.COLUMN),
    # The sequence mixers' rows come from their specs (model_plan).
    # Dense MLP and the MoE's shared experts.
    ("layers.*.mlp.gate_proj", Style.COLUMN), ("layers.*.mlp.up_proj", Style.COLUMN),
    ("layers.*.mlp.down_proj", Style.ROW),
    ("layers.*.mlp.shared.gate_proj", Style.COLUMN), ("layers.*.mlp.shared.up_proj", Style.COLUMN),
    ("layers.*.mlp.shared.down_proj", Style.ROW),
    # Routed experts; router, latent projections, norms and AttnRes mixes are replicated.
    ("layers.*.mlp.experts", Style.EXPERTS),
)
"""Pattern -> style, but for the sequence mixers' (model_plan). A pattern names a module (its own parameters
take the style) or one parameter; `*` stands for one path component. The first match wins. A
multi-token-prediction block's decoder layer (mtp.<k>.layer) is placed as the backbone's layers are
(backbone_path)."""

REPLICATED: tuple[str, ...] = (
    # The vision tower and projector: every tensor- and context-parallel rank encodes its rows' images whole.
    "vision_tower", "mm_projector", "final_mix", "final_norm",
    "layers.*.attn_mix", "layers.*.mlp_mix", "layers.*.attn_norm", "layers.*.mlp_norm",
    # The MoE's router and latent projections (every rank routes and projects its own tokens).
    "layers.*.mlp.router.gate", "layers.*.mlp.latent_down", "layers.*.mlp.latent_norm", "layers.*.mlp.latent_up",
)
REPLICATED += (
    # A multi-token-prediction block's input norms and projection and its norm before the shared head.
    "mtp.*.hidden_norm", "mtp.*.embedding_norm", "mtp.*.projection", "mtp.*.norm")
"""Modules (with everything below them) or parameters meant to stay whole on every tensor- and expert-parallel
rank, but for the sequence mixers' (replicated_modules); the same pattern syntax."""


def model_plan() -> tuple[tuple[str, Style], ...]:
    """MODEL_PLAN with the sequence mixers' rows from their specs (model/mixer_spec.MixerSpec.plan: KDA's
    projections to heads and per-head parameters, gated MLA's up projections; both split the output gate by
    column and the output projection by row), each once. Rules match by path, so two mixers that name one
    module must place it alike."""
    rows: dict[str, Style] = {}
    for spec in MIXERS.values():
        for name, style in spec.plan:
            pattern = f"layers.*.mixer.{name}"
            if rows.setdefault(pattern, Style(style)) != Style(style):
                raise ValueError(f"parallel/plan.py: the {spec.kind} mixer places mixer.{name} {style}, another "
                                 f"mixer {rows[pattern]}")
    return (*MODEL_PLAN, *rows.items())


def replicated_modules() -> tuple[str, ...]:
    """REPLICATED with the sequence mixers' (their specs' `replicated`: KDA's low-rank decay input and output
    norm, gated MLA's low-rank down projections and their norms)."""
    return (*REPLICATED, *dict.fromkeys(f"layers.*.mixer.{name}" for spec in MIXERS.values()
                                        for name in spec.replicated))

TENSOR_DIM = {Style.COLUMN: 0, Style.ROW: 1, Style.VOCAB: 0, Style.HEADS: 0}
FIRST_STAGE_MODULES = ("embedding", "vision_tower", "mm_projector")
LAST_STAGE_MODULES = ("final_mix", "final_norm", "head", "mtp")


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter's placement: over the tensor-parallel and the expert-parallel mesh dimension."""

    tensor: Placement = field(default_factory=Replicate)
    expert: Placement = field(default_factory=Replicate)

    @property
    def tensor_dim(self) -> int | None:
        return self.tensor.dim if isinstance(self.tensor, Shard) else None

    @property
    def expert_dim(self) -> int | None:
        return self.expert.dim if isinstance(self.expert, Shard) else None

    @property
    def reduce_group(self) -> str:
        """Name of the group its gradient is summed over (a ParallelContext attribute)."""
        if self.expert_dim is not None:
            return "edp_group"
        return "dp_group" if self.tensor_dim is not None else "tp_dp_group"

    def local_shape(self, shape: tuple[int, ...], tp: int, ep: int) -> tuple[int, ...]:
        local = list(shape)
        for dim, size in ((self.tensor_dim, tp), (self.expert_dim, ep)):
            if dim is not None:
                local[dim] //= size
        return tuple(local)

    def global_shape(self, local_shape: tuple[int, ...], tp: int, ep: int) -> tuple[int, ...]:
        """The whole tensor's shape, from one rank's shard (the inverse of local_shape)."""
        shape = list(local_shape)
        for dim, size in ((self.tensor_dim, tp), (self.expert_dim, ep)):
            if dim is not None:
                shape[dim] *= size
        return tuple(shape)

    def local_offsets(self, local_shape: tuple[int, ...], tp_rank: int, ep_rank: int) -> tuple[int, ...]:
        """Where this rank's shard starts in the global tensor."""
        offsets = [0] * len(local_shape)
        for dim, rank in ((self.tensor_dim, tp_rank), (self.expert_dim, ep_rank)):
            if dim is not None:
                offsets[dim] = rank * local_shape[dim]
        return tuple(offsets)


MTP_LAYER = re.compile(r"^mtp\.(\d+)\.layer\.")


def backbone_path(path: str) -> str:
    """A multi-token-prediction block's layer under the name a backbone layer would have (mtp.<k>.layer.x ->
    layers.mtp<k>.x), so the layers' rules place it; any other path as it is."""
    return MTP_LAYER.sub(lambda m: f"layers.mtp{m.group(1)}.", path)


def compile_pattern(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + "$")


def _places(regex: re.Pattern, name: str) -> bool:
    """Whether a rule's pattern names this parameter or the module that holds it (as placement() reads it)."""
    return bool(regex.match(name) or ("." in name and regex.match(name.rsplit(".", 1)[0])))


def _contains(regex: re.Pattern, name: str) -> bool:
    """Whether a REPLICATED pattern names this parameter or any module above it."""
    parts = name.split(".")
    return any(regex.match(".".join(parts[:end])) for end in range(1, len(parts) + 1))


class ShardingPlan:
    def __init__(self, rules: tuple[tuple[str, Style], ...] | None = None, replicated: tuple[str, ...] | None = None):
        """rules and replicated: model_plan() and replicated_modules() unless given."""
        rules = model_plan() if rules is None else rules
        replicated = replicated_modules() if replicated is None else replicated
        self.rules, self.replicated = rules, replicated
        self._patterns = [(compile_pattern(pattern), style) for pattern, style in rules]
        self._replicated = [compile_pattern(pattern) for pattern in replicated]
        self._placements: dict[str, ParamPlacement] = {}

    def style(self, path: str) -> Style | None:
        """The style declared for the module or parameter at `path` (global name), None when replicated."""
        path = backbone_path(path)
        for pattern, style in self._patterns:
            if pattern.match(path):
                return style
        return None

    def unplanned(self, names: list[str]) -> list[str]:
        """Parameters (global names) that no rule places and REPLICATED does not declare."""
        return [name for name in names if not any(_places(regex, backbone_path(name)) for regex, _ in self._patterns)
                and not any(_contains(regex, backbone_path(name)) for regex in self._replicated)]

    def unused(self, names: list[str]) -> list[str]:
        """Rules and REPLICATED entries that match none of these parameters (of a model that has every
        component: a renamed module leaves its rule behind)."""
        names = [backbone_path(name) for name in names]
        rules = [pattern for (pattern, _), (regex, _) in zip(self.rules, self._patterns)
                 if not any(_places(regex, name) for name in names)]
        return rules + [pattern for pattern, regex in zip(self.replicated, self._replicated)
                        if not any(_contains(regex, name) for name in names)]

    def placement(self, name: str) -> ParamPlacement:
        """The placement of the parameter with this global name (matched once per name: every save and
        the optimizer ask again)."""
        if name not in self._placements:
            self._placements[name] = self._match(name)
        return self._placements[name]

    def _match(self, name: str) -> ParamPlacement:
        module_path = name.rsplit(".", 1)[0] if "." in name else ""
        style = self.style(name) or self.style(module_path)
        if style is Style.EXPERTS:
            return ParamPlacement(expert=Shard(0))
        if style is None:
            return ParamPlacement()
        return ParamPlacement(tensor=Shard(TENSOR_DIM[style]))

    def check_divisible(self, shapes: dict[str, tuple[int, ...]], tp: int, ep: int) -> list[str]:
        """Layout problems: every sharded dimension must split evenly over its ranks."""
        problems = []
        for name, shape in shapes.items():
            placement = self.placement(name)
            splits = ((placement.tensor_dim, tp, "parallel.tp"), (placement.expert_dim, ep, "parallel.ep"))
            for dim, size, what in splits:
                if dim is not None and shape[dim] % size:
                    problems.append(f"{name} dimension {dim} ({shape[dim]}) is not divisible by {what}={size}")
        return problems


def pipeline_chunks(cfg: Config) -> list[list[int]]:
    """Global layer indices of each of the pp x vpp chunks, in pipeline order (parallel.pipeline_layers,
    or as even as the layer count allows, earlier chunks taking the remainder)."""
    chunks = cfg.parallel.pp * cfg.parallel.vpp
    counts = cfg.parallel.pipeline_layers or [
        cfg.model.num_layers // chunks + (1 if c < cfg.model.num_layers % chunks else 0) for c in range(chunks)]
    starts = [sum(counts[:c]) for c in range(chunks)]
    return [list(range(start, start + count)) for start, count in zip(starts, counts)]


def chunks_of_rank(num_chunks: int, pp: int, pp_rank: int) -> list[int]:
    """The chunks pipeline rank pp_rank holds: pp_rank, pp_rank + pp, ... (interleaved placement)."""
    return list(range(pp_rank, num_chunks, pp))


LAYER = re.compile(r"^layers\.(\d+)\.")


def pipeline_rank_of(name: str, chunks: list[list[int]], pp: int) -> int:
    """The pipeline rank that holds the parameter with this global name (chunks: pipeline_chunks): its
    layer's chunk owner, the first chunk's for the embeddings, the last chunk's for the final mix, norm,
    head and the multi-token-prediction blocks."""
    if match := LAYER.match(name):
        layer = int(match.group(1))
        return next(c for c, layers in enumerate(chunks) if layer in layers) % pp
    top = name.split(".", 1)[0]
    if top in FIRST_STAGE_MODULES:
        return 0
    if top in LAST_STAGE_MODULES:
        return (len(chunks) - 1) % pp
    raise ConfigError(f"parameter {name} belongs to no pipeline stage (parallel/plan.py)")
