"""Where a per-input-channel scale s of a decoder block's Linears can be folded: into what produces
their input, exactly (Llama-style block names). SmoothQuant's export (`stages.deployment.smooth_fold`)
and AWQ (`stages.quant.awq`) both divide by s there:

    producer of x                       consumers (one shared s)    fold
    input_layernorm  g * x / rms(x)     q_proj, k_proj, v_proj      g' = g / s
    post_attention_layernorm            gate_proj, up_proj          g' = g / s
                                        (GLM, GLM-4: gate_up_proj)
    v_proj rows, through attention      o_proj                      W_v' = W_v / s (rows, and b_v)
    up_proj rows, act(gate) * up        down_proj                   W_u' = W_u / s (rows, and b_u)
    (GLM, GLM-4: the second half of gate_up_proj's rows, [gate; up])

With grouped-query attention several heads read one v row, so o_proj's s must be equal over each
group of heads for the v_proj fold to be exact.
"""

from __future__ import annotations

from stages.model.registry import model_types

# model_type of families whose decoder blocks use these names and whose norms compute g * x_hat
# (Gemma's (1 + g) would need another fold; GPT-2 / OPT / NeoX name their layers otherwise).
# (stages/model/registry.py: `smooth_fold`)
FOLD_FAMILIES = model_types(smooth_fold=True)
FUSED_GATE_UP_FAMILIES = model_types(fused_gate_up=True)  # mlp.gate_up_proj, rows [gate; up], for gate_proj and up_proj
NORM_CONSUMERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}
FUSED_NORM_CONSUMERS = {**NORM_CONSUMERS, "post_attention_layernorm": ("mlp.gate_up_proj",)}
# consumer -> (producer, i, n): the consumer's input channels are the i-th of n equal blocks of the
# producer's output rows
ROW_PRODUCER = {"self_attn.o_proj": ("self_attn.v_proj", 0, 1), "mlp.down_proj": ("mlp.up_proj", 0, 1)}
FUSED_ROW_PRODUCER = {**ROW_PRODUCER, "mlp.down_proj": ("mlp.gate_up_proj", 1, 2)}


def fold_tables(model_type: str) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, int, int]]]:
    """(norm -> its consumers, consumer -> its row producer) of a family's decoder block."""
    if model_type in FUSED_GATE_UP_FAMILIES:
        return FUSED_NORM_CONSUMERS, FUSED_ROW_PRODUCER
    return NORM_CONSUMERS, ROW_PRODUCER
