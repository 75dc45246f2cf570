"""The checkpointable training state, usable without a trainer (resharding, tools, the memory bench).

It holds this rank's model (built on the meta device and materialised for this rank only: its pipeline
stage, its tensor and expert shards), the sharded optimizer, and the counters and positions a run resumes
from: optimizer step, tokens seen (which also fix the context-extension stage), the data loader's position,
every rank's RNG state and, inside the model, the routers' balancing biases. Saving and loading work on
this object; the training loop (trainer.py) advances it.
"""

import base64
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_kernels.choice import Kernels
from moe_pretrain import checkpoint
from moe_pretrain.checkpoint import GlobalState
from moe_pretrain.checkpoint.export import model_tensor_metadata
from moe_pretrain.checkpoint.fit import (
    CheckpointMismatchError,
    config_differences,
    mismatch_message,
    saved_tensor_shapes,
    tensor_differences,
)
from moe_pretrain.config import Config, config_to_dict
from moe_pretrain.fp8.experts import FP8_HISTORY
from moe_pretrain.training.optim import build_optimizer
from parallel.collectives import all_reduce_sum, gather_objects
from parallel.parallelize import build_model
from parallel.plan import ShardingPlan
from parallel.state import ParallelContext

log = logging.getLogger(__name__)


def rng_states(ctx: ParallelContext) -> list[str]:
    """Every rank's torch RNG state, base64 (JSON, no pickles), in rank order (collective)."""
    mine = base64.b64encode(bytes(torch.get_rng_state().tolist())).decode()
    if not ctx.distributed:
        return [mine]
    return gather_objects(mine, dist.group.WORLD)


def _is_model_tensor(key: str) -> bool:
    return key.startswith("model.") and not key.endswith(FP8_HISTORY)


