"""stages/quant/rtn.py: the RTN grid, its error bound, and bad group sizes."""

import pytest
import torch

from stages.quant.rtn import check_group_size, dequantize_weight, quantize_weight, relative_error


def _weight(out_f: int = 32, in_f: int = 64, seed: int = 0) -> torch.Tensor:
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[0] = w[0].abs()  # all >= 0: the z = 0 case that the GPTQ layout cannot store
    w[1] = -w[1].abs()  # all <= 0
    w[2] = 0.0  # no range at all
    return w


@pytest.mark.parametrize("bits,group_size", [(8, -1), (4, -1), (4, 16), (8, 32)])
def test_error_is_at_most_half_a_step(bits, group_size):
    w = _weight()
    q = quantize_weight(w, bits, group_size)
    maxq = 2**bits - 1
    assert q.codes.min() >= 0 and q.codes.max() <= maxq
    assert q.zeros.min() >= 1 and q.zeros.max() <= maxq  # storable as z - 1
    torch.testing.assert_close(q.scales, q.scales.half().float(), rtol=0, atol=0)  # fp16-exact
    step = q.scales.repeat_interleave(q.columns_per_group, dim=1)  # (out, in)
    err = (w - dequantize_weight(q)).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all()
    assert err[2].max() == 0  # zeros stay exactly zero


def test_group_wise_int4_beats_per_channel_int4():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    per_channel = relative_error(w, dequantize_weight(quantize_weight(w, 4, -1)))
    grouped = relative_error(w, dequantize_weight(quantize_weight(w, 4, 32)))
    int8 = relative_error(w, dequantize_weight(quantize_weight(w, 8, -1)))
    assert grouped < 0.85 * per_channel
    assert int8 < 0.1 * grouped


def test_bad_group_size_names_the_config_key():
    with pytest.raises(ValueError, match=r"quantize\.group_size=48 does not divide in_features=64 of mlp"):
        quantize_weight(torch.randn(8, 64), 4, 48, name="mlp")
    with pytest.raises(ValueError, match="quantize.group_size=0"):
        check_group_size(64, 0)
    assert check_group_size(64, -1) == 1 and check_group_size(64, 16) == 4


def test_unsupported_bits_and_non_finite_weights():
    with pytest.raises(ValueError, match="bits=3"):
        quantize_weight(torch.randn(8, 8), 3)
    w = torch.randn(8, 8)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_weight(w, 8, name="x")


@pytest.mark.parametrize("bits,group_size", [(4, 16), (8, -1)])
def test_symmetric_grid_keeps_the_half_step_bound(bits, group_size):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    q = quantize_weight(w, bits, group_size, sym=True)
    assert (q.zeros == 2 ** (bits - 1)).all()
    assert (q.scales.to(torch.float16).float() == q.scales).all()  # float16-exact
    cols = q.columns_per_group
    bound = q.scales.repeat_interleave(cols, dim=1) / 2
    assert ((w - dequantize_weight(q)).abs() <= bound * (1 + 1e-6)).all()
    # symmetric spends one code on a value no weight reaches: never better than asymmetric
    asym = quantize_weight(w, bits, group_size)
    assert relative_error(w, dequantize_weight(asym)) <= relative_error(w, dequantize_weight(q)) * 1.05
