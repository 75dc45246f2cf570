"""A checkpoint whose hashing outlasts the process-group timeout still commits and verifies: each rank hashes
(and at resume verifies) only its own share, and the waits for that I/O run in a group whose timeout grows
with the state's size (checkpoint_timeout), not in the default group.

The simulation: 4 gloo processes, a 2 s default timeout, 4 shard files of 0.25 MB per rank, writing (and
hashing while writing) and verification's SHA-256 slowed to 1 s per MB, and rank 3 on storage 4.5 times
slower still: the other ranks wait about 3.5 s for rank 3 in the commit's gather and again in verification,
well past the default timeout (the same test with the default group fails), and rank 0 hashing every file
alone, as it once did, would take 7.5 s.
"""

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.checkpoint import checkpoint_timeout, save, shared_verify

DEFAULT_TIMEOUT_S = 2.0
SECONDS_PER_MB = {0: 1.0, 1: 1.0, 2: 1.0, 3: 4.5}
SHARD = (32, 1024)  # fp32: 0.125 MB; 8 per rank


def slow_hashing_worker(rank: int, world: int, root: str) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    from moe_pretrain.checkpoint import hashing_writer, manifest, store

    original, hashed = manifest.sha256, []

    def slow_sha256(path: Path) -> str:
        time.sleep(path.stat().st_size / 1e6 * SECONDS_PER_MB[rank])
        hashed.append(path.name)
        return original(path)
    manifest.sha256 = slow_sha256
    write, link = hashing_writer._HashingStream.write, threading.Lock()

    def slow_write(stream, data) -> int:
        with link:  # the rank's writer threads share its storage bandwidth
            time.sleep(memoryview(data).nbytes / 1e6 * SECONDS_PER_MB[rank])
        return write(stream, data)
    hashing_writer._HashingStream.write = slow_write
    entries = store.rank_entries

    def recorded_entries(directory, rank_, written):
        found = entries(directory, rank_, written)
        hashed.extend(found)
        return found
    store.rank_entries = recorded_entries
    tensors = {f"rank{rank}.shard{i}": torch.full(SHARD, float(rank * 8 + i)) for i in range(8)}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    group = dist.new_group(backend="gloo", timeout=checkpoint_timeout(DEFAULT_TIMEOUT_S, state_bytes,
                                                                      floor_bytes_per_s=0.25e6))
    start = time.perf_counter()
    path = save(Path(root), 1, tensors, {"step": 1}, {}, keep_last=2, keep_every=0, group=group)
    save_s = time.perf_counter() - start
    saved_hashes = list(hashed)
    hashed.clear()
    start = time.perf_counter()
    problems = shared_verify(group)(path)
    verify_s = time.perf_counter() - start
    result = {"rank": rank, "save_s": save_s, "verify_s": verify_s, "problems": problems,
              "saved_hashes": saved_hashes, "verified": list(hashed)}
    reports: list = [None] * world
    dist.all_gather_object(reports, result, group=group)
    dist.destroy_process_group()
    return {"path": str(path), "ranks": reports}


@pytest.mark.timeout(120)
def test_slow_hashing_commits_and_verifies_without_a_collective_timing_out(tmp_path):
    out = run_distributed(slow_hashing_worker, 4, str(tmp_path / "checkpoints"), timeout=100)
    manifest = json.loads((Path(out["path"]) / "manifest.json").read_text())
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert len(shards) == 16, shards  # 4 files per rank
    for report in out["ranks"]:
        rank = report["rank"]
        assert report["problems"] == []
        own = [name for name in report["saved_hashes"] if name.endswith(".distcp")]
        assert own and all(name.startswith(f"__{rank}_") for name in own), (rank, report["saved_hashes"])
        assert report["save_s"] > 1.5 * DEFAULT_TIMEOUT_S  # rank 3's writing outlasted the default timeout
        assert 2 <= len([n for n in report["verified"] if n.endswith(".distcp")]) <= 6  # about a quarter each
    verified = sorted(name for report in out["ranks"] for name in report["verified"])
    assert verified == sorted(manifest["files"])  # every file checked once, by one rank
