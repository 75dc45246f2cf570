"""The plan beside the dry run, rank role by rank role: launch.plan --traces and bench/dry_run.py print it.

Per traced rank: the plan's GB per GPU and the traced peak, each communication column, the FLOPs, each with
the ratio traced / plan; the dry run's predicted time for the rank's micro-batches and its MFU; how long the
dry run took here. The plan is computed for the traced step (a cut step's micro-batches: dry_run.
first_micro_batches) and for the documents the dry run attended over (planning/documents.py): the plan's own
bound, one document per row, is not what the stage's loader packs.
"""

from collections.abc import Iterable

from moe_pretrain.config import Config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.model.counts import attended_keys
from moe_pretrain.planning.collective_traffic import PLAN_COLUMNS, plan_columns
from moe_pretrain.planning.documents import exchange_spans, rank_doc_ids
from moe_pretrain.planning.dry_run import first_micro_batches
from moe_pretrain.planning.sizing import StageDocuments
from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout, micro_batch_rows
from parallel.state import ParallelLayout


def ratio(traced: float, planned: float) -> str:
    return f"{traced / planned:6.2f}" if planned else "     -"


HEADER = (f"{'stage':6s} {'rank':>5s} {'role':13s} {'GB plan':>8s} {'traced':>8s} {'ratio':>6s} | "
          + " ".join(f"{c + ' GB':>8s} {'ratio':>6s}" for c in PLAN_COLUMNS)
          + f" | {'TFLOP':>8s} {'ratio':>6s} | {'step s':>7s} {'MFU':>6s} | {'here s':>6s}")


def plan_of_traced_step(cfg: Config, run: RunLayout, stage: int, micro_batches: int,
                        traced: Iterable[tuple[int, int]]) -> tuple[dict[tuple[int, int], list[dict]], str]:
    """MemoryPlanner.stage(...)["ranks"] of stage `stage`'s first `micro_batches` micro-batches for each traced
    rank's (cp rank, dp rank): its MLA attention (and latent exchange) priced by the documents of the rows that
    rank ran, what the latent exchange sends by its cp rank; and a line saying so."""
    cut = first_micro_batches(cfg, stage, micro_batches)
    config = resolve_stages(cut)[stage]
    dp = ParallelLayout(run.gpus, run.tp, run.pp, run.ep, config.cp, run.vpp).dp
    planner, ranks, lines = MemoryPlanner(cut), {}, []
    for cp_rank, dp_rank in sorted(set(traced)):
        doc_ids = rank_doc_ids(cut, stage, config.rows // micro_batches, micro_batches, dp_rank, dp)
        keys = attended_keys(doc_ids)
        spans = exchange_spans(doc_ids, micro_batch_rows(run, config), config.cp) \
            if config.cp > 1 and config.cp_mla == "latent" else ()
        documents = StageDocuments(keys, spans, cp_rank)
        ranks[cp_rank, dp_rank] = planner.stage(run, config, documents)["ranks"]
        line = (f"{config.name}, cp rank {cp_rank}, dp rank {dp_rank}: the plan prices attention at the {keys:.0f} "
                f"keys a query sees in the rows it ran (one document per row: {config.seq_len / 2:.0f})")
        if span := documents.span():
            line += (f"; its latent exchange expands {span.expanded_keys:.1f} keys a local position (one document "
                     f"per row: up to {config.cp}), its tiles meet {span.tile_keys:.0f} keys a query, and it sends "
                     f"{span.sent_keys:.2f} and receives {span.received_keys:.2f} keys a local position (one "
                     f"document per row: up to {config.cp - 1})")
        lines.append(line)
    return ranks, "\n  ".join(lines)


def comparison_lines(stage: str, planned_ranks: dict[tuple[int, int], list[dict]], traces: list[dict]
                     ) -> list[str]:
    """One line per trace under HEADER; planned_ranks: plan_of_traced_step's, by cp rank."""
    lines = []
    for trace in traces:
        row = planned_ranks[trace["cp_rank"], trace["dp_rank"]][trace["pipeline_rank"]]
        sent, comm = plan_columns(trace["sent_bytes"]), plan_columns(row["communication"])
        lines.append(f"{stage:6s} {trace['rank']:5d} {trace['role']:13s} {row['total_bytes'] / 1e9:8.2f} "
                     f"{trace['peak_bytes'] / 1e9:8.2f} {ratio(trace['peak_bytes'], row['total_bytes'])} | "
                     + " ".join(f"{sent[c] / 1e9:8.3f} {ratio(sent[c], comm[c])}" for c in PLAN_COLUMNS)
                     + f" | {trace['flops'] / 1e12:8.1f} {ratio(trace['flops'], row['flops'])} | "
                     f"{trace['step_s']:7.3f} {trace['mfu']:6.1%} | {trace['seconds']:6.0f}")
    return lines

