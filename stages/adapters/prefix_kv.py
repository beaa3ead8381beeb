"""Prefix tuning on our own model: P trained key/value vectors per layer, peft's file format.

Every attention layer gets `prefix_key` and `prefix_value` parameters of shape (K, P, hd) (K KV
heads, P = num_prefix_tokens), which `stages.model.llama.Attention` places before the real keys
and values, as peft's prefix tuning does through transformers' KV cache: the prefix is not
rotated and the real tokens take positions P, P+1, ... (transformers 5.23 numbers the tokens after
the cache's P slots; tests/unit/test_adapters_native.py holds our logits to peft's). Per-layer parameters, rather than peft's one
table, let tensor parallelism split them by KV head like k_proj/v_proj (partition_dim 0).

peft saves the prefix as one tensor `prompt_embeddings` (P, L * 2 * K * hd): for virtual token p,
the keys then values of layer 0, then of layer 1, ..., each K x hd (its `get_prompt` views it as
(P, 2L, K, hd) and splits the layers in pairs). `to_peft` / `from_peft` convert between the two.
Initialisation (`prefix_init`): `random` is peft's, N(0, 1) like its `nn.Embedding`; `tokens` is
the KV cache the base model computes for P real tokens (Li & Liang's "initialise with real
words"): the adapted model then starts as the base model reading those tokens before every input,
and training moves on from a prefix of the scale and geometry real keys and values have.
"""

from __future__ import annotations

import torch
from torch import nn

PEFT_KEY = "prompt_embeddings"


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """Our model's attention modules in layer order."""
    return [layer.self_attn for _, layer in sorted(model.model.layers.items(), key=lambda kv: int(kv[0]))]


def add_prefix(model: nn.Module, section: dict, init_ids: list[int] | None = None) -> int:
    """Freeze our `model` and give each attention layer fresh prefix keys/values (a validated
    `finetune.prefix` section's `num_prefix_tokens`), in place, before any parallelism: the KV
    cache of `init_ids` (P token ids) when given, else drawn from torch's global RNG in peft's
    order (one (P, L*2*K*hd) table). Returns the number of layers."""
    for p in model.parameters():
        p.requires_grad_(False)
    layers = attention_layers(model)
    config = model.config
    P, K, hd = section["num_prefix_tokens"], config.num_key_value_heads, config.head_dim
    if init_ids is not None:
        if len(init_ids) != P:
            raise ValueError(f"prefix_init=tokens needs num_prefix_tokens={P} token ids, got {len(init_ids)}")
        pairs = kv_cache_of(model, init_ids)
    else:
        weight = model.model.embed_tokens.weight
        table = torch.randn(P, len(layers) * 2 * K * hd, dtype=weight.dtype)
        if not weight.is_meta:  # a lazy base (stages.training.materialize) is filled later; the prefix is real now
            table = table.to(weight.device)
        pairs = from_peft(table, len(layers), K, hd)
    for attn, (key, value) in zip(layers, pairs):
        attn.prefix_key = nn.Parameter(key.clone())
        attn.prefix_value = nn.Parameter(value.clone())
    return len(layers)


@torch.no_grad()
def kv_cache_of(model: nn.Module, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value), each (K, P, hd): what our model's attention computes for the token
    ids `ids` at positions 0..P-1 (keys rotated), i.e. the KV cache of that text."""
    from stages.model.llama import apply_rope

    x = model.model.embed_tokens(torch.tensor([ids], device=model.model.embed_tokens.weight.device))  # (1, P, d)
    cos, sin = model.rotary_emb(len(ids), x.device, x.dtype)
    pairs = []
    for _, layer in sorted(model.model.layers.items(), key=lambda kv: int(kv[0])):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        key = attn.k_proj(h).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)  # (1, K, P, hd)
        value = attn.v_proj(h).view(1, len(ids), -1, attn.head_dim).transpose(1, 2)
        pairs.append((apply_rope(key, cos, sin)[0], value[0]))
        x = layer(x, cos, sin)
    return pairs


def from_peft(table: torch.Tensor, num_layers: int, kv_heads: int, head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """peft's (P, L*2*K*hd) table -> per layer (key, value), each (K, P, hd)."""
    P = table.shape[0]
    per = table.view(P, 2 * num_layers, kv_heads, head_dim).permute(1, 2, 0, 3)  # (2L, K, P, hd)
    return [(per[2 * i], per[2 * i + 1]) for i in range(num_layers)]


def to_peft(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per layer (key, value), each (K, P, hd) -> peft's (P, L*2*K*hd) table."""
    stacked = torch.stack([t for pair in pairs for t in pair])  # (2L, K, P, hd)
    P = stacked.shape[2]
    return stacked.permute(2, 0, 1, 3).reshape(P, -1).contiguous()


def prefix_names(num_layers: int) -> list[tuple[str, str]]:
    """Our parameter names of each layer's (key, value), in layer order."""
    return [(f"model.layers.{i}.self_attn.prefix_key", f"model.layers.{i}.self_attn.prefix_value")
            for i in range(num_layers)]
