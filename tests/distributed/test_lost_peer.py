"""A rank lost mid-run is named in one line by the ranks that remain (parallel/lost_peers.py), and the run ends
LOST_PEER (77), which the job script requeues after a node check, where gloo's 'Connection reset by peer' and its
tracebacks named no rank."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from parallel.lost_peers import lost_a_peer, transport_words
from tests.processes import TRAIN, wait_for_step

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27038: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")
"""What gloo raised on the remaining rank of a 2-process all-reduce whose peer was killed (torch 2.13)."""


@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_by_the_rank_that_remains(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
               "-m", "launch.train", *TRAIN[3:], "train.steps=400", f"train.run_dir={run_dir}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run_dir, 3)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    ranks = {int(pid): dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0")
                            if "=" in item)["RANK"] for pid in workers}
    os.kill(next(pid for pid, rank in ranks.items() if rank == "1"), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode in (77, 137), err[-3000:]  # the first to fail: the killed rank, or the one naming it
    lines = [line.split("ERROR ", 1)[1] for line in err.splitlines() if " ERROR lost peer" in line]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"lost peer (rank 0): lost rank 1 (host {socket.gethostname()}) at step ")
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("lost_peer", 77) and "lost rank 1" in status["message"]
    assert "Traceback" not in err and "ChildFailedError" not in err


def test_the_transports_words_for_a_lost_peer_are_recognised():
    assert lost_a_peer(RuntimeError(GLOO)) and not lost_a_peer(RuntimeError("shape mismatch"))
    assert transport_words(RuntimeError(GLOO)) == "Read error [127.0.0.1]:27038: Connection reset by peer"
