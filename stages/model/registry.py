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
    ours: bool  # every stage runs our model: every parallel layout (a mixture of experts: stages/model/moe_layouts.py);
    #   else transformers' model, data parallel + ZeRO
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
    qk_norm_whole: bool = False  # OLMoE: q_norm and k_norm over the whole q and k projections (every head at once)
    clip_qkv: bool = False  # OLMoE: config.json's clip_qkv clamps q, k and v
    # -- mixture of experts (stages/model/moe.py) ------------------------------------------------------
    moe_block: str | None = None  # the layer attribute (and checkpoint name) of its sparse block; None: dense
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up, down
    shared_expert: bool = False  # Qwen2-MoE: a dense expert every token runs, scaled by sigmoid(shared_expert_gate)
    renormalize_topk: str = "norm_topk_prob"  # "always" (Mixtral), or as config.json's norm_topk_prob says
    sparse_step: bool = False  # decoder_sparse_step and mlp_only_layers choose the sparse layers (else all are)
    experts_key: str = "num_experts"  # config.json's name for the number of routed experts (both are read)
    # LoRA may adapt the MLP projections: not where peft maps their names onto transformers 5's fused experts
    # (its MoE conversion of Mixtral, Qwen3-MoE and OLMoE adapters), so those adapt attention only
    lora_mlp: bool = True
    rope_theta: float = 10000.0  # transformers' RoPE base when config.json has none
    # config.json keys honoured under another of our field names (config.json key -> LlamaConfig field)
    hf_renames: Mapping[str, str] = field(default_factory=dict)
    # -- deployment ----------------------------------------------------------------------------------
    gguf_arch: str | None = None  # llama.cpp's architecture our GGUF writer writes it as; None: not written
    genai_named: bool = False  # onnxruntime-genai runs it under its model_type; else as its generic "decoder"
    smooth_fold: bool = False  # A8W8 SmoothQuant scales fold into its norms (compressed-tensors export)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_defaults", MappingProxyType(dict(self.hf_defaults)))
        object.__setattr__(self, "hf_renames", MappingProxyType(dict(self.hf_renames)))

    @property
    def moe(self) -> bool:
        """A mixture of experts: sparse MoE blocks in place of (some) dense MLPs."""
        return self.moe_block is not None

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
           gguf_arch="qwen3", genai_named=True, smooth_fold=True,
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
    # Mixtures of experts on our decoder (stages/model/moe.py): data parallel, ZeRO, tensor parallelism of
    # attention and expert parallelism (stages/model/moe_layouts.py, stages/parallel/experts.py)
    Family("Mixtral", "mixtral", "MixtralForCausalLM", ours=True, qkv_bias="never", windows="every_layer",
           moe_block="block_sparse_moe", expert_names=("w1", "w3", "w2"), renormalize_topk="always",
           experts_key="num_local_experts", hf_renames={"num_local_experts": "num_experts"}, rope_theta=1e6,
           lora_mlp=False, gguf_arch="llama",
           hf_defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=None,
                            max_position_embeddings=131072, rms_norm_eps=1e-5, initializer_range=0.02,
                            tie_word_embeddings=False, hidden_act="silu", attention_dropout=0.0, sliding_window=None,
                            num_experts_per_tok=2, num_local_experts=8,
                            router_aux_loss_coef=0.001, router_jitter_noise=0.0)),
    Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM", ours=True, moe_block="mlp", shared_expert=True,
           sparse_step=True, hf_renames={"qkv_bias": "attention_bias"}, gguf_arch="qwen2moe",
           hf_defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                            num_attention_heads=16, num_key_value_heads=16, head_dim=None,
                            max_position_embeddings=32768,
                            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, qkv_bias=True, decoder_sparse_step=1, moe_intermediate_size=1408,
                            shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                            norm_topk_prob=False, router_aux_loss_coef=0.001, mlp_only_layers=None)),
    Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM", ours=True, o_proj_bias=True, qk_norm=True,
           moe_block="mlp", sparse_step=True, experts_key="num_local_experts",
           hf_renames={"num_local_experts": "num_experts"}, lora_mlp=False, gguf_arch="qwen3moe",
           hf_defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=None, max_position_embeddings=32768,
                            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, attention_bias=False, decoder_sparse_step=1,
                            moe_intermediate_size=768, num_experts_per_tok=8, num_local_experts=128,
                            norm_topk_prob=False, router_aux_loss_coef=0.001, mlp_only_layers=None)),
    Family("OLMoE", "olmoe", "OlmoeForCausalLM", ours=True, o_proj_bias=True, qk_norm_whole=True, clip_qkv=True,
           moe_block="mlp", lora_mlp=False, gguf_arch="olmoe",
           hf_defaults=dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=None, head_dim=None,
                            max_position_embeddings=4096,
                            rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu",
                            attention_dropout=0.0, attention_bias=False, clip_qkv=None, num_experts_per_tok=8,
                            num_experts=64, norm_topk_prob=False, router_aux_loss_coef=0.01)),
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
