"""GPT-2 in our model's terms: its config.json keys and its state-dict names and layouts.

Our model runs GPT-2 with config switches (`LlamaConfig.model_type == "gpt2"`: learned absolute
positions, LayerNorm with bias, a GELU MLP without gate, biases on every projection, q/k/v fused in
one projection, tied embeddings), under our module names, so that the tensor-parallel plan, the
pipeline split and the checkpoints treat it as they treat Llama. What transformers'
`GPT2LMHeadModel` calls each tensor, and how it stores it, is translated here, once, for every
reader and writer of the Hugging Face layout:

    transformers' GPT2LMHeadModel                   ours
    transformer.wte.weight                          model.embed_tokens.weight
    transformer.wpe.weight                          model.embed_positions.weight
    transformer.h.<i>.ln_1.{weight,bias}            model.layers.<i>.input_layernorm.{weight,bias}
    transformer.h.<i>.attn.c_attn.{weight,bias}     model.layers.<i>.self_attn.qkv_proj.{weight,bias}
    transformer.h.<i>.attn.c_proj.{weight,bias}     model.layers.<i>.self_attn.o_proj.{weight,bias}
    transformer.h.<i>.ln_2.{weight,bias}            model.layers.<i>.post_attention_layernorm.{weight,bias}
    transformer.h.<i>.mlp.c_fc.{weight,bias}        model.layers.<i>.mlp.up_proj.{weight,bias}
    transformer.h.<i>.mlp.c_proj.{weight,bias}      model.layers.<i>.mlp.down_proj.{weight,bias}
    transformer.ln_f.{weight,bias}                  model.norm.{weight,bias}
    lm_head.weight (absent when tied)               lm_head.weight

transformers' `Conv1D` stores its weight as (in, out), the transpose of `nn.Linear`'s (out, in):
the four projection weights are transposed on the way in and out. Old checkpoints without the
`transformer.` prefix are read too; the causal-mask buffers some of them hold (`attn.bias`,
`attn.masked_bias`) are not weights and are dropped.

Config keys (GPT2Config's own names -> our fields): n_embd -> hidden_size, n_layer ->
num_hidden_layers, n_head -> num_attention_heads, n_inner -> intermediate_size (null: 4 x n_embd),
n_positions -> max_position_embeddings, layer_norm_epsilon -> rms_norm_eps (the epsilon of every
norm), activation_function -> hidden_act, attn_pdrop -> attention_dropout, resid_pdrop and
embd_pdrop -> fields of the same name.
"""

from __future__ import annotations

import re
from typing import Any

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# GPT2Config's key -> our field
CONFIG_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
               "layer_norm_epsilon": "rms_norm_eps", "activation_function": "hidden_act",
               "attn_pdrop": "attention_dropout", "resid_pdrop": "resid_pdrop", "embd_pdrop": "embd_pdrop",
               "vocab_size": "vocab_size", "initializer_range": "initializer_range",
               "tie_word_embeddings": "tie_word_embeddings"}
# transformers 5.23's GPT2Config defaults of the keys above
DEFAULTS: dict[str, Any] = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                                activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                layer_norm_epsilon=1e-5, initializer_range=0.02, tie_word_embeddings=True)
TOKEN_DEFAULTS = dict(bos_token_id=50256, eos_token_id=50256, pad_token_id=None)
# Keys GPT2Config has that change the maths, refused unless neutral (the value, why)
REFUSED: dict[str, tuple[Any, str]] = {
    "scale_attn_weights": (True, "attention scores are always scaled by 1/sqrt(head_dim)"),
    "scale_attn_by_inverse_layer_idx": (False, "the Mistral-style 1/(layer+1) score scaling is not implemented"),
    "add_cross_attention": (False, "only decoder-only (no cross-attention) models are implemented"),
}
# Keys that change nothing our model computes: the double-heads model's summary head, and the eager
# attention's fp32 upcast (our attention computes its softmax in fp32 anyway)
CARRIED = ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
           "summary_first_dropout", "reorder_and_upcast_attn")
