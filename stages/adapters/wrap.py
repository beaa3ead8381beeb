"""Attach the adapter a finetune method asks for to a base model, and count what trains.

Our model (the Llama family: Llama, Qwen2, Mistral, Qwen3, GLM, GLM-4, and the mixtures of experts)
gets our own LoRA layers and prefix keys/values (`lora_linear`, `prefix_kv`), which tensor parallelism
can split, and a mixture's routed experts LoRA of their own where `target_parameters` asks
(`expert_lora`); every other family gets peft's, on transformers' model (data parallel and ZeRO only).
All save in peft's format.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import peft
import torch

from stages.adapters import ADAPTER_METHODS
from stages.adapters.expert_lora import add_expert_lora
from stages.adapters.lora import build_lora_config, check_target_modules, targets_conv1d
from stages.adapters.lora_linear import add_lora
from stages.adapters.prefix import build_prefix_config
from stages.adapters.prefix_kv import add_prefix, to_peft
from stages.model import LlamaForCausalLM
from stages.sections import FINETUNE


def attach_adapter(model: torch.nn.Module, method: str, section: Mapping[str, Any],
                   init_ids: list[int] | None = None) -> torch.nn.Module:
    """Freeze `model` and give it a fresh `method` adapter ("lora" or "prefix"): in place for our
    model (returned as is), else wrapped by peft (the PeftModel is returned). `init_ids`: the
    tokens whose KV cache starts a prefix (`prefix_init: tokens`).

    The adapter's initial weights come from torch's global RNG: seed it first (set_seed) for
    reproducible runs. Only the adapter's parameters have requires_grad afterwards.
    """
    if method not in ADAPTER_METHODS:
        raise ValueError(f"adapter method={method!r} is unknown; choose one of {ADAPTER_METHODS}")
    section = FINETUNE[method].of(section)
    if method == "lora":
        check_target_modules(model, section.target_modules)
    if isinstance(model, LlamaForCausalLM):
        if method == "lora":
            add_lora(model, section)
            if section.target_parameters:
                add_expert_lora(model, section.lora_rank, section.lora_alpha, section.target_parameters)
        else:
            add_prefix(model, section, init_ids)
        return model
    if method == "lora":
        if section.target_parameters:
            raise ValueError(f"finetune.lora.target_parameters={section.target_parameters}: LoRA on experts runs on "
                             f"our model's mixtures of experts; {type(model).__name__} is not one")
        config = build_lora_config(section, fan_in_fan_out=targets_conv1d(model, section.target_modules))
    else:
        config = build_prefix_config(section)
    wrapped = peft.get_peft_model(model, config)
    if method == "prefix" and init_ids is not None:
        _prefix_from_cache(wrapped, init_ids)
    return wrapped


@torch.no_grad()
def _prefix_from_cache(model: peft.PeftModel, ids: list[int]) -> None:
    """Start peft's prefix table as the KV cache transformers' model computes for `ids`."""
    base = model.get_base_model()
    cache = base(input_ids=torch.tensor([ids], device=base.device), use_cache=True).past_key_values
    pairs = [(layer.keys[0], layer.values[0]) for layer in cache.layers]  # each (K, P, hd)
    model.prompt_encoder.default.embedding.weight.copy_(to_peft(pairs))
