"""Fused SiTU-GLU, forward and backward, in Triton (reference: moe_pretrain.ops.situ.situ_glu).

One pass over (gate, up) computes h = b tanh(g/b) sigmoid(g) * b_lin tanh(u/b_lin) in fp32 and writes h in
the inputs' dtype; the backward reads (grad_h, gate, up) once and writes both gradients, recomputing the
elementwise factors as the reference does. Eager PyTorch makes about ten passes over [R, F] memory for
the same work. tanh(x) is written 2 sigmoid(2x) - 1 (no tanh in triton.language).
"""

import torch
import triton
import triton.language as tl
from torch.library import custom_op

BLOCK = 1024
WITHOUT_PRODUCTS = ("situ_glu", "situ_glu_backward")
"""Ops here that multiply no matrices: the op census prices them by their bytes (elementwise)."""


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ_glu_forward(gate_ptr, up_ptr, out_ptr, n, beta, linear_beta, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    h = beta * _tanh(g / beta) * tl.sigmoid(g) * (linear_beta * _tanh(u / linear_beta))
    tl.store(out_ptr + offsets, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _situ_glu_backward(grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr, n, beta, linear_beta,
                       BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    t = _tanh(g / beta)
    s = tl.sigmoid(g)
    tu = _tanh(u / linear_beta)
    grad_gate = grad * linear_beta * tu * ((1.0 - t * t) * s + beta * t * s * (1.0 - s))
    grad_up = grad * beta * t * s * (1.0 - tu * tu)
    tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offsets, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


@custom_op("moe_pretrain::situ_glu", mutates_args=())
def situ_glu_forward(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """h from contiguous (gate, up). A custom op with a fake implementation: fake tensors (the dry run) and
    torch.compile see one kernel and its output's shape, never the launch (under TRITON_INTERPRET the
    interpreter would read the fake tensors' storage)."""
    out = torch.empty_like(gate)
    _situ_glu_forward[_grid(gate.numel())](gate, up, out, gate.numel(), beta, linear_beta, BLOCK=BLOCK)
    return out


@custom_op("moe_pretrain::situ_glu_backward", mutates_args=())
def situ_glu_backward(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
    _situ_glu_backward[_grid(gate.numel())](grad_h, gate, up, grad_gate, grad_up, gate.numel(), beta, linear_beta,
                                            BLOCK=BLOCK)
    return grad_gate, grad_up


@situ_glu_forward.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    return torch.empty_like(gate)


@situ_glu_backward.register_fake
def _(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float
      ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _save(ctx, inputs: tuple, output: torch.Tensor) -> None:
    gate, up, beta, linear_beta = inputs
    ctx.save_for_backward(gate, up)
    ctx.betas = beta, linear_beta


def _backward(ctx, grad_h: torch.Tensor):
    gate, up = ctx.saved_tensors
    return *situ_glu_backward(grad_h.contiguous(), gate, up, *ctx.betas), None, None


situ_glu_forward.register_autograd(_backward, setup_context=_save)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """The fused kernel; same contract as moe_pretrain.ops.situ_glu (fp32 math, output in gate's dtype)."""
    if gate.dtype != up.dtype or gate.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kernels.situ_glu: gate and up must share fp32 / bf16 / fp16, got {gate.dtype}, {up.dtype}")
    return situ_glu_forward(gate.contiguous(), up.contiguous(), float(beta), float(linear_beta))
