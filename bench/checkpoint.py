"""Checkpoint save, verify + load and async stall against raw sequential I/O of the same bytes, and how save
and verify time grow with ranks; everything measured in one run.

Run: .venv/bin/python bench/checkpoint.py [--hidden 1024 --layers 8 --experts 32 --rounds 3 --ranks 1 2 4]

Part 1 (one process): a smoke-shaped model (larger by default) takes one step so Adam state exists; then,
for each of --rounds rounds, in turn: a raw sequential write of the checkpoint's byte count (fsync'd: the
named reference) and our synchronous save (DCP files hashed while written, manifest, atomic commit); a raw
sequential read and our verify + load (SHA-256 of every file against the manifest while the DCP read fills
the model and the sharded optimizer in place, as a resume does); and the training stall of an asynchronous save against
the synchronous save: the time the call takes plus what the next training step waits, before its update,
for the copy to host buffers that runs beside its forward and backward. Medians over the rounds are
printed; the machine is shared and noisy. Reads are from storage: both the raw file's and the
checkpoint's pages are dropped from the page cache first (posix_fadvise DONTNEED), because at full size
(33 TB) a resume never reads from cache; the page-cache figures are printed too.

Part 2 (1, 2, 4 processes, gloo): weak scaling, each rank holding about the same state (data and expert
parallel over the ranks, experts growing with them): save and verify time (the slowest rank's) and the
aggregate throughput per rank count, against one rank. Every rank writes, hashes and verifies its own
bytes, so neither grows with ranks where each rank has its own cores and storage bandwidth; on one
small machine all ranks share them, and the aggregate throughput is the figure to read.
"""

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.checkpoint import AsyncSaver, find, shared_verify, verifying_load
from moe_pretrain.config import load_config
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.collectives import barrier as group_barrier
from parallel.collectives import gather_objects
from parallel.state import destroy_parallel, init_parallel

MIB = 2**20


