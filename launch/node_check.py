"""Is this node fit to train? Run by the SLURM job on every node after a run that ended hung or crashed.

    python -m launch.node_check --gpus 8 --dir RUN_DIR      # exit 0: fit; 1: not (the reason on stderr)

A hang or a crash seldom names its cause: every rank's watchdog fires when one peer stalls, and the elastic agents
of all nodes give up together. What a requeue must avoid is the same broken machine, so the job asks each node
directly: the GPUs it should have are all visible, each multiplies a matrix and gets the product a CPU computes
(a GPU fallen off the bus, one raising ECC or launch errors, or one too slow to answer within the job's timeout
fails), and the run directory on the shared file system takes a write and an fsync. A node that fails, or does
not answer in time, is excluded from the requeued job (launch/slurm_outcome.py).
"""

import argparse
import socket
import sys
from pathlib import Path

import torch

from moe_pretrain.writable import write_problem

SIDE = 512
TOLERANCE = 1e-3
"""Relative error of a float32 product on a GPU against the CPU's (TF32 is off for the check)."""


def check_gpus(expected: int) -> list[str]:
    """Problems with this node's GPUs: fewer than expected, or one whose product is wrong or raises."""
    if expected == 0:
        return []
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < expected:
        return [f"{found} GPUs visible, {expected} expected"]
    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(SIDE, SIDE, generator=generator), torch.randn(SIDE, SIDE, generator=generator)
    reference = a @ b
    problems = []
    for index in range(expected):
        try:
            product = (a.to(f"cuda:{index}") @ b.to(f"cuda:{index}")).cpu()
        except RuntimeError as err:  # an Xid or ECC error surfaces as a CUDA error here
            problems.append(f"GPU {index}: {err}")
            continue
        error = ((product - reference).norm() / reference.norm()).item()
        if not error < TOLERANCE:
            problems.append(f"GPU {index}: a product off by {error:.2e} (relative), more than {TOLERANCE:g}")
    return problems


def check_directory(path: Path) -> list[str]:
    """The run directory takes a small write and an fsync (a stale mount or a full disk fails)."""
    problem = write_problem(path)
    return [f"{path} {problem}"] if problem else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.node_check", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs this node should have (0: a CPU node)")
    parser.add_argument("--dir", type=Path, required=True, help="the run directory (shared file system)")
    args = parser.parse_args(argv)
    problems = check_gpus(args.gpus) + check_directory(args.dir)
    host = socket.gethostname()
    for problem in problems:
        print(f"node_check on {host}: {problem}", file=sys.stderr)
    if not problems:
        print(f"node_check on {host}: fit ({args.gpus} GPUs, {args.dir} writable)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
