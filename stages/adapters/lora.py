"""LoRA configuration from the `finetune.lora` config section.

LoRA replaces a frozen linear W by W + (alpha / r) * B A with A (r x in) and B (out x r), B
initialised to zero so that training starts exactly from the base model. peft does the wrapping;
this module maps our config names (PaddleNLP's `lora_rank`) to peft's and checks the target names
up front, because peft's own error for a misspelt module is raised deep inside `get_peft_model`
and does not list what the model actually has.
"""

from __future__ import annotations

import peft
import torch


def lora_modules(model: torch.nn.Module) -> list[str]:
    """Sorted leaf names (the last dotted part) of every `nn.Linear` in `model`: what
    `target_modules` may name, e.g. ['down_proj', 'gate_proj', 'k_proj', 'lm_head', ...]."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and name})


def check_target_modules(model: torch.nn.Module, target_modules: list[str]) -> None:
    """Raise ValueError naming every entry of `target_modules` that matches no linear layer."""
    if not target_modules:
        raise ValueError("finetune.lora.target_modules is empty; name at least one linear layer, "
                         "e.g. [q_proj, v_proj]")
    available = lora_modules(model)
    unknown = [t for t in target_modules if t not in available]
    if unknown:
        raise ValueError(
            f"finetune.lora.target_modules names {unknown}, which match no linear layer of "
            f"{type(model).__name__}; choose from {available}"
        )


def build_lora_config(section: dict) -> peft.LoraConfig:
    """A peft LoraConfig for a validated `finetune.lora` section (lora_rank, lora_alpha,
    lora_dropout, target_modules). Biases stay frozen and are not saved, so the adapter holds
    only A and B and merging is exactly W += (alpha / r) B A."""
    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=section["lora_rank"],
        lora_alpha=section["lora_alpha"],
        lora_dropout=section["lora_dropout"],
        target_modules=list(section["target_modules"]),
        bias="none",
    )
