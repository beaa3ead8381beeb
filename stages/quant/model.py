"""Quantizing a checkpoint's decoder Linears into GPTQ tensors, and the matching quantization_config.

Which layers: `stages.quant.layers.decoder_linear_layers` (every Linear / Conv1D of the decoder
blocks, found on the model built from config.json). Everything else (embeddings, norms, lm_head,
every bias) passes through unchanged in floating point: GPTQ runtimes keep those unquantized too,
and the embedding / lm_head are the layers most sensitive to rounding.

The GPTQ layout wants W as (out, in). A Conv1D weight is stored as W^T (in, out), so it is
transposed before quantizing, as GPTQModel and AutoGPTQ do when they pack GPT-2 (their QuantLinear
then has in_features = weight.shape[0]); `stages.quant.loader` transposes back.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from stages.quant import gptq_format
from stages.quant.gptq_config import GPTQConfig, GPTQResult
from stages.quant.rtn import QuantizedWeight, dequantize_weight, quantize_weight, relative_error
from stages.stage_logs import progress_iter

log = logging.getLogger(__name__)


def quantization_config(bits: int, group_size: int, gptq: GPTQConfig | None = None, *,
                        sym: bool | None = None, desc_act: bool | None = None) -> dict[str, Any]:
    """The `quantization_config` entry of config.json for weights in the GPTQ layout: RTN's without
    `gptq` (asymmetric unless `sym`; `desc_act` False unless given), else the GPTQ options that were
    really applied (`sym` / `desc_act`, if given, must agree with `gptq`'s).

    The checkpoint format follows the grid (`gptq_format.checkpoint_format_for`): symmetric "gptq",
    asymmetric "gptq_v2" (zero points stored unshifted), written under both `format` (GPTQModel's
    key) and `checkpoint_format` (the alias older readers and transformers read), as transformers'
    own GPTQConfig.to_dict does. The packer must be given the same format: `config["format"]`.

    For RTN, damp_percent is left out: no Hessian (and so no dampening) is used. No
    `modules_in_block_to_quantize` either: every Linear / Conv1D of the blocks is quantized, which
    is what runtimes assume without it. No `meta` (quantizer, version): neither AutoGPTQ nor
    GPTQModel wrote these files, and GPTQModel reads a gptqmodel>=0.9.0 claim there as leave to
    load asymmetric "gptq" files.
    """
    if gptq is not None:
        for key, given in (("sym", sym), ("desc_act", desc_act)):
            if given is not None and given != getattr(gptq, key):
                raise ValueError(f"quantization_config: {key}={given} contradicts the GPTQ config's "
                                 f"{key}={getattr(gptq, key)}")
        fmt = gptq_format.checkpoint_format_for(gptq.sym)
        return {
            "quant_method": "gptq",
            "bits": gptq.bits,
            "group_size": gptq.group_size,
            "desc_act": gptq.desc_act,
            "sym": gptq.sym,
            "static_groups": gptq.static_groups,
            "damp_percent": gptq.damp_percent,
            "true_sequential": gptq.true_sequential,
            "format": fmt,
            "checkpoint_format": fmt,
        }
    sym = bool(sym)
    fmt = gptq_format.checkpoint_format_for(sym)
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size,
        "desc_act": bool(desc_act),
        "sym": sym,
        "format": fmt,
        "checkpoint_format": fmt,
        "true_sequential": True,
    }


def layer_weights(state: dict[str, torch.Tensor], layers: dict[str, bool]) -> dict[str, torch.Tensor]:
    """{layer name: W (out, in)} for each of `layers` ({name: stored transposed}), read from the
    checkpoint tensors `state` (Conv1D weights transposed to (out, in)). ValueError naming the
    first layer whose `<name>.weight` the checkpoint lacks."""
    missing = [f"{name}.weight" for name in layers if f"{name}.weight" not in state]
    if missing:
        raise ValueError(f"the checkpoint has no tensor {missing[0]} ({len(missing)} of {len(layers)} decoder "
                         "Linear weights missing); its tensor names do not follow the module names of the "
                         "model built from its config.json, so it cannot be quantized here")
    return {name: state[f"{name}.weight"].t() if transposed else state[f"{name}.weight"]
            for name, transposed in layers.items()}


def check_shapes(weights: dict[str, torch.Tensor], bits: int, group_size: int, ragged_groups: bool = False) -> None:
    """Raise one ValueError naming the layer widths that `group_size` does not divide (unless
    `ragged_groups`: GPTQ's narrower last group), or the layer whose width the packer cannot store
    (a multiple of `gptq_format.codes_per_run(bits)` is needed in and out)."""
    in_widths: dict[int, str] = {}
    for name, w in weights.items():
        in_widths.setdefault(w.shape[1], name)
    narrow = sorted(width for width in in_widths if group_size > width)
    if narrow and ragged_groups:  # without ragged groups the divisibility check below says more
        raise ValueError(
            f"group_size={group_size} exceeds the input width of {in_widths[narrow[0]]} ({narrow[0]} features; all "
            f"widths: {sorted(in_widths)}); a group cannot be wider than its row: choose at most {narrow[0]} "
            "or -1 (per channel)")
    if group_size != -1 and not ragged_groups:
        bad = sorted(width for width in in_widths if group_size <= 0 or width % group_size)
        if bad:
            examples = ", ".join(f"{in_widths[width]} has {width}" for width in bad)
            raise ValueError(
                f"quantize.group_size={group_size} does not divide the input width(s) {bad} of the decoder "
                f"Linears ({examples}; all widths: {sorted(in_widths)}); choose a divisor of "
                f"{math.gcd(*in_widths)} or -1 for per channel"
            )
    per_word = gptq_format.codes_per_run(bits)
    for name, w in weights.items():
        out_f, in_f = w.shape
        if out_f % per_word or in_f % per_word:
            raise ValueError(f"{name}: weight (out={out_f}, in={in_f}) cannot be packed at {bits} bits: the "
                             f"GPTQ layout needs both widths divisible by {per_word}")


# RTN's grid is asymmetric (stages.quant.rtn), so its files are "gptq_v2"
RTN_CHECKPOINT_FORMAT = gptq_format.checkpoint_format_for(sym=False)


def quantize_model(
    state: dict[str, torch.Tensor], layers: dict[str, bool], bits: int, group_size: int,
    checkpoint_format: str = RTN_CHECKPOINT_FORMAT, sym: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Replace the weight of each of `layers` ({name: stored transposed}) by RTN's (asymmetric grid
    unless `sym`)
    `<name>.{qweight,qzeros,scales,g_idx}` (zero points stored as `checkpoint_format` says; RTN keeps
    z >= 1, so either format holds them); every other tensor of `state` passes through unchanged.

    Returns the new state dict and, per quantized layer, the relative reconstruction error
    ||W - W_hat||_F / ||W||_F of the weight as stored (float16 scales included). Raises ValueError
    before quantizing anything if a layer is missing, group_size does not divide a layer's input
    width, or a width cannot be packed.
    """
    if not layers:
        raise ValueError("no decoder Linear layers were given to quantize")
    weights = layer_weights(state, layers)
    check_shapes(weights, bits, group_size)
    codes: dict[str, QuantizedWeight] = {}
    errors: dict[str, float] = {}
    for name, w in progress_iter(weights.items(), log, f"RTN {bits}-bit layers"):
        codes[name] = quantize_weight(w, bits, group_size, name=name, sym=sym)
        errors[name] = relative_error(w, dequantize_weight(codes[name]))
    log.info("quantized %d layers to %d bits (group_size=%d)", len(errors), bits, group_size)
    return pack_codes(state, layers, codes, checkpoint_format), errors


def pack_codes(
    state: dict[str, torch.Tensor], layers: dict[str, bool], codes: dict[str, QuantizedWeight | GPTQResult],
    checkpoint_format: str, changed: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`state` with the weight of each of `layers` replaced by its packed `codes` (RTN's or AWQ's
    QuantizedWeight, or a GPTQResult with its g_idx: act-order and a narrower last group kept as
    they are) and the float tensors in `changed` (the norms and biases AWQ folded its scales into)
    replacing theirs; zero points stored as `checkpoint_format` says."""
    missing = sorted(set(layers) - set(codes))
    if missing:
        raise ValueError(f"no codes for {missing[0]} ({len(missing)} of {len(layers)} decoder Linears); the "
                         "model's blocks do not hold the checkpoint's layers")
    changed = changed or {}
    unknown = sorted(set(changed) - set(state))
    if unknown:
        raise ValueError(f"{unknown[0]} is not a tensor of the checkpoint")
    replaced = {f"{name}.weight" for name in layers}
    out = {k: changed.get(k, v) for k, v in state.items() if k not in replaced}
    for name in layers:
        q = codes[name]
        for suffix, packed in gptq_format.pack(q, checkpoint_format, g_idx=getattr(q, "g_idx", None)).items():
            out[f"{name}.{suffix}"] = packed
    return out


def pack_gptq_model(
    state: dict[str, torch.Tensor], layers: dict[str, bool], results: dict[str, GPTQResult],
    checkpoint_format: str,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """`quantize_model` for GPTQ: replace the weight of each of `layers` by the packed `results`
    (same names; act-order g_idx and a narrower last group kept as they are; zero points stored as
    `checkpoint_format` says, the `format` of the matching `quantization_config`). `state` holds the
    float weights before GPTQ; the errors are ||W - W_hat||_F / ||W||_F against them."""
    packed = pack_codes(state, layers, results, checkpoint_format)
    errors = {name: relative_error(w, results[name].weight.cpu()) for name, w in layer_weights(state, layers).items()}
    return packed, errors
