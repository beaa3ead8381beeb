"""Our decoder model (transformers' llama, qwen2, qwen3, mistral, glm, glm4, and gpt2 through
config switches): configuration, flavours, RoPE, the single-device model and its loss.

The names below are imported on first use, so that the torch-free modules of this package
(`stages.model.config`, `stages.model.labels`) load without torch: Snakemake's parse and data
preparation read them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOMES = {
    "FLAVOURS": "config", "SUPPORTED_MODEL_TYPES": "config", "LlamaConfig": "config", "config_for_flavour": "config",
    "LlamaForCausalLM": "llama", "build_model": "llama",
    "IGNORE_INDEX": "labels", "causal_lm_loss": "loss", "counted_tokens": "loss",
    "SUPPORTED_ROPE_TYPES": "rope_types", "RotaryEmbedding": "rope",
}
__all__ = ["FLAVOURS", "IGNORE_INDEX", "LlamaConfig", "LlamaForCausalLM", "RotaryEmbedding", "SUPPORTED_MODEL_TYPES",
           "SUPPORTED_ROPE_TYPES", "build_model", "causal_lm_loss", "config_for_flavour", "counted_tokens"]
assert sorted(__all__) == sorted(_HOMES)

if TYPE_CHECKING:
    from stages.model.config import FLAVOURS, SUPPORTED_MODEL_TYPES, LlamaConfig, config_for_flavour
    from stages.model.labels import IGNORE_INDEX
    from stages.model.llama import LlamaForCausalLM, build_model
    from stages.model.loss import causal_lm_loss, counted_tokens
    from stages.model.rope import RotaryEmbedding
    from stages.model.rope_types import SUPPORTED_ROPE_TYPES


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'stages.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stages.model.{_HOMES[name]}"), name)
