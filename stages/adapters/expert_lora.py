"""LoRA on a mixture of experts' routed experts, in peft's `target_parameters` layout.

transformers 5 keeps each sparse block's experts as two 3-D parameters, `mlp.experts.gate_up_proj`
(E, 2 x width, d: every expert's gate rows, then its up rows) and `mlp.experts.down_proj` (E, d,
width), and peft adapts them with `LoraConfig(target_parameters=[...])`: per expert e, the weight
W_e + (alpha / r) B_e A_e, so gate and up share one A_e (r, d) and B_e (2 x width, r) updates both.
Our model keeps one `Expert` per expert with three Linears (stages.model.moe); `add_expert_lora`
replaces each by a `LoraExpert` over the same Linears with that update beside them, as four
factor Linears per expert (`gate_up_lora_A` (r, d), `gate_up_lora_B` (2 x width, r), `down_lora_A`
(r, width), `down_lora_B` (d, r)), initialised as peft does (A Kaiming-uniform, B zero). Per expert,
so expert parallelism splits them with their expert and ZeRO-3 gathers them with it.

`peft_expert_tensors` writes them under peft's keys: per sparse block, `lora_A.weight` (E x r, in),
the experts' A_e stacked, and `lora_B.weight` (out, r x E) with B_e in columns e, E + e, 2E + e, ...
(peft reshapes it (out, r, E)); peft nests one wrapper per parameter in the experts module's
parameter order, so with both targeted gate_up's keys are `experts.base_layer.lora_*` and down's
`experts.lora_*` (with one, its keys are `experts.lora_*`). `PeftModel.from_pretrained` on
transformers' model then computes what ours does (tests/unit/test_expert_lora.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stages.adapters.lora_linear import PEFT_PREFIX
from stages.adapters.targets import EXPERT_PARAMETERS, expert_parameters_selected
from stages.model.moe import Expert, SparseMoeBlock
from stages.quant.moe_experts import module_name

FACTORS = {"gate_up_proj": ("gate_up_lora_A", "gate_up_lora_B"), "down_proj": ("down_lora_A", "down_lora_B")}


class LoraExpert(nn.Module):
    """An `Expert`'s three Linears (shared, frozen) with LoRA on its fused gate/up and/or its down
    projection: down(h) + s B_d A_d h, h = silu(gate(x) + s G_g) * (up(x) + s G_u), [G_g; G_u] = B_gu A_gu x."""

    def __init__(self, expert: Expert, rank: int, alpha: float, parameters: tuple[str, ...]):
        super().__init__()
        self.names = expert.names
        for name in self.names:
            setattr(self, name, getattr(expert, name))
        gate = getattr(expert, self.names[0])
        d, width = gate.in_features, gate.out_features
        shapes = {"gate_up_proj": (d, 2 * width), "down_proj": (width, d)}
        weight = gate.weight
        device = torch.device("cpu") if weight.is_meta else weight.device  # a lazy base is filled later
        self.adapted = tuple(p for p in EXPERT_PARAMETERS if p in parameters)
        for parameter in self.adapted:
            fan_in, fan_out = shapes[parameter]
            a_name, b_name = FACTORS[parameter]
            setattr(self, a_name, nn.Linear(fan_in, rank, bias=False, device=device, dtype=weight.dtype))
            setattr(self, b_name, nn.Linear(rank, fan_out, bias=False, device=device, dtype=weight.dtype))
            nn.init.kaiming_uniform_(getattr(self, a_name).weight, a=math.sqrt(5))
            nn.init.zeros_(getattr(self, b_name).weight)
        self.lora_scaling = alpha / rank

    def _delta(self, parameter: str, x: torch.Tensor) -> torch.Tensor:
        a_name, b_name = FACTORS[parameter]
        return getattr(self, b_name)(getattr(self, a_name)(x)) * self.lora_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        g, u = gate(x), up(x)
        if "gate_up_proj" in self.adapted:
            dg, du = self._delta("gate_up_proj", x).chunk(2, dim=-1)
            g, u = g + dg, u + du
        h = F.silu(g) * u
        y = down(h)
        if "down_proj" in self.adapted:
            y = y + self._delta("down_proj", h)
        return y

    def extra_repr(self) -> str:
        return f"adapted={list(self.adapted)}, scaling={self.lora_scaling:g}"


def add_expert_lora(model: nn.Module, rank: int, alpha: float, target_parameters: list[str]) -> None:
    """Give every routed expert of our mixture-of-experts `model` LoRA on the parameters
    `target_parameters` selects (`stages.adapters.targets.expert_parameters_selected`), in place,
    before any parallelism; the base stays frozen. `adapted_expert_parameters` names them for peft."""
    family = model.config.family
    chosen = expert_parameters_selected(target_parameters)
    if not family.moe:
        raise ValueError(f"finetune.lora.target_parameters={target_parameters}: LoRA on experts needs a mixture of "
                         f"experts, and {family.name} has none; leave target_parameters unset")
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            for index, expert in enumerate(block.experts):
                block.experts[index] = LoraExpert(expert, rank, alpha, chosen)


def adapted_expert_parameters(model: nn.Module) -> list[str]:
    """peft's `target_parameters` for the expert LoRA of `model` (`add_expert_lora`'s), by full name in
    transformers 5's model (`model.layers.0.mlp.experts.gate_up_proj`, ...); under expert parallelism
    too, where a block holds some of its experts."""
    names = []
    for block_name, block in model.named_modules():
        if isinstance(block, SparseMoeBlock):
            expert = next(iter(block.experts.values() if isinstance(block.experts, nn.ModuleDict) else block.experts))
            experts = module_name(f"{block_name}.experts", model.config.model_type)
            names += [f"{experts}.{p}" for p in getattr(expert, "adapted", ())]
    return names


def peft_expert_tensors(tensors: dict[str, torch.Tensor], model_config) -> dict[str, torch.Tensor]:
    """Expert LoRA factors (whole, by our names, each `is_expert_factor`: `model.layers.0.block_sparse_moe.
    experts.3.gate_up_lora_A.weight`) under peft's keys, packed per sparse block (module docstring)."""
    by_block: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in tensors.items():
        head, _, tail = name.partition(".experts.")
        index, factor, _ = tail.split(".")
        by_block.setdefault(head, {}).setdefault(factor, {})[int(index)] = tensor
    out = {}
    for block_name, factors in by_block.items():
        adapted = [p for p in EXPERT_PARAMETERS if FACTORS[p][0] in factors]
        prefix = f"{PEFT_PREFIX}{module_name(f'{block_name}.experts', model_config.model_type)}."
        for parameter in adapted:
            a_name, b_name = FACTORS[parameter]
            count = len(factors[a_name])
            a = torch.cat([factors[a_name][e] for e in range(count)])  # (E r, in): expert-major rows
            b = torch.stack([factors[b_name][e] for e in range(count)], dim=2)  # (out, r, E)
            nested = "base_layer." if len(adapted) == 2 and parameter == EXPERT_PARAMETERS[0] else ""
            out[f"{prefix}{nested}lora_A.weight"] = a
            out[f"{prefix}{nested}lora_B.weight"] = b.reshape(b.shape[0], -1)
    return out


def is_expert_factor(name: str) -> bool:
    """Whether parameter `name` of our model is an expert LoRA factor (`LoraExpert`)."""
    return ".experts." in name and any(f".{f}." in f"{name}." for pair in FACTORS.values() for f in pair)
