"""Launchers: the torchrun / single-process training entry point (launch.train). SLURM comes later."""
