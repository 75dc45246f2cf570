"""The next step's batches, prepared in a background thread while the current step computes.

Reading, packing and patch cutting are numpy work that releases the GIL for most of its time, as the
step's torch kernels do, so one thread overlaps them with the step. Every prepared step carries the
data position after it: the position a checkpoint saves is that of the last step *consumed*, never
of one prepared ahead, so a save at any moment resumes exactly.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from moe_pretrain.config.stage import Stage
from moe_pretrain.data.batch import Batch, PretrainingData


@dataclass(frozen=True)
class BatchRequest:
    """Which batches one step takes: its stage (mixture, rows, micro-batches) and this rank's share."""

    stage: Stage
    shard: int
    num_shards: int
    with_patches: bool

    @property
    def rows(self) -> int:
        """Global rows of each micro-batch."""
        return self.stage.rows // self.stage.micro_batches


@dataclass
class PreparedStep:
    request: BatchRequest
    batches: list[Batch]
    position: dict
    """PretrainingData.state() after these batches."""


class BatchPrefetcher:
    def __init__(self, data: PretrainingData, background: bool = True):
        self.data = data
        self.position = data.state()
        """The data position after the last step taken: what a checkpoint saves."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="batches") if background else None
        self._ahead: Future | None = None
        self._ahead_request: BatchRequest | None = None
        self.wait_s = 0.0
        """Seconds the last take() waited for its batches."""

    def _prepare(self, request: BatchRequest) -> PreparedStep:
        data = self.data
        data.set_stage(request.stage.index)
        batches = [data.next_batch(request.rows, request.shard, request.num_shards, request.with_patches)
                   for _ in range(request.stage.micro_batches)]
        return PreparedStep(request, batches, data.state())

    def load_state(self, position: dict) -> None:
        """Continue from a saved position (drops anything prepared ahead)."""
        self._drop_ahead()
        self.data.load_state(position)
        self.position = self.data.state()

    def take(self, request: BatchRequest) -> list[Batch]:
        """This step's batches: the ones prepared ahead when they are for this request, else prepared now."""
        start = time.perf_counter()
        if self._ahead is not None and self._ahead_request == request:
            prepared = self._ahead.result()
            self._ahead = self._ahead_request = None
        else:
            self._drop_ahead()
            prepared = self._prepare(request)
        self.wait_s = time.perf_counter() - start
        self.position = prepared.position
        return prepared.batches

    def prepare_ahead(self, request: BatchRequest) -> None:
        """Start preparing the next step's batches in the background (no-op without a thread)."""
        if self._executor is None:
            return
        self._drop_ahead()
        self._ahead_request = request
        self._ahead = self._executor.submit(self._prepare, request)

    def _drop_ahead(self) -> None:
        """Forget batches prepared ahead: the stream goes back to the last taken step's position."""
        if self._ahead is None:
            return
        self._ahead.exception()  # let it finish (or fail: nobody takes it) before the position is rewound
        self._ahead = self._ahead_request = None
        self.data.load_state(self.position)

    def close(self) -> None:
        """Stop preparing ahead (at the end of a run); the stream stays at the last taken step."""
        self._drop_ahead()
