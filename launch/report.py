"""PNG plots of a run from its metrics.jsonl: `python -m launch.report RUN_DIR [--steps N ...] [--out DIR]`.

Writes into RUN_DIR/report (or --out):
- loss_lr.png: loss and learning rate against tokens, a dashed line at every stage boundary;
- throughput.png: tokens/s and MFU against tokens;
- expert_load_step<N>.png: a layer x expert heatmap of load / mean load at step N, for the steps whose
  record holds per-expert loads (logging.expert_load_every), or those --steps names;
- stragglers.png, when the run wrote RUN_DIR/stragglers.jsonl (logging.straggler): two rank x window heatmaps,
  each rank's compute over its pipeline stage's median and its experts' rows over its group's mean, the
  ranks and nodes the check named marked with a red x.
Needs matplotlib (`pip install 'moe-pretrain[report]'`).
"""

import argparse
import itertools
import json
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    """The records by step; a step written twice (a crash between checkpoint and resume) keeps the later."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a run directory?)")
    by_step = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
            by_step[record["step"]] = record
    if not by_step:
        raise ValueError(f"{path}: no steps recorded yet")
    return [by_step[s] for s in sorted(by_step)]


def stage_boundaries(records: list[dict]) -> list[tuple[int, str]]:
    """(tokens at which a stage began, its name) for every stage after the first."""
    out = []
    for before, after in itertools.pairwise(records):
        if after["stage"] != before["stage"]:
            out.append((before["tokens"], after["stage"]))
    return out


def plot_loss_lr(plt, records: list[dict], path: Path) -> None:
    tokens = [r["tokens"] for r in records]
    fig, loss_axis = plt.subplots(figsize=(8, 4.5))
    loss_axis.plot(tokens, [r["loss"] for r in records], color="tab:blue", label="loss")
    evaluated = [r for r in records if "eval_loss" in r]
    if evaluated:
        loss_axis.plot([r["tokens"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-",
                       color="tab:green", label="held-out loss")
        loss_axis.legend(loc="upper right")
    loss_axis.set_xlabel("tokens")
    loss_axis.set_ylabel("loss (nats / token)", color="tab:blue")
    lr_axis = loss_axis.twinx()
    lr_axis.plot(tokens, [r["lr"] for r in records], color="tab:orange", label="learning rate")
    lr_axis.set_ylabel("learning rate", color="tab:orange")
    for at, name in stage_boundaries(records):
        loss_axis.axvline(at, color="grey", linestyle="--", linewidth=1)
        loss_axis.annotate(name, (at, 1.0), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right",
                           fontsize=8)
    loss_axis.set_title("loss and learning rate")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(plt, records: list[dict], path: Path) -> None:
    """tokens/s above, MFU below: within a stage MFU is tokens/s times a constant, so on twin axes the two lines
    would lie on top of each other."""
    tokens = [r["tokens"] for r in records]
    fig, (speed_axis, mfu_axis) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    speed_axis.plot(tokens, [r["tokens_per_s"] for r in records], color="tab:green", label="tokens / s")
    speed_axis.set_ylabel("tokens / s")
    mfu_axis.plot(tokens, [100 * r.get("mfu", 0.0) for r in records], color="tab:purple", label="MFU")
    mfu_axis.set_ylabel("MFU (%)")
    mfu_axis.set_xlabel("tokens")
    for axis in (speed_axis, mfu_axis):
        for at, _ in stage_boundaries(records):
            axis.axvline(at, color="grey", linestyle="--", linewidth=1)
        axis.legend(loc="lower right", fontsize=8)
    speed_axis.set_title("throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_expert_load(plt, record: dict, path: Path) -> None:
    layers = sorted(record["moe"], key=int)
    rows = []
    for layer in layers:
        load = record["moe"][layer]["load"]
        mean = sum(load) / len(load) or 1.0
        rows.append([x / mean for x in load])
    fig, axis = plt.subplots(figsize=(8, 1.2 + 0.4 * len(layers)))
    image = axis.imshow(rows, aspect="auto", cmap="viridis", interpolation="nearest")
    axis.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers])
    axis.set_xlabel("expert")
    axis.set_title(f"expert load / mean, step {record['step']} ({record['stage']})")
    fig.colorbar(image, ax=axis)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_straggler_windows(run_dir: Path) -> list[dict]:
    path = run_dir / "stragglers.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_stragglers(plt, windows: list[dict], path: Path) -> None:
    """Rank x window heatmaps of relative compute and of expert load; a red x where the check named the rank
    (or its node, or its load)."""
    ranks = len(windows[0]["ranks"])
    fig, axes = plt.subplots(1, 2, figsize=(4 + 0.5 * len(windows), 1.5 + 0.3 * ranks), squeeze=False)
    for axis, key, named, title in ((axes[0][0], "ratio", "stragglers", "compute / stage median"),
                                    (axes[0][1], "load", "expert_load", "expert rows / group mean")):
        grid = [[window["ranks"][r][key] for window in windows] for r in range(ranks)]
        image = axis.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest", vmin=0)
        for column, window in enumerate(windows):
            marked = set(window[named])
            if key == "ratio":
                marked |= {r["rank"] for r in window["ranks"] if r.get("node") in window["slow_nodes"]}
            for rank in marked:
                axis.plot(column, rank, "x", color="red", markersize=10, markeredgewidth=2)
        axis.set_xticks(range(len(windows)), [str(window["step"]) for window in windows], fontsize=8)
        axis.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=8)
        axis.set_xlabel("step (window end)")
        axis.set_title(title, fontsize=10)
        fig.colorbar(image, ax=axis)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def long_context_records(run_dir: Path, records: list[dict]) -> list[dict]:
    """Records with a long-context evaluation: the stage ends of metrics.jsonl, then launch.evaluate's."""
    found = [r for r in records if "probe_accuracy" in r or any(k.startswith("eval_position_loss.") for k in r)]
    evaluations = run_dir / "evaluations.jsonl"
    if evaluations.is_file():
        found += [json.loads(line) for line in evaluations.read_text().splitlines() if line.strip()]
    return found


