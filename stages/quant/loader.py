"""Loading a GPTQ-layout checkpoint as a plain float `transformers` model, on CPU, with no GPTQ
runtime: every `<name>.qweight/qzeros/scales/g_idx` group is dequantized back to `<name>.weight`
(transposed back to (in, out) where `<name>` is a Conv1D, as in GPT-2).

The float tensors are then loaded by transformers itself (`from_pretrained(None, config=...,
state_dict=...)`), so its checkpoint-name conversions (e.g. GPT-NeoX's `embed_out` -> `lm_head`)
and weight tying apply exactly as for an unquantized directory.

Any `g_idx` is honoured (GPTQ's act-order, a narrower last group), codes of 2, 3, 4 or 8 bits, and
both checkpoint formats, "gptq" (zero points stored minus one) and "gptq_v2" (stored as is), read
from quantization_config's `format`, else `checkpoint_format` (`gptq_format.format_of`,
`gptq_format.dequantize_packed`).

This is how the project evaluates its own quantized artifacts: the numbers equal what a GPTQ
kernel computes up to float accumulation order, since the weights are exactly s * (q - z).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import transformers

from stages.checkpoint.hf import load_state_dict
from stages.errors import InputError
from stages.quant.gptq_format import QUANT_SUFFIXES, dequantize_packed, format_of
from stages.quant.layers import linear_layers, meta_model

log = logging.getLogger(__name__)


def read_quantization_config(model_dir: str | Path) -> tuple[dict, dict]:
    """(config.json without quantization_config, quantization_config); raises ValueError naming the
    file if it is missing, not GPTQ, or declares a checkpoint format other than "gptq" / "gptq_v2"."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; expected a quantized Hugging Face checkpoint directory")
    config = json.loads(path.read_text())
    qcfg = config.pop("quantization_config", None)
    if qcfg is None or qcfg.get("quant_method") != "gptq":
        raise InputError(f"{path} has no quantization_config with quant_method 'gptq'; "
                         "load an unquantized directory with AutoModelForCausalLM.from_pretrained")
    try:
        format_of(qcfg)
    except ValueError as e:
        raise InputError(f"{path}: quantization_config {e}") from None
    return config, qcfg


def dequantize_state_dict(state: dict[str, torch.Tensor], bits: int, checkpoint_format: str,
                          transposed: dict[str, bool] | None = None) -> dict[str, torch.Tensor]:
    """Turn each `<name>.qweight` group (zero points stored as `checkpoint_format` says) into a
    float32 `<name>.weight`, (out, in), or (in, out) when `transposed[name]` is True (a Conv1D);
    every other tensor becomes float32."""
    transposed = transposed or {}
    prefixes = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    packed_keys = {f"{p}.{s}" for p in prefixes for s in QUANT_SUFFIXES}
    out = {k: v.float() for k, v in state.items() if k not in packed_keys}
    for p in prefixes:
        w = dequantize_packed({s: state[f"{p}.{s}"] for s in QUANT_SUFFIXES}, bits, checkpoint_format)  # (out, in)
        out[f"{p}.weight"] = w.t().contiguous() if transposed.get(p, False) else w
    return out


def load_quantized(model_dir: str | Path) -> transformers.PreTrainedModel:
    """A float32 `transformers` causal LM (e.g. LlamaForCausalLM, GPT2LMHeadModel) with dequantized
    weights, in eval mode. Built from config.json with its quantization_config removed; weights read
    with safetensors only, after the checks of `stages.checkpoint.weights` (meta.json's sha256,
    whole files; `WeightsError` naming the file otherwise). ValueError when the tensors do not fill
    the model exactly."""
    model_dir = Path(model_dir)
    config_dict, qcfg = read_quantization_config(model_dir)
    config_dict.pop("torch_dtype", None)
    config_dict.pop("dtype", None)
    config = transformers.AutoConfig.for_model(**config_dict)
    packed = load_state_dict(model_dir)  # checked before transformers sees a tensor
    n_layers = sum(k.endswith(".qweight") for k in packed)
    state = dequantize_state_dict(packed, int(qcfg["bits"]), format_of(qcfg), linear_layers(meta_model(config)))
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32,
                                              output_loading_info=True)
    problems = {k: sorted(v)[:5] for k, v in info.items()
                if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"{model_dir}: dequantized weights do not match config.json: {problems}")
    log.info("loaded %s with %d dequantized layers (%d bits)", model_dir, n_layers, qcfg["bits"])
    return model.eval()
