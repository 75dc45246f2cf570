"""Every collective of the project, each taking an explicit process group (megatron mappings style).

The differentiable ones are named autograd functions paired with their backward duals. With group None (a
single process) each is the identity. Nothing else in the project calls torch.distributed's collectives
(tests/distributed/test_collectives.py reads the sources to hold that), because each call here first checks that its
tensors are on the device the group's backend carries: an NCCL group takes CUDA tensors only, a gloo
group host tensors (gloo on CUDA tensors would copy through the host behind our back), and a CPU tensor
handed to NCCL fails only at the first multi-GPU step that reaches it. The check names the call site
(tests see it on a CPU by having a group report nccl).
"""

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from parallel.paired_passes import hand_over, would_hand_over
from parallel.torch_compat import all_gather_single, reduce_scatter_single

_SERVES = {"nccl": ("cuda",), "gloo": ("cpu",)}
"""Backend -> the device types of the tensors it is given here. Other backends are not checked."""


class CollectiveDeviceError(RuntimeError):
    """A tensor on a device its group's backend does not carry."""


_BACKEND = threading.local()


@contextlib.contextmanager
def backend_ops() -> Iterator[None]:
    """Ops inside are a process-group backend's own, not the program's: gloo emulates a reduce-scatter with
    copies around the collective and copies the result into place when it is waited for; NCCL runs none.
    planning/op_census.py leaves them out of a step's kernel launches."""
    _BACKEND.depth = getattr(_BACKEND, "depth", 0) + 1
    try:
        yield
    finally:
        _BACKEND.depth -= 1


def inside_backend() -> bool:
    return getattr(_BACKEND, "depth", 0) > 0


class CollectiveObserver:
    """What a meter of the collectives may be told; each meter overrides what it measures (the step's timeline,
    planning/timeline.py: when asynchronous collectives start and are waited for; the step telemetry,
    training/step_telemetry.py: how long each call that may wait for other ranks waits, by group)."""

    def started(self) -> object:
        """An asynchronous collective started; the token its wait hands back to waited."""
        return None

    def waited(self, token: object) -> None:
        """The collective started with `token` was waited for."""

    def blocking(self, group: dist.ProcessGroup | None) -> contextlib.AbstractContextManager:
        """Around a call that may wait for the group's other ranks (a blocking collective, or the wait of a
        started one)."""
        return contextlib.nullcontext()


_OBSERVERS: list[CollectiveObserver] = []


@contextlib.contextmanager
def observing(observer: CollectiveObserver) -> Iterator[None]:
    """Every collective of the block is told to `observer` (with those observing already)."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


@contextlib.contextmanager
def _blocking(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Around a call that may wait for the group's other ranks: inside every observer's blocking(group)."""
    if not _OBSERVERS:
        yield
        return
    with contextlib.ExitStack() as meters:
        for observer in _OBSERVERS:
            meters.enter_context(observer.blocking(group))
        yield


class Pending:
    """A started collective: wait() before reading its output (its backend's ops on completion are marked
    as the backend's: backend_ops)."""

    def __init__(self, work: dist.Work, group: dist.ProcessGroup | None):
        self.work, self.group = work, group
        self.observed = [(observer, observer.started()) for observer in _OBSERVERS]

    def wait(self) -> None:
        with backend_ops(), _blocking(self.group):
            self.work.wait()
        for observer, token in self.observed:
            observer.waited(token)


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def served_devices(group: dist.ProcessGroup) -> tuple[str, ...] | None:
    """Device types the group's backend carries ('cpu:gloo,cuda:nccl' lists them); None: not checked."""
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return tuple(pair.split(":")[0] for pair in backend.split(","))
    return _SERVES.get(backend)


