"""Per-rank peak memory against the state each rank holds, for one process and for pp2 x ep4 (8 processes).

Run: .venv/bin/python bench/memory.py [--config configs/probe_memory.yaml] [--set key=value ...]

Each rank measures its resident memory (Linux VmHWM, reset between phases) in three phases: build (the
trainer: data loader, model built on the meta device and materialised for this rank, optimizer with its
moments), step (two optimizer steps: gradients, activations, collectives) and save (a synchronous
checkpoint). Printed per rank: parameters held, the baseline (resident memory after imports and process
groups, before the trainer: the interpreter, torch and megatron-core, not state), and for each phase the
peak and the ratio (peak - baseline) / (16 B x parameters held): fp32 parameters, gradients and two Adam
moments are 16 bytes a parameter, so 1.0 is a rank holding nothing but its state. Goal: <= 1.3 everywhere.
Each phase's peak of live tensor bytes (measured.LiveTensorBytes, the main thread's ops; exact, what
tests/distributed/test_memory.py bounds) is measured too, as the ratio live peak / (16 B x parameters held).
"""

import argparse
import tempfile

import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.planning.measured import LiveTensorBytes, peak_resident_bytes, reset_peak, resident_bytes
from moe_pretrain.training import Trainer
from parallel.collectives import gather_objects
from parallel.state import destroy_parallel, init_parallel

PHASES = ("build", "step", "save")
STATE_BYTES_PER_PARAM = 16


def no_process_figures(phase: str) -> dict:
    """What tests measure besides live tensor bytes: nothing (the process's memory is neither read nor reset)."""
    return {}


def resident_figures(phase: str) -> dict:
    """The bench's process figure for a phase ("baseline": resident memory now; a phase: its resident peak),
    and a fresh peak for what follows."""
    value = resident_bytes() if phase == "baseline" else peak_resident_bytes()
    reset_peak()
    return {phase: value}


def measure(rank: int, world_size: int, config: str, overrides: list[str],
            process_figures=no_process_figures) -> list[dict]:
    """Every rank's row (collective; rank 0's return value is what run_distributed hands back): each phase's
    peak of live tensor bytes, and what process_figures(phase) adds at the baseline and after each phase."""
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(config, [*overrides, f"train.run_dir={run_dir}", "checkpoint.async_save=false",
                                   "logging.progress=false"])
        ctx = init_parallel(cfg)
        try:
            row = {"rank": rank, **process_figures("baseline")}
            with LiveTensorBytes() as live:
                trainer = Trainer(cfg, ctx)
                row.update(process_figures("build"), **{"live.build": live.peak})
                live.restart_peak()
                for _ in range(2):
                    trainer.train_step()
                row.update(process_figures("step"), **{"live.step": live.peak})
                live.restart_peak()
                trainer.checkpoints.save()
                row.update(process_figures("save"), **{"live.save": live.peak})
            row["params"] = sum(p.numel() for p in trainer.model.parameters())
            row["pp_rank"], row["ep_rank"] = ctx.pp_rank, ctx.ep_rank
            return gather_objects(row, dist.group.WORLD if ctx.distributed else None)
        finally:
            destroy_parallel()


def ratio(row: dict, phase: str) -> float:
    """A phase's resident peak over the baseline, per state byte (16 B x parameters held)."""
    return (row[phase] - row["baseline"]) / (STATE_BYTES_PER_PARAM * row["params"])


def live_ratio(row: dict, phase: str) -> float:
    """A phase's peak of live tensor bytes per state byte."""
    return row[f"live.{phase}"] / (STATE_BYTES_PER_PARAM * row["params"])


def run_layout(config: str, world_size: int, overrides: list[str], process_figures=no_process_figures
               ) -> list[dict]:
    """Rows of every rank of a layout, each process fresh (so its memory is its own)."""
    return run_distributed(measure, world_size, config, overrides, process_figures, timeout=1800)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/probe_memory.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = parser.parse_args()
    layouts = [("1 process", 1, []), ("pp2 x ep4", 8, ["parallel.pp=2", "parallel.ep=4"])]
    gb = 1e9
    print(f"{args.config} {' '.join(args.set)}: peak resident GB per phase, and (peak - baseline) / "
          f"({STATE_BYTES_PER_PARAM} B x params held)")
    print(f"{'layout':>10} {'rank':>4} {'pp':>2} {'ep':>2} {'params':>11} {'base':>5} "
          + " ".join(f"{phase:>24}" for phase in PHASES))
    worst = 0.0
    for name, world, overrides in layouts:
        for row in run_layout(args.config, world, [*args.set, *overrides], resident_figures):
            cells = " ".join(f"{row[p] / gb:5.2f} ({ratio(row, p):4.2f}, live {live_ratio(row, p):4.2f})"
                             for p in PHASES)
            print(f"{name:>10} {row['rank']:>4} {row['pp_rank']:>2} {row['ep_rank']:>2} {row['params']:>11,} "
                  f"{row['baseline'] / gb:5.2f} {cells}")
            worst = max(worst, *(ratio(row, p) for p in PHASES))
    print(f"worst ratio {worst:.2f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
