"""stages/quant/gptq_format.py: the GPTQ layout packing, bit for bit, in both zero-point formats
("gptq": z - 1 stored, AutoGPTQ v1; "gptq_v2": z stored)."""

import pytest
import torch

from stages.quant.gptq_format import checkpoint_format_for, dequantize_packed, format_of, pack, pack_bits, unpack
from stages.quant.rtn import QuantizedWeight, dequantize_weight, quantize_weight


def _random_codes(bits: int, out_f: int = 24, in_f: int = 64, group_size: int = 16, seed: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    maxq = 2**bits - 1
    n_groups = 1 if group_size == -1 else in_f // group_size
    return QuantizedWeight(
        codes=torch.randint(0, maxq + 1, (out_f, in_f), generator=g, dtype=torch.int32),
        scales=(torch.rand(out_f, n_groups, generator=g) * 0.01 + 1e-3).half().float(),
        zeros=torch.randint(1, maxq + 1, (out_f, n_groups), generator=g, dtype=torch.int32),
        bits=bits, group_size=group_size,
    )


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits,group_size", [(4, 16), (4, -1), (8, 32), (8, -1)])
def test_round_trip_is_exact_and_shapes_match_the_layout(bits, group_size, fmt):
    q = _random_codes(bits, group_size=group_size)
    t = pack(q, fmt)
    per = 32 // bits
    n_groups = q.scales.shape[1]
    assert t["qweight"].dtype == torch.int32 and t["qweight"].shape == (64 // per, 24)
    assert t["qzeros"].dtype == torch.int32 and t["qzeros"].shape == (n_groups, 24 // per)
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (n_groups, 24)
    assert t["g_idx"].dtype == torch.int32 and t["g_idx"].shape == (64,)
    assert (t["qweight"] < 0).any()  # high bits set: the int32 sign view is exercised
    u = unpack(t, bits, fmt)
    assert torch.equal(u.codes, q.codes) and torch.equal(u.zeros, q.zeros)
    assert torch.equal(u.scales, q.scales)
    torch.testing.assert_close(dequantize_packed(t, bits, fmt), dequantize_weight(q), rtol=0, atol=0)


def test_bit_order_and_zero_minus_one_convention():
    # 4 bit: input feature k of output o holds code k % 16; the first feature sits in the lowest nibble.
    codes = (torch.arange(16, dtype=torch.int32) % 16).repeat(8, 1)  # (out 8, in 16)
    zeros = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]], dtype=torch.int32)  # (out, G=1)
    q = QuantizedWeight(codes=codes, scales=torch.ones(8, 1), zeros=zeros, bits=4, group_size=-1)
    t = pack(q, "gptq")
    assert t["qweight"][0, 0].item() == 0x76543210
    assert t["qweight"][1, 0].item() == 0xFEDCBA98 - 2**32  # stored as signed int32
    # "gptq": qzeros holds z - 1, output channel c in nibble c: 0,1,2,3,4,5,6,14
    assert t["qzeros"][0, 0].item() == 0xE6543210 - 2**32
    assert torch.equal(t["g_idx"], torch.zeros(16, dtype=torch.int32))
    # "gptq_v2": the same words for codes, scales and g_idx; qzeros holds z: 1,2,3,4,5,6,7,15
    v2 = pack(q, "gptq_v2")
    assert v2["qzeros"][0, 0].item() == 0xF7654321 - 2**32
    assert all(torch.equal(t[k], v2[k]) for k in ("qweight", "scales", "g_idx"))
    # 8 bit: four codes per word
    q8 = QuantizedWeight(codes=torch.tensor([[1, 2, 3, 255]] * 4, dtype=torch.int32),  # (out 4, in 4)
                         scales=torch.ones(4, 1), zeros=torch.tensor([[1], [2], [128], [255]], dtype=torch.int32),
                         bits=8, group_size=-1)
    t8 = pack(q8, "gptq")
    assert t8["qweight"][0, 0].item() == 0xFF030201 - 2**32
    assert t8["qzeros"][0, 0].item() == 0xFE7F0100 - 2**32
    assert pack(q8, "gptq_v2")["qzeros"][0, 0].item() == 0xFF800201 - 2**32


def test_zero_point_zero_is_storable_only_unshifted():
    q = _random_codes(4)
    q.zeros[0, 0] = 0  # an asymmetric grid whose range starts at 0
    with pytest.raises(ValueError, match=r"zero points must lie in \[1, 15\].*'gptq'"):
        pack(q, "gptq")
    torch.testing.assert_close(dequantize_packed(pack(q, "gptq_v2"), 4, "gptq_v2"), dequantize_weight(q),
                               rtol=0, atol=0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_gptqmodel_v1_file_with_zero_point_zero_reads_back(bits):
    """GPTQModel writes format "gptq" by subtracting the word of ones (0x11111111 at 4 bits) from
    each v2 qzeros word (gptqmodel/utils/model.py, convert_gptq_v2_to_v1_format_module), so a zero
    point of 0 is stored as -1 borrowed from the next code: the reader adds the word back."""
    q = _random_codes(bits, out_f=32)
    q.zeros[0, 0], q.zeros[1, 0] = 0, 2 ** bits - 1  # a borrow, and a neighbour at the top of the range
    v2 = pack(q, "gptq_v2")
    ones = pack_bits(torch.ones(32 // bits, 1, dtype=torch.int32), bits)[0, 0].item()
    v1 = {**v2, "qzeros": ((v2["qzeros"].to(torch.int64) - ones) & 0xFFFFFFFF).to(torch.int64)}
    v1["qzeros"] = torch.where(v1["qzeros"] >= 2**31, v1["qzeros"] - 2**32, v1["qzeros"]).to(torch.int32)
    torch.testing.assert_close(dequantize_packed(v1, bits, "gptq"), dequantize_weight(q), rtol=0, atol=0)


def test_format_keys_and_unknown_formats():
    assert checkpoint_format_for(sym=True) == "gptq" and checkpoint_format_for(sym=False) == "gptq_v2"
    assert format_of({"format": "gptq_v2", "checkpoint_format": "gptq_v2"}) == "gptq_v2"
    assert format_of({"checkpoint_format": "gptq_v2"}) == "gptq_v2"  # the alias alone
    assert format_of({"format": "gptq_v2", "checkpoint_format": "gptq"}) == "gptq_v2"  # format wins, as in GPTQModel
    assert format_of({}) == "gptq"  # transformers' default
    with pytest.raises(ValueError, match="'marlin' is not supported"):
        format_of({"format": "marlin"})
    with pytest.raises(ValueError, match="'gptq_v3' is not supported"):
        pack(_random_codes(4), "gptq_v3")


def test_group_index_and_real_weights():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    q = quantize_weight(w, 4, 16)
    t = pack(q, "gptq_v2")
    assert torch.equal(t["g_idx"], torch.arange(64, dtype=torch.int32) // 16)
    torch.testing.assert_close(dequantize_packed(t, 4, "gptq_v2"), dequantize_weight(q), rtol=0, atol=0)


def test_shapes_that_do_not_fill_words_are_rejected():
    q = _random_codes(4, out_f=12, in_f=64)
    with pytest.raises(ValueError, match="divisible by 8"):
        pack(q, "gptq_v2")
