"""outcome.ended_before_restart: a worker torchrun restarts in place after its launch's run ended for good (75, 78,
74, 130) exits with the same code instead of rebuilding the model; after anything else it runs."""

import pytest

from moe_pretrain.operations.outcome import (
    HUNG,
    LOST_PEER,
    PERMANENT,
    REQUEUE,
    STORAGE_FULL,
    ended_before_restart,
    write_refusal,
    write_status,
)


@pytest.fixture
def restarted(monkeypatch):
    """This process as the first restart in place of torchrun launch 'launch-a'."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    return monkeypatch


@pytest.mark.parametrize("code", [REQUEUE, PERMANENT, STORAGE_FULL])
def test_a_restart_after_an_end_for_good_exits_with_its_code(tmp_path, restarted, code):
    write_status(tmp_path, code, 12, "the run's own words", None)
    found = ended_before_restart(tmp_path)
    assert found is not None and found[0] == code
    assert found[1].startswith("torchrun's restart 1 of this launch not run: the worker group before it ended ")


@pytest.mark.parametrize("code", [HUNG, LOST_PEER, 1])
def test_a_restart_after_a_crash_a_hang_or_a_lost_rank_runs(tmp_path, restarted, code):
    write_status(tmp_path, code, 12, "a restart may help", None)
    assert ended_before_restart(tmp_path) is None


def test_a_refusal_of_this_launch_is_not_retried(tmp_path, restarted):
    write_refusal(tmp_path, "another live run holds the directory")
    assert ended_before_restart(tmp_path)[0] == PERMANENT


def test_another_launchs_records_and_a_first_start_do_not_count(tmp_path, restarted):
    restarted.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    write_status(tmp_path, PERMANENT, 12, "written by launch b", None)
    restarted.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    assert ended_before_restart(tmp_path) is None  # an earlier launch's end: this one may have mended it
    restarted.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    restarted.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert ended_before_restart(tmp_path) is None  # not a restart: the launch starts as asked
