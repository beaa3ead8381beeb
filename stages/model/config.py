"""The Llama-family model configuration and its named flavours.

One dataclass describes every size; a flavour is a named set of architecture fields. The
vocabulary size is not part of a flavour: it comes from the tokenizer that `prepare` trained (or
from the checkpoint being loaded), so the same flavour serves any tokenizer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LlamaConfig:
    vocab_size: int = 32000  # rows of the embedding and of lm_head
    hidden_size: int = 4096  # model width d
    intermediate_size: int = 11008  # SwiGLU inner width
    num_hidden_layers: int = 32  # transformer blocks
    num_attention_heads: int = 32  # query heads
    num_key_value_heads: int | None = None  # KV heads (GQA); None means = attention heads
    head_dim: int | None = None  # None means hidden_size // num_attention_heads
    max_position_embeddings: int = 4096  # longest sequence RoPE is prepared for
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling dict, e.g. {"rope_type": "llama3", ...}
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 style)
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    initializer_range: float = 0.02  # std of the normal init of linear and embedding weights
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"  # "llama" or "qwen2": selects config.json's architecture name
    extra: dict[str, Any] = field(default_factory=dict)  # HF config keys we carry but do not use

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type={self.model_type!r}: expected 'llama' or 'qwen2'")

    # -- Hugging Face config.json -------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that `transformers.AutoConfig` reads for this model."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        d["architectures"] = [arch]
        d["hidden_act"] = "silu"
        d["torch_dtype"] = "float32"
        if self.model_type == "qwen2":
            d.pop("attention_bias")  # Qwen2 always has q/k/v bias
        d.update(self.extra)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Read a Llama or Qwen2 config.json (unknown keys are kept in `extra`)."""
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(
                f"config.json has model_type={model_type!r}; this project loads 'llama' and "
                "'qwen2' checkpoints"
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        if model_type == "qwen2":
            known["attention_bias"] = True
        ignored = {"architectures", "hidden_act", "torch_dtype", "dtype", "transformers_version"}
        extra = {k: v for k, v in d.items() if k not in names and k not in ignored}
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json has hidden_act={d['hidden_act']!r}; only 'silu' is supported")
        return cls(**known, extra=extra)

    def num_parameters(self) -> int:
        """Parameter count, computed from the shapes (no model is built)."""
        d, h, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.attention_bias:
            attn += h * hd + 2 * kv * hd
        mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return emb + self.num_hidden_layers * per_layer + d + head


# Architecture fields of each named flavour. Real sizes follow the published Llama 2 / 3.2 shapes.
FLAVOURS: dict[str, dict[str, Any]] = {
    "debug": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512),
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=1024),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
               tie_word_embeddings=True, rms_norm_eps=1e-5,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               max_position_embeddings=4096, rms_norm_eps=1e-5),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                max_position_embeddings=4096, rms_norm_eps=1e-5),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5),
}


def config_for_flavour(flavour: str, vocab_size: int, **overrides: Any) -> LlamaConfig:
    """The config of a named flavour with the tokenizer's vocabulary and optional field overrides."""
    if flavour not in FLAVOURS:
        raise ValueError(f"model.flavour={flavour!r} is unknown; choose one of {sorted(FLAVOURS)}")
    fields = {**FLAVOURS[flavour], **{k: v for k, v in overrides.items() if v is not None}}
    return LlamaConfig(vocab_size=vocab_size, **fields)