def plot_position_loss(plt, records: list[dict], path: Path) -> None:
    """Held-out loss by position bucket, a line per evaluation (later stages reach further)."""
    fig, axis = plt.subplots(figsize=(8, 4.5))
    for record in records:
        buckets = [(k.split(".", 1)[1], v) for k, v in record.items() if k.startswith("eval_position_loss.")]
        if buckets:
            middles = [(int(lo) + int(hi)) / 2 for lo, hi in (name.split("-") for name, _ in buckets)]
            axis.plot(middles, [v for _, v in buckets], "o-", label=f"step {record['step']} ({record['stage']})")
    axis.set_xscale("log")
    axis.set_xlabel("position in document (bucket middle)")
    axis.set_ylabel("held-out loss (nats / token)")
    axis.set_title("loss by position")
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_retrieval(plt, records: list[dict], path: Path) -> None:
    """Pass-key accuracy by probe length and key depth, a panel per evaluation."""
    records = [r for r in records if "probe_accuracy" in r]
    fig, axes = plt.subplots(1, len(records), figsize=(3.2 * len(records) + 1, 3.2), squeeze=False)
    for axis, record in zip(axes[0], records):
        cells = {tuple(k.split(".", 1)[1].split("@")): v for k, v in record.items()
                 if k.startswith("probe_accuracy.")}
        lengths = sorted({int(length) for length, _ in cells})
        depths = sorted({float(depth) for _, depth in cells})
        grid = [[cells[(str(length), str(depth))] for length in lengths] for depth in depths]
        image = axis.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        axis.set_xticks(range(len(lengths)), [str(length) for length in lengths])
        axis.set_yticks(range(len(depths)), [f"{depth:.0%}" for depth in depths])
        axis.set_xlabel("probe length (tokens)")
        axis.set_title(f"step {record['step']} ({record['stage']}): {record['probe_accuracy']:.0%}", fontsize=9)
    axes[0][0].set_ylabel("key depth")
    fig.colorbar(image, ax=axes[0].tolist())
    fig.savefig(path, dpi=100, bbox_inches="tight")  # the colorbar's axes defeat tight_layout: labels were cut off
    plt.close(fig)


def write_report(run_dir: Path, out: Path, steps: list[int] | None = None) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("launch.report needs matplotlib: pip install 'moe-pretrain[report]'") from err
    records = read_metrics(run_dir)
    with_loads = {r["step"]: r for r in records if r.get("moe") and all("load" in s for s in r["moe"].values())}
    if steps:
        missing = [s for s in steps if s not in with_loads]
        if missing:
            raise ValueError(f"steps {missing} have no per-expert loads in {run_dir / 'metrics.jsonl'}; steps that "
                             f"do: {sorted(with_loads) or 'none (logging.expert_load_every=0?)'}")
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "loss_lr.png", out / "throughput.png"]
    plot_loss_lr(plt, records, written[0])
    plot_throughput(plt, records, written[1])
    long_context = long_context_records(run_dir, records)
    if long_context:
        written.append(out / "position_loss.png")
        plot_position_loss(plt, long_context, written[-1])
    if any("probe_accuracy" in r for r in long_context):
        written.append(out / "retrieval.png")
        plot_retrieval(plt, long_context, written[-1])
    straggler_windows = read_straggler_windows(run_dir)
    if straggler_windows:
        written.append(out / "stragglers.png")
        plot_stragglers(plt, straggler_windows, written[-1])
    for step in steps or sorted(with_loads):
        written.append(out / f"expert_load_step{step}.png")
        plot_expert_load(plt, with_loads[step], written[-1])
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, nargs="*", help="steps for the expert-load heatmaps (default: all "
                        "steps with per-expert loads)")
    parser.add_argument("--out", type=Path, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.run_dir, args.out or args.run_dir / "report", args.steps)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"report: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
