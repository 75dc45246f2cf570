"""FP8 expert GEMMs (precision.fp8) in one process: each recipe's numerics against fp32, its scaling rules, the
engines against the loop, and the recipes a machine cannot run refused at start-up."""

import pytest
import torch

from moe_pretrain.config import ConfigError
from moe_pretrain.fp8 import RECIPES, Fp8Experts, advance_amax_histories, fp8_grouped_mm, fp8_unavailable_reason
from moe_pretrain.fp8.quantize import quantize, scaled_matmul
from moe_pretrain.step_reuse import reused_in_step
from tests.fp8_cases import (
    COUNTS,
    FORWARD_BOUND,
    GRAD_BOUND,
    experts_module,
    relative_error,
)
from tests.models import tiny_config

QUANTIZED_AT_LEAST = 0.01


def fp8_of(recipe: str, **kwargs) -> Fp8Experts:
    module = experts_module(recipe, **kwargs)
    return Fp8Experts(module.fp8_settings, module)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_expert_gemm_forward_and_gradients_against_fp32(name):
    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(sum(COUNTS), 256, generator=gen, dtype=torch.float64)
    x64[5] *= 30  # an outlier token
    w64 = torch.randn(len(COUNTS), 384, 256, generator=gen, dtype=torch.float64) * 0.05
    grad64 = torch.randn(sum(COUNTS), 384, generator=gen, dtype=torch.float64)
    x, w = x64.float().requires_grad_(), w64.float().requires_grad_()
    y = fp8_grouped_mm(x, w, torch.tensor(COUNTS), fp8_of(name), "gate")
    y.backward(grad64.float())
    x64.requires_grad_()
    w64.requires_grad_()
    reference = torch.cat([part @ w64[e].T for e, part in enumerate(torch.split(x64, COUNTS))])
    reference.backward(grad64)
    errors = {"y": relative_error(y, reference), "dx": relative_error(x.grad, x64.grad),
              "dW": relative_error(w.grad, w64.grad)}
    grad_bound = GRAD_BOUND[RECIPES[name].grad_dtype]
    bounds = {"y": FORWARD_BOUND, "dx": grad_bound, "dW": grad_bound}
    for key, err in errors.items():
        assert QUANTIZED_AT_LEAST < err <= bounds[key], f"{name} {key}: relative error {err:.4f} (bound {bounds[key]})"
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # the empty expert


def test_tensorwise_gemm_is_torchs_fp8_gemm_and_the_emulation_agrees():
    """The single-scale GEMM runs torch._scaled_mm; the emulation (dequantize, fp32 GEMM) that blockwise and mxfp8
    use on CPU gives the same result to fp32 accumulation order (1e-6 relative)."""
    gen = torch.Generator().manual_seed(1)
    a = quantize(torch.randn(33, 160, generator=gen), None, torch.float8_e4m3fn)
    b = quantize(torch.randn(48, 160, generator=gen) * 3, None, torch.float8_e5m2)
    fp8_gemm = scaled_matmul(a, b, torch.float32)
    torch.testing.assert_close(fp8_gemm, a.dequantize() @ b.dequantize().T, rtol=1e-6, atol=1e-5)


def test_block_scales_isolate_an_outlier():
    """One 1e4 outlier: under one tensor-wide scale the ordinary values fall to FP8's subnormals and lose
    most of their precision; 1x128 blocks (blockwise) and 1x32 power-of-two blocks (mxfp8) keep them."""
    t = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)) * 1e-2
    t[0, 0] = 1e4
    ordinary = (slice(1, 4), slice(None))
    errors = {}
    for name in ("tensorwise", "blockwise", "mxfp8"):
        recipe = RECIPES[name]
        q = quantize(t, recipe.activation_block, torch.float8_e4m3fn, power_of_two=recipe.power_of_two)
        errors[name] = relative_error(q.dequantize()[ordinary], t[ordinary].double())
        assert q.data.float().abs().max() <= 448
    assert errors["tensorwise"] > 0.1 and errors["blockwise"] < 0.05 and errors["mxfp8"] < 0.05, errors
    block = quantize(t, (1, 128), torch.float8_e4m3fn)
    assert block.scale_inv.shape == (4, 2)
    torch.testing.assert_close(block.scale_inv[1, 1], t[1, 128:].abs().max() / 448)
    mx = quantize(t, (1, 32), torch.float8_e4m3fn, power_of_two=True)
    assert torch.equal(mx.scale_inv, torch.exp2(torch.log2(mx.scale_inv).round()))  # powers of two


