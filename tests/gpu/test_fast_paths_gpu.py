"""The CUDA side of the expert fast paths: grouped GEMM (bf16) against the per-expert loop, FP8 GEMMs
through cuBLAS against the CPU's, and the start-up rules for recipes a GPU cannot run.

Tolerances: bf16 grouped vs loop within 1e-2 relative RMS (both bf16 GEMMs with fp32 accumulation; the
order differs); FP8 tensorwise on the GPU against the same quantized operands multiplied on the CPU within
1e-5 (the FP8 products are exact, only the fp32 accumulation order differs).
"""

import torch

from moe_pretrain.fp8 import RECIPES, fp8_unavailable_reason
from moe_pretrain.fp8.quantize import quantize, scaled_matmul
from moe_pretrain.ops import grouped_mm
from tests.helpers import rel_rms

CUDA = torch.device("cuda")


def test_grouped_gemm_matches_the_loop_in_bf16_forward_and_backward():
    counts = torch.tensor([512, 0, 1024, 384, 0, 128, 256, 0])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(counts.sum()), 256, generator=gen).to(CUDA, torch.bfloat16)
    w = (torch.randn(8, 512, 256, generator=gen) * 0.05).to(CUDA, torch.bfloat16)
    grad = torch.randn(x.shape[0], 512, generator=gen).to(CUDA, torch.bfloat16)
    results = {}
    for choice in ("grouped", "loop"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_mm(xi, wi, counts.to(CUDA), choice)
        y.backward(grad)
        results[choice] = (y, xi.grad, wi.grad)
    for got, ref in zip(results["grouped"], results["loop"]):
        assert rel_rms(got.float(), ref.float()) < 1e-2
    assert results["grouped"][2][1].abs().max() == 0  # an empty expert's gradient


def test_fp8_tensorwise_gemm_on_the_gpu_equals_the_cpus():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(512, 1024, generator=gen), torch.randn(768, 1024, generator=gen)
    cpu = scaled_matmul(quantize(a, None, torch.float8_e4m3fn), quantize(b, None, torch.float8_e4m3fn), torch.float32)
    gpu = scaled_matmul(quantize(a.to(CUDA), None, torch.float8_e4m3fn),
                        quantize(b.to(CUDA), None, torch.float8_e4m3fn), torch.float32)
    # The same quantized operands; cuBLAS's FP8 GEMM on Hopper sums runs of products in the tensor cores'
    # narrower accumulator before promoting them to fp32 (DeepSeek-V3 report, 3.3.2: about 14 bits), the CPU's
    # in fp32 throughout: a few 1e-4 apart, where a wrong scale or operand layout would be order 1.
    assert rel_rms(gpu.cpu().double(), cpu.double()) < 1e-3


def test_gpu_recipe_rules():
    capability = torch.cuda.get_device_capability()
    for name, recipe in RECIPES.items():
        reason = fp8_unavailable_reason(name, CUDA)
        assert (reason is None) == (recipe.tensorwise and capability >= (8, 9)), (name, reason)
