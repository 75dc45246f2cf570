"""The single-node smoke test to run before spending a cluster: `python -m launch.smoke [--gpus N]`.

With the tiny smoke model (configs/smoke.yaml, 16 experts) on N GPUs (or N CPU processes with --procs),
it runs, each as a real launch: one process; every parallel layout that fits N (data, tensor + expert,
pipeline, and tensor x pipeline from 4), whose losses must equal the one process's; a save, a resume,
and a check that the resumed run ends where an uninterrupted one does; a reshard of the checkpoint to
another layout and a run resumed from it. It prints a pass / fail table and exits 0 only if everything
passed. Runs go under --out (a temporary folder by default), each with its log.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 4
LOSS_RTOL = 1e-4
"""Layouts sum in other orders (fp32): over STEPS steps of the smoke model the losses agree far closer than
this (CPU, gloo, 2 processes: largest relative difference 9.1e-08 over dp2, tp2 x ep2 and pp2)."""


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def layouts(n: int) -> list[tuple[str, list[str]]]:
    out = [(f"dp{n}", [])] if n > 1 else []
    if n % 2 == 0:
        out.append((f"tp2 x ep2 (dp{n // 2})", ["parallel.tp=2", "parallel.ep=2"]))
        out.append((f"pp2 (dp{n // 2})", ["parallel.pp=2", "data.micro_batches=2"]))
    if n % 4 == 0:
        out.append((f"tp2 x pp2 x ep2 (dp{n // 4})", ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2",
                                                       "data.micro_batches=2"]))
    return out


class Smoke:
    def __init__(self, procs: int, out: Path, gpus: bool, overrides: list[str] | None = None):
        self.procs, self.out, self.gpus = procs, out, gpus
        self.overrides = overrides or []
        """Config overrides every run takes (before each run's own)."""
        self.rows: list[tuple[str, bool, float, str]] = []
        self.losses: dict[str, list[float]] = {}
        self.run_dirs: dict[str, Path] = {}

    def train(self, name: str, procs: int, overrides: list[str]) -> tuple[bool, str, Path]:
        run_dir = self.out / name.replace(" ", "").replace("(", "_").replace(")", "")
        # No evaluation (make smoke has it): these check layouts, resume and reshard, each in a few steps.
        base = ["-m", "launch.train", "--config", "configs/smoke.yaml", f"train.steps={STEPS}", "eval.tokens=0",
                "eval.every=0", "logging.progress=false", f"train.run_dir={run_dir}",
                *([] if self.gpus else ["parallel.backend=gloo"]), *self.overrides]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
               if procs > 1 else [sys.executable])
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / "launch.log").open("a") as log:
            done = subprocess.run([*cmd, *base, *overrides], stdout=log, stderr=subprocess.STDOUT, timeout=900,
                                  env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // procs))})
        detail = f"exit {done.returncode}, log {run_dir / 'launch.log'}"
        return done.returncode == 0, detail, run_dir

    def check(self, name: str, step) -> None:
        start = time.perf_counter()
        try:
            ok, detail = step()
        except Exception as err:  # a failed check is a table row, not the end of the smoke test
            ok, detail = False, f"{type(err).__name__}: {err}"
        self.rows.append((name, ok, time.perf_counter() - start, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({detail})", flush=True)

    def run(self) -> bool:
        self.check("1 process", lambda: self.layout_run("1 process", 1, []))
        for name, overrides in layouts(self.procs):
            self.check(name, lambda n=name, o=overrides: self.layout_run(n, self.procs, o))
        self.check("every layout's losses = 1 process's", self.losses_agree)
        self.check("save, resume, same final loss", self.save_and_resume)
        if self.procs % 2 == 0:
            self.check("reshard to tp2 x ep2, resume there", self.reshard)
        return all(ok for _, ok, _, _ in self.rows)

    def layout_run(self, name: str, procs: int, overrides: list[str]) -> tuple[bool, str]:
        ok, detail, run_dir = self.train("single" if procs == 1 else name, procs, overrides)
        if ok:
            self.losses[name], self.run_dirs[name] = losses(run_dir), run_dir
        return ok, detail

    def losses_agree(self) -> tuple[bool, str]:
        """Every layout computes the same step as one process: the same losses within LOSS_RTOL."""
        reference = self.losses.get("1 process")
        if reference is None or len(self.losses) < 2:
            return False, "the single-process run or every layout run failed"
        worst = max(abs(a - b) / abs(b) for run in self.losses.values() for a, b in zip(run, reference, strict=True))
        return worst <= LOSS_RTOL, f"largest relative difference {worst:.1e} over {len(self.losses) - 1} layouts " \
                                   f"and {len(reference)} steps (allowed {LOSS_RTOL:.0e})"

    def uninterrupted(self) -> tuple[bool, str, Path]:
        """A finished run of the default layout on every process, with its final checkpoint: the data-
        parallel layout check's when it passed (the same launch), else one of its own."""
        name = f"dp{self.procs}"
        if name in self.run_dirs:
            return True, "", self.run_dirs[name]
        return self.train("straight", self.procs, [])

    def save_and_resume(self) -> tuple[bool, str]:
        ok, detail, straight = self.uninterrupted()
        if not ok:
            return ok, detail
        ok, detail, resumed = self.train("resumed", self.procs, ["train.exit_at_step=2"])
        ok2, detail2, _ = self.train("resumed", self.procs, [])
        if not (ok and ok2):
            return False, detail if not ok else detail2
        a, b = (losses(d)[-1] for d in (straight, resumed))
        return a == b, f"final loss {a:.6f} uninterrupted, {b:.6f} saved at step 2 and resumed"

    def reshard(self) -> tuple[bool, str]:
        checkpoints = self.uninterrupted()[2] / "checkpoints"
        source = checkpoints / (checkpoints / "latest").read_text().strip()
        target = self.out / "resharded"
        cmd = [sys.executable, "-m", "checkpoints_tool", "reshard", str(source.resolve()), str(target / "checkpoints"),
               "--tp", "2", "--ep", "2", "--dp", str(self.procs // 2)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode:
            return False, f"reshard exit {done.returncode}: {done.stderr.strip()[-300:]}"
        layout = ["parallel.tp=2", "parallel.ep=2", f"train.steps={STEPS + 2}"]
        ok, detail, run_dir = self.train("resharded", self.procs, layout)
        resumed = "resumed from" in (run_dir / "launch.log").read_text()
        return ok and resumed, f"resharded, {'resumed' if resumed else 'NOT resumed'} on tp2 x ep2: {detail}"

    def table(self) -> str:
        width = max(len(name) for name, *_ in self.rows)
        lines = [f"{'check':<{width}}  result  seconds", f"{'-' * width}  ------  -------"]
        lines += [f"{name:<{width}}  {'pass' if ok else 'FAIL':<6}  {seconds:7.1f}"
                  for name, ok, seconds, _ in self.rows]
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs on this node to use (NCCL)")
    parser.add_argument("--procs", type=int, default=2, help="CPU processes when --gpus is 0 (gloo)")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (key=value), e.g. a smaller "
                        "model; the layouts' own come after them")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="moe-smoke-"))
    if args.out and out.exists() and any(out.iterdir()):
        print(f"launch.smoke: --out {out} is not empty; give a new folder", file=sys.stderr)
        return 2
    smoke = Smoke(args.gpus or args.procs, out, gpus=args.gpus > 0, overrides=args.overrides)
    passed = smoke.run()
    print(f"\n{smoke.table()}\n\nsmoke test {'PASSED' if passed else 'FAILED'}; runs and logs in {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
