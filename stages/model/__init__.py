"""The Llama family: configuration, flavours and the single-device model."""

from stages.model.config import FLAVOURS, LlamaConfig, config_for_flavour
from stages.model.llama import IGNORE_INDEX, LlamaForCausalLM, build_model, causal_lm_loss

__all__ = ["FLAVOURS", "IGNORE_INDEX", "LlamaConfig", "LlamaForCausalLM", "build_model",
           "causal_lm_loss", "config_for_flavour"]
