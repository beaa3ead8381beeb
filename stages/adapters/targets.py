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


# A mixture of experts' router and routed experts take no LoRA: transformers 5 stores the experts fused
# (one 3-D parameter per projection, no module per expert) and its router is no Linear, so a peft
# adapter has nothing to put a per-expert LoRA on (peft's own `target_parameters` route is not ours).
# Qwen2-MoE's shared expert and its gate are Linears in both models and take LoRA.
MOE_LINEARS = ("shared_expert_gate",)


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
