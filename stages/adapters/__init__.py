"""LoRA and prefix-tuning glue around peft: config sections in, peft configs and models out."""

from stages.adapters.lora import build_lora_config, check_target_modules, lora_modules
from stages.adapters.prefix import build_prefix_config
from stages.adapters.wrap import ADAPTER_METHODS, attach_adapter, count_parameters

__all__ = ["ADAPTER_METHODS", "attach_adapter", "build_lora_config", "build_prefix_config",
           "check_target_modules", "count_parameters", "lora_modules"]
