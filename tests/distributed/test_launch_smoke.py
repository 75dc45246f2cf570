"""launch.smoke, the pre-flight check infra teams run on one node, passes on 2 CPU processes: torchrun end to
end, with every layout's losses equal to one process's (the check the old torchrun expert-parallel test made)."""

import subprocess
import sys

import pytest

from tests.models import TINY


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_command_passes_every_check(tmp_path):
    """With the TINY model (the overrides every run takes): the launches, checks and table are the same, each
    run's training a fraction of the smoke model's."""
    done = subprocess.run([sys.executable, "-m", "launch.smoke", "--procs", "2", "--out", str(tmp_path / "smoke"),
                           *TINY], capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("check ")[-1]
    for check in ("1 process", "dp2", "tp2 x ep2 (dp1)", "pp2 (dp1)", "every layout's losses = 1 process's",
                  "save, resume, same final loss",
                  "reshard to tp2 x ep2, resume there"):
        assert f"{check}" in table and "FAIL" not in table, table
    assert "smoke test PASSED" in done.stdout
