"""Where full recomputation keeps each decoder layer's inputs until its backward (train.saved_inputs).

Under train.recompute=full a decoder layer saves only its inputs (the running partial sum and the AttnRes
bank entries it reads, handed to the checkpoint as its arguments); on the long stages those are most of
a rank's activation bytes (planning/step_activations.py). Each layer's checkpoint runs inside a
saved-tensor hooks region of a SavedInputs store, which keeps the inputs one of three ways:
- device: where they are (the default; the store only counts them);
- host: copied to host memory as they are saved (pinned, on a side stream on CUDA) and copied back one
  layer ahead of their backward: when backward reaches layer i, layer i - 1's inputs start their copy
  back. An H200 node has about 2 TB of host memory for 8 GPUs;
- fp8: kept on the device in FP8 (e4m3) with one fp32 scale per 128 values along the hidden dim (the
  model class's report keeps most activations block-wise in FP8): 1 + 4 / 128 bytes per value against
  2 in bf16, and lossy: the recomputed layer starts from the dequantized input.
A bank entry that several layers read is stored once per forward. The store's ledger counts the bytes it
keeps on the device and on the host, tensor by tensor (deterministic: tests/unit/test_saved_inputs.py holds
it against the plan's formula, saved_input_bytes).
"""

import contextlib
import weakref
from collections.abc import Iterator
from typing import Literal

import torch

from moe_pretrain.fp8.quantize import Quantized, quantize

SavedInputsPolicy = Literal["device", "host", "fp8"]
FP8_BLOCK = 128
"""Values per FP8 scale (one row block of the hidden dim)."""
PREFETCH_LAYERS = 2
"""Layers whose inputs are on the device at once under the host policy: the one in backward, the next."""


def saved_input_bytes(policy: SavedInputsPolicy, elements: float, act_bytes: int) -> tuple[float, float]:
    """(device bytes, host bytes) for `elements` saved input values in the activation dtype (act_bytes
    each) under a policy; host keeps its prefetch window on the device (stage_memory adds it)."""
    if policy == "host":
        return 0.0, elements * act_bytes
    if policy == "fp8":
        return elements * (1 + 4 / FP8_BLOCK), 0.0
    return elements * act_bytes, 0.0


class _Stored:
    """One saved input as the policy keeps it."""

    def __init__(self, t: torch.Tensor, policy: SavedInputsPolicy):
        self.policy, self.dtype, self.shape, self.device = policy, t.dtype, t.shape, t.device
        self._loaded: weakref.ref | None = None
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._copied: torch.cuda.Event | None = None
        """Recorded after the copy out (CUDA): a copy back on another stream waits for it."""
        if policy == "fp8":
            self.value: torch.Tensor | Quantized = quantize(t.detach().reshape(-1, t.shape[-1]), (1, FP8_BLOCK),
                                                            torch.float8_e4m3fn)
        elif policy == "host":
            self.value = self._to_host(t.detach())
        else:
            self.value = t

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:  # one code path: on CPU the "host" is a copy, so the saved tensor's memory is freed
            return t.clone()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        stream = _side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
        t.record_stream(stream)  # the device memory is not reused before the copy has read it
        return host

    def device_bytes(self) -> int:
        if self.policy == "fp8":
            return self.value.data.nbytes + self.value.scale_inv.nbytes
        return 0 if self.policy == "host" else self.value.nbytes

    def host_bytes(self) -> int:
        return self.value.nbytes if self.policy == "host" else 0

    def prefetch(self) -> None:
        """Start the copy back (host policy, CUDA), or hold on to the copy a later layer brought back:
        load() then only waits for it."""
        if self.policy != "host" or self.device.type != "cuda" or self._pending is not None:
            return
        live = self._live()
        if live is not None:
            self._pending = (live, None)
            return
        stream = _side_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            back = self.value.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._pending = (back, done)

    def _live(self) -> torch.Tensor | None:
        return None if self._loaded is None else self._loaded()

    def load(self) -> torch.Tensor:
        if self.policy == "device":
            return self.value
        if self.policy == "fp8":
            return self.value.dequantize().to(self.dtype).reshape(self.shape)
        if self._pending is not None:
            back, done = self._pending
            self._pending = None
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
                back.record_stream(torch.cuda.current_stream(self.device))
        elif self._live() is not None:  # a bank entry another layer's backward brought back already
            back = self._live()
        else:
            if self._copied is not None:  # the copy out ran on the side stream
                torch.cuda.current_stream(self.device).wait_event(self._copied)
            back = self.value.to(self.device)
        self._loaded = weakref.ref(back)
        return back


_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


class _Layer:
    """The inputs one layer's checkpoint saved in one forward, and the layer before it in that forward.
    It lives as long as autograd holds what the layer packed; the links to it are weak, so the store
    keeps nothing alive past the backward that frees it."""

    def __init__(self, index: int, before: "_Layer | None"):
        self.index, self.stored = index, []
        self.before = None if before is None else weakref.ref(before)

    def earlier(self) -> "_Layer | None":
        return None if self.before is None else self.before()


class SavedInputs:
    """The saved-input store of a model's decoder layers (one per model: pipeline chunks share it)."""

    def __init__(self, policy: SavedInputsPolicy = "device"):
        self.policy = policy
        self.elements = self.device_bytes = self.host_bytes = 0
        """The ledger since the last reset(): values stored (each once), and their bytes by where they are kept."""
        self._last: weakref.ref | None = None
        """The layer the latest forward packed for last (weak)."""
        self._seen: dict[int, tuple[weakref.ref, _Stored]] = {}

    def reset(self) -> None:
        self.elements = self.device_bytes = self.host_bytes = 0

    @contextlib.contextmanager
    def layer(self, index: int) -> Iterator[None]:
        """Layer `index`'s checkpoint runs inside: what it saves is kept by the policy."""
        last = None if self._last is None else self._last()
        before = last if last is not None and last.index == index - 1 else None
        current = _Layer(index, before)
        self._last = weakref.ref(current)
        if before is None:
            self._seen.clear()  # a new forward: share entries within one forward only

        def pack(t: torch.Tensor) -> tuple[_Layer, _Stored]:
            seen = self._seen.get(id(t))
            if seen is not None and seen[0]() is t:
                stored = seen[1]
            else:
                kept = t.is_floating_point() and t.dim() >= 2  # (integers and scalars stay as they are)
                stored = _Stored(t, self.policy if kept else "device")
                self._seen[id(t)] = (weakref.ref(t), stored)
                self.elements += t.numel()
                self.device_bytes += stored.device_bytes()
                self.host_bytes += stored.host_bytes()
            current.stored.append(stored)  # what this layer's backward needs, for the prefetch before it
            return current, stored

        def unpack(packed: tuple[_Layer, _Stored]) -> torch.Tensor:
            owner, stored = packed
            earlier = owner.earlier()
            for entry in earlier.stored if earlier is not None else ():
                entry.prefetch()
            return stored.load()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
