"""Checkpoint CLI: `python -m checkpoints_tool inspect|verify|prune` (see __main__.py)."""
