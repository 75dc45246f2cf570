"""launch.torchrun (what make smoke and the SLURM script launch workers with): a failed rank's exit code, and one line
of ours naming it, where torchrun would print its ChildFailedError block and exit 1. A config launch.train would
refuse is refused once, before any worker starts."""

import subprocess
import sys

import pytest

from launch.torchrun import exit_code
from tests.models import TINY

WRAPPER = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2", "-m", "launch.train",
           "--config", "configs/smoke.yaml", *TINY, "logging.progress=false"]


@pytest.mark.timeout(120)
def test_a_bad_config_is_one_line_and_78_before_any_worker_starts():
    done = subprocess.run([*WRAPPER, "model.hidden_size=abc"], capture_output=True, text=True, timeout=100)
    assert done.returncode == 78
    assert done.stderr.strip() == ("config error: model.hidden_size='abc' has type str, expected int (from the "
                                   "command line)")


@pytest.mark.timeout(240)
def test_a_rank_that_fails_keeps_its_exit_code_and_is_named_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the run directory should be")
    done = subprocess.run([*WRAPPER, f"train.run_dir={run_dir}"], capture_output=True, text=True, timeout=200)
    assert done.returncode == 78, done.stderr[-3000:]
    assert f"refused (rank 0): train.run_dir={run_dir} is a file, not a directory" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("launch.torchrun: rank ")
    assert done.stderr.strip().endswith("exited with 78; 1 more rank failed after it: exit 78")
    assert "ChildFailedError" not in done.stderr and "Traceback" not in done.stderr


def test_a_worker_killed_by_a_signal_exits_as_a_shell_reports_it():
    assert exit_code(-9) == 137 and exit_code(-15) == 143 and exit_code(75) == 75
