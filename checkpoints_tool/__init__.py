"""Checkpoint CLI: `python -m checkpoints_tool inspect|verify|prune|export|import|reshard` (see __main__.py)."""


class ImportWorkerError(Exception):
    """A worker process of a parallel import failed (its own traceback is on stderr); nothing was committed."""
