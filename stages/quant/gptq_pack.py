"""GPTQ results in the classic GPTQ layout: `pack_gptq` stores a GPTQResult with its own g_idx
(act-order, a narrower last group) at 2, 3, 4 or 8 bits. The layout and the bit-stream packing are
`stages.quant.gptq_format`'s; this module only binds a GPTQResult to them (and keeps the names the
GPTQ tests import)."""

from __future__ import annotations

import torch

from stages.quant.gptq import GPTQResult
from stages.quant.gptq_format import dequantize_packed, pack, pack_bits, unpack_bits

__all__ = ["dequantize_packed", "pack_bits", "pack_gptq", "unpack_bits"]


def pack_gptq(result: GPTQResult) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one layer (keys are the suffixes without `<name>.`)."""
    return pack(result, g_idx=result.g_idx)
