"""How long before a job's time limit the run must stop to save: derived from what its largest rank writes.

A fixed lead (300 s) is ample for the smoke model and far too short at full size: there a rank of the 2048-GPU
layout checkpoints tens of GB, which at a shared file system's worst rate takes longer than the lead, and the job
ends as TIMEOUT with its checkpoint cut short and no status. The lead is one step and the commit (STEP_MARGIN_S;
SLURM also delivers a --signal up to 60 s off its mark) plus one pass over the largest rank's checkpointed bytes at
the storage floor the checkpoint group already plans for (checkpoint.io_floor_mb_s; the save hashes while it writes,
checkpoint/hashing_writer.py, so one pass). The bytes come from the memory plan, not a model: the parameters the
rank holds and its optimizer slice (planning/rank_state.py), an upper bound of its share of the save.
"""

import math
from dataclasses import dataclass

from moe_pretrain.config import Config
from moe_pretrain.planning.rank_state import parameter_shapes, stage_state_bytes
from parallel.state import ParallelLayout

STEP_MARGIN_S = 240
"""One more training step (the run stops at a step boundary), the commit's gathers, and SLURM's signal timing."""
MIN_LEAD_S = 300
"""Never less than the lead that served the small runs so far."""


@dataclass(frozen=True)
class SignalLead:
    seconds: int
    why: str


def signal_lead(cfg: Config, layout: ParallelLayout) -> SignalLead:
    """launch.signal_lead_s when set; else the margin plus the largest rank's save at checkpoint.io_floor_mb_s,
    rounded up to a minute."""
    if cfg.launch.signal_lead_s:
        return SignalLead(cfg.launch.signal_lead_s, f"launch.signal_lead_s={cfg.launch.signal_lead_s}")
    stages = stage_state_bytes(cfg, parameter_shapes(cfg), layout)
    largest = max(stages, key=lambda s: s["checkpoint_bytes"])
    saved = largest["checkpoint_bytes"]
    floor = cfg.checkpoint.io_floor_mb_s * 1e6
    seconds = max(MIN_LEAD_S, 60 * math.ceil((STEP_MARGIN_S + saved / floor) / 60))
    return SignalLead(seconds, f"{STEP_MARGIN_S} s for a step and the commit + rank {largest['rank']}'s "
                               f"{saved / 1e9:.1f} GB at checkpoint.io_floor_mb_s={cfg.checkpoint.io_floor_mb_s:g}")