class TrainingState:
    def __init__(self, cfg: Config, ctx: ParallelContext, plan: ShardingPlan | None = None, *,
                 draw_values: bool = True, kernels: Kernels | None = None):
        """draw_values=False leaves the parameters uninitialised: for a state about to be loaded. kernels:
        what the model is built with (None: resolved from the config for ctx.device, build_model)."""
        self.cfg, self.ctx = cfg, ctx
        self.plan = plan or ShardingPlan()
        self.model = build_model(cfg, ctx, self.plan, draw_values=draw_values, kernels=kernels)
        """This rank's model: the whole model, or its pipeline chunks under their global names."""
        self.optimizer = build_optimizer(self.model, cfg, ctx, self.plan)
        self.tensors = GlobalState(self.model, self.optimizer, ctx, self.plan)
        self.step = 0
        self.tokens_seen = 0
        self.data_position: dict[str, Any] = {}
        """The data loader's position (PretrainingData.state()) as of the last save or load."""
        self.hook_states: dict[str, Any] = {}
        """The step hooks' states by name (training/step_hooks.py) as of the last save or load."""
        self.token_ids: dict[str, int] = {}
        """The data's special token ids by name (Vocabulary.special_ids), saved with every checkpoint so that an
        export can name them (the trainer sets them; an import takes the release's)."""
        self.rng: list[str] | None = None
        """Every rank's RNG state as loaded (None: take the live ones at save)."""
        self.checkpoint_group: dist.ProcessGroup | None = None
        """The group checkpoint I/O collectives wait in (the trainer's, with a size-aware timeout); None =
        the default group."""

    def state_bytes(self) -> int:
        """An upper bound of this rank's checkpointed bytes: parameters and two Adam moments of each."""
        return 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())

    def snapshot(self) -> tuple[dict, dict[str, Any], dict[str, Any]]:
        """(tensors, trainer_state JSON, manifest info) of this step, as checkpoint.save takes them.
        Collective (RNG states)."""
        layout = self.ctx.layout
        rng = self.rng if self.rng is not None else rng_states(self.ctx)
        trainer_state = {"step": self.step, "tokens_seen": self.tokens_seen, "data": self.data_position,
                         "config": config_to_dict(self.cfg), "rng": rng, "token_ids": self.token_ids,
                         "hooks": self.hook_states}
        info = {"tokens": self.tokens_seen, "layout": dataclasses.asdict(layout), "layout_text": layout.describe()}
        return self.tensors.state_dict(), trainer_state, info

    def save(self, root: Path) -> Path:
        """Save synchronously into the checkpoint root; returns the committed step directory."""
        tensors, trainer_state, info = self.snapshot()
        c = self.cfg.checkpoint
        return checkpoint.save(root, self.step, tensors, trainer_state, info, c.keep_last, c.keep_every,
                               self.checkpoint_group)

    def _wanted(self, path: Path, saved: set[str], model_only: bool, tensors: dict, quiet: bool = False) -> dict:
        """Of this state's `tensors`, those a checkpoint fills (keys in `saved`, its tensor keys): all, but of a
        model-only checkpoint (an import of released weights) the model alone, without the multi-token-prediction
        blocks it lacks (the release has none); and FP8 amax histories only if it has them."""
        if model_only:
            tensors = {key: value for key, value in tensors.items() if key.startswith("model.")}
            absent = [key for key in tensors if key.startswith("model.mtp.") and key not in saved]
            if absent and not quiet:
                log.info(f"{path} holds no multi-token-prediction blocks ({len(absent)} tensors): model.mtp.* keep "
                         f"their initial values")
            tensors = {key: value for key, value in tensors.items() if key not in absent}
        fresh = [key for key in tensors if key.endswith(FP8_HISTORY) and key not in saved]
        if fresh and not quiet:  # written without delayed FP8 scaling: the histories start empty (current scaling)
            log.info(f"{path} holds no FP8 amax histories ({len(fresh)} expert modules): they start empty")
        return {key: value for key, value in tensors.items() if key not in fresh}

    def check_fit(self, path: Path) -> None:
        """Raise CheckpointMismatchError on every rank when the checkpoint was saved by another model or
        optimizer (its tensors' keys or global shapes differ from this run's), naming the config keys that
        differ; settings that change no tensor are logged. Reads only JSON and DCP's metadata; an unreadable
        one is left to verification (collective over the checkpoint group and the pipeline group)."""
        saved = saved_tensor_shapes(path)
        try:
            saved_state = checkpoint.read_trainer_state(path)
            saved_config = saved_state["config"]
        except (OSError, ValueError, KeyError):
            saved_state = saved_config = None
        problems: list[str] = []
        unplaced = 0
        if saved is not None and saved_config is not None:
            tensors = self.tensors.state_dict()
            wanted = self._wanted(path, set(saved), bool(saved_state.get("model_only")), tensors, quiet=True)
            problems = tensor_differences(saved, {key: tuple(value.size()) for key, value in wanted.items()})
            # Under pipeline parallelism each rank holds its stage's tensors: their count is summed over the stages.
            # FP8 amax histories come and go with the FP8 recipe, not with the model.
            mine = sum(_is_model_tensor(key) for key in tensors)
            group = self.ctx.pp_group if self.ctx.layout.pp > 1 else None
            held = int(all_reduce_sum(torch.tensor([mine]), group).item()) if group is not None else mine
            unplaced = sum(_is_model_tensor(key) for key in saved) - held
        group = self.checkpoint_group or (dist.group.WORLD if dist.is_initialized() else None)
        reports = gather_objects((problems, unplaced), group)
        problems = sorted({line for lines, _ in reports for line in lines})
        differences = config_differences(saved_config, config_to_dict(self.cfg)) if saved_config else []
        message = mismatch_message(path, differences, problems, max(count for _, count in reports))
        if message:
            raise CheckpointMismatchError(message)
        if differences and self.ctx.is_logging_rank:
            log.info(f"resuming {path} with changed settings that change no tensor: {'; '.join(differences)}")

    def load(self, path: Path) -> dict[str, Any]:
        """Fill this state from a checkpoint directory (any layout's), in place; returns its trainer_state.
        A model-only checkpoint (an import of released weights) fills the model; the optimizer starts fresh, and
        multi-token-prediction blocks it lacks (the release has none) keep their initialization."""
        model_only = bool(checkpoint.read_trainer_state(path).get("model_only"))
        wanted = self._wanted(path, set(model_tensor_metadata(path)), model_only, self.tensors.state_dict())
        state = checkpoint.load(path, wanted, self.checkpoint_group)
        self.tensors.after_load(state["step"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.data_position = state["data"]
        self.hook_states = state.get("hooks", {})
        self.rng = state.get("rng")
        return state

    def restore_rng(self) -> None:
        """This rank's saved RNG stream, when the checkpoint was written by the same world size (per-rank
        streams mean nothing on another); afterwards saves take the live states again."""
        if self.rng is not None and len(self.rng) == self.ctx.layout.world_size:
            torch.set_rng_state(torch.tensor(list(base64.b64decode(self.rng[self.ctx.rank])), dtype=torch.uint8))
        self.rng = None
