"""A GGUF file of a mixture of experts read into the Hugging Face layout, where transformers' GGUF
loader reads none: Mixtral (llama.cpp's arch "llama" with `expert_count`), OLMoE (arch "olmoe"),
Qwen2-MoE and Qwen3-MoE (archs "qwen2moe" and "qwen3moe", which transformers reads at their config
classes' default widths only).

What llama.cpp's converter (and `stages.deployment.gguf_writer`) wrote is undone tensor by tensor:
every tensor dequantized to float32 with the gguf package (`gguf.quants.dequantize`: f32, f16, the
q4/q5/q8 and k-quant blocks), llama.cpp's names mapped back (`gguf_names.TENSOR_NAMES` inverted),
arch llama's q and k rows permuted back from llama.cpp's interleaved RoPE pairs to Hugging Face's
rotate-half halves (the other archs run NEOX RoPE on unpermuted rows), each layer's stacked experts
(E, out, in) split into one matrix per expert under the checkpoint names transformers saves
(Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`, the others' `mlp.experts.{e}.gate_proj/up_proj/
down_proj`), Qwen2-MoE's 1-D shared-expert gate made (1, hidden) again. config.json comes from the
file's `{arch}.*` keys, with what llama.cpp's graphs compute: the top-k weights renormalised by
Mixtral's and Qwen3-MoE's graphs and not by Qwen2-MoE's and OLMoE's (`norm_topk_prob`), every layer
sparse, no sliding window, no q/k/v clamp (OLMoE's `clip_qkv`). A tied head is a file without
`output.weight`. The tokenizer is transformers' reading of the file's `tokenizer.ggml.*` keys (the
caller's; `PreTrainedTokenizerFast` builds it for any arch, where `AutoTokenizer` first needs a config
transformers' loader knows).

Refused (ValueError naming the key): RoPE scaling keys (not mapped back here) and a Qwen2-MoE
file without its shared expert.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.checkpoint.gguf_names import TENSOR_NAMES, unpermute_qk
from stages.model.registry import FAMILIES, family

log = logging.getLogger(__name__)

# arch (with experts) -> config.json model_type: the mixtures the GGUF writer writes (the family registry's gguf_arch)
MODEL_TYPES = {f.gguf_arch: f.model_type for f in FAMILIES if f.moe and f.gguf_arch}
_PER_EXPERT = ("mlp", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"})
# llama.cpp's stacked experts -> each expert's matrix, per model_type
EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
    "qwen2_moe": _PER_EXPERT, "qwen3_moe": _PER_EXPERT, "olmoe": _PER_EXPERT,
}


def is_mixture(arch: str | None, expert_count: int | None) -> bool:
    """Whether a file of `arch` with `{arch}.expert_count` is read by this module."""
    return arch in MODEL_TYPES and bool(expert_count)


def is_mixture_file(gguf_path: Path) -> bool:
    """Whether the GGUF file at `gguf_path` is a mixture this module reads (its metadata only)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    return is_mixture(arch, _field(reader, f"{arch}.expert_count"))


