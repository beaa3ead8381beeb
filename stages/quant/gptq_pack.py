"""GPTQ results in the GPTQ checkpoint layout: `pack_gptq` stores a GPTQResult with its own g_idx
(act-order, a narrower last group) at 2, 3, 4 or 8 bits. The layout, its two zero-point formats
("gptq", "gptq_v2") and the bit-stream packing are `stages.quant.gptq_format`'s; this module only
binds a GPTQResult to them (and keeps the names the GPTQ tests import)."""

from __future__ import annotations

import torch

from stages.quant.gptq_config import GPTQResult
from stages.quant.gptq_format import checkpoint_format_for, dequantize_packed, pack, pack_bits, unpack_bits

__all__ = ["dequantize_packed", "pack_bits", "pack_gptq", "unpack_bits"]


def pack_gptq(result: GPTQResult, checkpoint_format: str | None = None) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one layer (keys are the suffixes without `<name>.`), zero points
    stored as `checkpoint_format` says; None: the format of the result's grid
    (`checkpoint_format_for(result.sym)`: "gptq" when symmetric, "gptq_v2" otherwise)."""
    fmt = checkpoint_format_for(result.sym) if checkpoint_format is None else checkpoint_format
    return pack(result, fmt, g_idx=result.g_idx)
