"""MXFP4 in the compressed-tensors "mxfp4-pack-quantized" format: how the released Kimi K3 stores its routed experts.

A weight [out, in] becomes `weight_packed` uint8 [out, in / 2] and `weight_scale` uint8 [out, in / 32]:
- each group of 32 inputs shares one E8M0 scale, a biased power of two: scale = 2^(code - 127);
- each value is an E2M1 code (bit 3 the sign, bits 0-2 an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), two per byte,
  the even column in the low nibble.

Decoding is exact: every E2M1 value times the power of two of a scale code up to 252 is a float32 and a bfloat16
(above, 6 x 2^126 overflows them; float64 holds every code).
Encoding follows the compressed-tensors rule (its memoryless min-max observer and `generate_mx_scales`): the
group's largest magnitude is rounded to a power of two (up when its mantissa is 1.75 or more), the scale is that
power / 4 (E2M1's largest power of two), clamped into the uint8 range, so an all-zero group gets code 0; values
are divided by the scale, clamped to +-6 and rounded to the nearest E2M1 value, ties to the even code. A value
that rounds to zero keeps its sign (code 8 for a negative one), as compressed-tensors writes it.

A group encoded by this rule has a largest code magnitude of 4 or 6 (or is all zero with scale code 0), so its
decoded values encode back to the same codes and scale: the byte-exact round trip (see `reencodes_exactly`).
"""

import torch

GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCALE_BIAS = 127
E2M1_MAX_POWER = 2
"""floor(log2(6)): the scale is the group's power of two divided by 2^this."""


def _check_groups(inputs: int) -> None:
    if inputs % GROUP:
        raise ValueError(f"MXFP4 needs the input width in whole groups of {GROUP}, got {inputs}")


def _power_of_two_code(amax: torch.Tensor) -> torch.Tensor:
    """E8M0 codes of the groups' scales from their largest magnitudes (float32)."""
    bits = amax.view(torch.int32)
    # Round the mantissa to one bit (E2M1's): 1.75 and above carries into the exponent; then keep the exponent.
    exponent = ((bits + (1 << 21)) >> 23) & 0xFF  # float32's biased exponent: log2 of the rounded power of two
    code = exponent - E2M1_MAX_POWER
    code = torch.where(amax == 0, torch.zeros_like(code), code)  # log2(0) = -inf clamps to 0
    return code.clamp(0, 255)


def _e2m1_index(magnitude: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 index of magnitudes already clamped to [0, 6], ties to the even index."""
    index = torch.zeros_like(magnitude, dtype=torch.uint8)
    for threshold, inclusive in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                                 (3.5, True), (5.0, False)):
        index += (magnitude >= threshold if inclusive else magnitude > threshold).to(torch.uint8)
    return index


def encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., in] (any float dtype) -> (packed uint8 [..., in / 2], scale uint8 [..., in / 32])."""
    _check_groups(weight.shape[-1])
    groups = weight.float().unflatten(-1, (weight.shape[-1] // GROUP, GROUP))
    code = _power_of_two_code(groups.abs().amax(-1))
    scale = torch.ldexp(torch.ones_like(code, dtype=torch.float32), code - SCALE_BIAS)
    magnitude = (groups.abs() / scale.unsqueeze(-1)).clamp(max=6.0)
    nibbles = _e2m1_index(magnitude) | (torch.signbit(groups).to(torch.uint8) << 3)
    pairs = nibbles.flatten(-2).unflatten(-1, (weight.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4), code.to(torch.uint8)


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 [..., in / 2], scale uint8 [..., in / 32]) -> the exact values [..., in] in `dtype`."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 codes and scales are uint8, got {packed.dtype} and {scale.dtype}")
    inputs = packed.shape[-1] * 2
    _check_groups(inputs)
    if tuple(scale.shape) != (*packed.shape[:-1], inputs // GROUP):
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not fit codes {tuple(packed.shape)}")
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    values = _byte_values(wide, packed.device)[packed.long()].flatten(-2)  # [..., in]: one lookup per byte
    scales = torch.ldexp(torch.ones_like(scale, dtype=wide), scale.to(torch.int32) - SCALE_BIAS)
    # A power of two times an E2M1 value: exact (the smallest product, 2^-128, is a float32 subnormal).
    return (values.unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)).flatten(-2).to(dtype)


def _signed_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 E2M1 codes' values (bit 3 the sign; code 8 is -0.0)."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([magnitudes, -magnitudes])


def _byte_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: a byte's two values, the low nibble's first."""
    codes = torch.arange(256, device=device)
    signed = _signed_values(dtype, device)
    return torch.stack([signed[codes & 0x0F], signed[codes >> 4]], dim=-1)


def reencodes_exactly(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per group: whether its decoded values encode back to the same bytes (the encoding rule's groups do: the
    largest code magnitude 4 or 6, or all zero under scale code 0). [..., in / 32] bool."""
    codes = torch.arange(256, dtype=torch.uint8, device=packed.device)
    byte_largest = torch.maximum(codes & 0x07, (codes >> 4) & 0x07)  # a byte's larger magnitude index
    largest = byte_largest[packed.long()].unflatten(-1, (scale.shape[-1], GROUP // 2)).amax(-1)
    return (largest >= 6) | ((largest == 0) & (scale == 0))