def test_delayed_scaling_follows_the_history_of_steps():
    fp8 = fp8_of("delayed", history=2)
    assert fp8.scaling_amax("up.x", 0, torch.tensor(1.0)) == 1.0  # before any step: current scaling
    assert fp8.scaling_amax("up.x", 0, torch.tensor(8.0)) == 8.0  # still the first step
    advance_amax_histories(fp8.owner)  # step 1's largest amax, 8, joins the history
    for current, expected in [(2.0, 8.0), (3.0, 8.0), (4.0, 3.0)]:
        assert fp8.scaling_amax("up.x", 0, torch.tensor(current)) == expected
        advance_amax_histories(fp8.owner)  # the spike leaves after two steps
    assert fp8.scaling_amax("up.x", 1, torch.tensor(5.0)) == 5.0  # experts keep their own histories
    assert fp8.scaling_amax("down.x", 0, torch.tensor(0.5)) == 0.5  # and each operand its own
    assert experts_module("tensorwise").state_dict().keys() == {"w_gate", "w_up", "w_down"}  # no history kept


def test_recipes_this_machine_cannot_run_are_refused_at_start_up():
    cuda = torch.device("cuda")
    assert fp8_unavailable_reason("tensorwise", cuda, capability=(9, 0)) is None
    assert "8.9+" in fp8_unavailable_reason("delayed", cuda, capability=(8, 0))
    assert "no torch GPU GEMM (Transformer Engine" in fp8_unavailable_reason("blockwise", cuda, capability=(9, 0))
    assert all(fp8_unavailable_reason(name, torch.device("cpu")) is None for name in RECIPES)
    with pytest.raises(ConfigError, match=r"precision\.fp8=mxfp8 needs train.dtype float32 or bfloat16"):
        tiny_config("precision.fp8=mxfp8", "train.dtype=float64")


@pytest.mark.parametrize("name, per_gemm", [("tensorwise", 1), ("mxfp8", 2)])
def test_expert_weights_are_quantized_once_per_step(monkeypatch, name, per_gemm):
    """Two micro-batches' forward and backward inside one step's region quantize each expert's weights once per
    GEMM (mxfp8's 1x32 blocks twice: the dx GEMM needs them along the other dimension), with the same results
    as quantizing afresh every time; outside a region every use (forward, dx) quantizes again."""
    module = experts_module(name, history=4)
    for p in module.parameters():
        p.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    x = torch.randn(sum(COUNTS), 8, generator=torch.Generator().manual_seed(4))
    weight_quantizations = []
    original = Fp8Experts.quantize

    def counting(self, t, op, expert, **kwargs):
        weight_quantizations.append(op) if op.endswith(".w") else None
        return original(self, t, op, expert, **kwargs)

    monkeypatch.setattr(Fp8Experts, "quantize", counting)

    def two_micro_batches():
        outs = []
        for _ in range(2):
            y = module(x, torch.tensor(COUNTS))
            y.square().sum().backward()
            outs.append(y.detach())
        return outs

    with reused_in_step():
        reused = two_micro_batches()
    assert len(weight_quantizations) == 3 * 3 * per_gemm  # 3 GEMMs x 3 experts with rows
    weight_quantizations.clear()
    fresh = two_micro_batches()
    assert len(weight_quantizations) == 2 * 3 * 3 * 2  # every forward and every dx GEMM
    assert all(torch.equal(a, b) for a, b in zip(reused + reused, fresh + fresh))