HONOURED = ("model_type", *DEFAULTS, *TOKEN_DEFAULTS)

_CONV1D = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")  # stored (in, out)
_LAYER = {"ln_1": "input_layernorm", "attn.c_attn": "self_attn.qkv_proj", "attn.c_proj": "self_attn.o_proj",
          "ln_2": "post_attention_layernorm", "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
_TOP = {"wte": "model.embed_tokens", "wpe": "model.embed_positions", "ln_f": "model.norm"}
_LAYER_HF = {ours: theirs for theirs, ours in _LAYER.items()}
_TOP_HF = {ours: theirs for theirs, ours in _TOP.items()}
_BUFFERS = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$")


def fields_from_config(d: dict[str, Any], where: str) -> dict[str, Any]:
    """LlamaConfig keyword arguments (without `extra`) of a GPT-2 config.json dict."""
    for key, (neutral, why) in REFUSED.items():
        if d.get(key, neutral) != neutral:
            raise ValueError(f"{where}: {key}={d[key]!r} is not supported: {why}")
    fields = {field: d.get(key, DEFAULTS[key]) for key, field in CONFIG_KEYS.items()}
    if fields["intermediate_size"] is None:
        fields["intermediate_size"] = 4 * fields["hidden_size"]
    fields.update({k: d.get(k, default) for k, default in TOKEN_DEFAULTS.items()})
    return {**fields, "model_type": "gpt2"}


def config_dict(config, extra: dict[str, Any]) -> dict[str, Any]:
    """GPT2Config's keys of `config` (a LlamaConfig), after the carried `extra` keys; n_inner is
    written null where it was null and still means 4 x n_embd."""
    d = dict(extra)
    for key, field in CONFIG_KEYS.items():
        d[key] = getattr(config, field)
    if extra.get("n_inner", "absent") is None and config.intermediate_size == 4 * config.hidden_size:
        d["n_inner"] = None
    d.update({k: getattr(config, k) for k in TOKEN_DEFAULTS})
    d["model_type"] = "gpt2"
    return d


def hf_name(name: str) -> str:
    """transformers' GPT2LMHeadModel name of one of our state-dict names."""
    if name == "lm_head.weight":
        return name
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m:
        return f"transformer.h.{m.group(1)}.{_LAYER_HF[m.group(2)]}.{m.group(3)}"
    module, _, kind = name.rpartition(".")
    return f"transformer.{_TOP_HF[module]}.{kind}"


def our_name(name: str) -> str | None:
    """Our state-dict name of a GPT2LMHeadModel name (with or without `transformer.`), or None for
    the causal-mask buffers old checkpoints carry; KeyError for a name GPT-2 does not have."""
    if _BUFFERS.search(name):
        return None
    if name == "lm_head.weight":
        return name
    bare = name.removeprefix("transformer.")
    m = re.fullmatch(r"h\.(\d+)\.(.+)\.(weight|bias)", bare)
    if m:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    module, _, kind = bare.rpartition(".")
    return f"{_TOP[module]}.{kind}"


def _is_conv1d_weight(our: str) -> bool:
    return our.endswith(".weight") and any(f".{module}." in f".{our}" for module in _CONV1D)


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> GPT2LMHeadModel's names, projection weights transposed to Conv1D's (in, out)."""
    return {hf_name(k): (v.t().contiguous() if _is_conv1d_weight(k) else v) for k, v in state.items()}


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict -> ours (names, projection weights back to (out, in))."""
    out = {}
    for k, v in state.items():
        try:
            ours = our_name(k)
        except KeyError:
            raise ValueError(f"tensor {k!r} is not part of a GPT-2 checkpoint") from None
        if ours is not None:
            out[ours] = v.t().contiguous() if _is_conv1d_weight(ours) else v
    return out
