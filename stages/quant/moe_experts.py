"""A quantized mixture of experts in transformers' model: one Linear per expert and projection again.

Checkpoints (and our model, `stages.model.moe`) keep each expert's projections as Linears,
`model.layers.0.block_sparse_moe.experts.3.w1` (Mixtral) or `model.layers.0.mlp.experts.3.gate_proj`
(Qwen-MoE, OLMoE), which is how GPTQ and A8W8 quantize and write them. transformers 5 fuses them on
load into two 3-D parameters per layer (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), which
no low-bit kernel replaces. `unfuse_experts` swaps each fused experts module of a loaded transformers
model for `ExpertLinears`, the same computation over per-expert Linears (filled from the fused
weights) that the quantized layers then replace by name; `module_name` maps a checkpoint name to
that module path (Mixtral's `block_sparse_moe` is `mlp` in transformers 5).
"""

from __future__ import annotations

import torch
from torch import nn

from stages.model.moe import Expert, run_experts
from stages.model.registry import BY_MODEL_TYPE


def is_moe(model_type: str | None) -> bool:
    """Whether `model_type` is a mixture of experts of ours (stages/model/registry.py)."""
    return model_type in BY_MODEL_TYPE and BY_MODEL_TYPE[model_type].moe


def module_name(name: str, model_type: str) -> str:
    """The module path in transformers 5's model of checkpoint name `name`."""
    if BY_MODEL_TYPE[model_type].moe_block == "block_sparse_moe":
        return name.replace(".block_sparse_moe.", ".mlp.")
    return name


class ExpertLinears(nn.Module):
    """transformers' fused experts module as one `Expert` (stages.model.moe) per expert, under the
    checkpoint's names (`experts.3.w1`): forward(hidden (N, d), top_k_index (N, k), top_k_weights
    (N, k)) -> (N, d), as transformers' experts modules are called."""

    def __init__(self, experts: list[Expert]):
        super().__init__()
        for e, expert in enumerate(experts):
            self.add_module(str(e), expert)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(list(self.children()), hidden_states, top_k_index, top_k_weights)


@torch.no_grad()
def unfuse_experts(model: nn.Module, model_type: str) -> int:
    """Replace every fused experts module of transformers' `model` (gate_up_proj (E, 2f, d),
    down_proj (E, d, f)) by `ExpertLinears` holding the same weights, and mark the Linear routers
    `keep_float` (`stages.quant.layers.quantizable`); returns how many experts modules it split."""
    names = BY_MODEL_TYPE[model_type].expert_names
    fused = [(name, m) for name, m in model.named_modules()
             if name.endswith(".experts") and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)]
    for name, module in fused:
        gate_up, down = module.gate_up_proj, module.down_proj  # (E, 2f, d), (E, d, f)
        width, hidden = down.shape[2], down.shape[1]
        experts = []
        for e in range(gate_up.shape[0]):
            expert = Expert(hidden, width, names)
            gate, up, out = (getattr(expert, n) for n in names)
            gate.weight.copy_(gate_up[e, :width])
            up.weight.copy_(gate_up[e, width:])
            out.weight.copy_(down[e])
            experts.append(expert)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ExpertLinears(experts))
    for name, module in model.named_modules():  # Qwen2-MoE's one-output gate is a router: it stays float
        if name.endswith(".shared_expert_gate"):
            module.keep_float = True
    return len(fused)
