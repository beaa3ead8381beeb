"""Attach the adapter a finetune method asks for to a base model, and count what trains.

Our model (the Llama family: Llama, Qwen2, Mistral) gets our own LoRA layers and prefix
keys/values (`lora_linear`, `prefix_kv`), which tensor parallelism can split; every other family
gets peft's, on transformers' model (data parallel and ZeRO only). Both save in peft's format.
"""

from __future__ import annotations

import peft
import torch

from stages.adapters.lora import build_lora_config, check_target_modules, targets_conv1d
from stages.adapters.lora_linear import add_lora
from stages.adapters.prefix import build_prefix_config
from stages.adapters.prefix_kv import add_prefix
from stages.model import LlamaForCausalLM

ADAPTER_METHODS = ("lora", "prefix")


def attach_adapter(model: torch.nn.Module, method: str, section: dict) -> torch.nn.Module:
    """Freeze `model` and give it a fresh `method` adapter ("lora" or "prefix"): in place for our
    model (returned as is), else wrapped by peft (the PeftModel is returned).

    The adapter's initial weights come from torch's global RNG: seed it first (set_seed) for
    reproducible runs. Only the adapter's parameters have requires_grad afterwards.
    """
    if method not in ADAPTER_METHODS:
        raise ValueError(f"adapter method={method!r} is unknown; choose one of {ADAPTER_METHODS}")
    if method == "lora":
        check_target_modules(model, section["target_modules"])
    if isinstance(model, LlamaForCausalLM):
        if method == "lora":
            add_lora(model, section)
        else:
            add_prefix(model, section)
        return model
    if method == "lora":
        config = build_lora_config(section, fan_in_fan_out=targets_conv1d(model, section["target_modules"]))
    else:
        config = build_prefix_config(section)
    return peft.get_peft_model(model, config)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights are counted once."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total
