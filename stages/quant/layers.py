"""Which layers of a causal LM are quantized: found by module type on the model built from its
config on the meta device (no weights), so every architecture transformers knows is covered without
a per-family table of names.

Quantized: every `nn.Linear` and every `transformers.pytorch_utils.Conv1D` (GPT-2's linear, whose
weight is stored transposed, (in, out)) inside the decoder blocks, a mixture of experts' routed
experts included. Kept in floating point: the embeddings, norms, lm_head, biases and the routers of
a mixture of experts. This is the set GPTQ runtimes replace when they load a GPTQ
checkpoint with no `modules_in_block_to_quantize` (optimum / transformers take every Linear and
Conv1D of the block list), and the set peft's `target_modules="all-linear"` wraps.

The decoder blocks are the entries of the one `nn.ModuleList` holding `num_hidden_layers` modules
(`model.layers`, `transformer.h`, `model.decoder.layers`, `gpt_neox.layers`, ...); when several
lists have that length, the one whose entries are the model's `_no_split_modules` class is taken.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import transformers
from transformers.pytorch_utils import Conv1D

from stages.model.registry import BY_MODEL_TYPE

LINEAR_TYPES = (torch.nn.Linear, Conv1D)
KEEP_FLOAT = "keep_float"  # a Linear with this attribute true is not quantized (`quantizable`)


def linear_weight(module: torch.nn.Module) -> torch.Tensor:
    """W (out, in) of a Linear, or of a Conv1D (which stores W^T, (in, out))."""
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


def meta_model(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    """The causal LM of `config` with every tensor on the meta device: module structure, no memory."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def quantizable(module: torch.nn.Module) -> bool:
    """A Linear / Conv1D that quantization takes: not one marked `keep_float` (a mixture of experts'
    routers, `stages.model.moe`: GPTQModel, llm-compressor and vLLM leave them in floating point)."""
    return isinstance(module, LINEAR_TYPES) and not getattr(module, KEEP_FLOAT, False)


def linear_layers(module: torch.nn.Module, prefix: str = "") -> dict[str, bool]:
    """{name: weight stored transposed} for every quantizable Linear / Conv1D under `module`, names
    prefixed with `prefix.`. The value is True for Conv1D, whose weight is (in, out) rather than (out, in)."""
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{name}": isinstance(m, Conv1D) for name, m in module.named_modules()
            if name and quantizable(m)}


def checkpoint_model(config: Mapping[str, Any] | transformers.PretrainedConfig) -> torch.nn.Module:
    """The meta-device model whose module names are a checkpoint's tensor names: transformers' model
    of `config`, except for a mixture of experts of ours (Mixtral, Qwen-MoE, OLMoE), whose experts
    transformers 5 fuses into 3-D parameters while checkpoints (and our model) keep one Linear per
    expert and projection: our model then."""
    d = config if isinstance(config, Mapping) else config.to_dict()
    model_type = d.get("model_type")
    if model_type in BY_MODEL_TYPE and BY_MODEL_TYPE[model_type].moe:
        from stages.model import LlamaConfig, build_model  # torch: here only for MoE checkpoints

        return build_model(LlamaConfig.from_hf_dict(dict(d)), device="meta")
    if isinstance(config, Mapping):
        config = transformers.AutoConfig.for_model(**{k: v for k, v in d.items() if k not in ("torch_dtype", "dtype")})
    return meta_model(config)


def decoder_blocks(model: torch.nn.Module) -> str:
    """The dotted name of the `nn.ModuleList` of decoder blocks (our model's `ModuleDict`
    `model.layers`); ValueError when it is not unique."""
    if isinstance(getattr(getattr(model, "model", None), "layers", None), torch.nn.ModuleDict):
        return "model.layers"  # our LlamaForCausalLM (stages.model.llama)
    config = getattr(model, "config", None)
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None) if config is not None else None
    candidates = {name: m for name, m in model.named_modules()
                  if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and (n_layers is None or len(m) == n_layers)}
    lists = candidates
    if len(lists) > 1:
        block_classes = set(getattr(model, "_no_split_modules", None) or ())
        lists = {name: m for name, m in lists.items() if {type(b).__name__ for b in m} <= block_classes}
    if len(lists) != 1:
        raise ValueError(
            f"{type(model).__name__}: cannot tell the decoder blocks apart: ModuleLists of "
            f"num_hidden_layers={n_layers} entries: {sorted(candidates) or 'none'}, of which "
            f"{len(lists)} hold the model's _no_split_modules; this architecture is not supported "
            "by stages.quant"
        )
    return next(iter(lists))


def decoder_linear_layers(model: torch.nn.Module) -> dict[str, bool]:
    """{name: weight stored transposed} for the Linear / Conv1D layers of the decoder blocks,
    e.g. {"transformer.h.0.attn.c_attn": True, ...} for GPT-2; ValueError when there is none."""
    blocks = decoder_blocks(model)
    layers = linear_layers(model.get_submodule(blocks), prefix=blocks)
    if not layers:
        raise ValueError(f"{type(model).__name__}: the decoder blocks {blocks} hold no Linear or "
                         "Conv1D layer to quantize")
    return layers
