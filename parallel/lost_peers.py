"""Which ranks a failed collective lost, named in one line by the ranks that remain.

When a process or a node dies, every rank's next collective with it fails in the transport's words (gloo:
"Connection reset by peer" and an address; NCCL: a remote error), thread tracebacks around them, and nothing names
the rank. Here the ranks meet in the launcher's store instead (torchrun's rendezvous store, through the attempt's
prefix: ParallelContext.store), where each registered its host at start: each rank that remains marks itself alive,
they wait for one another until arrivals stop (SETTLED_S, at most SURVIVORS_WAIT_S), and the first to arrive names
the ranks that never did, for all of them to say. The run then ends LOST_PEER: the job script takes it for a
possibly sick node (node check, exclusion, requeue) and torchrun --max-restarts restarts it. Without a store (one
process, the dry run) or with the store's host lost too, the line says what the transport said.
"""

import socket
import time

import torch.distributed as dist

SURVIVORS_WAIT_S = 10.0
"""The longest the remaining ranks wait for one another in the store: their collectives fail within a few seconds
of each other (each as its own peer in a collective goes)."""
SETTLED_S = 2.0
"""...and no longer than this after the last of them arrived: a lost rank never comes, so the first to arrive
stops waiting once arrivals have stopped, not at the cap."""
TRANSPORT_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
                   "remote process exited", "NCCL communicator was aborted", "ncclRemoteError")
"""Words of gloo's and NCCL's errors for a peer that is gone."""


def register(store: dist.Store | None, rank: int) -> None:
    """At start: this rank's host, for the others to name it should it be lost."""
    if store is not None:
        store.set(f"host/{rank}", socket.gethostname())


def lost_a_peer(err: BaseException) -> bool:
    """Whether err is a collective's failure for a peer that is gone."""
    if isinstance(err, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(err, RuntimeError) and any(sign in str(err) for sign in TRANSPORT_SIGNS)


def transport_words(err: BaseException) -> str:
    """The transport's own sentence (gloo's first, without its source location)."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split("] ", 1)[-1].split(". ", 1)[0]


def lost_ranks(store: dist.Store, rank: int, world_size: int, wait_s: float = SURVIVORS_WAIT_S) -> list[int]:
    """The ranks that do not mark themselves alive while the others arrive (within wait_s of the first, and
    SETTLED_S of the last; every remaining rank calls this and they all return the first one's finding)."""
    store.set(f"alive/{rank}", "1")
    if store.add("alive_count", 1) == 1:  # the first to arrive waits out the others, then names the missing
        deadline, arrived, last = time.monotonic() + wait_s, 1, time.monotonic()
        while arrived < world_size and time.monotonic() < min(deadline, last + SETTLED_S):
            time.sleep(0.2)
            now = store.add("alive_count", 0)
            arrived, last = now, (time.monotonic() if now > arrived else last)
        missing = [r for r in range(world_size) if not store.check([f"alive/{r}"])]
        store.set("lost", ",".join(map(str, missing)))
    found = store.get("lost").decode()
    return [int(r) for r in found.split(",")] if found else []


def lost_line(err: BaseException, store: dist.Store | None, rank: int, world_size: int, step: int) -> str:
    """One line for a collective that failed at step `step`: the lost ranks with their hosts, or what the
    transport said when the store cannot tell."""
    said = transport_words(err)
    if store is None:
        return f"a collective failed at step {step}: {said}"
    try:
        lost = lost_ranks(store, rank, world_size)
        names = ", ".join(f"rank {r} (host {store.get(f'host/{r}').decode()})" for r in lost)
    except (RuntimeError, dist.DistError) as store_err:  # the store's host (torchrun's node 0 agent) is gone too
        return f"a collective failed at step {step}: {said}; the launcher's store is unreachable too ({store_err})"
    if not lost:
        return f"a collective failed at step {step} with every rank alive: {said}"
    return f"lost {names} at step {step}: {said}"
