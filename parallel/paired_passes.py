"""One micro-batch's forward beside another's backward, run by turns (parallel.overlap_micro_batches).

Chunks inside a MoE layer (chunk_pipeline.py) cannot hide a layer's first dispatch or last combine: nothing of
that layer is left to compute. Another micro-batch has plenty: Megatron-core's combined 1F1B and DeepSeek's
DualPipe run micro-batch i + 1's forward beside micro-batch i's backward, so that each pass's exchanges are in
flight while the other computes. Here the two passes are two threads that take turns, one running at a time:
a pass that is about to wait for a row exchange (parallel/collectives.start_rows / finish_rows: the expert
all-to-alls, forward and backward) first hands the turn to the other, which computes until it reaches such a
wait of its own and hands the turn back. The context-parallel all-gathers hand over on both sides too, and the
forward also at its tensor-parallel gathers and reduce-scatters: the forward has a third of the backward's
compute (which re-runs the forward under full recomputation and so has twice its exchanges), and the more
finely its compute is cut, the more of the backward's waits it covers before it runs out. Only waits that
every rank reaches at the same points of the same layers hand over, on every rank of the world, not only of
one group: a rank's collectives on each of its groups must come in the order its peers issue them, and a
hand-over reorders them (a wait for the optimizer's parameter gathers, say, falls in whichever pass first
touches a bucket, which differs between ranks; the image exchanges are made by the ranks holding images).
The order in which the device receives work is therefore fixed by the code alone, the same on every rank of a
group (their collectives must match) and on every run, and a dry run's timeline sees each exchange in flight
behind the other pass's compute.

Threads rather than an explicit split of every layer into nodes: a wait may sit anywhere in the call stack
(inside a checkpoint's recomputation, the autograd engine, a dispatcher's chunk pipeline), and a thread can
hand over from any depth with the model's code unchanged. What a thread inherits is carried over: grad mode,
autocast, the dispatch and function modes (a dry run's meters and fake tensors), context variables, the CUDA
device and stream. The forward pass gets the new thread; the backward is every other thread while the pair
runs: the caller's, and on CUDA the autograd engine's device thread, where backward and its recomputation run.
"""

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

T = TypeVar("T")
FORWARD, BACKWARD = 0, 1

_ACTIVE: "_Turns | None" = None
"""The pair running in this process (one at a time)."""
_hand_overs = 0
"""Hand-overs in this process so far (hand_overs())."""
_pairs = 0
"""Pairs run in this process so far (pairs_run())."""


class _Abandoned(BaseException):
    """Raised in the forward's thread at its next hand-over once the backward failed: the forward stops."""


class _Turns:
    """Which of the two passes may run; each waits for its turn and hands it over."""

    def __init__(self):
        self.forward_thread: threading.Thread | None = None
        self.lock = threading.Condition()
        self.holder = FORWARD
        self.finished = [False, False]
        self.abandoned = False

    def wait_for_turn(self, side: int) -> None:
        with self.lock:
            self.lock.wait_for(lambda: self.holder == side or self.finished[1 - side])
        if self.abandoned and side == FORWARD:
            raise _Abandoned

    def hand_over(self, side: int) -> None:
        """Let the other pass run until it waits or ends; no-op once it has ended."""
        global _hand_overs
        with self.lock:
            if self.finished[1 - side]:
                return
            self.holder = 1 - side
            _hand_overs += 1
            self.lock.notify_all()
        self.wait_for_turn(side)

    def finish(self, side: int, failed: bool = False) -> None:
        with self.lock:
            self.finished[side] = True
            self.abandoned = self.abandoned or (failed and side == BACKWARD)
            self.holder = 1 - side
            self.lock.notify_all()


def hand_overs() -> int:
    """How often a pass has handed the turn to the other in this process (a run that paired nothing: 0)."""
    return _hand_overs


def pairs_run() -> int:
    """How many pairs have run in this process (a dry run counts a step's)."""
    return _pairs


def pair_running() -> bool:
    """Whether a pair is running now (a dry run's timeline files the waits inside pairs apart)."""
    return _ACTIVE is not None


def _side(turns: _Turns) -> int:
    return FORWARD if threading.current_thread() is turns.forward_thread else BACKWARD


def would_hand_over(forward_only: bool = False) -> bool:
    """Whether a wait here would hand the turn over: inside a pair, and (forward_only) on the forward's side."""
    turns = _ACTIVE
    return turns is not None and not (forward_only and _side(turns) == BACKWARD)


def hand_over() -> None:
    """Called where a pass is about to wait for a collective: inside a pair, the other pass runs first."""
    turns = _ACTIVE
    if turns is not None:
        turns.hand_over(_side(turns))


def _carried(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The caller's thread-local state, as a context to enter in another thread."""
    dispatch_modes = _get_current_dispatch_mode_stack()
    function_modes = _get_current_function_mode_stack()
    grad = torch.is_grad_enabled()
    autocast = torch.is_autocast_enabled(device.type)
    autocast_dtype = torch.get_autocast_dtype(device.type)
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if stream is not None:
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(stream))
            stack.enter_context(torch.set_grad_enabled(grad))
            if autocast:
                stack.enter_context(torch.autocast(device.type, dtype=autocast_dtype))
            for mode in function_modes:
                torch._C._push_on_torch_function_stack(mode)
                stack.callback(torch._C._pop_torch_function_stack)
            for mode in dispatch_modes:
                _push_mode(mode)
                stack.callback(_pop_mode, getattr(mode, "_mode_key", None))
            yield

    return entered


def run_paired(forward: Callable[[], T], backward: Callable[[], None], device: torch.device) -> T:
    """Run forward() and backward() by turns (the forward first) and return forward()'s result; an error in
    either is raised here once both have stopped (a failed backward stops the forward at its next hand-over)."""
    turns = _Turns()
    outcome: dict[str, object] = {}
    context = contextvars.copy_context()
    entered = _carried(device)

    def forward_side() -> None:
        try:
            turns.wait_for_turn(FORWARD)
            with entered():
                outcome["result"] = forward()
        except _Abandoned:
            pass
        except BaseException as error:  # raised again on the caller's thread
            outcome["error"] = error
        finally:
            turns.finish(FORWARD)

    global _ACTIVE, _pairs
    if _ACTIVE is not None:
        raise RuntimeError("run_paired: a pair is already running in this process")
    turns.forward_thread = threading.Thread(target=context.run, args=(forward_side,), name="forward beside backward",
                                            daemon=True)
    _ACTIVE = turns
    failed = True
    try:
        turns.forward_thread.start()
        turns.wait_for_turn(BACKWARD)
        backward()
        failed = False
    finally:
        turns.finish(BACKWARD, failed)
        turns.forward_thread.join()
        _ACTIVE = None
        _pairs += 1
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]
