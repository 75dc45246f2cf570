"""Held-out validation on every layout gives the values of one process (in one process, the held-out documents
and the evaluations against their direct computation: tests/integration/test_validation_runs.py)."""


import pytest

from launch.local import run_distributed
from moe_pretrain.operations.run_loop import run_training
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel
from tests.models import EVAL, tiny_config


def layout_worker(rank, world_size, run_dir, overrides):
    cfg = tiny_config(*EVAL, "eval.every=2", "train.steps=4", "train.dtype=float64", "logging.progress=false",
                      "data.batch_size=8", f"train.run_dir={run_dir}", *overrides)
    ctx = init_parallel(cfg)
    try:
        history = run_training(Trainer(cfg, ctx))
        return [{k: v for k, v in h.items() if k.startswith(("eval_", "probe_"))} for h in history]
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "overrides"), [
    (4, ["parallel.pp=2", "parallel.ep=2", "data.micro_batches=2"]),
], ids=["dp2xpp2xep2"])
def test_eval_loss_is_the_same_on_every_layout(tmp_path, world_size, overrides):
    """Data-parallel shards of the validation rows (padded to whole micro-batches per rank) and the pipeline
    schedule's forward-only pass give one process's values (pp2 x cp2 was checked the same way by hand)."""
    single = layout_worker(0, 1, str(tmp_path / "single"), [o for o in overrides if not o.startswith("parallel.")])
    spread = run_distributed(layout_worker, world_size, str(tmp_path / "spread"), overrides)
    assert [sorted(r) for r in spread] == [sorted(r) for r in single]
    assert [bool(r) for r in single] == [False, True, False, True]  # steps 2 and 4
    assert "probe_accuracy" in single[-1] and "eval_position_loss.0-6" in single[-1]  # at the run's end
    for got, want in zip(spread, single):
        assert got == pytest.approx(want, rel=1e-9)
