"""Draft (not wired in): the classic GPTQ layout of `stages.quant.gptq_format` for GPTQ results, with
what that packer lacks: 2- and 3-bit codes, a stored g_idx (act-order), and a narrower last group.

The tensors and the "- 1" zero-point convention are `gptq_format`'s; only the packing of codes into
words is generalised. AutoGPTQ / GPTQModel lay codes out as one little-endian bit stream per column
of words: code t of a run sits at bit offset bits * t, so a run of 32 // gcd(32, bits) codes fills
bits // gcd(32, bits) whole words. For 2, 4 and 8 bits this is `gptq_format`'s P = 32 // bits
codes per word; for 3 bits 32 codes fill 3 words and codes 10 and 21 straddle a word boundary:

    qweight  int32   (in * bits // 32, out)     needs in  % 32 == 0 at 3 bits, % (32 // bits) else
    qzeros   int32   (G, out * bits // 32)      zero points minus one, same rule on out
    scales   float16 (G, out)                   G = ceil(in / group_size)
    g_idx    int32   (in,)                      result.g_idx as is: k // group_size, or act-order's

`gptq_format.dequantize_packed` already honours any g_idx and any G at 4 and 8 bits; at 2 and 3
bits `dequantize_packed` here reads the words. Merging this into `gptq_format` means replacing
its `_pack_rows` / `_unpack_rows` by `pack_bits` / `unpack_bits`, `SUPPORTED_BITS` by (2, 3, 4, 8),
taking g_idx from the caller in `pack`, and deriving `unpack`'s group size with ceil.
"""

from __future__ import annotations

import math

import torch

from stages.quant.gptq import GPTQResult

_WORD = 32


def _run(bits: int) -> tuple[int, int]:
    """(codes, words) of the shortest run of codes that fills whole words."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits={bits} is not supported by the GPTQ layout; choose one of (2, 3, 4, 8)")
    g = math.gcd(_WORD, bits)
    return _WORD // g, bits // g


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack (n, m) codes along dim 0 into (n * bits // 32, m) int32 words (little-endian bit stream)."""
    codes, words = _run(bits)
    n, m = values.shape
    if n % codes:
        raise ValueError(f"{n} codes cannot be packed at {bits} bits: a multiple of {codes} is needed")
    v = values.to(torch.int64).reshape(n // codes, codes, m)  # (runs, codes, m)
    out = torch.zeros(n // codes, words, m, dtype=torch.int64)
    for t in range(codes):
        word, shift = divmod(bits * t, _WORD)
        out[:, word] |= (v[:, t] << shift) & 0xFFFFFFFF
        if shift + bits > _WORD:  # straddles: the high bits start the next word
            out[:, word + 1] |= v[:, t] >> (_WORD - shift)
    return _to_int32(out.reshape(-1, m))


def unpack_bits(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: (w, m) int32 words -> (w * 32 // bits, m) int32 codes."""
    codes, per_run = _run(bits)
    w, m = words.shape
    u = (words.to(torch.int64) & 0xFFFFFFFF).reshape(w // per_run, per_run, m)  # (runs, words, m)
    out = torch.zeros(w // per_run, codes, m, dtype=torch.int64)
    mask = 2**bits - 1
    for t in range(codes):
        word, shift = divmod(bits * t, _WORD)
        value = u[:, word] >> shift
        if shift + bits > _WORD:
            value = value | (u[:, word + 1] << (_WORD - shift))
        out[:, t] = value & mask
    return out.reshape(-1, m).to(torch.int32)


def pack_gptq(result: GPTQResult) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one layer (keys are the suffixes without `<name>.`)."""
    zeros_minus_one = result.zeros - 1  # (out, G)
    if (zeros_minus_one < 0).any():
        raise ValueError("zero point 0 cannot be stored in the classic GPTQ layout (it stores z - 1)")
    return {
        "qweight": pack_bits(result.codes.t(), result.bits),  # (in * bits // 32, out)
        "qzeros": pack_bits(zeros_minus_one, result.bits).t().contiguous(),  # (G, out * bits // 32)
        "scales": result.scales.t().to(torch.float16).contiguous(),  # (G, out)
        "g_idx": result.g_idx.to(torch.int32),
    }


def dequantize_packed(tensors: dict[str, torch.Tensor], bits: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W (out, in) from GPTQ tensors at any supported width: W[o, k] = s[g_k, o] * (q[k, o] - z[g_k, o])."""
    codes = unpack_bits(tensors["qweight"], bits).float()  # (in, out)
    stored = unpack_bits(tensors["qzeros"].t().contiguous(), bits)  # (out, G)
    zeros = torch.remainder(stored + 1, 2**bits).t().float()  # (G, out), as gptq_format reads them
    scales = tensors["scales"].float()  # (G, out)
    g = tensors["g_idx"].long()
    return (scales[g] * (codes - zeros[g])).t().contiguous().to(dtype)
