"""The FP8 recipes of precision.fp8, and which machines can run each one.

A recipe fixes, per GEMM operand, the FP8 format and the granularity of its scales. Blocks are given as
(rows, columns) of an operand laid out [M, K] with K the contracted dimension, so one rule covers the
forward (y = x W^T) and both backward GEMMs (dx = dy W, dW = dy^T x), which contract other dimensions.

- tensorwise: one scale per tensor from its current amax ("current scaling"); e4m3 forward, e5m2 gradients.
- delayed: one scale per tensor from the largest amax of its last amax_history uses (Transformer Engine's
  DelayedScaling default); e4m3 / e5m2.
- blockwise: activations and gradients in 1x128 blocks along K, weights in 128x128 blocks (DeepSeek-V3's
  recipe, TE's Float8BlockScaling); e4m3 throughout.
- mxfp8: 1x32 blocks along K for every operand with power-of-two (E8M0) scales (the OCP MX format, TE's
  MXFP8BlockScaling); e4m3 throughout.

Where the GEMMs run: tensorwise and delayed through torch's FP8 GEMM (torch._scaled_mm, on
CPU and on CUDA GPUs of compute capability 8.9+). blockwise and mxfp8 on CPU through the exact emulation
(each operand quantized to its FP8 format with the recipe's scales, then dequantized and multiplied with
fp32 accumulation: FP8 products are exact in fp32, so this is the FP8 GEMM's arithmetic without its
speed); there is no GPU kernel for them here yet, so asking for one on a GPU is a start-up error.
"""

from dataclasses import dataclass

import torch

Block = tuple[int, int] | None
"""(rows, columns) of one scaling block of an [M, K] operand; None = the whole tensor."""


@dataclass(frozen=True)
class Recipe:
    name: str
    grad_dtype: torch.dtype
    activation_block: Block
    weight_block: Block
    power_of_two: bool = False
    delayed: bool = False
    forward_dtype: torch.dtype = torch.float8_e4m3fn

    @property
    def weight_transposable(self) -> bool:
        """The weight's scale blocks are symmetric (one per tensor, or square), so its forward quantization,
        transposed, is exactly what the dx = dy W GEMM would quantize (no second pass over the weights)."""
        return self.weight_block is None or self.weight_block[0] == self.weight_block[1]

    @property
    def tensorwise(self) -> bool:
        """One scale per operand: the GEMM can run as torch's tensorwise scaled_mm."""
        return self.activation_block is None and self.weight_block is None


RECIPES = {
    "tensorwise": Recipe("tensorwise", torch.float8_e5m2, None, None),
    "delayed": Recipe("delayed", torch.float8_e5m2, None, None, delayed=True),
    "blockwise": Recipe("blockwise", torch.float8_e4m3fn, (1, 128), (128, 128)),
    "mxfp8": Recipe("mxfp8", torch.float8_e4m3fn, (1, 32), (1, 32), power_of_two=True),
}

_SCALED_MM_CAPABILITY = (8, 9)


def fp8_unavailable_reason(name: str, device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """Why precision.fp8=<name> cannot run its GEMMs on this device; None when it can. capability: the
    CUDA compute capability (read from the device when None)."""
    recipe = RECIPES[name]
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no FP8 GEMM for device {device.type}"
    if not recipe.tensorwise:
        return (f"{name} has no GPU GEMM here yet (its numerics run on CPU only); use precision.fp8=tensorwise "
                "or delayed")
    capability = capability or torch.cuda.get_device_capability(device)
    if capability < _SCALED_MM_CAPABILITY:
        return f"FP8 GEMMs need compute capability 8.9+ (Ada, Hopper, Blackwell); this GPU has {capability}"
    return None


def describe(name: str, device: torch.device) -> str:
    """How the active recipe's GEMMs run on this device, for the start-up report."""
    if name == "off":
        return "off (precision.fp8)"
    recipe = RECIPES[name]
    engine = ("torch._scaled_mm (tensorwise FP8 GEMM)" if recipe.tensorwise
              else "exact CPU emulation (quantize to FP8, fp32-accumulated GEMM)")
    return f"{name} on the routed experts' GEMMs via {engine}"
