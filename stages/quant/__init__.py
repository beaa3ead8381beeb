"""Weight quantization: RTN and GPTQ (with its calibration sets), packing to the Hugging Face GPTQ
layout, and loading it back onto low-bit CPU kernels (or dequantized, the float reference).

The names below load their module (and torch) on first use, so the torch-free `stages.quant.variants`
is imported while Snakemake parses the workflow without torch."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "Int4WeightOnlyLinear": "weight_only", "Int8WeightOnlyLinear": "weight_only",
    "apply_weight_only_kernels": "weight_only", "kernel_module": "weight_only",
    "decoder_linear_layers": "layers", "load_quantized": "loader",
    "quantization_config": "model", "quantize_model": "model",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'stages.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stages.quant.{_HOMES[name]}"), name)