def _call_site() -> str:
    """file:line (function) of the nearest caller outside this module."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    if frame is None:
        return "unknown call site"
    path = Path(frame.f_code.co_filename)
    try:
        path = path.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def check_devices(group: dist.ProcessGroup | None, tensors: Iterable[torch.Tensor], what: str) -> None:
    """Raise CollectiveDeviceError, naming the call site, if a tensor is on a device the group's backend
    does not carry (a group of one included: the same code meets a larger group on a cluster)."""
    if group is None:
        return
    served = served_devices(group)
    if served is None:
        return
    for t in tensors:
        if t.device.type not in served:
            raise CollectiveDeviceError(
                f"{_call_site()}: {what} of a {t.device.type} tensor {tuple(t.shape)} {t.dtype} over a "
                f"{dist.get_backend(group)} group, which carries {' / '.join(served)} tensors only")


def _tensors_in(obj: object) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from _tensors_in(value)


class RowCodec(Protocol):
    """How rows travel when not as they are (parallel/fp8_dispatch.py): encode -> tensors with one row per row
    of x, each exchanged alike; decode those received -> the rows in `dtype`."""

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]: ...

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor: ...


class RowExchange:
    """An all-to-all of rows in flight (start_rows / finish_rows)."""

    def __init__(self, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup,
                 codec: RowCodec | None, hands_over: bool):
        self.output_splits, self.input_splits, self.group = output_splits, input_splits, group
        self.codec = codec
        self.hands_over = hands_over
        """Its waits, forward and backward, let the pass beside this one run first (paired_passes.py)."""
        self.dtype: torch.dtype | None = None
        self.received: list[torch.Tensor] = []
        self.pending: list[Pending] = []
        self.grad: torch.Tensor | None = None
        """The gradient's exchange back, once the backward has started it..."""
        self.grad_pending: Pending | None = None
        """...and its work."""


def _start_all_to_all(out: torch.Tensor, x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      group: dist.ProcessGroup) -> Pending:
    with backend_ops():
        return Pending(dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group,
                                              async_op=True), group)


class _StartRows(torch.autograd.Function):
    """Starts the rows' exchange; its backward waits for the gradients' exchange that _FinishRows' started
    (the gradient it is handed is the received rows', which that exchange has already taken)."""

    @staticmethod
    def forward(ctx, x, exchange):
        ctx.exchange = exchange
        rows = sum(exchange.output_splits)
        parts = exchange.codec.encode(x) if exchange.codec else [x]
        exchange.dtype = x.dtype
        exchange.received = [part.new_empty(rows, *part.shape[1:]) for part in parts]
        exchange.pending = [_start_all_to_all(out, part, exchange.output_splits, exchange.input_splits,
                                              exchange.group) for out, part in zip(exchange.received, parts,
                                                                                   strict=True)]
        # Encoded, the rows arrive in other tensors: this output only carries the gradient's edge (no storage).
        return x.new_zeros(()).expand(rows, *x.shape[1:]) if exchange.codec else exchange.received[0]

    @staticmethod
    def backward(ctx, grad):
        exchange = ctx.exchange
        if exchange.hands_over:  # beside another micro-batch's pass (paired_passes.py), that one runs first
            hand_over()
        exchange.grad_pending.wait()
        received, exchange.grad, exchange.grad_pending = exchange.grad, None, None  # a work holds its tensors
        return received, None


class _FinishRows(torch.autograd.Function):
    """Waits for the rows' exchange; its backward starts the gradients' exchange back, which _StartRows'
    backward waits for, and hands its own gradient on only to keep the two connected."""

    @staticmethod
    def forward(ctx, out, exchange):
        ctx.exchange = exchange
        if exchange.hands_over:
            hand_over()
        for pending in exchange.pending:
            pending.wait()
        received, exchange.received, exchange.pending = exchange.received, [], []  # a work holds its tensors
        return exchange.codec.decode(received, exchange.dtype) if exchange.codec else out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        exchange = ctx.exchange
        exchange.grad = grad.new_empty(sum(exchange.input_splits), *grad.shape[1:])
        exchange.grad_pending = _start_all_to_all(exchange.grad, grad, exchange.input_splits,
                                                  exchange.output_splits, exchange.group)
        return grad, None


def _start_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup | None, codec: RowCodec | None, hands_over: bool
                ) -> tuple[torch.Tensor, RowExchange | None]:
    if group_size(group) == 1:
        return x, None
    exchange = RowExchange(output_splits, input_splits, group, codec, hands_over)
    return _StartRows.apply(x, exchange), exchange


