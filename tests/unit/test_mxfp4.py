"""MXFP4 (compressed-tensors mxfp4-pack-quantized): decoding is exact, the encoding rule's groups round-trip byte
for byte, and our bytes are compressed-tensors' own (its compressor writes them and its decompressor reads ours)."""

import pytest
import torch

from moe_pretrain.checkpoint import mxfp4

E2M1 = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float64)


def test_every_code_under_every_scale_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8).repeat(2, 1)  # [2, 256]: both nibbles of every byte
    for scale_code in (0, 1, 100, 127, 150, 252):
        scale = torch.full((2, 16), scale_code, dtype=torch.uint8)
        got = mxfp4.decode(codes, scale, torch.float64)
        nibbles = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).long()
        want = E2M1[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0) * 2.0 ** (scale_code - 127)
        assert torch.equal(got, want), scale_code
        for dtype in (torch.float32, torch.bfloat16):  # exact in both
            assert torch.equal(mxfp4.decode(codes, scale, dtype).double(), want), (scale_code, dtype)


def test_encoding_follows_the_rule_and_round_trips_bytes():
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * 0.02
    weight[0, :32] = 0.0  # an all-zero group: scale code 0
    weight[1, :2] = torch.tensor([1.0, -1e-9])  # the second rounds to (negative) zero under the group's scale
    packed, scale = mxfp4.encode(weight)
    assert packed.shape == (48, 128) and scale.shape == (48, 8) and packed.dtype == scale.dtype == torch.uint8
    decoded = mxfp4.decode(packed, scale, torch.float64)
    group = weight.double().unflatten(-1, (8, 32))
    step = 2.0 ** (scale.double() - 127)  # the scale; the largest E2M1 step is 2 scales (between 4 and 6)
    assert ((decoded.unflatten(-1, (8, 32)) - group).abs() <= step.unsqueeze(-1)).all()
    amax = group.abs().amax(-1)
    nonzero = amax > 0
    assert ((amax[nonzero] / step[nonzero] >= 3.5) & (amax[nonzero] / step[nonzero] < 8)).all()
    assert scale[0, 0] == 0 and (packed[0, :16] == 0).all() and packed[1, 0] >> 4 == 8
    assert mxfp4.reencodes_exactly(packed, scale).all()
    for dtype in (torch.float32, torch.bfloat16):  # the decoded values, as import stores them, encode back
        again = mxfp4.encode(mxfp4.decode(packed, scale, dtype))
        assert torch.equal(again[0], packed) and torch.equal(again[1], scale), dtype


def test_a_group_whose_largest_code_is_small_decodes_exactly_but_says_so():
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)  # every value 1.0: the rule would pick a smaller scale
    scale = torch.full((1, 1), 120, dtype=torch.uint8)
    assert not mxfp4.reencodes_exactly(packed, scale).any()
    again = mxfp4.encode(mxfp4.decode(packed, scale))
    assert torch.equal(mxfp4.decode(*again), mxfp4.decode(packed, scale))  # the same values, other bytes


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="whole groups of 32"):
        mxfp4.encode(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="scale shape"):
        mxfp4.decode(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_compressed_tensors_writes_our_bytes_and_reads_them_back():
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                            scale_dtype=torch.uint8)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="mxfp4-pack-quantized")
    compressor = BaseCompressor.get_value_from_registry("mxfp4-pack-quantized")
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        weight = (torch.randn(64, 128) * 0.03).to(dtype)
        groups = weight.unflatten(-1, (4, 32))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        theirs = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
        packed, codes = mxfp4.encode(weight)
        assert torch.equal(theirs["weight_packed"], packed) and torch.equal(theirs["weight_scale"], codes), dtype
        state = {"weight_packed": packed, "weight_scale": codes}
        back = compressor.decompress(state, scheme)["weight"]
        assert torch.equal(back.double(), mxfp4.decode(packed, codes, torch.float64)), dtype
