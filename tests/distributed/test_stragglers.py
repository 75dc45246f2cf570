"""The straggler check on real 4-process runs (gloo): one rank slowed by a sleep inside its forward is named,
and only it; the ranks that wait for it are not; a run without the sleep names nobody; two ranks of one
declared node slowed name the node; routing pushed to one expert-parallel rank's experts is named expert load.

The slowed rank sleeps at the end of every forward for 0.4 s plus three times that forward's own time: at least
twice the step's compute whatever the machine's load (a loaded machine slows the forward, and the sleep grows
with it), as a slow GPU is slower in proportion. A rank is named at twice its stage's median
(logging.straggler.threshold=1.0) for 2 windows in a row: a margin wide enough that a loaded machine's noise
neither hides the slow rank nor names a waiting one.
"""

import json
import socket
import time
from pathlib import Path

import pytest

from launch.local import run_distributed
from launch.report import write_report
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.operations.stragglers import StragglerWindows
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel
from tests.models import tiny_config

SLOW_RANK = 2


def slow_down(model) -> None:
    """The test-only hook: a slow GPU, as a sleep at the end of this rank's forward (module docstring)."""
    started = []
    model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
    model.register_forward_hook(lambda *_: time.sleep(0.4 + 3 * (time.perf_counter() - started.pop())))


def straggler_worker(rank, world_size, run_dir, slow_ranks, overrides):
    cfg = tiny_config("train.steps=8", "data.batch_size=8", "parallel.ep=2", "logging.progress=false",
                      "logging.straggler.every=2", "logging.straggler.windows=2", "logging.straggler.threshold=1.0",
                      f"train.run_dir={run_dir}", "checkpoint.every=0", *overrides)
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        if rank in slow_ranks:
            slow_down(trainer.model)
        history = run_training(trainer)
        return [record.get("stragglers") for record in history]
    finally:
        destroy_parallel()


def routed_to_first_experts(rank, world_size, run_dir):
    """Every router's bias pushed towards experts 0-3 (expert-parallel rank 0's) before every forward, on every
    rank: the routing sends that rank most rows, whatever the balancing does between steps."""
    cfg = tiny_config("train.steps=4", "data.batch_size=8", "parallel.ep=2", "logging.progress=false",
                      "logging.straggler.every=2", "logging.straggler.threshold=0.5",
                      f"train.run_dir={run_dir}", "checkpoint.every=0")
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)

        def bias(*_):
            for router in trainer.model.routers().values():
                router.expert_bias.zero_()
                router.expert_bias[:4] = 10.0
        trainer.model.register_forward_pre_hook(bias)
        run_training(trainer)
        check = next(hook.check for hook in trainer.hooks if isinstance(hook, StragglerWindows))
        return [identity.ep for identity in check.identities]
    finally:
        destroy_parallel()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stragglers.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slow_rank", [SLOW_RANK, None], ids=["one-slow-rank", "clean"])
def test_the_slow_rank_is_named_and_only_it(tmp_path, slow_rank):
    counts = run_distributed(straggler_worker, 4, str(tmp_path), [slow_rank], [])
    windows = records(tmp_path)
    assert [w["step"] for w in windows] == [2, 4, 6, 8]
    assert counts[1::2] == [float(len(w["stragglers"])) for w in windows]  # the metrics carry the count
    named = [w["stragglers"] for w in windows]
    if slow_rank is None:
        assert named == [[], [], [], []]
        return
    assert named[0] == [] and all(n == [slow_rank] for n in named[1:]), named  # from its second window on
    assert tmp_path / "report" / "stragglers.png" in write_report(tmp_path, tmp_path / "report")
    for window in windows:
        ranks = window["ranks"]
        waiting = [r for r in ranks if r["rank"] != slow_rank]
        assert ranks[slow_rank]["ratio"] > 2 and all(r["ratio"] < 2 for r in waiting)
        # its victims spent the time it took waiting in collectives, not computing
        slow_blocked = sum(ranks[slow_rank]["blocked_s"].values())
        assert all(sum(r["blocked_s"].values()) > slow_blocked for r in waiting)
        assert window["slow_nodes"] == [] and window["expert_load"] == []
        # the parts (their collectives' waits included) fill each rank's step
        assert all(0 < sum(r["parts_s"].values()) <= r["step_s"] for r in ranks)


@pytest.mark.timeout(300)
def test_a_node_whose_ranks_are_all_slow_is_named(tmp_path):
    """Two nodes of two processes (parallel.ranks_per_node=2); both of node 1's ranks sleep. Half the stage is
    slow, so the stage's median lies between them; beside node 0's ranks they are over 2x, named at 1.5x."""
    run_distributed(straggler_worker, 4, str(tmp_path), [2, 3],
                    ["parallel.ranks_per_node=2", "logging.straggler.threshold=0.5",
                     "logging.straggler.action=exclude"])
    windows = records(tmp_path)
    assert [w["slow_nodes"] for w in windows] == [[], [1], [1], [1]]
    assert all(w["stragglers"] == [] for w in windows)  # named as a node, not rank by rank
    # marked once for the next requeue's exclusion (every "node" here is this machine); the run went on to its end
    assert (tmp_path / "slow_hosts").read_text() == f"{socket.gethostname()}\n"
    assert windows[-1]["step"] == 8


@pytest.mark.timeout(300)
def test_expert_load_is_reported_as_routing_not_as_a_straggler(tmp_path):
    ep_ranks = run_distributed(routed_to_first_experts, 4, str(tmp_path))
    loaded = [rank for rank, ep in enumerate(ep_ranks) if ep == 0]
    for window in records(tmp_path):
        assert window["expert_load"] == loaded, window["expert_load"]
        assert window["stragglers"] == [] and window["slow_nodes"] == []
        assert all(window["ranks"][r]["load"] > 1.5 for r in loaded)
