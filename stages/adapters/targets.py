"""Which layers a LoRA `target_modules` setting selects, by their dotted names. Torch-free: the
memory planner (`stages.planning.memory`) reads it while Snakemake parses the workflow.

`target_modules` is either "all-linear", every projection of the decoder blocks (never lm_head),
as peft's "all-linear" does for transformers' models, or a list of names, each selecting the
layers whose dotted name equals it or ends with "." + it (peft's rule).
"""

from __future__ import annotations

ALL_LINEAR = "all-linear"
# The projections of our model's decoder blocks by their last name: Llama's q/k/v/o, gate/up/down;
# GLM's one gate_up_proj for gate and up; GPT-2's one qkv_proj for q, k and v.
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
                 "qkv_proj")


def matches(name: str, target: str) -> bool:
    """Whether the layer named `name` is the one `target` names (peft's suffix rule)."""
    return name == target or name.endswith(f".{target}")


# A mixture of experts' router and routed experts take no LoRA as Linears (`target_modules`): transformers
# 5 stores the experts fused (one 3-D parameter per projection, no module per expert) and its router is
# no Linear. The experts take LoRA through peft's `target_parameters` instead (EXPERT_PARAMETERS below);
# the routers none. Qwen2-MoE's shared expert and its gate are Linears in both models and take LoRA.
MOE_LINEARS = ("shared_expert_gate",)


# A mixture of experts' routed experts as transformers 5 holds them, per sparse block: the fused gate and
# up projections (E, 2 x width, d) and the down projection (E, d, width). peft's LoRA adapts them by
# `target_parameters` (stages.adapters.expert_lora), in this order (the experts module's).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def expert_parameters_selected(target_parameters: list[str] | None) -> tuple[str, ...]:
    """The expert parameters (EXPERT_PARAMETERS) a `target_parameters` setting names, each entry a
    parameter name or a dotted suffix of its path (`down_proj`, `experts.down_proj`,
    `mlp.experts.down_proj`: peft's suffix rule); ValueError naming an entry that selects none."""
    if not target_parameters:
        return ()
    chosen = set()
    for entry in target_parameters:
        hits = [p for p in EXPERT_PARAMETERS if matches(f"model.layers.0.mlp.experts.{p}", entry)]
        if not hits:
            raise ValueError(f"target_parameters names {entry!r}, which is no expert parameter; choose from "
                             f"{list(EXPERT_PARAMETERS)} (transformers 5's fused experts: mlp.experts.<name>)")
        chosen.update(hits)
    return tuple(p for p in EXPERT_PARAMETERS if p in chosen)


def routed(name: str) -> bool:
    """Whether the layer named `name` is a router or a routed expert of a sparse MoE block."""
    return ".experts." in f".{name}." or name.endswith((".mlp.gate", ".block_sparse_moe.gate"))


def selected(name: str, target_modules: str | list[str], attention_only: bool = False) -> bool:
    """Whether the layer named `name` (its dotted name in our model) gets LoRA under `target_modules`;
    `attention_only`: a family whose MLPs peft cannot adapt (`Family.lora_mlp`)."""
    if routed(name) or (attention_only and ".self_attn." not in f".{name}"):
        return False
    if target_modules == ALL_LINEAR:
        return name.rsplit(".", 1)[-1] in BLOCK_LINEARS + MOE_LINEARS and ".layers." in f".{name}"
    return any(matches(name, t) for t in target_modules)
