"""Quantizing a whole decoder state dict into GPTQ tensors, and the matching quantization_config.

Quantized: every Linear of the decoder blocks, i.e. the weights named
`model.layers.<i>.self_attn.{q,k,v,o}_proj.weight` and `model.layers.<i>.mlp.{gate,up,down}_proj.weight`.
Kept in floating point: the token embedding, the RMSNorm weights, lm_head and every bias. These are
what GPTQ runtimes keep unquantized too (their QuantLinear replaces only the block Linears), and
the embedding / lm_head are the layers most sensitive to rounding.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch

from stages.quant import gptq_format
from stages.quant.rtn import dequantize_weight, quantize_weight, relative_error

log = logging.getLogger(__name__)

# HF parameter names of the decoder Linears (ours match HF's, see stages/model/llama.py).
QUANTIZED_WEIGHT = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)


def is_quantized_weight(name: str) -> bool:
    return QUANTIZED_WEIGHT.match(name) is not None


def quantization_config(bits: int, group_size: int) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for RTN weights in the classic GPTQ layout.

    damp_percent is left out: no Hessian (and so no dampening) is used by RTN.
    """
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq",
        "true_sequential": True,
    }


def _check_group_size(state: dict[str, torch.Tensor], group_size: int) -> None:
    """Raise one error listing every input width that `group_size` does not divide."""
    if group_size == -1:
        return
    widths = {t.shape[1] for n, t in state.items() if is_quantized_weight(n)}
    bad = sorted(w for w in widths if group_size <= 0 or w % group_size)
    if bad:
        gcd = math.gcd(*widths)
        raise ValueError(
            f"quantize.group_size={group_size} does not divide the input width(s) {bad} of the decoder "
            f"Linears (all widths: {sorted(widths)}); choose a divisor of {gcd} or -1 for per channel"
        )


def quantize_model(
    state: dict[str, torch.Tensor], bits: int, group_size: int,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Replace each decoder Linear `<name>.weight` by `<name>.{qweight,qzeros,scales,g_idx}`.

    Returns the new state dict (other tensors passed through unchanged) and, per quantized layer,
    the relative reconstruction error ||W - W_hat||_F / ||W||_F of the weight as stored (float16
    scales included). Raises ValueError if group_size does not divide a layer's input width or if
    no decoder Linear is found.
    """
    _check_group_size(state, group_size)
    out: dict[str, torch.Tensor] = {}
    errors: dict[str, float] = {}
    for name, tensor in state.items():
        if not is_quantized_weight(name):
            out[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        q = quantize_weight(tensor, bits, group_size, name=name)
        for suffix, packed in gptq_format.pack(q).items():
            out[f"{prefix}.{suffix}"] = packed
        errors[prefix] = relative_error(tensor, dequantize_weight(q))
    if not errors:
        raise ValueError("no decoder Linear weights (model.layers.<i>.self_attn/mlp ... .weight) were "
                         "found to quantize; is this a Llama/Qwen2 Hugging Face checkpoint?")
    log.info("quantized %d layers to %d bits (group_size=%d)", len(errors), bits, group_size)
    return out, errors
