"""The Llama family (transformers' llama, qwen2 and mistral): configuration, flavours, RoPE and the
single-device model."""

from stages.model.config import FLAVOURS, SUPPORTED_MODEL_TYPES, LlamaConfig, config_for_flavour
from stages.model.llama import IGNORE_INDEX, LlamaForCausalLM, build_model, causal_lm_loss
from stages.model.rope import SUPPORTED_ROPE_TYPES, RotaryEmbedding

__all__ = ["FLAVOURS", "IGNORE_INDEX", "LlamaConfig", "LlamaForCausalLM", "RotaryEmbedding", "SUPPORTED_MODEL_TYPES",
           "SUPPORTED_ROPE_TYPES", "build_model", "causal_lm_loss", "config_for_flavour"]
