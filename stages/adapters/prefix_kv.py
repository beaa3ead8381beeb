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

With `prefix_projection` (Li & Liang's reparameterisation, peft's PrefixEncoder) the model gets a
`prefix_encoder` instead: an embedding (P, K*hd) and an MLP Linear -> tanh -> Linear whose output is
peft's table, recomputed at every forward and handed to the layers. Only the table is saved, as
peft saves it. On the default experiment (seeds 1-3, 200 steps) it reaches at a learning rate of
1e-2 the dev loss a plain prefix reaches at 1e-1 (1.69 and 1.70; a plain prefix at 1e-2: 4.33),
but over 3000 steps it stays there (1.65) where a plain prefix at 3e-2 goes on down (1.25).
"""

from __future__ import annotations

import torch
from torch import nn

from stages.sections import PrefixSettings

PEFT_KEY = "prompt_embeddings"


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """Our model's attention modules in layer order."""
    return [layer.self_attn for _, layer in sorted(model.model.layers.items(), key=lambda kv: int(kv[0]))]


def add_prefix(model: nn.Module, section: PrefixSettings, init_ids: list[int] | None = None) -> int:
    """Freeze our `model` and give each attention layer fresh prefix keys/values (a validated
    `finetune.prefix` section's `num_prefix_tokens`), in place, before any parallelism: the KV
    cache of `init_ids` (P token ids) when given, else drawn from torch's global RNG in peft's
    order (one (P, L*2*K*hd) table). Returns the number of layers."""
    for p in model.parameters():
        p.requires_grad_(False)
    layers = attention_layers(model)
    config = model.config
    P, K, hd = section.num_prefix_tokens, config.num_key_value_heads, config.head_dim
    weight = model.model.embed_tokens.weight
    if section.prefix_projection:
        if init_ids is not None:
            raise ValueError("prefix_init=tokens sets the prefix itself; a prefix_projection computes it")
        encoder = PrefixProjection(P, K * hd, section.prefix_projection_hidden_size or K * hd, len(layers))
        model.prefix_encoder = encoder.to(dtype=weight.dtype, device="cpu" if weight.is_meta else weight.device)
        return len(layers)
    if init_ids is not None:
        if len(init_ids) != P:
            raise ValueError(f"prefix_init=tokens needs num_prefix_tokens={P} token ids, got {len(init_ids)}")
        pairs = kv_cache_of(model, init_ids)
    else:
        table = torch.randn(P, len(layers) * 2 * K * hd, dtype=weight.dtype)
        if not weight.is_meta:  # a lazy base (stages.training.materialize) is filled later; the prefix is real now
            table = table.to(weight.device)
        pairs = from_peft(table, len(layers), K, hd)
    for attn, (key, value) in zip(layers, pairs):
        attn.prefix_key = nn.Parameter(key.clone())
        attn.prefix_value = nn.Parameter(value.clone())
    return len(layers)


class PrefixProjection(nn.Module):
    """peft's PrefixEncoder with `prefix_projection`, built in its order (the same draws from the
    same seed): `embedding` (P, kv_width), then `transform` = Linear(kv_width, hidden), tanh,
    Linear(hidden, L * 2 * kv_width). Called, it computes peft's (P, L*2*K*hd) table; `place` gives
    each attention layer its (K, P, hd) `prefix_key` / `prefix_value` from it."""

    def __init__(self, num_tokens: int, kv_width: int, hidden: int, num_layers: int):
        super().__init__()
        self.embedding = nn.Embedding(num_tokens, kv_width)
        self.transform = nn.Sequential(nn.Linear(kv_width, hidden), nn.Tanh(),
                                       nn.Linear(hidden, num_layers * 2 * kv_width))

    def forward(self) -> torch.Tensor:
        """peft's prefix table (P, L*2*K*hd): what its adapter file holds. (Returned, not only
        placed: ZeRO-3 gathers the MLP's weights for backward through hooks on a module's outputs.)"""
        return self.transform(self.embedding.weight)

    @staticmethod
    def place(layers: list[nn.Module], table: torch.Tensor) -> None:
        """Give the attention `layers` this step's prefix from `table` (plain tensors, in the graph)."""
        first = layers[0]
        for attn, (key, value) in zip(layers, from_peft(table, len(layers), first.num_kv_heads, first.head_dim)):
            attn.prefix_key, attn.prefix_value = key, value

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "PrefixProjection":
        """The projection whose parameters are `tensors`, by names relative to it."""
        (P, width), hidden, out = tensors["embedding.weight"].shape, tensors["transform.0.weight"].shape[0], \
            tensors["transform.2.weight"].shape[0]
        projection = cls(P, width, hidden, out // (2 * width))
        projection.load_state_dict({k: v.float() for k, v in tensors.items()})
        return projection


@torch.no_grad()
def projected_table(tensors: dict[str, torch.Tensor], prefix: str = "prefix_encoder.") -> torch.Tensor:
    """peft's table from a trained projection's whole tensors (names starting with `prefix`)."""
    own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    return PrefixProjection.from_tensors(own)()


@torch.no_grad()
def kv_cache_of(model: nn.Module, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value), each (K, P, hd): what our model's attention computes for the token
    ids `ids` at positions 0..P-1 (keys rotated), i.e. the KV cache of that text."""
    x = model.model.embed_tokens(torch.tensor([ids], device=model.model.embed_tokens.weight.device))  # (1, P, d)
    cos, sin = model.rotary_emb(len(ids), x.device, x.dtype)
    pairs = []
    for _, layer in sorted(model.model.layers.items(), key=lambda kv: int(kv[0])):
        _, key, value = layer.self_attn.project(layer.input_layernorm(x), cos, sin)  # (1, K, P, hd) each
        pairs.append((key[0], value[0]))
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