def model_overrides(hidden: int, layers: int, experts: int, run_dir: str) -> list[str]:
    return [f"model.hidden_size={hidden}", f"model.num_layers={layers}",
            f"model.layer_pattern={'KKKM' * (layers // 4)}", f"model.moe.num_experts={experts}",
            f"model.moe.latent_size={hidden // 2}", "train.steps=1",
            "logging.progress=false", f"train.run_dir={run_dir}", "checkpoint.every=0", "checkpoint.keep_last=1000",
            "eval.tokens=0", "eval.every=0"]


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' pages from this machine's page cache (clean pages: they were fsync'd)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def raw_write(path: Path, size: int) -> None:
    block = os.urandom(MIB)
    with path.open("wb") as f:
        for _ in range(size // MIB):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: Path) -> None:
    with path.open("rb", buffering=0) as f:
        while f.read(MIB):
            pass


def verify_and_load(trainer: Trainer, path: Path) -> None:
    """As a resume does: the files hashed while the load reads them into the model and the optimizer."""
    found, _ = find(path.parent, str(path), verifying_load(trainer.state.load))
    if found != path:
        raise RuntimeError(f"{path} did not verify")


def single_process(args: argparse.Namespace, tmp: Path) -> None:
    cfg = load_config("configs/smoke.yaml", model_overrides(args.hidden, args.layers, args.experts, f"{tmp}/run"))
    trainer = Trainer(cfg)
    run_training(trainer)  # one step, then the end-of-run save (untimed warm-up of the code path)
    rows: dict[str, list[float]] = {k: [] for k in ("raw_w", "save", "raw_r", "load", "raw_r_warm", "load_warm",
                                                   "stall", "sync", "step", "step_copying")}
    size = 0
    for round_ in range(args.rounds):
        trainer.step += 1  # a new step number: checkpoints are never overwritten
        rows["save"].append(timed(trainer.checkpoints.save))
        path = trainer.checkpoints.last
        files = [p for p in path.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        raw = tmp / f"raw{round_}.bin"
        rows["raw_w"].append(timed(raw_write, raw, size))
        for cache in ("", "_warm"):
            if not cache:
                drop_cache([raw, *files])

            rows["raw_r" + cache].append(timed(raw_read, raw))
            rows["load" + cache].append(timed(verify_and_load, trainer, path))
        raw.unlink()
        saver, trainer.checkpoints.async_saver = trainer.checkpoints.async_saver, AsyncSaver(None)
        rows["step"].append(timed(trainer.train_step))  # a training step with no save in flight
        call = timed(trainer.checkpoints.save)  # returns at once: the copy runs beside the next step
        rows["step_copying"].append(timed(trainer.train_step))
        rows["stall"].append(call + trainer.checkpoints.async_saver.staging_wait_s)  # + the wait before its update
        trainer.checkpoints.async_saver.wait()
        trainer.checkpoints.async_saver = saver
        trainer.step += 1
        rows["sync"].append(timed(trainer.checkpoints.save))
    m = {k: statistics.median(v) for k, v in rows.items()}
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"checkpoint of {size / MIB:.1f} MiB ({params:,} parameters + Adam moments), 1 process, "
          f"median of {args.rounds} rounds")
    print(f"  raw sequential write        {size / m['raw_w'] / MIB:8.1f} MiB/s   (reference)")
    print(f"  save (sync)                 {size / m['save'] / MIB:8.1f} MiB/s   {m['raw_w'] / m['save']:.2f}x raw write"
          "   goal >= 0.7")
    print(f"  raw sequential read         {size / m['raw_r'] / MIB:8.1f} MiB/s   (reference, from storage)")
    print(f"  verify + load               {size / m['load'] / MIB:8.1f} MiB/s   {m['raw_r'] / m['load']:.2f}x raw read"
          "    goal >= 0.5")
    print(f"  raw read, page cache        {size / m['raw_r_warm'] / MIB:8.1f} MiB/s")
    print(f"  verify + load, page cache   {size / m['load_warm'] / MIB:8.1f} MiB/s   "
          f"{m['raw_r_warm'] / m['load_warm']:.2f}x")
    print(f"  async save stall            {m['stall'] * 1e3:8.1f} ms       {m['stall'] / m['sync']:.2f}x the "
          f"synchronous save ({m['sync'] * 1e3:.1f} ms)   goal <= 0.1")
    print(f"    (the call, and the next step's wait for the host copy; that step took {m['step_copying'] * 1e3:.0f} ms"
          f" against {m['step'] * 1e3:.0f} ms without a copy beside it, on {os.cpu_count()} shared cores)")


def barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        group_barrier(group or dist.group.WORLD)


def scaling_worker(rank: int, world: int, hidden: int, layers: int, experts: int, run_dir: str,
                   rounds: int) -> list[dict]:
    overrides = model_overrides(hidden, layers, experts * world, run_dir)
    cfg = load_config("configs/smoke.yaml", [*overrides, f"parallel.ep={world}"])
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        run_training(trainer)
        group = trainer.state.checkpoint_group
        check = shared_verify(group)
        results = []
        for _ in range(rounds):
            trainer.step += 1
            barrier(group)
            save_s = timed(trainer.checkpoints.save)
            path = trainer.checkpoints.last
            own = sum(p.stat().st_size for p in path.glob(f"__{rank}_*"))
            barrier(group)
            verify_s = timed(check, path)
            results.append({"save_s": save_s, "verify_s": verify_s, "bytes": own})
        return gather_objects(results, group)
    finally:
        destroy_parallel()


def scaling(args: argparse.Namespace, tmp: Path) -> None:
    print(f"\nweak scaling: {args.experts} experts per rank (ep = ranks), median of {args.rounds} rounds; the "
          "slowest rank's time")
    print("  ranks  rank 0 MiB  total MiB   save s  save MiB/s (x 1 rank)  verify s  verify MiB/s (x 1 rank)")
    base = None
    for world in args.ranks:
        ranks = run_distributed(scaling_worker, world, args.hidden, args.layers, args.experts,
                                str(tmp / f"scale{world}"), args.rounds, timeout=900)
        # Per round, the slowest rank's time (what every rank waits for); then the median round.
        save_s = statistics.median(max(rank[i]["save_s"] for rank in ranks) for i in range(args.rounds))
        verify_s = statistics.median(max(rank[i]["verify_s"] for rank in ranks) for i in range(args.rounds))
        total = sum(rank[0]["bytes"] for rank in ranks)
        rates = (total / save_s / MIB, total / verify_s / MIB)
        base = base or rates
        print(f"  {world:5d}  {ranks[0][0]['bytes'] / MIB:10.1f}  {total / MIB:9.1f}  {save_s:7.3f}  {rates[0]:10.1f} "
              f"({rates[0] / base[0]:4.2f}x)  {verify_s:8.3f}  {rates[1]:12.1f} ({rates[1] / base[1]:4.2f}x)")
    print(f"  (this machine: {os.cpu_count()} cores and one disk shared by all ranks; rank 0 hashes its own files "
          "only, where it once hashed the total)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        single_process(args, Path(tmp))
        if args.ranks:
            scaling(args, Path(tmp))


if __name__ == "__main__":
    main()
