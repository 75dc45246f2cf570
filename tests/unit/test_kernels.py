"""Our Triton kernels against their PyTorch references, under TRITON_INTERPRET=1 on CPU (tests/conftest.py)
and natively on a GPU (tests/gpu/ runs this module there too).

Tolerances: fp32 kernels against the float64 reference within 2e-6 relative to the largest value (the
kernels compute in fp32 with tanh as 2 sigmoid(2x) - 1); bf16 within two bf16 ulps (2^-7 relative) of the
reference computed from the same bf16 inputs.
"""

import importlib
import pkgutil

import pytest
import torch
from torch.library import opcheck

pytest.importorskip("triton")

import gpu_kernels
from gpu_kernels.triton_support import triton_unavailable_reason
from moe_pretrain.model.token_dispatch import LocalTokenDispatcher
from moe_pretrain.ops import attn_res_mix, rms_norm, situ_glu
from moe_pretrain.ops.norms import l2_norm
from moe_pretrain.ops.permute import permute, unpermute

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(triton_unavailable_reason(DEVICE) is not None,
                                reason=str(triton_unavailable_reason(DEVICE)))
for _module in pkgutil.walk_packages(gpu_kernels.__path__, "gpu_kernels."):
    importlib.import_module(_module.name)  # importing a module registers its custom ops
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7}


def close(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, widen: float = 1.0) -> None:
    """widen: the tolerance times this (a kernel's fp32 sums over long rows round more)."""
    scale = reference.abs().max().clamp_min(1.0)
    err = ((actual.double() - reference.double()).abs().max() / scale).item()
    bound = TOLERANCE[dtype] * widen
    assert err <= bound, f"{dtype}: max error {err:.3g} of the largest value (bound {bound:.3g})"


def run(fn, *inputs, fused: bool):
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves, fused=fused)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    out.backward(grad_out)
    return out, [x.grad for x in leaves if x.requires_grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 1000), (7, 2053)])
def test_fused_situ_glu_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(shape, generator=gen, dtype=torch.float64) * 6).to(DEVICE, dtype)
    up = (torch.randn(shape, generator=gen, dtype=torch.float64) * 40).to(DEVICE, dtype)
    for beta, linear_beta in [(4.0, 25.0), (2.0, 7.0)]:
        def fn(g, u, beta=beta, linear_beta=linear_beta, *, fused):
            return situ_glu(g, u, beta, linear_beta, fused=fused)

        out, grads = run(fn, gate, up, fused=True)
        reference_inputs = (gate.double(), up.double()) if dtype == torch.float32 else (gate, up)
        ref_out, ref_grads = run(fn, *reference_inputs, fused=False)
        assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
        close(out, ref_out, dtype)
        for grad, ref in zip(grads, ref_grads):
            close(grad, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("entries", "width"), [(2, 100), (5, 100), (3, 3000)])
def test_fused_attn_res_mix_matches_the_float64_reference(dtype, entries, width):
    """The mix and the gradients of every entry, the pseudo-query and the norm weight, against the reference in
    float64 on the same values. The first entry is fp32 as the embedding's output is in bf16 training; entries
    of unequal scale so that the softmax is far from uniform; widths that are not a power of two, narrow (many
    rows a program, the last tile part empty) and wide (a row a program, as at the model's widths)."""
    gen = torch.Generator().manual_seed(7)
    scales = [1.0, 6.0, 0.3, 2.0, 12.0][:entries]
    bank = [(torch.randn(3, 5, width, generator=gen, dtype=torch.float64) * scale).to(DEVICE)
            for scale in scales]
    bank = [bank[0].float()] + [entry.to(dtype) for entry in bank[1:]]
    query = (torch.randn(width, generator=gen, dtype=torch.float64) * 0.3).to(DEVICE, torch.float32)
    weight = (torch.rand(width, generator=gen, dtype=torch.float64) + 0.5).to(DEVICE, torch.float32)

    def mix(*tensors, fused):
        return attn_res_mix(list(tensors[:-2]), tensors[-2], tensors[-1], 1e-5, fused=fused)

    out, grads = run(mix, *bank, query, weight, fused=True)
    ref_out, ref_grads = run(mix, *(t.double() for t in (*bank, query, weight)), fused=False)
    assert out.dtype == torch.float32 and [g.dtype for g in grads] == [t.dtype for t in (*bank, query, weight)]
    widen = max(1.0, (width / 500) ** 0.5)  # fp32 sums over a row: rounding grows as the root of its length
    close(out, ref_out, dtype, widen)
    for grad, ref in zip(grads, ref_grads):
        close(grad, ref, dtype, widen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [100, 3000])
