"""What the GGUF writer (`stages.deployment.gguf_writer`) takes, torch-free: the config check reads it
while Snakemake parses the workflow, so an experiment whose model the writer refuses stops there."""

from stages.model.registry import FAMILIES

# config.json model_types written to GGUF, those with a llama.cpp architecture in the family registry:
# "llama" for Llama and Mistral, "qwen2" for Qwen2. Qwen3, GLM and GLM-4 have architectures of their
# own in llama.cpp (q/k head norms, a fused gate_up_proj, partial interleaved RoPE) this writer does
# not implement; GPT-2 and the families on transformers' model are not written either.
GGUF_MODEL_TYPES = tuple(sorted(f.model_type for f in FAMILIES if f.gguf_arch))
