"""Adapter directories in peft's format, written from whole tensors by the training engine.

The engine trains LoRA and prefix tuning on our model (every layout) or through peft on a
transformers model (data parallel and ZeRO); either way it ends with whole fp32 tensors of the
adapter under the model's own parameter names. This module turns them into what
`PeftModel.save_pretrained` writes: adapter_config.json and adapter_model.safetensors with peft's
keys, so `PeftModel.from_pretrained(base, dir)` loads them and `stages.merge` folds LoRA in.

The adapter config is peft's own: for our model it is taken from `peft.get_peft_model` over
transformers' model of the same config, built on the meta device (no memory, no weights), so every
field peft fills from the model (the expanded `all-linear` targets, a prefix's layers, KV heads and
widths) is what peft itself would write.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import peft
import torch

from stages.adapters.lora import build_lora_config
from stages.adapters.lora_linear import peft_name
from stages.adapters.prefix import build_prefix_config
from stages.adapters.prefix_kv import PEFT_KEY, prefix_names, to_peft
from stages.checkpoint.integrity import write_tensors

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config_for(method: str, section: dict[str, Any], base_dir: str | Path) -> peft.PeftConfig:
    """The adapter config peft would write for `method` on the transformers model of `base_dir`'s
    config.json (built on the meta device)."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(base_dir, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(hf_config)
    config = build_lora_config(section) if method == "lora" else build_prefix_config(section)
    return peft.get_peft_model(skeleton, config).peft_config["default"]


def peft_tensors(method: str, tensors: dict[str, torch.Tensor], num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Our model's adapter tensors (whole, by our parameter names) -> peft's saved keys."""
    if method == "lora":
        return {peft_name(name): t for name, t in tensors.items()}
    pairs = [(tensors[k], tensors[v]) for k, v in prefix_names(num_layers)]
    return {PEFT_KEY: to_peft(pairs)}


def peft_model_tensors(model: peft.PeftModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A peft-wrapped transformers model's adapter tensors (by its in-memory parameter names) ->
    peft's saved keys, by peft's own renaming."""
    return peft.get_peft_model_state_dict(model, state_dict=tensors)


def write_adapter(directory: Path, config: peft.PeftConfig, tensors: dict[str, torch.Tensor],
                  base_dir: str | Path) -> None:
    """adapter_config.json (inference mode, base = `base_dir`) and adapter_model.safetensors."""
    config = copy.deepcopy(config)
    config.inference_mode, config.base_model_name_or_path = True, str(base_dir)
    config.save_pretrained(directory)
    write_tensors(Path(directory) / ADAPTER_WEIGHTS, {k: v.float() for k, v in tensors.items()})