def test_scaled_grouped_mm_operands_are_the_loops_quantization_and_pass_torchs_checks():
    """The one-call engine's row-wise e4m3 operands (each expert's rows under its own scale) dequantize to exactly
    what the loop's per-expert tensorwise quantization gives; its call satisfies torch._scaled_grouped_mm's own
    shape, stride and dtype rules (its meta function: the kernel itself runs on CUDA only)."""
    from moe_pretrain.fp8.scaled_grouped_mm import grouped_call, quantize_rows, stacked_weights

    for name in ("tensorwise", "delayed"):
        fp8 = fp8_of(name)
        x = torch.randn(sum(COUNTS), 32, generator=torch.Generator().manual_seed(5)) * 3
        counts = torch.tensor(COUNTS)
        data, scale = quantize_rows(x, counts, fp8, "gate")
        parts = enumerate(torch.split(x, COUNTS))
        loop = [fp8.quantize(part, "gate.x", e).dequantize() for e, part in parts if len(part)]
        assert torch.equal(data.float() * scale.unsqueeze(1), torch.cat(loop))
        w = torch.randn(len(COUNTS), 48, 32, generator=torch.Generator().manual_seed(6))
        w_data, w_scale = stacked_weights(w, fp8, "gate")
        for e in range(len(COUNTS)):
            expected = fp8.weight(w, "gate", e).dequantize()
            assert torch.equal(w_data[e].float() * w_scale[e].unsqueeze(1), expected)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        meta = [t.to("meta") for t in (data, scale, w_data, w_scale, offsets)]
        out = grouped_call(*meta)
        assert out.shape == (sum(COUNTS), 48) and out.dtype == torch.bfloat16


def test_padded_groups_align_every_expert_without_reading_the_counts():
    """The grouped FP8 engines' padding: each expert's rows land in a group of a multiple of 16 rows, in order,
    with zero rows between; computed on the device (no host read)."""
    from moe_pretrain.fp8.expert_rows import padded_groups, scatter_rows
    from moe_pretrain.planning.host_reads import HostReads

    x = torch.arange(1.0, sum(COUNTS) + 1).unsqueeze(1)
    with HostReads() as reads:
        index, ends, bound = padded_groups(torch.tensor(COUNTS), x.shape[0], 16)
        padded = scatter_rows(x, index, bound)
    assert reads.total == 0
    assert ends.tolist() == [304, 304, 816, 1024] and bound == sum(COUNTS) + 4 * 15
    starts = [0, 304, 304, 816]
    for e, part in enumerate(torch.split(x, COUNTS)):
        assert torch.equal(padded[starts[e]:starts[e] + len(part)], part)
    assert padded.sum() == x.sum() and torch.equal(padded[index], x)


def test_scaled_grouped_mm_engine_around_the_kernel_equals_the_loop(monkeypatch):
    """The one-call engine end to end, with torch._scaled_grouped_mm (CUDA only) replaced by its definition
    (each group's rows times its expert's weight, both dequantized by their row / column scales, bf16 out):
    the padding, scales and gathers around the call give the loop engine's forward within bf16 rounding (2^-8
    relative), and its backward (the loop's) exactly."""
    def definition(a, b, scale_a, scale_b, offs, out_dtype):
        out, start = torch.zeros(a.shape[0], b.shape[-1]), 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g])
            start = end
        return out.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", definition, raising=False)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(sum(COUNTS), 32, generator=gen)
    w = torch.randn(len(COUNTS), 48, 32, generator=gen) * 0.1
    grad = torch.randn(sum(COUNTS), 48, generator=gen)
    results = {}
    for engine in ("scaled_grouped_mm", "torch"):
        module = experts_module("tensorwise", engine=engine)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_grouped_mm(xi, wi, torch.tensor(COUNTS), Fp8Experts(module.fp8_settings, module), "gate")
        y.backward(grad)
        results[engine] = (y.detach(), xi.grad, wi.grad)
    (y, dx, dw), (y_loop, dx_loop, dw_loop) = results["scaled_grouped_mm"], results["torch"]
    assert relative_error(y, y_loop.double()) < 2 ** -8
    assert torch.equal(dx, dx_loop) and torch.equal(dw, dw_loop)
