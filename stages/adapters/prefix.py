"""Prefix tuning configuration from the `finetune.prefix` config section.

Prefix tuning (Li & Liang, 2021) learns `num_prefix_tokens` key/value vectors per layer that every
attention layer sees before the real tokens; the base model stays frozen. peft implements it by
handing the model a pre-filled KV cache (`past_key_values`) of length `num_prefix_tokens`.

Checked with transformers 5.23 (LlamaForCausalLM) and peft 0.21.2, no workaround needed:
training forward/backward reaches the prefix embedding; `generate` (greedy, batched with left
padding, repeated calls) gives the same tokens as step-by-step full forwards with the prefix, with
per-step logits within 3e-7; save/load round-trips exactly; GQA models get prefixes of
`num_key_value_heads * head_dim` per layer; the real tokens take RoPE positions P, P+1, ... after the
prefix's P cache slots. tests/unit/test_adapters.py keeps these checks, so an
upgrade that breaks one of them fails there first. Qwen2, Mistral, Qwen3, GLM, GLM-4, GPT-2, OPT,
Bloom and GPT-NeoX train and evaluate (batched left-padded generation included) with a prefix too:
tests/unit/test_families.py (slow).
"""

from __future__ import annotations

import peft

from stages.sections import PrefixSettings


def build_prefix_config(section: PrefixSettings) -> peft.PrefixTuningConfig:
    """A peft PrefixTuningConfig for a validated `finetune.prefix` section.

    Without `prefix_projection` the trained vectors are the prefix itself, so the adapter file is
    exactly num_layers * 2 * num_prefix_tokens * kv_width floats. With it, peft trains an embedding
    and a two-layer MLP (`encoder_hidden_size` wide, None: peft's default, the KV width) and saves
    the MLP's output, the same table, which it reads back in inference mode.
    """
    return peft.PrefixTuningConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        num_virtual_tokens=section.num_prefix_tokens,
        prefix_projection=section.prefix_projection,
        encoder_hidden_size=section.prefix_projection_hidden_size,
    )
