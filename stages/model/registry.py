"""Every model family the pipeline takes, one entry each: what a family is, read by the model
config, the checkpoint source check, training, the memory planner and the deployment writers.
Adding a family is one entry here, its layer code in stages/model/ if our decoder lacks a switch it
needs, and its tests (tests/unit/test_families.py runs every stage on each).

The switches of our decoder say what transformers' class of that `model_type` builds (the names of
`LlamaConfig`'s properties, which read them). Torch-free: the config check reads this while
Snakemake parses the workflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # what the README's support table calls it
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]: transformers' class
    ours: bool  # every stage runs our model: every parallel layout; else transformers' model, data parallel + ZeRO
    # (continued) pretraining and full SFT run our model, in every layout, even where not `ours`
    # (adapters and the later stages then use transformers' model)
    trains_ours: bool = False
    # transformers 5.23's defaults for the keys a config.json may omit (its config class's field
    # defaults; tests/unit/test_model_config_fidelity.py checks them against transformers); our families only
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    # -- our decoder's switches --------------------------------------------------------------------
    qkv_bias: str = "attention_bias"  # "attention_bias": as config.json says; "always"; "never"
    o_proj_bias: bool = False  # attention_bias also on o_proj
    qk_norm: bool = False  # an RMSNorm over head_dim on every query and key head, before RoPE
    fused_gate_up: bool = False  # one gate_up_proj whose output rows are [gate; up]
    sandwich_norms: bool = False  # a norm after attention and after the MLP, before each residual add
    rope_interleaved: bool = False  # RoPE on pairs (0,1), (2,3), ... instead of (i, i + d/2)
    partial_rotary_factor: float | None = None  # the share of each head RoPE turns when config.json is silent
    windows: str = "none"  # sliding windows: "none", "every_layer" (sliding_window), "per_layer" (layer_types)
    gpt2_blocks: bool = False  # learned positions, LayerNorm with bias, GELU MLP, fused qkv (gpt2_layout)
    # -- deployment ----------------------------------------------------------------------------------
    gguf_arch: str | None = None  # llama.cpp's architecture our GGUF writer writes it as; None: not written
    genai_named: bool = False  # onnxruntime-genai runs it under its model_type; else as its generic "decoder"
    smooth_fold: bool = False  # A8W8 SmoothQuant scales fold into its norms (compressed-tensors export)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_defaults", MappingProxyType(dict(self.hf_defaults)))

    @property
    def full_training_on_ours(self) -> bool:
        return self.ours or self.trains_ours


FAMILIES: tuple[Family, ...] = (
    Family("Llama", "llama", "LlamaForCausalLM", ours=True, o_proj_bias=True, gguf_arch="llama", genai_named=True,
           smooth_fold=True,
           hf_defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=None, head_dim=None, max_position_embeddings=2048,
                            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, attention_bias=False, mlp_bias=False)),
    Family("Qwen2", "qwen2", "Qwen2ForCausalLM", ours=True, qkv_bias="always", windows="per_layer",
           gguf_arch="qwen2", genai_named=True, smooth_fold=True,
           hf_defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=32, head_dim=None, max_position_embeddings=32768,
                            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, use_sliding_window=False, sliding_window=4096, max_window_layers=28,
                            layer_types=None)),
    Family("Mistral", "mistral", "MistralForCausalLM", ours=True, qkv_bias="never", windows="every_layer",
           gguf_arch="llama", genai_named=True, smooth_fold=True,
           hf_defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=None, max_position_embeddings=131072,
                            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, sliding_window=4096)),
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM", ours=True, o_proj_bias=True, qk_norm=True, windows="per_layer",
           genai_named=True, smooth_fold=True,
           hf_defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, attention_bias=False, use_sliding_window=False, sliding_window=4096,
                            max_window_layers=28, layer_types=None)),
    Family("GLM", "glm", "GlmForCausalLM", ours=True, fused_gate_up=True, rope_interleaved=True,
           partial_rotary_factor=0.5, smooth_fold=True,
           hf_defaults=dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                            num_attention_heads=32, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                            rms_norm_eps=1.5625e-07, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, attention_bias=True)),
    Family("GLM-4", "glm4", "Glm4ForCausalLM", ours=True, fused_gate_up=True, sandwich_norms=True,
           rope_interleaved=True, partial_rotary_factor=0.5, smooth_fold=True,
           hf_defaults=dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                            num_attention_heads=32, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                            rms_norm_eps=1.5625e-07, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, attention_bias=True)),
    # GPT-2 pretrains and fully fine-tunes on our model (stages.model.gpt2_layout); LoRA, prefix tuning
    # and the later stages use transformers' GPT2LMHeadModel
    Family("GPT-2", "gpt2", "GPT2LMHeadModel", ours=False, trains_ours=True, o_proj_bias=True, gpt2_blocks=True),
    Family("OPT", "opt", "OPTForCausalLM", ours=False),
    Family("Bloom", "bloom", "BloomForCausalLM", ours=False),
    Family("GPT-NeoX", "gpt_neox", "GPTNeoXForCausalLM", ours=False),
)
BY_ARCHITECTURE: Mapping[str, Family] = MappingProxyType({f.architecture: f for f in FAMILIES})
BY_MODEL_TYPE: Mapping[str, Family] = MappingProxyType({f.model_type: f for f in FAMILIES})


def family(model_type: str) -> Family:
    """The family of a config.json `model_type` (KeyError naming the known ones otherwise)."""
    try:
        return BY_MODEL_TYPE[model_type]
    except KeyError:
        raise KeyError(f"model_type {model_type!r} is not a known family; known: {', '.join(BY_MODEL_TYPE)}") from None


def model_types(**traits: Any) -> tuple[str, ...]:
    """The model_types of the families with every given trait, in registry order:
    `model_types(ours=True)`, `model_types(fused_gate_up=True)`."""
    return tuple(f.model_type for f in FAMILIES if all(getattr(f, k) == v for k, v in traits.items()))
