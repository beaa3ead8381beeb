"""The project's Llama as an ONNX decoder with a KV cache, under the names optimum and
onnxruntime-genai use.

Graph (fp32, dynamic batch B, new tokens T, past tokens P; P may be 0, the first step):

    inputs   input_ids                      (B, T)        int64
             attention_mask                 (B, P + T)    int64   1 = real token, 0 = padding
             position_ids                   (B, T)        int64   cumsum(attention_mask) - 1 (as HF)
             past_key_values.{i}.key/value  (B, K, P, hd) float32 for each layer i
    outputs  logits                         (B, T, V)     float32
             present.{i}.key/value          (B, K, P + T, hd)

`CachedDecoder` wraps a built `stages.model.LlamaForCausalLM` and reuses its modules (embedding,
projections, norms, MLPs, lm_head, RoPE frequencies), so the weights are the model's own; only the
attention is rewritten to take explicit past tensors and a padding mask. A query at absolute
index P + t attends to key j when j <= P + t, attention_mask[b, j] == 1 and, on a sliding layer,
P + t - j < window: left padding hides the pads, which then change no other row or position.
The mask is additive with the dtype's minimum (not -inf), so a pad query, which sees no key,
gets finite (ignored) outputs instead of NaN that would leak through the cache.

Not covered: RoPE of type `dynamic` (its frequencies depend on the total length, which a graph
with a cache does not see as one number), prefix-tuned models (their virtual cache is not an
input here); `check_exportable` refuses both with the reason.

Exporter: `torch.onnx.export(dynamo=True)` first, the TorchScript exporter when dynamo raises or
writes another opset than asked (as stages.export always did).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from stages.model.config import LlamaConfig
from stages.model.llama import Attention, LlamaForCausalLM
from stages.model.rope import angles
from stages.model.rope_types import depends_on_length
from stages.deployment.onnx_files import export_with_fallback

log = logging.getLogger(__name__)

INPUT_NAMES = ("input_ids", "attention_mask", "position_ids")
PAST_KEY, PAST_VALUE = "past_key_values.{}.key", "past_key_values.{}.value"
PRESENT_KEY, PRESENT_VALUE = "present.{}.key", "present.{}.value"
# (batch, new tokens, past tokens) of the traced example: sizes 0/1 would be specialised by torch.export
_EXAMPLE = (2, 3, 5)


def past_names(num_layers: int) -> list[str]:
    """past_key_values.0.key, past_key_values.0.value, past_key_values.1.key, ..."""
    return [name.format(i) for i in range(num_layers) for name in (PAST_KEY, PAST_VALUE)]


def present_names(num_layers: int) -> list[str]:
    """present.0.key, present.0.value, present.1.key, ..."""
    return [name.format(i) for i in range(num_layers) for name in (PRESENT_KEY, PRESENT_VALUE)]


def check_exportable(model: LlamaForCausalLM) -> None:
    """Raise ValueError naming what a cache graph of `model` cannot compute."""
    config: LlamaConfig = model.config
    if depends_on_length(config.rope_scaling):
        raise ValueError("rope_scaling.rope_type='dynamic' recomputes the RoPE frequencies from the total "
                         "sequence length; the ONNX decoder with a KV cache supports the other rope types")
    layers = list(model.model.layers.values())
    if any(getattr(layer.self_attn, "prefix_key", None) is not None for layer in layers) or \
            getattr(model, "prefix_encoder", None) is not None:
        raise ValueError("a prefix-tuned model has a virtual KV cache the ONNX decoder does not take as input; "
                         "export the base model or merge another kind of adapter")


def _cached_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      bias: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output (B, T, d), present key, present value (B, K, P+T, hd)) of one attention layer;
    `bias` (B, 1, T, P+T) is 0 where a query may attend a key, the dtype's minimum elsewhere."""
    B, T, _ = x.shape
    hd = attn.head_dim
    q, k, v = attn.project(x, cos, sin)  # (B, H, T, hd), (B, K, T, hd) x 2
    k = torch.cat([past_k, k], dim=2)  # (B, K, P+T, hd): the present cache
    v = torch.cat([past_v, v], dim=2)
    H, K = q.shape[1], k.shape[1]
    S = k.shape[2]
    # GQA: each KV head serves H / K query heads (expand + reshape: plain ONNX Expand/Reshape)
    k_all = k[:, :, None].expand(B, K, H // K, S, hd).reshape(B, H, S, hd)  # (B, H, P+T, hd)
    v_all = v[:, :, None].expand(B, K, H // K, S, hd).reshape(B, H, S, hd)
    scores = q @ k_all.transpose(-1, -2) * hd ** -0.5 + bias  # (B, H, T, P+T)
    y = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v_all  # (B, H, T, hd)
    y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*hd)
    return attn.o_proj(y), k, v


def attention_bias(attention_mask: torch.Tensor, num_new: int, window: int | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, P+T) additive bias: causal over absolute indices (query t sits at P + t), padding
    keys hidden, and keys `window` or more tokens back hidden when `window` is given."""
    S = attention_mask.shape[1]
    q_index = torch.arange(num_new, device=attention_mask.device) + (S - num_new)  # (T,) absolute
    k_index = torch.arange(S, device=attention_mask.device)  # (P+T,)
    distance = q_index[:, None] - k_index[None, :]  # (T, P+T)
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    allowed = allowed[None] & (attention_mask[:, None, :] > 0)  # (B, T, P+T)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]  # (B, 1, T, P+T)


class CachedDecoder(nn.Module):
    """forward(input_ids, attention_mask, position_ids, past) -> (logits, *present) of `model`;
    `past` is the list [key_0, value_0, key_1, ...] of (B, K, P, hd) tensors, the outputs follow
    `present_names`."""

    def __init__(self, model: LlamaForCausalLM):
        super().__init__()
        check_exportable(model)
        self.model = model
        rotary = model.rotary_emb
        # fp32 frequencies as a buffer so they become one initializer (not a traced constant per use)
        self.register_buffer("inv_freq", rotary.inv_freq.clone(), persistent=False)  # (rd/2,)
        self.attention_factor = float(rotary.attention_factor)

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, T, rd) of `position_ids` (B, T), as RotaryEmbedding computes its tables."""
        freqs = position_ids.float()[..., None] * self.inv_freq  # (B, T, rd/2)
        emb = angles(freqs, self.model.config.rope_interleaved)  # (B, T, rd)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]  # (B, 1, T, hd)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past_key_values: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        inner = self.model.model
        x = inner.embed_tokens(input_ids)  # (B, T, d)
        cos, sin = self.rope(position_ids, x.dtype)
        biases: dict[int | None, torch.Tensor] = {}  # one mask per distinct window
        present = []
        for i, layer in enumerate(inner.layers.values()):
            window = layer.self_attn.sliding_window
            if window not in biases:
                biases[window] = attention_bias(attention_mask, input_ids.shape[1], window, x.dtype)
            h, k, v = _cached_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, biases[window],
                                        past_key_values[2 * i], past_key_values[2 * i + 1])
            x = layer.add_mlp(layer.add_attention(x, h))
            present += [k, v]
        logits = self.model.lm_head(inner.norm(x))  # (B, T, V)
        return (logits, *present)


