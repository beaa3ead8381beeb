"""What the GGUF writer (`stages.deployment.gguf_writer`) takes, torch-free: the config check reads it
while Snakemake parses the workflow, so an experiment whose model the writer refuses stops there."""

from stages.model.registry import FAMILIES

# config.json model_types written to GGUF, those with a llama.cpp architecture in the family registry:
# "llama" for Llama, Mistral and Mixtral, "qwen2" for Qwen2, "qwen2moe" and "olmoe" for Qwen2-MoE and
# OLMoE. Qwen3, Qwen3-MoE, GLM and GLM-4 have architectures of their own in llama.cpp (q/k head norms, a
# fused gate_up_proj, partial interleaved RoPE) this writer does not implement; GPT-2 and the families on
# transformers' model are not written either.
GGUF_MODEL_TYPES = tuple(sorted(f.model_type for f in FAMILIES if f.gguf_arch))