def start_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None,
               codec: RowCodec | None = None) -> tuple[torch.Tensor, RowExchange | None]:
    """all_to_all_rows started and not waited for: (its output, not to be read before finish_rows, the exchange).
    Differentiable: the backward starts the gradients' exchange where the forward finished and waits for it
    where the forward started, so what runs between the two in either direction hides it. codec: the rows
    sent encoded (the gradients travel as they are: the encoding's gradient is taken as the identity). A group
    of one returns (x, None). Beside another micro-batch's pass (parallel/paired_passes.py) each wait, forward
    and backward, first lets that pass run."""
    check_devices(group, [x], "start_rows")
    return _start_rows(x, output_splits, input_splits, group, codec, hands_over=True)


def finish_rows(out: torch.Tensor, exchange: RowExchange | None) -> torch.Tensor:
    """Wait for start_rows' exchange: its rows, now readable."""
    if exchange is None:
        return out
    return _FinishRows.apply(out, exchange)


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send input_splits[r] rows of x to rank r; receive output_splits[r] rows from rank r (differentiable: the
    gradients go back along the reversed splits). start_rows waited for at once, without handing over to a pass
    beside this one: the small exchanges of metadata (routing weights, expert ids, states) are not worth a
    turn, and the image exchanges are made only by ranks holding images."""
    check_devices(group, [x], "all_to_all_rows")
    return finish_rows(*_start_rows(x, output_splits, input_splits, group, None, hands_over=False))


def all_to_all_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """counts [size, n]: row r goes to rank r; returns [size, n] whose row r came from rank r (no grad)."""
    check_devices(group, [counts], "all_to_all_counts")
    if group_size(group) == 1:
        return counts
    out = torch.empty_like(counts)
    with _blocking(group):
        dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_to_all_flat(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send input_splits[r] elements of the flat x to rank r; returns the output_splits[r] elements received
    from each rank r in rank order (no grad; a group of one returns x)."""
    check_devices(group, [x], "all_to_all_flat")
    if group_size(group) == 1:
        return x
    out = x.new_empty(sum(output_splits))
    with _blocking(group):
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp, what: str) -> torch.Tensor:
    check_devices(group, [x], what)
    if group_size(group) == 1:
        return x
    out = x.detach().clone()
    with _blocking(group):
        dist.all_reduce(out, op=op, group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over the group into a new tensor (no grad)."""
    return _all_reduce(x, group, dist.ReduceOp.SUM, "all_reduce_sum")


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Elementwise maximum over the group into a new tensor (no grad)."""
    return _all_reduce(x, group, dist.ReduceOp.MAX, "all_reduce_max")


def all_gather_into_async(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None
                          ) -> Pending | None:
    """out [size * n, ...] <- every rank's x [n, ...] in rank order (in place; no grad), started and not
    waited for: the caller waits the returned work before reading out (None: a group of one, out already
    holds x)."""
    check_devices(group, [out, x], "all_gather_into_async")
    if group_size(group) == 1:
        out.copy_(x)
        return None
    with backend_ops():
        return Pending(all_gather_single(out, x, group=group, async_op=True), group)


def reduce_scatter_into_async(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None
                              ) -> Pending | None:
    """out [n, ...] <- this rank's slice of the sum over the group of x [size * n, ...] (in place; no grad),
    started and not waited for: the caller waits the returned work before reading out (None: a group of
    one, out already holds x)."""
    check_devices(group, [out, x], "reduce_scatter_into_async")
    if group_size(group) == 1:
        out.copy_(x)
        return None
    with backend_ops():
        return Pending(reduce_scatter_single(out, x, group=group, async_op=True), group)


def gather_objects(obj: object, group: dist.ProcessGroup | None) -> list:
    """Every rank's picklable obj, in rank order, on every rank ([obj] without a group). For small per-rank
    reports (failures, file lists, bench rows), never per-step state. Tensors inside must be on the host:
    a pickled CUDA tensor unpickles onto the sender's GPU number on every receiver."""
    for t in _tensors_in(obj):
        if t.device.type != "cpu":
            raise CollectiveDeviceError(f"{_call_site()}: gather_objects of an object holding a {t.device.type} "
                                        f"tensor {tuple(t.shape)}; move it to the host first")
    if group_size(group) == 1:
        return [obj]
    objects: list = [None] * group_size(group)
    with _blocking(group):
        dist.all_gather_object(objects, obj, group=group)
    return objects


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait for every rank of the group (nothing without one)."""
    if group is not None:
        with _blocking(group):
            dist.barrier(group=group)


# Sequence-parallel mappings over dimension 1 of [B, T, ...] activations (megatron-core's
# gather_from / reduce_scatter_to / scatter_to_sequence_parallel_region, device-agnostic).


def _beside_a_pair(collective: Callable[..., dist.Work | None], group: dist.ProcessGroup, *args,
                   forward_only: bool = False) -> None:
    """collective(*args, group=group, async_op=...) waited for before returning; inside a pair of passes
    (paired_passes.py; forward_only: on the forward's side of one) it is started, the other pass takes a
    turn, and then it is waited for."""
    if not would_hand_over(forward_only):
        with backend_ops(), _blocking(group):
            collective(*args, group=group)
        return
    with backend_ops():
        pending = Pending(collective(*args, group=group, async_op=True), group)
    hand_over()
    pending.wait()


def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    x_T = x.transpose(0, 1).contiguous()
    out = x_T.new_empty(x_T.shape[0] * size, *x_T.shape[1:])
    _beside_a_pair(all_gather_single, group, out, x_T, forward_only=True)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    x_T = x.transpose(0, 1).contiguous()
    if x_T.shape[0] % size:
        raise ValueError(f"sequence length {x_T.shape[0]} is not divisible by the {size} sequence-parallel ranks")
    out = x_T.new_empty(x_T.shape[0] // size, *x_T.shape[1:])
    _beside_a_pair(reduce_scatter_single, group, out, x_T, forward_only=True)
    return out.transpose(0, 1)


def _split_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[1] % size:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the {size} sequence-parallel ranks")
    chunk = x.shape[1] // size
    return x[:, rank * chunk:(rank + 1) * chunk].contiguous()


def _paired(name: str, forward, backward, doc: str) -> type[torch.autograd.Function]:
    """An autograd function whose backward is the dual collective of its forward (same group)."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd),
                                                    "__doc__": doc})


