"""Each FP8 engine's grouped expert GEMM on the GPU against the CPU emulation of the same recipe, forward and both
gradients: torch._scaled_grouped_mm (tensorwise, delayed; compute capability 9.0 / 10.0) and Transformer Engine's
grouped GEMM (every recipe TE runs here).

Tolerances: each engine's y, dx and dW within the CPU test's bounds of float64 (tests/distributed/test_fp8.py: 0.05
forward, 0.08 e5m2 / 0.05 e4m3 gradients), and within 0.03 relative (Frobenius) of the CPU emulation on the same
inputs: the same recipe, rounded by other kernels (bf16 outputs, TE's power-of-two block scales, fp32 accumulation
order).
"""

import pytest
import torch

from moe_pretrain.fp8 import RECIPES, Fp8Experts, fp8_grouped_mm
from moe_pretrain.fp8.scaled_grouped_mm import scaled_grouped_mm_unavailable_reason
from moe_pretrain.fp8.transformer_engine import te_unavailable_reason
from tests.fp8_cases import COUNTS, FORWARD_BOUND, GRAD_BOUND, experts_module, relative_error

CUDA = torch.device("cuda")
TO_EMULATION = 0.03


def run(recipe: str, engine: str, device: torch.device, x, w, grad):
    owner = experts_module(recipe, engine=engine).to(device)
    xi = x.to(device).requires_grad_()
    wi = w.to(device).requires_grad_()
    y = fp8_grouped_mm(xi, wi, torch.tensor(COUNTS, device=device), Fp8Experts(owner.fp8_settings, owner), "gate")
    y.backward(grad.to(device, y.dtype))
    return [t.detach().cpu().double() for t in (y, xi.grad, wi.grad)]


def reasons(recipe: str) -> dict[str, str | None]:
    return {"scaled_grouped_mm": scaled_grouped_mm_unavailable_reason(RECIPES[recipe], CUDA),
            "transformer_engine": te_unavailable_reason(RECIPES[recipe], CUDA)}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("engine", ["scaled_grouped_mm", "transformer_engine"])
def test_engine_matches_the_cpu_emulation_forward_and_gradients(recipe, engine):
    if reason := reasons(recipe)[engine]:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(sum(COUNTS), 256, generator=gen, dtype=torch.float64)
    w64 = torch.randn(len(COUNTS), 384, 256, generator=gen, dtype=torch.float64) * 0.05
    grad64 = torch.randn(sum(COUNTS), 384, generator=gen, dtype=torch.float64)
    x, w = x64.to(torch.bfloat16), w64.to(torch.bfloat16)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    reference = torch.cat([part @ w64[e].T for e, part in enumerate(torch.split(x64, COUNTS))])
    reference.backward(grad64)
    exact = [reference.detach(), x64.grad, w64.grad]
    gpu = run(recipe, engine, CUDA, x, w, grad64)
    emulated = run(recipe, "torch", torch.device("cpu"), x.float(), w.float(), grad64)
    grad_bound = GRAD_BOUND[RECIPES[recipe].grad_dtype]
    for name, got, emu, ref, bound in zip(("y", "dx", "dW"), gpu, emulated, exact,
                                          (FORWARD_BOUND, grad_bound, grad_bound)):
        assert relative_error(got, ref) <= bound, (engine, recipe, name, relative_error(got, ref))
        assert relative_error(got, emu) <= TO_EMULATION, (engine, recipe, name, relative_error(got, emu))
    assert gpu[2][1].abs().max() == 0  # the empty expert's weight gradient
