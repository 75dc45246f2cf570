"""What holds a step's peak memory: live tensor bytes (measured.LiveTensorBytes) filed under the op that made
each storage and the innermost line of the project's code on the stack when it was made (a backward's ops
are filed under the line that started the backward). At each new peak, once it has grown 1% past the last
look, the bytes per site are kept: the kept table describes a moment within 1% of the peak. Counts are of
tensor sizes, the same on every machine."""

import collections
from pathlib import Path

import torch

from moe_pretrain.planning.host_reads import project_site
from moe_pretrain.planning.measured import LiveTensorBytes

_PLANNING = str(Path(__file__).resolve().parent) + "/"
"""The meters' own frames, never the site of an allocation."""
LOOK_GROWTH = 1.01


class PeakSites(LiveTensorBytes):
    """with PeakSites() as live: ... ; live.peak, and live.at_peak: Counter of bytes by 'op at file:line'."""

    def __init__(self):
        super().__init__()
        self.at_peak: collections.Counter = collections.Counter()
        self._site_of: dict[int, str] = {}
        self._making = "?"
        self._looked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._making = f"{func._overloadpacket.__name__} at {project_site((_PLANNING,))}"
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key not in self._sizes:
            self._site_of[key] = self._making
        super()._track(storage)
        if self.live == self.peak and self.peak >= self._looked * LOOK_GROWTH:
            self._looked = self.peak
            # Storages die (and their finalizers edit both tables) whenever the collector runs, the counting
            # below included: count over copies, the sites taken first so every copied storage has one.
            sites = dict(self._site_of)
            self.at_peak = collections.Counter()
            for held, size in dict(self._sizes).items():
                self.at_peak[sites[held]] += size

    def _freed(self, key: int) -> None:
        super()._freed(key)
        del self._site_of[key]
