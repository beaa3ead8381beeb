"""LoRA configuration from the `finetune.lora` config section.

LoRA replaces a frozen linear W by W + (alpha / r) * B A with A (r x in) and B (out x r), B
initialised to zero so that training starts exactly from the base model. peft does the wrapping;
this module maps our config names (PaddleNLP's `lora_rank`) to peft's and checks the target names
up front, because peft's own error for a misspelt module is raised deep inside `get_peft_model`
and does not list what the model actually has.

`target_modules` is either (the rule itself: `stages.adapters.targets`)
  * "all-linear": peft's choice of every Linear / Conv1D except the output layer, i.e. the
    Linears of the decoder blocks in every family (Llama q,k,v,o,gate,up,down; GPT-2 c_attn,
    c_proj, c_fc; OPT q,k,v,out_proj, fc1, fc2; Bloom / GPT-NeoX query_key_value, dense,
    dense_h_to_4h, dense_4h_to_h), or
  * a list of module names, each matching a layer whose dotted name equals it or ends with
    "." + it (peft's rule): a leaf name such as "q_proj", or a longer suffix such as "mlp.c_proj"
    where a leaf name alone is ambiguous (GPT-2 has attn.c_proj and mlp.c_proj).
GPT-2's layers are `transformers.pytorch_utils.Conv1D` (weight stored (in, out)); peft handles
them when `fan_in_fan_out` is True, which `build_lora_config` sets for such models.
"""

from __future__ import annotations

import peft
import torch
from transformers.pytorch_utils import Conv1D

from stages.adapters.targets import ALL_LINEAR, matches, routed
from stages.sections import LoraSettings

LINEAR_TYPES = (torch.nn.Linear, Conv1D)


def _linear_names(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if name and isinstance(m, LINEAR_TYPES)}


def lora_modules(model: torch.nn.Module) -> list[str]:
    """Sorted leaf names (the last dotted part) of every `nn.Linear` / `Conv1D` in `model`: what
    `target_modules` may name, e.g. ['down_proj', 'gate_proj', 'k_proj', 'lm_head', ...]; a mixture of
    experts' routers and routed experts are not among them (`stages.adapters.targets.routed`)."""
    return sorted({name.rsplit(".", 1)[-1] for name in _linear_names(model) if not routed(name)})


def check_target_modules(model: torch.nn.Module, target_modules: str | list[str]) -> None:
    """Raise ValueError unless `target_modules` is "all-linear" or a non-empty list whose every
    entry matches some linear layer of `model` (naming the entries that match none)."""
    if isinstance(target_modules, str):
        if target_modules != ALL_LINEAR:
            raise ValueError(f"finetune.lora.target_modules={target_modules!r}: a string must be "
                             f"{ALL_LINEAR!r}; otherwise give a list of module names, e.g. [q_proj, v_proj]")
        return
    if not target_modules:
        raise ValueError(f"finetune.lora.target_modules is empty; name at least one linear layer, "
                         f"e.g. [q_proj, v_proj], or use {ALL_LINEAR!r}")
    names = [n for n in _linear_names(model) if not routed(n)]
    family = getattr(getattr(model, "config", None), "family", None)
    if family is not None and not family.lora_mlp:
        mlp = [t for t in target_modules if any(matches(n, t) for n in names if ".self_attn." not in f".{n}")]
        if mlp:
            raise ValueError(f"finetune.lora.target_modules names {mlp}: peft maps the MLP projections of a "
                             f"{family.name} adapter onto transformers 5's fused experts, so LoRA adapts its "
                             "attention only; use [q_proj, k_proj, v_proj, o_proj] or 'all-linear' (the same)")
    unknown = [t for t in target_modules if not any(matches(n, t) for n in names)]
    if unknown:
        raise ValueError(
            f"finetune.lora.target_modules names {unknown}, which match no linear layer of "
            f"{type(model).__name__}; choose from {lora_modules(model)} or use {ALL_LINEAR!r}"
        )


def targets_conv1d(model: torch.nn.Module, target_modules: str | list[str]) -> bool:
    """Whether any layer `target_modules` selects is a Conv1D (then peft needs fan_in_fan_out)."""
    convs = [n for n, m in _linear_names(model).items() if isinstance(m, Conv1D)]
    if target_modules == ALL_LINEAR:
        return bool(convs)
    return any(matches(n, t) for n in convs for t in target_modules)


def build_lora_config(section: LoraSettings, fan_in_fan_out: bool = False) -> peft.LoraConfig:
    """A peft LoraConfig for a validated `finetune.lora` section (lora_rank, lora_alpha,
    lora_dropout, target_modules). Biases stay frozen and are not saved, so the adapter holds
    only A and B and merging is exactly W += (alpha / r) B A. `fan_in_fan_out` must be True when
    the targets are Conv1D layers (GPT-2), whose weight is stored (in, out)."""
    targets = section.target_modules
    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=section.lora_rank,
        lora_alpha=section.lora_alpha,
        lora_dropout=section.lora_dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        fan_in_fan_out=fan_in_fan_out,
        bias="none",
    )
