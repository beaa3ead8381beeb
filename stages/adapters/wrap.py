"""Wrap a base model with the adapter a finetune method asks for, and count what trains."""

from __future__ import annotations

import peft
import torch

from stages.adapters.lora import build_lora_config, check_target_modules, targets_conv1d
from stages.adapters.prefix import build_prefix_config

ADAPTER_METHODS = ("lora", "prefix")


def attach_adapter(model: torch.nn.Module, method: str, section: dict) -> peft.PeftModel:
    """Freeze `model` and wrap it with a fresh `method` adapter ("lora" or "prefix").

    The adapter's initial weights come from torch's global RNG: seed it first (set_seed) for
    reproducible runs. Only the adapter's parameters have requires_grad afterwards.
    """
    if method == "lora":
        check_target_modules(model, section["target_modules"])
        config = build_lora_config(section, fan_in_fan_out=targets_conv1d(model, section["target_modules"]))
    elif method == "prefix":
        config = build_prefix_config(section)
    else:
        raise ValueError(f"adapter method={method!r} is unknown; choose one of {ADAPTER_METHODS}")
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
