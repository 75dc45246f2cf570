"""The checkpoint library: reshardable DCP state with global keys, manifests, atomic commits."""

from moe_pretrain.checkpoint.global_state import GlobalState
from moe_pretrain.checkpoint.manifest import verify
from moe_pretrain.checkpoint.store import (
    TRAINER_STATE,
    AsyncSaver,
    CheckpointError,
    committed_checkpoints,
    find,
    load,
    prune,
    save,
)

__all__ = ["TRAINER_STATE", "AsyncSaver", "CheckpointError", "GlobalState", "committed_checkpoints", "find", "load",
           "prune", "save", "verify"]