def example_inputs(config: LlamaConfig, shape: tuple[int, int, int] = _EXAMPLE, seed: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A seeded (input_ids, attention_mask, position_ids, past) with one left-padded row."""
    B, T, P = shape
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (B, T), generator=g)
    mask = torch.ones((B, P + T), dtype=torch.long)
    mask[0, :2] = 0  # row 0 starts with two pads
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]
    kv = (B, config.num_key_value_heads or config.num_attention_heads, P, config.head_dim)
    past = [torch.randn(kv, generator=g) for _ in range(2 * config.num_hidden_layers)]
    return ids, mask, position_ids, past


def export_decoder(decoder: CachedDecoder, path: Path, opset_version: int, external_data: bool) -> str:
    """Write `path` from `decoder`; returns the exporter that succeeded ("dynamo" or "torchscript")."""
    example = example_inputs(decoder.model.config)
    n = decoder.num_layers
    names = dict(input_names=[*INPUT_NAMES, *past_names(n)], output_names=["logits", *present_names(n)],
                 opset_version=opset_version)
    # Dim.DYNAMIC, not named Dims: attention_mask's length is past + seq, which named Dims can
    # only express as a Dim plus a constant; export derives the relation itself.
    dyn = torch.export.Dim.DYNAMIC
    shapes = {"input_ids": {0: dyn, 1: dyn}, "attention_mask": {0: dyn, 1: dyn},
              "position_ids": {0: dyn, 1: dyn}, "past_key_values": [{0: dyn, 2: dyn}] * (2 * n)}
    axes = {name: dict(enumerate(dims)) for name, dims in _axis_names(n).items()}
    for name in (*past_names(n), *present_names(n)):
        axes[name] = {0: axes[name][0], 2: axes[name][2]}
    return export_with_fallback(decoder, example, path, names, dynamic_shapes=shapes, dynamic_axes=axes,
                                external_data=external_data, after_dynamo=lambda p: tidy_graph(p, n))


def _axis_names(num_layers: int) -> dict[str, tuple[str, ...]]:
    """The dynamic axes of every graph input and output, named as optimum names them."""
    b, t, p, s = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
    return {"input_ids": (b, t), "attention_mask": (b, s), "position_ids": (b, t), "logits": (b, t),
            **{name: (b, "", p, "") for name in past_names(num_layers)},
            **{name: (b, "", s, "") for name in present_names(num_layers)}}


# node metadata the dynamo exporter writes that names files of this machine: the Python stack of
# each node, with the absolute paths of the checkout and the venv (the other keys name modules)
MACHINE_METADATA = ("pkg.torch.onnx.stack_trace",)


def tidy_graph(path: Path, num_layers: int) -> None:
    """Rename the dynamo exporter's symbolic axes (s43, "s70 + s81") of the graph's inputs and
    outputs to `_axis_names`, and drop the node metadata that names this machine's files
    (MACHINE_METADATA), so the same model exported from another checkout is the same file; the
    weights (external data included) stay where they are."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    names = _axis_names(num_layers)
    for value in [*proto.graph.input, *proto.graph.output]:
        for dim, name in zip(value.type.tensor_type.shape.dim, names[value.name]):
            if name and dim.HasField("dim_param"):
                dim.dim_param = name
    for node in proto.graph.node:
        kept = [kv for kv in node.metadata_props if kv.key not in MACHINE_METADATA]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    onnx.save(proto, str(path))
