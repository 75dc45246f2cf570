"""The plan beside the dry run, rank role by rank role: launch.plan --traces and bench/dry_run.py print it.

Per traced rank: the plan's GB per GPU and the traced peak, each communication column, the FLOPs, each with
the ratio traced / plan; the dry run's predicted time for the rank's micro-batches and its MFU; how long the
dry run took here. The plan must be computed for the traced step (a cut step's micro-batches: dry_run.
first_micro_batches).
"""

from moe_pretrain.planning.collective_traffic import PLAN_COLUMNS, plan_columns


def ratio(traced: float, planned: float) -> str:
    return f"{traced / planned:6.2f}" if planned else "     -"


HEADER = (f"{'stage':6s} {'rank':>5s} {'role':13s} {'GB plan':>8s} {'traced':>8s} {'ratio':>6s} | "
          + " ".join(f"{c + ' GB':>8s} {'ratio':>6s}" for c in PLAN_COLUMNS)
          + f" | {'TFLOP':>8s} {'ratio':>6s} | {'step s':>7s} {'MFU':>6s} | {'here s':>6s}")


def comparison_lines(stage: str, planned_ranks: list[dict], traces: list[dict]) -> list[str]:
    """One line per trace under HEADER; planned_ranks: MemoryPlanner.stage(...)["ranks"] of the traced step."""
    lines = []
    for trace in traces:
        row = planned_ranks[trace["pipeline_rank"]]
        sent, comm = plan_columns(trace["sent_bytes"]), row["communication"]
        lines.append(f"{stage:6s} {trace['rank']:5d} {trace['role']:13s} {row['total_bytes'] / 1e9:8.2f} "
                     f"{trace['peak_bytes'] / 1e9:8.2f} {ratio(trace['peak_bytes'], row['total_bytes'])} | "
                     + " ".join(f"{sent[c] / 1e9:8.3f} {ratio(sent[c], comm[c])}" for c in PLAN_COLUMNS)
                     + f" | {trace['flops'] / 1e12:8.1f} {ratio(trace['flops'], row['flops'])} | "
                     f"{trace['step_s']:7.3f} {trace['mfu']:6.1%} | {trace['seconds']:6.0f}")
    return lines

