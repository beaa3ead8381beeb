"""llama.cpp's names of a Hugging Face decoder's tensors and its q/k row order: what the GGUF writer
(`stages.deployment.gguf_writer`) writes and the mixture reader (`stages.checkpoint.gguf_mixture`)
reads back, as llama.cpp's convert_hf_to_gguf.py names and permutes them."""

from __future__ import annotations

import torch

# Hugging Face parameter name (with {i} for the layer) -> llama.cpp tensor name.
TENSOR_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    **{f"model.layers.{{i}}.self_attn.{p}_proj.{kind}": f"blk.{{i}}.attn_{p}.{kind}"
       for p in "qkv" for kind in ("weight", "bias")},
}
TENSOR_NAMES.update({
    "model.layers.{i}.block_sparse_moe.gate.weight": "blk.{i}.ffn_gate_inp.weight",  # Mixtral's router
    "model.layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",  # Qwen2-MoE's and OLMoE's router
    # Qwen2-MoE's shared expert and its sigmoid gate
    **{f"model.layers.{{i}}.mlp.shared_expert.{p}_proj.weight": f"blk.{{i}}.ffn_{p}_shexp.weight"
       for p in ("gate", "up", "down")},
    "model.layers.{i}.mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
    # q/k norms: OLMoE's over the whole projections, Qwen3's and Qwen3-MoE's per head
    "model.layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
})


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (num_heads * hd, d) reordered per head from Hugging Face's rotate-half
    RoPE pairs (i, i + hd/2) to llama.cpp's adjacent pairs (2i, 2i + 1): convert_hf_to_gguf's permute."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])  # (heads, 2, hd/2, ...)
    return w.transpose(1, 2).reshape(weight.shape)  # (heads, hd/2, 2, ...) -> (rows, ...)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of `permute_qk`: llama.cpp's adjacent RoPE pairs (2i, 2i + 1) back to Hugging
    Face's halves (i, i + hd/2), within each head."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])  # (heads, hd/2, 2, ...)
    return w.transpose(1, 2).reshape(weight.shape)
