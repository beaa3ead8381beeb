"""LoRA on our own model: a Linear that adds (alpha / r) B A x, shardable by tensor parallelism.

`LoraLinear` keeps the frozen base weight under its own name (`q_proj.weight`) and adds `lora_A`
(r x in) and `lora_B` (out x r) beside it, so the parameter names are peft's saved names less
`base_model.model.` (`model.layers.0.self_attn.q_proj.lora_A.weight`): the adapter this model
trains loads with `peft.PeftModel.from_pretrained` on transformers' model of the same family, and
merges with `stages.merge`. Initialisation is peft's: A Kaiming-uniform (a = sqrt 5), B zero, so
training starts exactly from the base model.

Under tensor parallelism (`stages.parallel.plan.apply_tensor_parallel`) the factors are split the
way their base weight is: a column-parallel base (q/k/v, gate/up, GLM's gate_up) keeps A whole and
splits B along the output (gate_up: each half); a row-parallel base (o, down) splits A along the
input and keeps B whole, its r-wide product all-reduced before B (`stages.parallel.tensor`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stages.adapters.targets import selected
from stages.sections import LoraSettings

PEFT_PREFIX = "base_model.model."


class LoraLinear(nn.Linear):
    """y = x W^T + b + scaling * B(A(dropout(x))), W and b frozen."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.lora_scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.lora_A.out_features}, scaling={self.lora_scaling:g}"


def lora_linear(base: nn.Linear, rank: int, alpha: float, dropout: float) -> LoraLinear:
    """`base` (its weight and bias objects, frozen) with fresh LoRA factors, initialised as peft
    does from torch's global RNG."""
    layer = LoraLinear(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
    layer.weight = base.weight
    layer.bias = base.bias
    device, dtype = base.weight.device, base.weight.dtype
    if base.weight.is_meta:  # a lazy base (stages.training.materialize) is filled later; the factors are real now
        device = torch.device("cpu")
    layer.lora_A = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
    layer.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
    nn.init.kaiming_uniform_(layer.lora_A.weight, a=math.sqrt(5))
    nn.init.zeros_(layer.lora_B.weight)
    layer.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    layer.lora_scaling = alpha / rank
    return layer


def add_lora(model: nn.Module, section: LoraSettings) -> list[str]:
    """Freeze every parameter of our `model` and wrap the Linears `section.target_modules`
    selects (a validated `finetune.lora` section) with LoRA, in place, before any parallelism.
    Returns the wrapped module names (peft's `target_modules` for the adapter config)."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = section.target_modules
    attention_only = not model.config.family.lora_mlp
    wrapped = []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and selected(name, targets, attention_only):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child,
                    lora_linear(module, section.lora_rank, section.lora_alpha, section.lora_dropout))
            wrapped.append(name)
    if not wrapped:
        raise ValueError(f"finetune.lora.target_modules={targets!r} selects no Linear of the model")
    return wrapped


def peft_name(name: str) -> str:
    """Our parameter name -> the key peft writes into adapter_model.safetensors."""
    return PEFT_PREFIX + name
