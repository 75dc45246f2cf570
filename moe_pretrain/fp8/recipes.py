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

Where the GEMMs run (the engine, kernels.fp8_gemm; fp8/settings.py): on a GPU every recipe through
Transformer Engine where it runs it (fp8/transformer_engine.py). Without TE: tensorwise and delayed
through torch's FP8 GEMMs (torch._scaled_grouped_mm for the forward on compute capability 9.0 / 10.0,
torch._scaled_mm per expert otherwise, and on CPU); blockwise and mxfp8 on CPU through the exact emulation
(each operand quantized to its FP8 format with the recipe's scales, then dequantized and multiplied with
fp32 accumulation: FP8 products are exact in fp32, so this is the FP8 GEMM's arithmetic without its
speed), and refused on a GPU without TE (a start-up error naming the key).
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
    """Why precision.fp8=<name> cannot run its GEMMs on this device through torch (without Transformer
    Engine); None when it can. capability: the CUDA compute capability (read from the device when None)."""
    recipe = RECIPES[name]
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no FP8 GEMM for device {device.type}"
    if not recipe.tensorwise:
        return (f"{name} has no torch GPU GEMM (Transformer Engine runs it: kernels.fp8_gemm=auto or "
                "transformer_engine with TE installed); or use precision.fp8=tensorwise or delayed")
    capability = capability or torch.cuda.get_device_capability(device)
    if capability < _SCALED_MM_CAPABILITY:
        return f"FP8 GEMMs need compute capability 8.9+ (Ada, Hopper, Blackwell); this GPU has {capability}"
    return None