def mixture_tokenizer(gguf_path: Path):
    """transformers' tokenizer of the file's `tokenizer.ggml.*` keys: the fast tokenizer class itself,
    which builds it for any arch (AutoTokenizer would first read a config of the arch, which
    transformers' GGUF loader has for none of these mixtures' experts)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def mixture_config(reader, arch: str, tensors: set[str]) -> dict[str, Any]:
    """config.json's fields of the file's model (see the module docstring)."""
    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    scaling = [k for k in reader.fields if k.startswith(f"{arch}.rope.scaling.") or k == f"{arch}.rope.scale_linear"]
    if scaling or "rope_freqs.weight" in tensors:
        raise ValueError(f"{scaling or 'rope_freqs.weight'}: RoPE scaling in a mixture's GGUF file is not read back "
                         "by this converter; convert the original checkpoint instead")
    model_type = MODEL_TYPES[arch]
    heads, hidden = key("attention.head_count"), key("embedding_length")
    fields: dict[str, Any] = {
        "model_type": model_type, "hidden_size": hidden, "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "max_position_embeddings": key("context_length"), "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0), "num_experts_per_tok": key("expert_used_count"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    head_dim = key("attention.key_length")
    if head_dim is not None and head_dim != hidden // heads:
        fields["head_dim"] = head_dim
    experts, ff = key("expert_count"), key("feed_forward_length")
    if model_type == "mixtral":
        fields.update(num_local_experts=experts, intermediate_size=ff, sliding_window=None)
    elif model_type == "olmoe":  # feed_forward_length is each expert's width, as for Mixtral
        fields.update(num_experts=experts, intermediate_size=ff, norm_topk_prob=False, clip_qkv=None,
                      attention_bias="blk.0.attn_q.bias" in tensors)
    elif model_type == "qwen3_moe":
        fields.update(num_experts=experts, intermediate_size=ff,
                      moe_intermediate_size=key("expert_feed_forward_length"), norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                      head_dim=head_dim or hidden // heads, attention_bias="blk.0.attn_q.bias" in tensors)
    else:  # llama.cpp's qwen2moe defaults when the widths are absent
        if "blk.0.ffn_gate_inp_shexp.weight" not in tensors:
            raise ValueError("qwen2moe file without blk.0.ffn_gate_inp_shexp.weight: a Qwen2-MoE has a shared expert")
        fields.update(num_experts=experts, intermediate_size=ff,
                      moe_intermediate_size=key("expert_feed_forward_length") or ff // key("expert_used_count"),
                      shared_expert_intermediate_size=key("expert_shared_feed_forward_length") or ff,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                      qkv_bias="blk.0.attn_q.bias" in tensors)
    return fields


def _hf_names() -> dict[str, str]:
    """llama.cpp name pattern (with {i}) -> Hugging Face name, the writer's table inverted (Mixtral's
    router and the others' share a llama.cpp name: the caller picks by model type)."""
    return {gguf: hf for hf, gguf in TENSOR_NAMES.items() if "block_sparse_moe" not in hf}


def mixture_state(reader, arch: str, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Hugging Face name -> float32 tensor of every weight in the file (see the module docstring)."""
    from gguf.quants import dequantize

    model_type = MODEL_TYPES[arch]
    block, experts = EXPERT_NAMES[model_type]
    names = _hf_names()
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        # a copy: an f32 tensor dequantizes to a read-only view of the file's memory map
        value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            layer, pattern = parts[1], ".".join(["blk", "{i}", *parts[2:]])
        else:
            layer, pattern = None, tensor.name
        kind = parts[-2] if parts[0] == "blk" else None
        if kind in experts:  # (E, out, in): one matrix per expert
            for e in range(value.shape[0]):
                state[f"model.layers.{layer}.{block}.experts.{e}.{experts[kind]}.weight"] = value[e].clone()
            continue
        if pattern not in names:
            raise ValueError(f"tensor {tensor.name!r} of a {arch} mixture has no Hugging Face name here")
        hf = names[pattern].format(i=layer) if layer is not None else names[pattern]
        if model_type == "mixtral" and hf.endswith("mlp.gate.weight"):
            hf = hf.replace("mlp.gate.weight", "block_sparse_moe.gate.weight")
        if arch == "llama" and kind in ("attn_q", "attn_k") and parts[-1] == "weight":
            heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
            value = unpermute_qk(value, heads)
        if kind == "ffn_gate_inp_shexp":
            value = value.reshape(1, -1)  # transformers' shared_expert_gate is a (1, hidden) Linear
        state[hf] = value
    return state


def write_mixture(gguf_path: Path, tmp: Path, tokenizer) -> dict[str, Any]:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer of the mixture
    in `gguf_path` into `tmp`; returns the parameter count, vocabulary size and model type."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig, GenerationConfig

    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    tensors = {t.name for t in reader.tensors}
    fields = mixture_config(reader, arch, tensors)
    state = mixture_state(reader, arch, fields)
    fields["vocab_size"] = state["model.embed_tokens.weight"].shape[0]
    config = AutoConfig.for_model(**fields)
    config.architectures = [family(config.model_type).architecture]
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    log.info("read a %s mixture (%d experts, top %d) from %s", config.model_type, fields.get("num_local_experts")
             or fields.get("num_experts"), fields["num_experts_per_tok"], gguf_path)
    return {"num_parameters": sum(t.numel() for t in state.values()), "vocab_size": fields["vocab_size"],
            "model_type": config.model_type}
