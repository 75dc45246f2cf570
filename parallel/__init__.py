"""Parallelism: the linear-layer factory and expert dispatchers the model builds on.

Only the single-process implementations exist yet; the tensor/expert-parallel ones replace them
behind the same interfaces (STYLE.md rules 1-3).
"""
