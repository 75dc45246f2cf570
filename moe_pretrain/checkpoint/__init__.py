"""The checkpoint library: reshardable DCP state with global keys, manifests, atomic commits."""

from moe_pretrain.checkpoint.directory import committed_checkpoints
from moe_pretrain.checkpoint.global_state import GlobalState
from moe_pretrain.checkpoint.manifest import verify
from moe_pretrain.checkpoint.pruning import prune, wait_for_deletions
from moe_pretrain.checkpoint.store import (
    AsyncSaver,
    CheckpointError,
    checkpoint_timeout,
    find,
    load,
    read_trainer_state,
    save,
    shared_verify,
    verifying_load,
)

__all__ = ["AsyncSaver", "CheckpointError", "GlobalState", "checkpoint_timeout", "committed_checkpoints", "find",
           "load", "prune", "read_trainer_state", "save", "shared_verify", "verify",
           "verifying_load", "wait_for_deletions"]
