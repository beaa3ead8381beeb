"""LoRA and prefix-tuning glue around peft: config sections in, peft configs and models out.

The names below are imported on first use: `import peft` costs ~1.9 s on 2 CPU cores (it loads
transformers' model classes), which full fine-tuning (`stages.finetune --method sft`) never needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

ADAPTER_METHODS = ("lora", "prefix")  # the finetune methods that train an adapter on a frozen base

_HOMES = {"attach_adapter": "wrap", "count_parameters": "trainable", "build_lora_config": "lora",
          "check_target_modules": "lora", "lora_modules": "lora", "build_prefix_config": "prefix"}
__all__ = ["ADAPTER_METHODS", "attach_adapter", "build_lora_config", "build_prefix_config",
           "check_target_modules", "count_parameters", "lora_modules"]
assert sorted(__all__) == sorted([*_HOMES, "ADAPTER_METHODS"])

if TYPE_CHECKING:
    from stages.adapters.lora import build_lora_config, check_target_modules, lora_modules
    from stages.adapters.prefix import build_prefix_config
    from stages.adapters.trainable import count_parameters
    from stages.adapters.wrap import attach_adapter


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'stages.adapters' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stages.adapters.{_HOMES[name]}"), name)
