"""Parallelism: process groups, tensor / sequence / expert / pipeline layers and collectives, the
sharded optimizer; the model builds on its layer factory and dispatchers (STYLE.md rules 1-3)."""
