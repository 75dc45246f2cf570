"""The activation half of the sharding plan: where the tensors between the modules live, declared by path.

parallel/plan.py places the parameters; this table places the activations, and the model's code reads
neither. A rank of a tp x cp block holds some positions of its rows: its context-parallel fragments
(parallel/context_parallel.py), and between the tensor-parallel regions its sequence shard of those
(parallel/sequence.py). Each style applies one module's part of that, in place, from outside the math:
- EmbeddingSplit: the tokens [B, T] come in over every position; the embedding takes this rank's
  fragments (a forward pre-hook) and hands on its sequence shard (a forward hook, after the vocabulary-
  parallel embedding's all-reduce). The multi-token-prediction blocks' embeddings go through the same module.
- ImagesSplit: the image merge becomes ImageSplit, which deals the images over the block and sends each
  token to the rank holding its position (parallel/image_split.py).
- MixerSplit: each sequence mixer takes its strategies for the splits (parallel/context_parallel_mixers.py).
The head's logits are split over the vocabulary by its COLUMN placement; the step runner reads its scores
through parallel/vocab_parallel_loss.VocabularySplit, which combines the slices wherever tp > 1. How many
positions each of these holds (position_counts) is what the pipeline declares its boundary shapes from.
A stage boundary that changes cp applies the table again with the new split (training/stage_switch.py):
every style replaces what it applied before.
"""

from dataclasses import dataclass
from typing import Protocol
from weakref import WeakKeyDictionary

from torch import nn

from parallel.context_parallel import ContextParallel, NoContextParallel
from parallel.context_parallel_mixers import place_mixer
from parallel.image_split import place_image_merge
from parallel.plan import backbone_path, compile_pattern
from parallel.sequence import NoSequenceParallel, SequenceParallel
from parallel.state import ParallelContext


@dataclass(frozen=True)
class Splits:
    """How this rank's rows are split: along T between tensor-parallel regions, and over context parallel."""

    sequence: NoSequenceParallel
    context: NoContextParallel


def splits_of(ctx: ParallelContext, cp: int, mla: str) -> Splits:
    """The splits at context-parallel size cp with MLA's exchange `mla` (resolved: config/stage.mla_exchange)."""
    sequence = SequenceParallel(ctx.tp_group) if ctx.layout.tp > 1 else NoSequenceParallel()
    context = ContextParallel(ctx.context(cp).group, mla) if cp > 1 else NoContextParallel()
    return Splits(sequence, context)


class ActivationStyle(Protocol):
    def apply(self, module: nn.Module, splits: Splits) -> None: ...


class EmbeddingSplit:
    """Tokens over every position in; this rank's positions out, as its sequence shard."""

    def __init__(self):
        self._hooks: WeakKeyDictionary[nn.Module, list] = WeakKeyDictionary()

    def apply(self, module: nn.Module, splits: Splits) -> None:
        for handle in self._hooks.pop(module, []):
            handle.remove()
        hooks = []
        if splits.context.size > 1:
            context = splits.context
            hooks.append(module.register_forward_pre_hook(lambda _, args: (context.local(args[0]), *args[1:])))
        if splits.sequence.size > 1:
            sequence = splits.sequence
            hooks.append(module.register_forward_hook(lambda _, args, out: sequence.scatter(out)))
        self._hooks[module] = hooks


class ImagesSplit:
    def apply(self, module: nn.Module, splits: Splits) -> None:
        place_image_merge(module, splits.sequence, splits.context)


class MixerSplit:
    def apply(self, module: nn.Module, splits: Splits) -> None:
        place_mixer(module, splits.sequence, splits.context)


ACTIVATION_PLAN: tuple[tuple[str, ActivationStyle], ...] = (
    ("embedding", EmbeddingSplit()),
    ("image_merge", ImagesSplit()),
    ("layers.*.mixer", MixerSplit()),  # a multi-token-prediction block's too (plan.backbone_path)
)
"""Module path -> style; the parameter plan's pattern syntax (`*` one path component)."""

_RULES = [(compile_pattern(pattern), style) for pattern, style in ACTIVATION_PLAN]


def apply_activation_plan(model: nn.Module, splits: Splits) -> None:
    """Place the activations of every module of `model` (the whole model, a pipeline stage or one layer's
    mixer, named as in the whole model) the table names."""
    for path, module in model.named_modules():
        path = backbone_path(path)
        for regex, style in _RULES:
            if regex.match(path):
                style.apply(module, splits)
                break


@dataclass(frozen=True)
class PositionCounts:
    """How many positions of a row of T a rank's activations hold where the table places them (what the
    pipeline declares its boundary shapes from)."""

    inputs: int
    """The model's inputs (tokens, image mask, document ids): every position."""
    between_layers: int
    """From the embedding to the head: the sequence shard of its context-parallel positions."""
    logits: int
    """The head's output: its context-parallel positions (the column-parallel head gathers the sequence)."""


def position_counts(seq_len: int, tp: int, cp: int) -> PositionCounts:
    return PositionCounts(seq_len, seq_len // cp // tp, seq_len // cp)

