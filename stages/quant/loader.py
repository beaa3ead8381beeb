"""Loading a GPTQ-layout checkpoint as a plain float `transformers` model, on CPU, with no GPTQ
runtime: every `<name>.qweight/qzeros/scales/g_idx` group is dequantized back to `<name>.weight`.

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
from stages.quant.gptq_format import QUANT_SUFFIXES, dequantize_packed

log = logging.getLogger(__name__)


def read_quantization_config(model_dir: str | Path) -> tuple[dict, dict]:
    """(config.json without quantization_config, quantization_config); raises if it is missing."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; expected a quantized Hugging Face checkpoint directory")
    config = json.loads(path.read_text())
    qcfg = config.pop("quantization_config", None)
    if qcfg is None or qcfg.get("quant_method") != "gptq":
        raise ValueError(f"{path} has no quantization_config with quant_method 'gptq'; "
                         "load an unquantized directory with AutoModelForCausalLM.from_pretrained")
    if qcfg.get("checkpoint_format", "gptq") != "gptq":
        raise ValueError(f"{path}: checkpoint_format={qcfg['checkpoint_format']!r} is not supported; "
                         "only the classic 'gptq' layout (zero points stored minus one) is read")
    return config, qcfg


def dequantize_state_dict(state: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """Turn each `<name>.qweight` group into a float32 `<name>.weight`; other tensors become float32."""
    prefixes = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    out = {k: v.float() for k, v in state.items()
           if not any(k == f"{p}.{s}" for p in prefixes for s in QUANT_SUFFIXES)}
    for p in prefixes:
        tensors = {s: state[f"{p}.{s}"] for s in QUANT_SUFFIXES}
        out[f"{p}.weight"] = dequantize_packed(tensors, bits)
    return out


def load_quantized(model_dir: str | Path) -> transformers.PreTrainedModel:
    """A float32 `transformers` causal LM (e.g. LlamaForCausalLM) with dequantized weights, in eval mode.

    Built from config.json with its quantization_config removed; weights read with safetensors only.
    """
    config_dict, qcfg = read_quantization_config(model_dir)
    config_dict["torch_dtype"] = "float32"
    config = transformers.AutoConfig.for_model(**config_dict)
    packed = load_state_dict(model_dir)
    n_layers = sum(k.endswith(".qweight") for k in packed)
    state = dequantize_state_dict(packed, int(qcfg["bits"]))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding, which tie_weights restores
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: dequantized weights do not match config.json: "
                         f"missing={missing[:5]} unexpected={unexpected[:5]}")
    model.tie_weights()
    log.info("loaded %s with %d dequantized layers (%d bits)", model_dir, n_layers, qcfg["bits"])
    return model.eval()