_GatherFromSequenceParallel = _paired(
    "_GatherFromSequenceParallel", _gather_seq, _reduce_scatter_seq,
    "Forward: all-gather the sequence shards. Backward: reduce-scatter (each rank's use was partial).")
_ReduceScatterToSequenceParallel = _paired(
    "_ReduceScatterToSequenceParallel", _reduce_scatter_seq, _gather_seq,
    "Forward: sum partial results and keep this rank's sequence shard. Backward: all-gather.")
_ScatterToSequenceParallel = _paired(
    "_ScatterToSequenceParallel", _split_seq, _gather_seq,
    "Forward: keep this rank's shard of a replicated sequence. Backward: all-gather the gradient.")


def gather_from_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    check_devices(group, [x], "gather_from_sequence_parallel")
    return x if group_size(group) == 1 else _GatherFromSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    check_devices(group, [x], "reduce_scatter_to_sequence_parallel")
    return x if group_size(group) == 1 else _ReduceScatterToSequenceParallel.apply(x, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    check_devices(group, [x], "scatter_to_sequence_parallel")  # its backward all-gathers
    return x if group_size(group) == 1 else _ScatterToSequenceParallel.apply(x, group)


def _gather_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty(size * x.numel())  # flat: gloo accepts the concatenated form only
    _beside_a_pair(all_gather_single, group, out, x.reshape(-1).contiguous())
    return out.view(size, *x.shape)


def _reduce_scatter_stacked(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty(x[0].numel())
    _beside_a_pair(reduce_scatter_single, group, out, x.reshape(-1).contiguous())
    return out.view(x.shape[1:])


_AllGatherStacked = _paired(
    "_AllGatherStacked", _gather_stacked, _reduce_scatter_stacked,
    "Forward: every rank's tensor, stacked along a new dim 0. Backward: each rank's piece gets the sum of "
    "the gradients every rank computed for it.")


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[*shape] -> [group size, *shape], row r from rank r (differentiable)."""
    check_devices(group, [x], "all_gather_stacked")
    return x.unsqueeze(0) if group_size(group) == 1 else _AllGatherStacked.apply(x, group)
