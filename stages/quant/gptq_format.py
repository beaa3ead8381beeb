"""Packing RTN codes into the Hugging Face GPTQ checkpoint layout ("gptq", i.e. AutoGPTQ v1).

For a Linear layer `<name>` with W (out, in), `bits` in {4, 8}, P = 32 // bits codes per int32 and
G groups along the input features, the checkpoint holds:

    <name>.qweight  int32   (in // P, out)   codes of W^T, P input features per word
    <name>.qzeros   int32   (G, out // P)    zero points minus one, P output channels per word
    <name>.scales   float16 (G, out)
    <name>.g_idx    int32   (in,)            group of each input feature: k // group_size
    <name>.bias     (optional, unchanged, float)

Bit order (little-endian within a word, the first element in the lowest bits):

    qweight[r, o] = sum_j  q[o, r * P + j]        << (bits * j),   j = 0 .. P-1
    qzeros[g, c]  = sum_j (z[c * P + j, g] - 1)   << (bits * j)

The words are the unsigned 32-bit patterns reinterpreted as int32 (two's complement), as AutoGPTQ
writes them with numpy uint32 -> int32. The "- 1" on the zero point is the classic
checkpoint_format="gptq" convention (AutoGPTQ <= 0.7 stores `zeros -= 1` before packing and its
kernels add the 1 back); GPTQModel calls the unshifted layout "gptq_v2" and converts on load.
A reader therefore recovers z = ((word >> (bits * j)) & (2**bits - 1)) + 1, and the weight

    W[o, k] = scales[g_idx[k], o] * (q[o, k] - z[o, g_idx[k]])

`stages.quant.rtn` keeps z in [1, 2**bits - 1] so that z - 1 is never negative: kernels that add
the 1 back without masking would read a stored -1 as 2**bits.
desc_act is false: g_idx is monotonic and no column permutation is stored.
"""

from __future__ import annotations

import torch

from stages.quant.rtn import SUPPORTED_BITS, QuantizedWeight

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
_WORD = 32


def _per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported by the GPTQ packer; choose one of {SUPPORTED_BITS}")
    return _WORD // bits


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack (n, m) codes along dim 0: (n // P, m) words, row r holding values[r*P : (r+1)*P]."""
    per = _per_word(bits)
    n, m = values.shape
    v = values.to(torch.int64).reshape(n // per, per, m)  # (words, P, m)
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    return _to_int32((v << shifts).sum(dim=1))  # disjoint bit fields: the sum is a bitwise or


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_rows`: (w, m) int32 words -> (w * P, m) int32 codes."""
    per = _per_word(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF  # undo the sign of the int32 view
    shifts = (torch.arange(per, dtype=torch.int64) * bits).view(1, per, 1)
    codes = (w.unsqueeze(1) >> shifts) & (2**bits - 1)  # (w, P, m)
    return codes.reshape(-1, words.shape[1]).to(torch.int32)


def _unpack_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """(G, out // P) qzeros -> (out, G) zero points z = stored + 1.

    Zero points are packed along the output channels, so unpack the transpose. The + 1 wraps
    modulo 2**bits like AutoGPTQ's torch fallback; `pack` never writes the word that would wrap.
    """
    stored = _unpack_rows(qzeros.t().contiguous(), bits)  # (out, G)
    return torch.remainder(stored + 1, 2**bits).to(torch.int32)


def pack(q: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one layer (keys are the suffixes without `<name>.`)."""
    per = _per_word(q.bits)
    out_f, in_f = q.codes.shape
    if in_f % per or out_f % per:
        raise ValueError(
            f"a {q.bits}-bit GPTQ layer needs in_features and out_features divisible by {per}; "
            f"got weight shape ({out_f}, {in_f})"
        )
    zeros_minus_one = q.zeros - 1  # (out, G), >= 0 by rtn's contract
    if (zeros_minus_one < 0).any():
        raise ValueError("zero point 0 cannot be stored in the classic GPTQ layout (it stores z - 1)")
    g_idx = torch.arange(in_f, dtype=torch.int32) // q.columns_per_group
    return {
        "qweight": _pack_rows(q.codes.t(), q.bits),  # (in // P, out)
        "qzeros": _pack_rows(zeros_minus_one, q.bits).t().contiguous(),  # (G, out // P)
        "scales": q.scales.t().to(torch.float16).contiguous(),  # (G, out)
        "g_idx": g_idx,
    }


def unpack(tensors: dict[str, torch.Tensor], bits: int) -> QuantizedWeight:
    """Codes, scales and zero points of one layer from its GPTQ tensors (g_idx must be k // group)."""
    codes = _unpack_rows(tensors["qweight"], bits).t().contiguous()  # (out, in)
    scales = tensors["scales"]  # (G, out)
    n_groups = scales.shape[0]
    zeros = _unpack_zeros(tensors["qzeros"], bits)  # (out, G)
    in_f = codes.shape[1]
    group_size = -1 if n_groups == 1 else in_f // n_groups
    expected = torch.arange(in_f, dtype=torch.int32) // (in_f // n_groups)
    if not torch.equal(tensors["g_idx"].to(torch.int32), expected):
        raise ValueError("g_idx is not k // group_size (desc_act checkpoint); use dequantize_packed")
    return QuantizedWeight(codes=codes, scales=scales.t().float().contiguous(),
                           zeros=zeros, bits=bits, group_size=group_size)


def dequantize_packed(
    tensors: dict[str, torch.Tensor], bits: int, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W (out, in) from GPTQ tensors, honouring any g_idx: W[o, k] = s[g_k, o] * (q[k, o] - z[g_k, o])."""
    codes = _unpack_rows(tensors["qweight"], bits).float()  # (in, out)
    scales = tensors["scales"].float()  # (G, out)
    zeros = _unpack_zeros(tensors["qzeros"], bits).t().float()  # (G, out)
    g = tensors["g_idx"].long()  # (in,)
    w_t = scales[g] * (codes - zeros[g])  # (in, out)
    return w_t.t().contiguous().to(dtype)
