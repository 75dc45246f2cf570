"""Checkpoint CLI (inspect, verify, reshard, export, prune). Empty until the checkpoint library lands."""
