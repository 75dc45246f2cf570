"""A rank lost mid-run is named in one line by the ranks that remain (parallel/lost_peers.py), and the run ends
LOST_PEER (77), which the job script requeues after a node check, where gloo's 'Connection reset by peer' and its
tracebacks named no rank."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from launch.local import free_port
from parallel.lost_peers import lost_a_peer, transport_words
from tests.processes import TRAIN, wait_for_step

GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:27038: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")
"""What gloo raised on the remaining rank of a 2-process all-reduce whose peer was killed (torch 2.13)."""


@pytest.mark.timeout(300)
def test_a_rank_killed_on_another_node_is_named_by_the_rank_that_remains(tmp_path):
    """Two torchrun agents (two "nodes" of one rank each, one c10d rendezvous, hosted by the first to start, as the
    head node's agent hosts it under SLURM): the other node's rank is killed. The head node's rank names it in one
    line, and its launcher exits 77 (the job script checks the nodes and requeues); the killed node's launcher
    names its own rank, 137. (One agent: bench/soak.py's SIGKILL of a rank.)"""
    run_dir, port = tmp_path / "run", free_port()
    command = [sys.executable, "-m", "launch.torchrun", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=two-nodes", "--max-restarts=0", "-m",
               "launch.train", *TRAIN[3:], "train.steps=400", f"train.run_dir={run_dir}"]
    head = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    agents = [head]
    try:
        wait_for_listener(port, head)
        other = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        agents.append(other)
        wait_for_step(head, run_dir, 3)
        pid, lost = worker_rank(other)
        os.kill(pid, signal.SIGKILL)
        errs = [agent.communicate(timeout=180)[1] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    remains, host = 1 - lost, socket.gethostname()
    assert (head.returncode, other.returncode) == (77, 137), errs
    lines = [line.split("ERROR ", 1)[1] for line in errs[0].splitlines() if " ERROR lost peer" in line]
    assert len(lines) == 1, errs[0][-3000:]
    assert lines[0].startswith(f"lost peer (rank {remains}): lost rank {lost} (host {host}) at step ")
    assert errs[0].strip().splitlines()[-1] == f"launch.torchrun: rank {remains} (local rank 0 on {host}) exited " \
                                              "with 77: exit 77"
    assert errs[1].strip().splitlines()[-1] == f"launch.torchrun: rank {lost} (local rank 0 on {host}) exited " \
                                              "with 137: exit 137"
    if remains == 0:  # rank 0 writes the status
        status = json.loads((run_dir / "status.json").read_text())
        assert (status["state"], status["exit_code"]) == ("lost_peer", 77) and f"lost rank {lost}" in status["message"]
    assert not any("Traceback" in err or "ChildFailedError" in err for err in errs)


def wait_for_listener(port: int, agent: subprocess.Popen, timeout: float = 60) -> None:
    """Until the agent hosts the rendezvous store on port (the second agent then joins it as a client)."""
    deadline = time.time() + timeout
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("localhost", port)) == 0:
                return
        assert agent.poll() is None and time.time() < deadline, "the first agent did not host the rendezvous"
        time.sleep(0.2)


def worker_rank(agent: subprocess.Popen) -> tuple[int, int]:
    """(pid, RANK) of the one worker an agent runs."""
    pid = int(subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()[0])
    environment = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    return pid, int(environment["RANK"])


def test_the_transports_words_for_a_lost_peer_are_recognised():
    assert lost_a_peer(RuntimeError(GLOO)) and not lost_a_peer(RuntimeError("shape mismatch"))
    assert transport_words(RuntimeError(GLOO)) == "Read error [127.0.0.1]:27038: Connection reset by peer"
