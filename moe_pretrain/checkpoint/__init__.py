"""The checkpoint library: reshardable DCP state with global keys, manifests, atomic commits."""

from moe_pretrain.checkpoint.global_state import GlobalState
from moe_pretrain.checkpoint.manifest import verify
from moe_pretrain.checkpoint.store import (
    AsyncSaver,
    CheckpointError,
    committed_checkpoints,
    find,
    load,
    prune,
    read_trainer_state,
    save,
)

__all__ = ["AsyncSaver", "CheckpointError", "GlobalState", "committed_checkpoints", "find", "load", "prune",
           "read_trainer_state", "save", "verify"]
