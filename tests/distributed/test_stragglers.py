"""The straggler check on a real 4-process run (gloo): one rank slowed by a sleep inside its forward is named,
and only it; the ranks that wait for it are not; a run without the sleep names nobody.

The slowed rank sleeps 0.4 s in every forward, several times the tiny model's compute on this machine, and a rank
is named at twice its stage's median (logging.straggler.threshold=1.0) for 2 windows in a row: a margin wide
enough that a loaded machine's noise neither hides the slow rank nor names a waiting one.
"""

import json
import time
from pathlib import Path

import pytest

from launch.local import run_distributed
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel
from tests.models import tiny_config

SLOW_RANK = 2


def straggler_worker(rank, world_size, run_dir, slow_rank):
    cfg = tiny_config("train.steps=8", "data.batch_size=8", "parallel.ep=2", "logging.progress=false",
                      "logging.straggler.every=2", "logging.straggler.windows=2", "logging.straggler.threshold=1.0",
                      f"train.run_dir={run_dir}", "checkpoint.every=0")
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        if rank == slow_rank:  # the test-only hook: a slow GPU, as a sleep inside this rank's forward
            trainer.model.register_forward_pre_hook(lambda *_: time.sleep(0.4))
        history = trainer.run()
        return [record.get("stragglers") for record in history]
    finally:
        destroy_parallel()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stragglers.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slow_rank", [SLOW_RANK, None], ids=["one-slow-rank", "clean"])
def test_the_slow_rank_is_named_and_only_it(tmp_path, slow_rank):
    counts = run_distributed(straggler_worker, 4, str(tmp_path), slow_rank)
    windows = records(tmp_path)
    assert [w["step"] for w in windows] == [2, 4, 6, 8]
    assert counts[1::2] == [float(len(w["stragglers"])) for w in windows]  # the metrics carry the count
    named = [w["stragglers"] for w in windows]
    if slow_rank is None:
        assert named == [[], [], [], []]
        return
    assert named[0] == [] and all(n == [slow_rank] for n in named[1:]), named  # from its second window on
    for window in windows:
        ranks = window["ranks"]
        waiting = [r for r in ranks if r["rank"] != slow_rank]
        assert ranks[slow_rank]["ratio"] > 2 and all(r["ratio"] < 2 for r in waiting)
        # its victims spent the time it took waiting in collectives, not computing
        slow_blocked = sum(ranks[slow_rank]["blocked_s"].values())
        assert all(sum(r["blocked_s"].values()) > slow_blocked for r in waiting)
        assert window["slow_hosts"] == [] and window["expert_load"] == []
