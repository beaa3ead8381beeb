"""Packing quantized weights (RTN or GPTQ) into the Hugging Face GPTQ checkpoint layout, in either of
its two zero-point conventions: "gptq" (AutoGPTQ v1) and "gptq_v2" (GPTQModel's).

For a Linear layer `<name>` with W (out, in), `bits` in {2, 3, 4, 8} and G groups along the input
features, the checkpoint holds:

    <name>.qweight  int32   (in * bits // 32, out)   codes of W^T, a bit stream down each column
    <name>.qzeros   int32   (G, out * bits // 32)    zero points (see below), along the output channels
    <name>.scales   float16 (G, out)
    <name>.g_idx    int32   (in,)                    group of each input feature
    <name>.bias     (optional, unchanged, float)

Codes are one little-endian bit stream per column of words: code t of a run sits at bit offset
bits * t, the first element in the lowest bits. For 2, 4 and 8 bits that is P = 32 // bits codes per
word,

    qweight[r, o] = sum_j  q[o, r * P + j]          << (bits * j),   j = 0 .. P-1
    qzeros[g, c]  = sum_j (z[c * P + j, g] - off)   << (bits * j)

and for 3 bits 32 codes fill 3 words (codes 10 and 21 straddle a word boundary), as AutoGPTQ and
GPTQModel lay them out. Hence `in` and `out` must be multiples of `codes_per_run(bits)`: 16, 32, 8,
4 at 2, 3, 4, 8 bits.

The words are the unsigned 32-bit patterns reinterpreted as int32 (two's complement), as AutoGPTQ
writes them with numpy uint32 -> int32. The zero-point offset `off` is what the two checkpoint
formats (config.json's quantization_config `format`, alias `checkpoint_format`) differ in; every
other tensor is the same:

    "gptq"     off = 1: z - 1 is stored (AutoGPTQ <= 0.7 stores `zeros -= 1` before packing and its
               kernels add the 1 back), so z must lie in [1, 2**bits - 1]. Kernels that add the 1
               back without masking (GPTQModel's v1 -> v2 conversion) would read a stored -1 as
               2**bits, so z = 0 is refused.
    "gptq_v2"  off = 0: z is stored as is, z in [0, 2**bits - 1]. GPTQModel's internal layout.

The weight is in both

    W[o, k] = scales[g_idx[k], o] * (q[o, k] - z[o, g_idx[k]])

Which format a file gets (`checkpoint_format_for`): symmetric grids (z = 2**(bits - 1) everywhere)
"gptq", the classic layout every GPTQ runtime reads alike; asymmetric ones "gptq_v2", because
GPTQModel (7.x) refuses sym=False in "gptq" unless `meta.quantizer` claims gptqmodel >= 0.9.0 as the
producer, a claim these files must not make (docs/gptq_interop.md). `stages.quant.rtn` and
`stages.quant.gptq` keep z in [1, 2**bits - 1], so their codes can be stored in either format.

g_idx: RTN writes the monotonic k // group_size; GPTQ with desc_act (act-order) passes its own,
non-monotonic one, and a width not divisible by group_size has a narrower last group
(G = ceil(in / group_size)). No column permutation is stored: readers index by g_idx.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from stages.quant.rtn import QuantizedWeight

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
LAYOUT_BITS = (2, 3, 4, 8)  # code widths the layout (and `load_quantized`) can hold
ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint format -> what is subtracted from z when stored
CHECKPOINT_FORMATS = tuple(ZERO_OFFSET)
_WORD = 32


class Codes(Protocol):
    """What `pack` reads: rtn's QuantizedWeight and gptq's GPTQResult both have these."""

    codes: torch.Tensor  # (out, in) int32
    scales: torch.Tensor  # (out, G) float32, float16-exact
    zeros: torch.Tensor  # (out, G) int32 in [0, 2**bits - 1] ([1, ...] for "gptq")
    bits: int


def checkpoint_format_for(sym: bool) -> str:
    """The checkpoint format written for a symmetric (`sym`) or asymmetric grid: "gptq" or "gptq_v2"."""
    return "gptq" if sym else "gptq_v2"


def zero_offset(checkpoint_format: str) -> int:
    """1 for "gptq" (z - 1 stored), 0 for "gptq_v2"; ValueError naming the supported formats otherwise."""
    if checkpoint_format not in ZERO_OFFSET:
        raise ValueError(f"checkpoint format {checkpoint_format!r} is not supported; the GPTQ layout is read and "
                         f"written as one of {list(CHECKPOINT_FORMATS)}")
    return ZERO_OFFSET[checkpoint_format]


def format_of(quantization_config: dict) -> str:
    """The checkpoint format a `quantization_config` declares: `format` (GPTQModel's canonical key),
    else `checkpoint_format` (its deprecated alias, transformers' name), else "gptq" (transformers'
    default). ValueError for any value but "gptq" and "gptq_v2"."""
    fmt = quantization_config.get("format") or quantization_config.get("checkpoint_format") or "gptq"
    zero_offset(fmt)
    return fmt


def _run(bits: int) -> tuple[int, int]:
    """(codes, words) of the shortest run of codes that fills whole words."""
    if bits not in LAYOUT_BITS:
        raise ValueError(f"bits={bits} is not supported by the GPTQ layout; choose one of {LAYOUT_BITS}")
    g = math.gcd(_WORD, bits)
    return _WORD // g, bits // g


def codes_per_run(bits: int) -> int:
    """The multiple of which a packed dimension (in for qweight, out for qzeros) must be."""
    return _run(bits)[0]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
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
        out[:, word] |= (v[:, t] << shift) & 0xFFFFFFFF  # disjoint bit fields
        if shift + bits > _WORD:  # straddles: the high bits start the next word
            out[:, word + 1] |= v[:, t] >> (_WORD - shift)
    return _to_int32(out.reshape(-1, m))


def unpack_bits(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: (w, m) int32 words -> (w * 32 // bits, m) int32 codes."""
    codes, per_run = _run(bits)
    w, m = words.shape
    if w % per_run:
        raise ValueError(f"{w} words cannot hold whole runs of {bits}-bit codes ({per_run} words per run)")
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


def _unpack_zeros(qzeros: torch.Tensor, bits: int, checkpoint_format: str) -> torch.Tensor:
    """(G, out * bits // 32) qzeros -> (out, G) zero points z = stored + offset.

    Zero points are packed along the output channels, so unpack the transpose. For "gptq" at 2, 4
    and 8 bits the + 1 is added to each 32-bit word (0x11111111 at 4 bits), as GPTQModel converts v1
    to v2 on load: GPTQModel writes v1 by subtracting that word from v2's, so a zero point of 0 is
    stored as a borrow from its neighbour (gptqmodel/utils/model.py, convert_gptq_v2_to_v1_format_module),
    which only the word-wise addition undoes. Where nothing borrowed (every file `pack` writes, z >= 1)
    it equals adding 1 to each code. At 3 bits, whose codes straddle words, each code gets its + 1
    modulo 2**3 (AutoGPTQ's torch fallback).
    """
    offset = zero_offset(checkpoint_format)
    if offset and bits != 3:
        ones = pack_bits(torch.ones(_WORD // bits, 1, dtype=torch.int32), bits)[0, 0].item() & 0xFFFFFFFF
        words = ((qzeros.to(torch.int64) & 0xFFFFFFFF) + ones) & 0xFFFFFFFF
        return unpack_bits(words.t().contiguous(), bits).to(torch.int32)  # (out, G)
    stored = unpack_bits(qzeros.t().contiguous(), bits)  # (out, G)
    return torch.remainder(stored + offset, 2**bits).to(torch.int32)


def pack(q: Codes, checkpoint_format: str, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one layer (keys are the suffixes without `<name>.`), zero points
    stored as `checkpoint_format` says ("gptq": z - 1, "gptq_v2": z).

    `g_idx` (in,): the group of each input feature, e.g. a GPTQResult's (act-order, narrower last
    group); default k // q.columns_per_group (a QuantizedWeight's monotonic groups)."""
    offset = zero_offset(checkpoint_format)
    per = codes_per_run(q.bits)
    out_f, in_f = q.codes.shape
    if in_f % per or out_f % per:
        raise ValueError(
            f"a {q.bits}-bit GPTQ layer needs in_features and out_features divisible by {per}; "
            f"got weight shape ({out_f}, {in_f})"
        )
    n_groups = q.scales.shape[1]
    if g_idx is None:
        g_idx = torch.arange(in_f, dtype=torch.int32) // q.columns_per_group
    g_idx = g_idx.to(torch.int32).cpu()
    if g_idx.shape != (in_f,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups:
        raise ValueError(f"g_idx of shape {tuple(g_idx.shape)} must give each of the {in_f} input features "
                         f"a group in [0, {n_groups})")
    stored = q.zeros - offset  # (out, G)
    if int(stored.min()) < 0 or int(stored.max()) > 2**q.bits - 1:
        raise ValueError(f"zero points must lie in [{offset}, {2**q.bits - 1}] to be stored in the "
                         f"{checkpoint_format!r} format (it stores z - {offset}); got "
                         f"[{int(q.zeros.min())}, {int(q.zeros.max())}]")
    return {
        "qweight": pack_bits(q.codes.t().cpu(), q.bits),  # (in * bits // 32, out)
        "qzeros": pack_bits(stored.cpu(), q.bits).t().contiguous(),  # (G, out * bits // 32)
        "scales": q.scales.t().to(torch.float16).cpu().contiguous(),  # (G, out)
        "g_idx": g_idx,
    }


def unpack(tensors: dict[str, torch.Tensor], bits: int, checkpoint_format: str) -> QuantizedWeight:
    """Codes, scales and zero points of one layer from its GPTQ tensors in `checkpoint_format`
    (g_idx must be k // group, with equal groups: an RTN checkpoint)."""
    codes = unpack_bits(tensors["qweight"], bits).t().contiguous()  # (out, in)
    scales = tensors["scales"]  # (G, out)
    n_groups = scales.shape[0]
    zeros = _unpack_zeros(tensors["qzeros"], bits, checkpoint_format)  # (out, G)
    in_f = codes.shape[1]
    group_size = -1 if n_groups == 1 else in_f // n_groups
    expected = torch.arange(in_f, dtype=torch.int32) // (in_f // n_groups)
    if in_f % n_groups or not torch.equal(tensors["g_idx"].to(torch.int32), expected):
        raise ValueError("g_idx is not k // group_size with equal groups (a desc_act or narrower-last-group "
                         "checkpoint); use dequantize_packed")
    return QuantizedWeight(codes=codes, scales=scales.t().float().contiguous(),
                           zeros=zeros, bits=bits, group_size=group_size)


def dequantize_packed(
    tensors: dict[str, torch.Tensor], bits: int, checkpoint_format: str, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W (out, in) from GPTQ tensors in `checkpoint_format`, honouring any g_idx:
    W[o, k] = s[g_k, o] * (q[k, o] - z[g_k, o])."""
    codes = unpack_bits(tensors["qweight"], bits).float()  # (in, out)
    scales = tensors["scales"].float()  # (G, out)
    zeros = _unpack_zeros(tensors["qzeros"], bits, checkpoint_format).t().float()  # (G, out)
    g = tensors["g_idx"].long()  # (in,)
    w_t = scales[g] * (codes - zeros[g])  # (in, out)
    return w_t.t().contiguous().to(dtype)
