"""fla's chunk KDA as custom ops (gpu_kernels/kda/fla_ops.py): their fakes and launch profile against fla's own code.

fla's Triton kernels do not run on a CPU, but its Python around them does, on fake tensors: with Triton's kernel
launches intercepted (each recorded with the tensors it is handed, none run), fla's chunk_kda_fwd / chunk_kda_bwd
allocate their results and call their kernels as on a GPU. That is an independent count of what the op census
must price (gpu_kernels/kda/fla_launches.py): every kernel by name, and the bytes of its tensors, for packed
documents and plain rows, bf16 and fp32, with and without states. The FLOPs are checked against the products fla's
kernels run, counted under Triton's interpreter (tests/unit/test_fla_cpu.py), as are the numbers themselves.
"""

import collections

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_kernels.kda import fla_ops
from gpu_kernels.kda.fla_launches import FLA
from moe_pretrain.planning.op_census import OpCensus, tensor_bytes

pytest.importorskip("fla")
triton_jit = pytest.importorskip("triton.runtime.jit")

CASES = {
    # name: (B, T, H, K, V, document bounds or None, dtype, initial state, final state, gate floor)
    "packed documents, bf16 (training)": (1, 300, 2, 32, 64, [0, 50, 120, 300], torch.bfloat16, False, False, -5.0),
    "packed documents with states, fp32": (1, 200, 2, 64, 32, [0, 70, 200], torch.float32, True, True, None),
    "rows, bf16, final state": (2, 128, 3, 32, 32, None, torch.bfloat16, False, True, -5.0),
}


class _FlaLaunches(TorchDispatchMode):
    """Records fla's launches: its Triton kernels (intercepted, not run) and the aten ops that compute."""

    def __init__(self, patch: pytest.MonkeyPatch):
        super().__init__()
        self.bytes: collections.Counter = collections.Counter()
        self.count: collections.Counter = collections.Counter()

        def launcher(kernel, grid):
            while hasattr(kernel, "fn"):  # heuristics, autotuner, JIT (or interpreted) function, its Python
                kernel = kernel.fn

            def launch(*args, **kwargs):
                self._record(kernel.__name__, tensor_bytes((args, kwargs)))

            return launch

        patch.setattr(triton_jit.KernelInterface, "__getitem__", launcher)

    def _record(self, name: str, moved: int) -> None:
        self.count[FLA + name] += 1
        self.bytes[FLA + name] += moved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        census = OpCensus()  # the census's own rule for what is a launch, on this one op
        with census:
            func(*args, **(kwargs or {}))
        for name, n in census.launches_by_op.items():
            self.count[FLA + name] += n
            self.bytes[FLA + name] += census.bytes_by_op[name]
        return out


def _inputs(case):
    B, T, H, K, V, bounds, dtype, initial, final, floor = case
    q, k = (torch.empty(B, T, H, K, dtype=dtype) for _ in range(2))
    v = torch.empty(B, T, H, V, dtype=dtype)
    g, beta = torch.empty(B, T, H, K), torch.empty(B, T, H)  # the model's gate and beta: fp32
    cu = None if bounds is None else torch.tensor(bounds)
    tables = (None, None) if bounds is None else fla_ops.chunk_tables(bounds, 64, torch.device("cpu"))
    N = B if bounds is None else len(bounds) - 1
    state = torch.empty(N, H, K, V) if initial else None
    return (q, k, v, g, beta, state, cu, *tables, K ** -0.5, 64, floor, final)


def _described(tensors) -> list:
    return [(tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_the_ops_fakes_and_launches_are_flas(case, monkeypatch):
    with FakeTensorMode():
        args = _inputs(CASES[case])
        q, k, v, _, beta, state, cu, indices, offsets, scale, chunk, floor, final = args
        ours = OpCensus()
        with ours:
            fake = fla_ops.fla_chunk_kda_forward(*args)
        fla = _FlaLaunches(monkeypatch)
        with fla:
            real = fla_ops.fla_forward(*args)
        assert _described(fake) == _described(real), "forward results"
        do, dht = torch.empty_like(fake[0]), torch.empty_like(fake[1]) if final else None
        back = (q, k, v, beta, *fake[2:], state, do, dht, cu, indices, offsets, scale, chunk, floor)
        with ours:
            fake_grads = fla_ops.fla_chunk_kda_backward(*back)
        with fla:
            real_grads = fla_ops.fla_backward(*back)
        assert _described(fake_grads) == _described(real_grads), "backward results"
    assert dict(ours.launches_by_op) == dict(fla.count)
    assert dict(ours.bytes_by_op) == dict(fla.bytes)


def test_the_chunk_tables_are_flas():
    from fla.ops.utils import prepare_chunk_indices, prepare_chunk_offsets

    bounds = [0, 1, 64, 65, 300, 301]
    indices, offsets = fla_ops.chunk_tables(bounds, 64, torch.device("cpu"))
    cu = torch.tensor(bounds)
    assert torch.equal(indices, prepare_chunk_indices(cu, 64))
    assert torch.equal(offsets, prepare_chunk_offsets(cu, 64))


def test_the_chunk_tables_are_built_once_per_cu_seqlens():
    """Every KDA layer of a forward is handed the same cu_seqlens: its tables are copied to the device once per
    cu_seqlens and chunk."""
    bounds = [0, 70, 200]
    cu = torch.tensor(bounds)
    first = fla_ops.tables_for(cu, bounds, 64)
    assert all(a is b for a, b in zip(first, fla_ops.tables_for(cu, bounds, 64), strict=True))
    other = fla_ops.tables_for(torch.tensor(bounds), bounds, 64)  # the next forward's
    assert other[0] is not first[0] and all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert fla_ops.tables_for(cu, bounds, 32)[0].shape[0] == 3 + 5  # another chunk: built again
    # Two micro-batches' forwards and recomputations interleave (parallel.overlap_micro_batches): each keeps its own.
    assert all(a is b for a, b in zip(first, fla_ops.tables_for(cu, bounds, 64), strict=True))
