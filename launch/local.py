"""Running a function on N local gloo processes (tests, benches), with a free port and a hard timeout.

Each worker gets (rank, world_size, *args); what rank 0's function returns comes back to the test
(through torch.save to a file: tensors cannot outlive their process in a queue). A worker that raises
fails the call with every rank's traceback; a hang is killed at the timeout.

Workers are forked from a fork server that has imported torch, megatron-core and this package once
(PRELOAD): a fresh interpreter spends ~10 s of CPU importing them (megatron-core alone ~8 s: it compiles
torch's inductor and imports wandb), which used to be most of a short multi-process test. The server
itself has run no torch op, so no thread pool is forked half-started (fork from the test process would
be). Environment changes made after the first call do not reach later workers (they fork from the server);
_worker sets what the layout needs.
"""

import multiprocessing.context
import os
import queue
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, reports, result_file):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(result, result_file)
        reports.put((rank, "ok", None))
    except BaseException:  # report everything, including assertion errors, to the test process
        reports.put((rank, "error", traceback.format_exc()))
        raise


PRELOAD = ["torch.distributed.checkpoint", "megatron.core", "moe_pretrain.training", "moe_pretrain.checkpoint",
           "parallel.state", "launch.local"]


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call); later calls reuse it
    return ctx


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0):
    """Run fn on world_size processes; return rank 0's result. fn must be importable (module level)."""
    ctx = _context()
    reports = ctx.Queue()
    port = free_port()
    result_file = Path(tempfile.mkdtemp()) / "rank0.pt"
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, reports, result_file))
             for r in range(world_size)]
    for p in procs:
        p.start()
    errors = []
    try:
        for _ in range(world_size):
            # After a first failure, give the other ranks a moment to report theirs.
            rank, status, payload = reports.get(timeout=5 if errors else timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{payload}")
    except queue.Empty:
        if not errors:
            raise
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        # A crashed peer makes the others fail with "Connection closed": list the root cause first.
        errors.sort(key=lambda e: "Connection closed" in e)
        raise AssertionError("worker(s) failed:\n" + "\n".join(errors))
    result = torch.load(result_file, weights_only=True)
    result_file.unlink()
    result_file.parent.rmdir()
    return result