def test_fused_rms_norm_matches_the_float64_reference(dtype, width):
    """The norm and the gradients of its input and weight against the reference in float64 on the same values,
    rows of unequal scale, narrow (many rows a program) and wide (a row a program)."""
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(3, 7, width, generator=gen, dtype=torch.float64)
         * torch.rand(3, 7, 1, generator=gen, dtype=torch.float64) * 10).to(DEVICE, dtype)
    weight = (torch.rand(width, generator=gen, dtype=torch.float64) + 0.5).to(DEVICE, torch.float32)

    def norm(x, w, *, fused):
        return rms_norm(x, w, 1e-5, fused=fused)

    out, grads = run(norm, x, weight, fused=True)
    ref_out, ref_grads = run(norm, x.double(), weight.double(), fused=False)
    assert out.dtype == dtype and [g.dtype for g in grads] == [dtype, torch.float32]
    # The cast that follows a norm folded into its write: fp32 in, bf16 out, one rounding.
    cast = rms_norm(x.float(), weight, 1e-5, fused=True, out_dtype=torch.bfloat16)
    assert cast.dtype == torch.bfloat16
    close(cast, ref_out, torch.bfloat16)
    widen = max(1.0, (width / 500) ** 0.5)  # fp32 sums over a row: rounding grows as the root of its length
    close(out, ref_out, dtype, widen)
    for grad, ref in zip(grads, ref_grads):
        close(grad, ref, dtype, widen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_l2_norm_through_the_rms_norm_kernel_matches_the_float64_reference(dtype):
    """KDA's q / k L2 norm on RMSNorm's kernel (a weight of D^-1/2, eps / D): the norm and its input's gradient
    against the reference L2 norm in float64, rows of unequal scale and one near zero (where eps decides)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 5, 3, 32, generator=gen, dtype=torch.float64) * torch.rand(4, 5, 3, 1, generator=gen,
                                                                                 dtype=torch.float64) * 10
    x[0, 0, 0] *= 1e-4
    x = x.to(DEVICE, dtype)
    out, grads = run(lambda x, *, fused: l2_norm(x, 1e-6, fused=fused), x, fused=True)
    ref_out, ref_grads = run(lambda x, *, fused: l2_norm(x, 1e-6, fused=fused), x.double(), fused=False)
    assert out.dtype == grads[0].dtype == dtype
    close(out, ref_out, dtype)
    close(grads[0], ref_grads[0], dtype)


def conv_positions(B: int, T: int, starts: list[int], continued: bool) -> torch.Tensor:
    """[B, T] offsets in their documents: documents start at `starts` (and at 0 unless the row continues a
    document begun before it, as a context-parallel fragment's first may)."""
    positions = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        offset = 5 if continued else 0
        for t in range(T):
            offset = 0 if t in starts else offset + (t > 0)
            positions[b, t] = offset
    return positions.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("channels", "with_halo", "silu"), [(40, False, True), (300, True, True), (40, True, False)])
def test_fused_short_conv_matches_the_float64_reference(dtype, channels, with_halo, silu):
    """The convolution (and SiLU) and the gradients of its input, halo and weight against the reference module
    in float64: documents starting inside the rows, a halo a fragment continues from (its first document
    reaching back into it), channels in one block and in several."""
    from moe_pretrain.model.short_conv import ShortConvolution

    gen = torch.Generator().manual_seed(9)
    B, T, K = 2, 13, 4
    x = torch.randn(B, T, channels, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    halo = torch.randn(B, K - 1, channels, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    weight = torch.randn(channels, K, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)
    positions = conv_positions(B, T, [6, 11], continued=with_halo)
    module = ShortConvolution(channels, K)

    del module.weight  # the weight is each run's leaf, so that its gradient is compared too

    def conv(x, halo, w, *, fused):
        module.fused, module.weight = fused, w
        return module(x, positions, halo if with_halo else None, silu=silu)

    out, grads = run(conv, x, halo, weight, fused=True)
    ref_out, ref_grads = run(conv, x.double(), halo.double(), weight.double(), fused=False)
    assert out.dtype == dtype and (grads[1] is not None) == with_halo and grads[2] is not None
    close(out, ref_out, dtype)
    for grad, ref in zip(grads, ref_grads):
        assert (grad is None) == (ref is None)
        if grad is not None:
            close(grad, ref, dtype)


def routing(num_tokens: int, k: int, num_experts: int, seed: int):
    """Ragged routing with empty experts: tokens only pick among the first num_experts - 2."""
    gen = torch.Generator().manual_seed(seed)
    topk_idx = torch.stack([torch.randperm(num_experts - 2, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=gen, dtype=torch.float32)
    return topk_idx.to(DEVICE), weights.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [40, 3000])  # many rows a program (the last part empty), and a row a program
def test_permute_kernels_match_reference(dtype, width):
    num_tokens, k = 37, 3
    topk_idx, weights = routing(num_tokens, k, num_experts=8, seed=2)
    dispatcher = LocalTokenDispatcher(8)
    x = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    _rows, counts, meta = dispatcher.dispatch(x, topk_idx, weights)
    assert counts[-2:].sum() == 0
    token_index = meta.positions.reshape(-1).argsort() // k

    def permuted(x_TL, *, fused):
        return permute(x_TL, token_index, meta.positions, fused=fused)

    def unpermuted(rows, w, *, fused):
        return unpermute(rows, meta.positions, w, fused=fused)

    rows, (grad_x,) = run(permuted, x, fused=True)
    ref_rows, (ref_grad_x,) = run(permuted, x, fused=False)
    assert torch.equal(rows, ref_rows)
    close(grad_x, ref_grad_x, dtype)

    out, (grad_rows, grad_w) = run(unpermuted, rows, weights, fused=True)
    ref_inputs = (rows.double(), weights.double()) if dtype == torch.float32 else (rows, weights)
    ref_out, (ref_grad_rows, ref_grad_w) = run(unpermuted, *ref_inputs, fused=False)
    assert out.dtype == dtype and grad_w.dtype == torch.float32
    close(out, ref_out, dtype)
    close(grad_rows, ref_grad_rows, dtype)
    close(grad_w, ref_grad_w, dtype)


def test_dispatch_round_trip_through_the_kernels():
    """dispatch -> scale each expert's rows -> combine, kernels on, equals the reference path."""
    topk_idx, weights = routing(29, 2, num_experts=6, seed=4)
    x = torch.randn(29, 24, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    outs = {}
    for fused in (True, False):  # each dispatcher built with its choice, as a model's are
        dispatcher = LocalTokenDispatcher(6, fused=fused)
        rows, counts, meta = dispatcher.dispatch(x, topk_idx, weights)
        scale = torch.repeat_interleave(torch.arange(1.0, 7.0, device=DEVICE), counts)
        outs[fused] = dispatcher.combine(rows * scale[:, None], meta)
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-6, atol=1e-6)


def kernel_samples() -> dict[str, tuple]:
    """Arguments for each of our GPU kernels' custom ops (gpu_kernels/), in bf16 as training runs them."""
    gen = torch.Generator().manual_seed(6)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    num_tokens, k, width = 11, 2, 24
    positions = torch.randperm(num_tokens * k, generator=gen).reshape(num_tokens, k).to(DEVICE)
    token_index = positions.reshape(-1).argsort() // k
    rows, weights = randn(num_tokens * k, width), randn(num_tokens, k, dtype=torch.float32)
    gate, up = randn(5, 300), randn(5, 300)
    bank = [randn(2, 3, 40, dtype=torch.float32), randn(2, 3, 40), randn(2, 3, 40)]
    u = randn(40, dtype=torch.float32)
    mix, probs = torch.ops.moe_pretrain.attn_res_mix(bank, u, 1e-5)
    conv_x, conv_w = randn(2, 9, 40), randn(40, 4, dtype=torch.float32)
    conv_positions_ = conv_positions(2, 9, [4], continued=True)
    conv_halo = randn(2, 3, 40)
    x, norm_weight = randn(4, 3, 40), randn(40, dtype=torch.float32)
    _, rstd = torch.ops.moe_pretrain.rms_norm(x, norm_weight, 1e-5, torch.bfloat16)
    return {"short_conv": (conv_x, conv_positions_, conv_halo, conv_w, True),
            "short_conv_backward": (randn(2, 9, 40), conv_x, conv_positions_, None, conv_w, True),
            "rms_norm": (x.float(), norm_weight, 1e-5, torch.bfloat16),  # the cast folded into the norm
            "rms_norm_backward": (randn(4, 3, 40), x, norm_weight, rstd),
            "attn_res_mix": (bank, u, 1e-5), "attn_res_mix_backward": (randn(2, 3, 40, dtype=torch.float32), mix,
                                                                       bank, u, probs, 1e-5),
            "situ_glu": (gate, up, 4.0, 25.0), "situ_glu_backward": (randn(5, 300), gate, up, 4.0, 25.0),
            "permute": (randn(num_tokens, width), token_index, positions),
            "unpermute": (rows, positions, weights),
            "unpermute_backward": (randn(num_tokens, width), rows, positions, weights)}


LIBRARY_OPS = {"fla_chunk_kda", "fla_chunk_kda_backward"}
"""Ops around a library's kernels (fla's), which run here only with the interpreter's shims: their opcheck is in
tests/unit/test_fla_cpu.py, their fakes and launches against fla's own code in tests/unit/test_fla_ops.py."""


def test_every_gpu_kernel_op_has_a_sample_here():
    """A kernel added to gpu_kernels/ without a fake-vs-real check below fails here."""
    namespace = torch.ops.moe_pretrain
    ops = {name for name in dir(namespace) if isinstance(getattr(namespace, name), torch._ops.OpOverloadPacket)}
    assert ops == set(kernel_samples()) | LIBRARY_OPS


def test_every_gpu_kernel_op_is_priced_by_a_flop_formula_or_declared_free_of_products():
    """The dry run prices each launch by its FLOPs and its bytes: an op that multiplies matrices needs a FLOP formula
    in torch's registry (which the op census reads), or its FLOPs would be priced at nothing; an op that does not
    says so in its module's WITHOUT_PRODUCTS, and an op that stands for several kernels lists them with their FLOPs
    (gpu_kernels/launch_profile.py). A new op that is none of these fails here."""
    from torch.utils.flop_counter import flop_registry

    from gpu_kernels.launch_profile import PROFILES

    namespace = torch.ops.moe_pretrain
    ops = {name for name in dir(namespace) if isinstance(getattr(namespace, name), torch._ops.OpOverloadPacket)}
    declared = {name for module in pkgutil.walk_packages(gpu_kernels.__path__, "gpu_kernels.")
                for name in getattr(importlib.import_module(module.name), "WITHOUT_PRODUCTS", ())}
    priced = {name for name in ops if getattr(namespace, name) in flop_registry or getattr(namespace, name) in PROFILES}
    assert ops == priced | declared and not priced & declared, (priced, declared)
    assert {"attn_res_mix", "attn_res_mix_backward"} <= priced


@pytest.mark.parametrize("name", sorted(kernel_samples()))
def test_each_gpu_kernel_fake_gives_its_real_outputs_shapes_and_dtypes(name):
    """torch.library.opcheck runs the op for real (Triton under the interpreter here, natively on a GPU) and
    under fake tensors, and compares the outputs' shapes, dtypes and strides; also the schema and the
    autograd registration. What the dry run (planning/dry_run.py) and torch.compile rely on."""
    opcheck(getattr(torch.ops.moe_pretrain, name), kernel_samples()[name],
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
