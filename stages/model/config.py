"""The Llama-family model configuration, its Hugging Face config.json, and the named flavours.

One dataclass describes every size of six transformers families that share one architecture, each
a few switches away from Llama: `llama`, `qwen2` (q/k/v bias, per-layer sliding windows),
`mistral` (a sliding window on every layer), `qwen3` (Qwen2's windows plus an RMSNorm over each
query and key head, `q_norm` / `k_norm`), `glm` (GLM-4-0414's predecessor in transformers: q/k/v
bias, one fused `gate_up_proj`, RoPE on the first half of each head in interleaved pairs) and
`glm4` (GLM plus a norm after attention and after the MLP, before each residual add), and four
mixtures of experts on the same blocks (stages/model/moe.py): `mixtral` (Mistral's attention, a
sparse `block_sparse_moe`), `qwen2_moe` (Qwen2's attention, sparse layers by `decoder_sparse_step` /
`mlp_only_layers`, a shared expert), `qwen3_moe` (Qwen3's attention, Qwen2-MoE's layer choice, no
shared expert) and `olmoe` (q/k norms over the whole projections, `clip_qkv`). Field names and
meanings are transformers' own, per family. A flavour is a named set of architecture fields; the
vocabulary size is not part of it (it comes from the tokenizer or from the checkpoint being loaded).

`LlamaConfig.from_hf_dict` sorts every key of a config.json into one of three kinds:

- honoured (`HONOURED_KEYS`): read into a field and implemented exactly as transformers does,
  in the transformers-4 layout (top-level `rope_theta`, `rope_scaling`) and the transformers-5
  layout (`rope_parameters`);
- carried (everything else transformers' class for that model_type does not read either, e.g.
  `transformers_version`, `architectures`, `dtype`, `use_cache`, `pretraining_tp`): kept in
  `extra` and written back unchanged. Keys outside `CARRIED_KEYS` are logged once as unknown;
- refused: a value we cannot honour raises ValueError naming the file, the key, the value and
  what is supported (`REFUSED_KEYS` lists the keys refused whenever they change the maths;
  honoured keys are refused for unsupported values: hidden_act other than silu, rope types other
  than `rope_types.SUPPORTED_ROPE_TYPES`, partial rotary factors, sliding layers without a window, ...).

`to_hf_dict` writes the config back in the layout it came in (a transformers-5 config keeps
`rope_parameters`, a transformers-4 one `rope_theta` + `rope_scaling`), with the source's
`model_type` and `architectures`, so `AutoModelForCausalLM.from_pretrained` builds the same class.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.model import gpt2_layout
from stages.model.registry import FAMILIES, Family, family, model_types
from stages.model.rope_types import check_rope_scaling, rope_type

log = logging.getLogger(__name__)

ARCHITECTURES = {f.model_type: f.architecture for f in FAMILIES if f.ours or f.trains_ours}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
ROPE_LAYOUTS = ("rope_scaling", "rope_parameters")  # transformers 4, transformers 5
ACTIVATIONS = ("silu", "swish")  # both are SiLU in transformers' ACT2FN
# GPT-2's MLP: transformers' ACT2FN names we compute exactly (gelu_new and gelu_pytorch_tanh are the
# tanh approximation, gelu the erf form)
GELU_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu")
LAYER_TYPES = {"full_attention": False, "attention": False, "sliding_attention": True}  # -> slides?

# transformers' defaults for the keys a config.json may omit, per family of ours (stages/model/registry.py)
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {f.model_type: dict(f.hf_defaults) for f in FAMILIES if f.hf_defaults}
# The share of each head's dimensions RoPE rotates, when config.json does not say: GLM's config
# classes default to half (transformers 5 writes it into rope_parameters, 4 at the top level).
PARTIAL_ROTARY_DEFAULTS = {f.model_type: f.partial_rotary_factor for f in FAMILIES if f.partial_rotary_factor}
WINDOWED_PER_LAYER = model_types(windows="per_layer")  # use_sliding_window + max_window_layers / layer_types
# Honoured keys of each family: its defaults above, the RoPE keys and the special token ids.
# (Qwen2's config class has no head_dim, but its modeling reads one when config.json has it.)
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
HONOURED_KEYS: dict[str, tuple[str, ...]] = {
    family: ("model_type", *defaults, *_ROPE_KEYS, *_TOKEN_KEYS,
             *(("partial_rotary_factor",) if family in PARTIAL_ROTARY_DEFAULTS else ()))
    for family, defaults in FAMILY_DEFAULTS.items()
}
# Families whose config class has no head_dim (their modeling reads one when config.json has it):
# written only when it differs from hidden_size / num_attention_heads.
HEAD_DIM_IMPLICIT = ("qwen2", "qwen2_moe", "qwen3_moe", "olmoe")
# Our MoE options transformers does not have: read when config.json has them, written when set.
_OUR_MOE_KEYS: dict[str, Any] = {"router_z_loss_coef": 0.0, "moe_capacity_factor": None}
for _moe in (f.model_type for f in FAMILIES if f.moe):
    HONOURED_KEYS[_moe] = (*HONOURED_KEYS[_moe], "num_experts", "num_local_experts", *_OUR_MOE_KEYS)
# Keys of MoE classes carried without comment: what forward returns, and Qwen-MoE's windows (checked
# to be off by _moe_fields).
_QWEN_MOE_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
MOE_CARRIED_KEYS = {"mixtral": ("output_router_logits",), "olmoe": ("output_router_logits",),
                    "qwen2_moe": ("output_router_logits", *_QWEN_MOE_WINDOWS),
                    "qwen3_moe": ("output_router_logits", *_QWEN_MOE_WINDOWS)}
# Bookkeeping that changes nothing in the forward pass: carried without comment.
CARRIED_KEYS = frozenset({
    "architectures", "transformers_version", "torch_dtype", "dtype", "use_cache", "pretraining_tp",
    "output_attentions", "output_hidden_states", "return_dict", "_name_or_path", "name_or_path",
    "_commit_hash", "attn_implementation", "_attn_implementation_autoset", "id2label", "label2id",
    "num_labels", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "torchscript", "use_bfloat16", "sep_token_id", "decoder_start_token_id",
    "max_length", "min_length", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
    "num_beams", "length_penalty", "no_repeat_ngram_size",
})
# Keys refused when present with anything but the neutral value, and why.
REFUSED_KEYS: dict[str, tuple[Any, str]] = {
    "quantization_config": (None, "a quantized checkpoint; this model loads float weights "
                                  "(stages.quant.loader.load_quantized reads GPTQ checkpoints)"),
    "is_causal": (True, "only causal (decoder) attention is implemented"),
    "per_layer_config": (None, "per-layer configs (heterogeneous models) are not implemented"),
    "partial_rotary_factor": (1.0, "only GLM's classes rotate part of each head; transformers' Llama, "
                                   "Qwen2/3 and Mistral rotate every head dimension"),
}


@dataclass
class LlamaConfig:
    """Architecture of one Llama-family model; names and meanings as in transformers' config of
    `model_type`. Fields that belong to one family only say so."""

    vocab_size: int = 32000  # rows of the embedding and of lm_head
    hidden_size: int = 4096  # model width d
    intermediate_size: int = 11008  # SwiGLU inner width
    num_hidden_layers: int = 32  # transformer blocks
    num_attention_heads: int = 32  # query heads
    num_key_value_heads: int | None = None  # KV heads (GQA); None means = attention heads
    head_dim: int | None = None  # None means hidden_size // num_attention_heads
    max_position_embeddings: int = 4096  # context length; dynamic/yarn RoPE scale relative to it
    rms_norm_eps: float = 1e-6  # epsilon inside RMSNorm
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: dict[str, Any] | None = None  # HF scaling dict with "rope_type" (see rope.py); None: plain
    rope_layout: str = "rope_scaling"  # how config.json spells RoPE: "rope_scaling" (transformers 4:
    #   top-level rope_theta + rope_scaling, read by 4 and 5) or "rope_parameters" (transformers 5)
    partial_rotary_factor: float = 1.0  # glm/glm4 only (their default 0.5): RoPE turns the first
    #   int(head_dim * factor) dimensions of each head, in interleaved pairs; the rest pass unrotated
    hidden_act: str = "silu"  # MLP activation: "silu" (or its alias "swish")
    attention_bias: bool = False  # llama, qwen3: bias on q, k, v and o_proj; qwen2: q/k/v bias (always);
    #   glm/glm4: q/k/v bias (default true); mistral: none
    mlp_bias: bool = False  # llama only: bias on gate/up/down_proj
    attention_dropout: float = 0.0  # dropout on the attention probabilities, in training only
    resid_pdrop: float = 0.0  # gpt2 only: dropout on each sub-block's output, in training only
    embd_pdrop: float = 0.0  # gpt2 only: dropout on the summed token and position embeddings
    sliding_window: int | None = None  # mistral: window of every layer; qwen2/qwen3: of their sliding layers
    use_sliding_window: bool = False  # qwen2/qwen3 only: sliding layers exist at all
    max_window_layers: int | None = None  # qwen2/qwen3 only: layers >= this index slide (when layer_types is None)
    layer_types: list[str] | None = None  # qwen2/qwen3 only: "full_attention"/"sliding_attention" per layer
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    initializer_range: float = 0.02  # std of the normal init of linear and embedding weights
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    clip_qkv: float | None = None  # olmoe only: q, k and v clamped to [-clip_qkv, clip_qkv]
    # -- mixture of experts: mixtral, qwen2_moe, qwen3_moe, olmoe (stages/model/moe.py) --------------
    num_experts: int = 0  # routed experts per sparse layer (config.json: num_local_experts for mixtral,
    #   qwen3_moe; num_experts for the others; both spellings are read); 0: a dense model
    num_experts_per_tok: int = 2  # top k: experts each token runs
    moe_intermediate_size: int | None = None  # qwen2_moe/qwen3_moe: each expert's width (mixtral, olmoe:
    #   intermediate_size); the dense layers of mlp_only_layers keep intermediate_size
    shared_expert_intermediate_size: int = 0  # qwen2_moe: width of the shared expert every token runs
    norm_topk_prob: bool = False  # renormalise the k routing weights to sum to one (mixtral: always)
    decoder_sparse_step: int = 1  # qwen2_moe/qwen3_moe: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] | None = None  # ... and i is not listed here (dense MLP there)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss training adds
    router_jitter_noise: float = 0.0  # mixtral: multiplicative uniform noise on the router input, training only
    # Ours, not transformers' (written to config.json only when set; transformers ignores them):
    router_z_loss_coef: float = 0.0  # weight of ST-MoE's router z-loss in training
    moe_capacity_factor: float | None = None  # None: dropless routing; else each expert's token budget
    #   as a multiple of an even share (transformers always routes dropless)
    experts_key: str | None = None  # how config.json spells num_experts (None: as the family writes it)
    model_type: str = "llama"  # transformers' family and class (ARCHITECTURES)
    extra: dict[str, Any] = field(default_factory=dict)  # config.json keys carried unchanged

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
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
        activations = GELU_ACTIVATIONS if self.model_type == "gpt2" else ACTIVATIONS
        if self.hidden_act not in activations:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported for model_type={self.model_type!r}; "
                             f"supported: {', '.join(activations)}")
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout={self.rope_layout!r}: expected one of {ROPE_LAYOUTS}")
        check_rope_scaling(self.rope_scaling, self.rope_layout)
        for name in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be in [0, 1)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive number of tokens or null")
        if self.partial_rotary_factor != 1.0 and self.model_type not in PARTIAL_ROTARY_DEFAULTS:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor!r} with model_type="
                             f"{self.model_type!r}: {REFUSED_KEYS['partial_rotary_factor'][1]}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor!r} must be in (0, 1] and rotate an "
                             f"even number of dimensions (head_dim={self.head_dim} -> {self.rotary_dim})")
        {"llama": self._check_llama, "qwen2": self._check_windowed, "qwen3": self._check_windowed,
         "mistral": self._check_mistral, "glm": self._check_glm, "glm4": self._check_glm,
         "gpt2": self._check_gpt2, "mixtral": self._check_mixtral, "qwen2_moe": self._check_qwen_moe,
         "qwen3_moe": self._check_qwen_moe, "olmoe": self._check_olmoe}[self.model_type]()
        self._check_experts()
        if self.model_type != "gpt2" and (self.resid_pdrop or self.embd_pdrop):
            raise ValueError(f"resid_pdrop={self.resid_pdrop}, embd_pdrop={self.embd_pdrop} exist only for "
                             f"model_type 'gpt2'; {ARCHITECTURES[self.model_type]} has attention_dropout only")

    def _refuse_set(self, names: tuple[str, ...], owners: str) -> None:
        """Raise if any of `names` (options of the families `owners`) is set for this family."""
        set_here = {n: getattr(self, n) for n in names if getattr(self, n) not in (None, False)}
        if set_here:
            raise ValueError(f"{set_here} exist only for model_type {owners}, not {self.model_type!r}; "
                             f"transformers' {ARCHITECTURES[self.model_type]} has no such option")

    def _check_llama(self) -> None:
        self._refuse_set(("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
                         "'qwen2' / 'qwen3' / 'mistral'")

    def _check_mistral(self) -> None:
        self._refuse_set(("attention_bias", "mlp_bias"), "'llama' (attention_bias also 'qwen3', 'glm', 'glm4')")
        self._refuse_set(("use_sliding_window", "max_window_layers", "layer_types"), "'qwen2' / 'qwen3'")

    def _check_gpt2(self) -> None:
        self._refuse_set(("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
                         "'qwen2' / 'qwen3' / 'mistral'")
        if self.num_key_value_heads != self.num_attention_heads or \
                self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"GPT-2 has one key/value head per query head and head_dim = hidden_size / heads; got "
                             f"num_key_value_heads={self.num_key_value_heads}, head_dim={self.head_dim}")
        if self.rope_scaling is not None:
            raise ValueError(f"rope_scaling={self.rope_scaling!r}: GPT-2 has learned absolute positions, no RoPE")
        self.attention_bias = self.mlp_bias = True  # every GPT-2 projection has a bias

    def _check_glm(self) -> None:
        self._refuse_set(("mlp_bias",), "'llama'")
        self._refuse_set(("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
                         "'qwen2' / 'qwen3' / 'mistral'")

    def _check_mixtral(self) -> None:
        self._refuse_set(("attention_bias", "mlp_bias"), "'llama' (attention_bias also 'qwen3', 'glm', 'glm4')")
        self._refuse_set(("use_sliding_window", "max_window_layers", "layer_types"), "'qwen2' / 'qwen3'")

    def _check_qwen_moe(self) -> None:
        self._refuse_set(("mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
                         "'llama' (mlp_bias), 'qwen2' / 'qwen3' / 'mistral' / 'mixtral' (windows)")

    def _check_olmoe(self) -> None:
        self._refuse_set(("mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
                         "'llama' (mlp_bias), 'qwen2' / 'qwen3' / 'mistral' / 'mixtral' (windows)")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"head_dim={self.head_dim} with num_attention_heads={self.num_attention_heads} and "
                             f"hidden_size={self.hidden_size}: OLMoE's q_norm spans hidden_size, so head_dim must be "
                             "hidden_size / num_attention_heads")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"clip_qkv={self.clip_qkv!r} must be a positive number or null")

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: set only for the MoE families, and consistent there."""
        moe_fields = ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                      "mlp_only_layers", "router_jitter_noise", "router_z_loss_coef", "moe_capacity_factor",
                      "clip_qkv")
        if not self.family.moe:
            self._refuse_set(moe_fields, "'mixtral' / 'qwen2_moe' / 'qwen3_moe' / 'olmoe' (clip_qkv: 'olmoe')")
            return
        if self.clip_qkv is not None and not self.family.clip_qkv:
            self._refuse_set(("clip_qkv",), "'olmoe'")
        if self.shared_expert_intermediate_size and not self.family.shared_expert:
            self._refuse_set(("shared_expert_intermediate_size",), "'qwen2_moe'")
        if self.moe_intermediate_size is not None and not self.family.sparse_step:
            self._refuse_set(("moe_intermediate_size",), "'qwen2_moe' / 'qwen3_moe' (the others: intermediate_size)")
        if self.router_jitter_noise and self.model_type != "mixtral":
            self._refuse_set(("router_jitter_noise",), "'mixtral'")
        if self.num_experts < 1 or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}: a "
                             f"{self.family.name} model needs at least one expert and 1 <= top k <= num_experts")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step!r} must be at least 1")
        bad = [i for i in self.mlp_only_layers or [] if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers={self.mlp_only_layers!r}: {bad} are not layers of this model "
                             f"(0 .. {self.num_hidden_layers - 1})")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor!r} must be positive, or null for "
                             "dropless routing")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must not be negative")
        if self.experts_key is None:
            self.experts_key = self.family.experts_key

    def _check_windowed(self) -> None:
        """Qwen2 and Qwen3: sliding windows on the layers `layer_types` (or `max_window_layers`) marks."""
        self._refuse_set(("mlp_bias",), "'llama'")
        if self.model_type == "qwen2":
            self.attention_bias = True  # Qwen2 always has q/k/v bias (and never an o_proj bias)
        if self.max_window_layers is None:
            self.max_window_layers = FAMILY_DEFAULTS[self.model_type]["max_window_layers"]
        if self.layer_types is not None:
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if bad or len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types={self.layer_types!r} must list one of {sorted(LAYER_TYPES)} for "
                                 f"each of the num_hidden_layers={self.num_hidden_layers} layers")
            if any(LAYER_TYPES[t] for t in self.layer_types) and self._layer_window() is None:
                raise ValueError(f"layer_types has sliding_attention layers but use_sliding_window="
                                 f"{self.use_sliding_window} and sliding_window={self.sliding_window}: "
                                 "transformers fails on this config too; set use_sliding_window: true and a "
                                 "sliding_window, or make every layer full_attention")

    def _layer_window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    # -- what the model builds --------------------------------------------------------------------
    @property
    def family(self) -> Family:
        """The family's entry in stages/model/registry.py: the switches below read it."""
        return family(self.model_type)

    @property
    def qkv_bias(self) -> bool:
        """Bias on q_proj, k_proj and v_proj (GPT-2: on the fused qkv_proj)."""
        return {"always": True, "never": False}.get(self.family.qkv_bias, self.attention_bias)

    @property
    def o_proj_bias(self) -> bool:
        """Bias on o_proj: transformers' Llama, Qwen3 and GPT-2 put attention_bias on o_proj too,
        Qwen2 and GLM never do."""
        return self.attention_bias and self.family.o_proj_bias

    @property
    def gpt2_blocks(self) -> bool:
        """GPT-2: learned absolute positions (no RoPE), LayerNorm with bias, a GELU MLP without gate
        (up_proj, down_proj), q/k/v fused in `qkv_proj` ([q; k; v] rows); see stages.model.gpt2_layout."""
        return self.family.gpt2_blocks

    @property
    def qk_norm(self) -> bool:
        """Qwen3: an RMSNorm over head_dim on every query and key head, before RoPE."""
        return self.family.qk_norm

    @property
    def fused_gate_up(self) -> bool:
        """GLM: one `gate_up_proj` whose output is [gate; up] (2 x intermediate_size rows)."""
        return self.family.fused_gate_up

    @property
    def sandwich_norms(self) -> bool:
        """GLM-4: `post_self_attn_layernorm` and `post_mlp_layernorm` on each sub-block's output."""
        return self.family.sandwich_norms

    @property
    def rope_interleaved(self) -> bool:
        """GLM rotates pairs of adjacent dimensions (0,1), (2,3), ...; Llama pairs i with i + d/2."""
        return self.family.rope_interleaved

    @property
    def qk_norm_whole(self) -> bool:
        """OLMoE: q_norm over the whole query projection (H x hd), k_norm over the keys' (K x hd)."""
        return self.family.qk_norm_whole

    @property
    def moe(self) -> bool:
        """A mixture of experts (stages.model.moe): sparse blocks in place of some or all MLPs."""
        return self.family.moe

    def sparse_layers(self) -> list[bool]:
        """Per layer, whether its MLP is a sparse MoE block, as transformers' class decides
        (Qwen-MoE: every decoder_sparse_step-th layer not in mlp_only_layers; the others: all)."""
        if not self.moe:
            return [False] * self.num_hidden_layers
        dense = set(self.mlp_only_layers or [])
        return [i not in dense and (i + 1) % self.decoder_sparse_step == 0 for i in range(self.num_hidden_layers)]

    @property
    def expert_width(self) -> int:
        """Each routed expert's inner width."""
        return self.moe_intermediate_size if self.family.sparse_step else self.intermediate_size

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head RoPE turns (the first ones; all unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_windows(self) -> list[int | None]:
        """Per layer, the sliding-window length in tokens (the query and the window-1 tokens before
        it), or None for full causal attention, as transformers' class of `model_type` decides."""
        n = self.num_hidden_layers
        if self.family.windows == "every_layer":
            return [self.sliding_window] * n
        if self.family.windows == "per_layer":
            window = self._layer_window()
            if self.layer_types is not None:
                return [window if LAYER_TYPES[t] else None for t in self.layer_types]
            return [window if window is not None and i >= self.max_window_layers else None for i in range(n)]
        return [None] * n

    # -- Hugging Face config.json -------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json that `transformers.AutoConfig` reads for this model: the carried keys
        unchanged, then every honoured field of the family, RoPE in `rope_layout`."""
        d = dict(self.extra)
        d.setdefault("architectures", [ARCHITECTURES[self.model_type]])
        if "dtype" not in d:
            d.setdefault("torch_dtype", "float32")
        if self.model_type == "gpt2":
            return gpt2_layout.config_dict(self, d)
        family = [k for k in FAMILY_DEFAULTS[self.model_type] if k != "head_dim"]
        renames = self.family.hf_renames
        d.update({k: getattr(self, renames.get(k, k)) for k in ("model_type", *family, *_TOKEN_KEYS)})
        if self.moe:
            d.pop(self.family.experts_key)
            d[self.experts_key] = self.num_experts  # spelled as the source spelled it
            d.update({k: getattr(self, k) for k in _OUR_MOE_KEYS if getattr(self, k) != _OUR_MOE_KEYS[k]})
        implicit = self.head_dim == self.hidden_size // self.num_attention_heads
        if self.model_type not in HEAD_DIM_IMPLICIT or not implicit:
            d["head_dim"] = self.head_dim  # the config classes of HEAD_DIM_IMPLICIT have none: written when it differs
        if self.model_type == "mixtral" and implicit:
            d["head_dim"] = None  # as MixtralConfig writes it (its modeling then takes hidden_size / heads)
        if self.model_type in WINDOWED_PER_LAYER and self.layer_types is None:
            d.pop("layer_types")  # absent (transformers 4): max_window_layers decides, as it was read
        partial = {}
        if self.model_type in PARTIAL_ROTARY_DEFAULTS or self.partial_rotary_factor != 1.0:
            partial = {"partial_rotary_factor": self.partial_rotary_factor}
        if self.rope_layout == "rope_parameters":
            d["rope_parameters"] = {**(self.rope_scaling or {"rope_type": "default"}), **partial,
                                    "rope_theta": self.rope_theta}
        else:
            d["rope_theta"], d["rope_scaling"] = self.rope_theta, self.rope_scaling
            d.update(partial)  # transformers 4 read it at the top level
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str | Path | None = None) -> "LlamaConfig":
        """Read a config.json of a family in ARCHITECTURES (either RoPE layout). Keys the config omits
        take transformers' defaults for that model_type. Raises ValueError naming `source` (the
        config.json path, when known), the key, its value and what is supported, for anything
        that cannot be honoured."""
        where = str(source) if source is not None else "config.json"
        try:
            return cls(**_fields_from_hf(d, where))
        except ValueError as e:
            if str(e).startswith(where):
                raise
            raise ValueError(f"{where}: {e}") from None

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count, computed from the shapes (no model is built). `active`: a mixture of
        experts counts the k routed experts one token runs, not all of them (the FLOPs of a token)."""
        d, h, kv, hd, f = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                           self.intermediate_size)
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        attn += (h * hd + 2 * kv * hd) * self.qkv_bias + d * self.o_proj_bias
        attn += (h * hd + kv * hd) * self.qk_norm_whole if self.qk_norm_whole else 2 * hd * self.qk_norm
        mlp = (2 if self.gpt2_blocks else 3) * d * f + ((f + d) if self.gpt2_blocks else (2 * f + d)) * self.mlp_bias
        norms = (4 if self.sandwich_norms else 2) * d * (2 if self.gpt2_blocks else 1)  # LayerNorm: weight + bias
        mlps = self.num_hidden_layers * mlp
        if self.moe:  # the sparse layers: router, routed experts (all, or the k a token runs), shared expert
            sparse = sum(self.sparse_layers())
            experts = self.num_experts_per_tok if active else self.num_experts
            block = d * self.num_experts + experts * 3 * d * self.expert_width
            if self.shared_expert_intermediate_size:
                block += 3 * d * self.shared_expert_intermediate_size + d
            mlps += sparse * (block - mlp)
        emb = self.vocab_size * d + self.max_position_embeddings * d * self.gpt2_blocks
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return emb + self.num_hidden_layers * (attn + norms) + mlps + d * (2 if self.gpt2_blocks else 1) + head


def _fields_from_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    """LlamaConfig keyword arguments from a config.json dict (see the module docstring)."""
    model_type = d.get("model_type", "llama")
    if model_type == "gpt2":
        return _gpt2_fields(d, where)
    if model_type not in FAMILY_DEFAULTS:
        raise ValueError(f"{where}: model_type={model_type!r} is not supported; supported model types: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (architectures {', '.join(ARCHITECTURES.values())})")
    for key, (neutral, why) in REFUSED_KEYS.items():
        if d.get(key, neutral) != neutral and key not in HONOURED_KEYS[model_type]:
            raise ValueError(f"{where}: {key}={d[key]!r} is not supported: {why}")
    renames = family(model_type).hf_renames
    fields = {renames.get(k, k): d.get(k, default) for k, default in FAMILY_DEFAULTS[model_type].items()}
    if family(model_type).moe:
        fields.update(_moe_fields(d, model_type, where))
    fields.update({k: d.get(k) for k in _TOKEN_KEYS})
    fields.update(_rope_from_hf(d, where))
    if model_type in PARTIAL_ROTARY_DEFAULTS:  # elsewhere a factor is refused (REFUSED_KEYS, check_rope_scaling)
        # transformers 5 keeps the rotated share in rope_parameters, 4 at the top level; 5 prefers the former
        scaling = fields["rope_scaling"]
        partial = scaling.pop("partial_rotary_factor", None) if scaling else None
        if partial is None:
            partial = d.get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULTS[model_type])
        fields["partial_rotary_factor"] = partial
    extra = {k: v for k, v in d.items() if k not in HONOURED_KEYS[model_type]}
    unknown = set(extra) - CARRIED_KEYS - set(MOE_CARRIED_KEYS.get(model_type, ()))
    if model_type == "mistral" and "layer_types" in extra:
        _check_mistral_layer_types(extra["layer_types"], fields, where)
        unknown.discard("layer_types")  # agrees with what MistralForCausalLM runs
    if unknown:
        log.warning("%s: carrying keys that transformers' %s does not read either: %s", where,
                    ARCHITECTURES[model_type], sorted(unknown))
    return {**fields, "model_type": model_type, "extra": extra}


def _moe_fields(d: dict[str, Any], model_type: str, where: str) -> dict[str, Any]:
    """The expert count under either spelling (transformers 5 maps one onto the other), ours
    (router z-loss, capacity) when present, and the windows of Qwen's MoE classes refused: their
    released checkpoints have none, and our MoE families slide only as Mixtral does (every layer)."""
    own = family(model_type).experts_key
    other = ({"num_experts", "num_local_experts"} - {own}).pop()
    spelled = own if own in d or other not in d else other
    if own in d and other in d and d[own] != d[other]:
        raise ValueError(f"{where}: {own}={d[own]!r} and {other}={d[other]!r} disagree; keep one")
    fields = {"num_experts": d.get(spelled, FAMILY_DEFAULTS[model_type][own]), "experts_key": spelled}
    fields.update({k: d[k] for k in _OUR_MOE_KEYS if k in d})
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if d.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true with model_type={model_type!r}: sliding windows of "
                             "Qwen's MoE classes are not implemented (the released Qwen1.5/2/3-MoE checkpoints have "
                             "none); set use_sliding_window: false")
        sliding = [t for t in d.get("layer_types") or [] if LAYER_TYPES.get(t)]
        if sliding:
            raise ValueError(f"{where}: layer_types has {len(sliding)} sliding_attention layers with model_type="
                             f"{model_type!r}: not implemented; make every layer full_attention")
    return fields


def _gpt2_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = gpt2_layout.fields_from_config(d, where)
    extra = {k: v for k, v in d.items() if k not in gpt2_layout.HONOURED}
    extra["n_inner"] = d.get("n_inner")  # written back as it came (null: 4 x n_embd)
    unknown = set(extra) - CARRIED_KEYS - set(gpt2_layout.CARRIED) - set(gpt2_layout.REFUSED) - {"n_inner"}
    if unknown:
        log.warning("%s: carrying keys that transformers' GPT2LMHeadModel does not read either: %s", where,
                    sorted(unknown))
    return {**fields, "extra": extra}


def _rope_from_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    """rope_theta, rope_scaling and rope_layout from either layout, with transformers' precedence
    (a theta inside rope_parameters wins over a top-level one; absent: the family's default, 10000
    except Mixtral's 1e6)."""
    params, scaling = d.get("rope_parameters"), d.get("rope_scaling")
    default_theta = family(d.get("model_type", "llama")).rope_theta  # absent: transformers' default of the family
    if params is not None and scaling is not None:
        raise ValueError(f"{where}: both rope_parameters={params!r} and rope_scaling={scaling!r} are set; keep "
                         "one (rope_parameters for transformers 5, rope_theta + rope_scaling for 4)")
    if params is not None:
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"{where}: rope_parameters={params!r} is nested per layer type; only one RoPE "
                             "for all layers is supported")
        params = dict(params)
        theta = params.pop("rope_theta", d.get("rope_theta", default_theta))
        out = dict(rope_theta=theta, rope_scaling=params, rope_layout="rope_parameters")
    else:
        out = dict(rope_theta=d.get("rope_theta", default_theta),
                   rope_scaling=None if scaling is None else dict(scaling),
                   rope_layout="rope_scaling")
    top_original = d.get("original_max_position_embeddings")
    scaled = out["rope_scaling"] or {}
    if top_original is not None and rope_type(scaled) in ("llama3", "yarn") and \
            scaled.get("original_max_position_embeddings") != top_original:
        raise ValueError(f"{where}: original_max_position_embeddings={top_original!r} at the top level differs from "
                         f"{out['rope_layout']}.original_max_position_embeddings="
                         f"{scaled.get('original_max_position_embeddings')!r}; transformers takes the top-level "
                         f"one: move it into {out['rope_layout']}")
    return out


def _check_mistral_layer_types(layer_types: Any, fields: dict[str, Any], where: str) -> None:
    """transformers' Mistral ignores layer_types (a sliding window on every layer, or on none);
    a list that says otherwise belongs to another class (Ministral), so it is refused."""
    kind = "full_attention" if fields["sliding_window"] is None else "sliding_attention"
    if any(t != kind and LAYER_TYPES.get(t) != LAYER_TYPES[kind] for t in layer_types):
        raise ValueError(f"{where}: layer_types={layer_types!r} with model_type='mistral': transformers' "
                         f"MistralForCausalLM ignores it and gives every layer {kind} (sliding_window="
                         f"{fields['sliding_window']}); per-layer windows are supported for model_type "
                         "'qwen2' only (or remove layer_types)")


# Architecture fields of each named flavour. Real sizes follow the published Llama 2 / 3.2 shapes; the
# gpt-* flavours are GPT-2 blocks (learned positions, LayerNorm, GELU; untied so that pipeline
# parallelism can split them), gpt2-124m the published GPT-2 small shape (tied, as released).
_GPT = dict(model_type="gpt2", hidden_act="gelu_new", rms_norm_eps=1e-5)
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
    # mixtures of experts (Mixtral blocks), top 2: a token runs two experts, 2 x 128 / 2 x 384 wide against the
    # 192 / 704 of `debug` / `tiny` (widths that group size 64 divides; attention, embeddings and norms are theirs).
    # Load balancing at 0.01 (Switch Transformer's and OLMoE's weight; Mixtral's config defaults to 0.001): on
    # config/moe.yaml's pretraining it gave corpus perplexity 37.6 and the busiest expert 2.2x an even share,
    # against 41.8 and 3.0x at 0.001 (docs/pretrained.md)
    "moe-debug": dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, num_experts=4,
                      num_experts_per_tok=2, rms_norm_eps=1e-6, rope_theta=10000.0, router_aux_loss_coef=0.01),
    "moe-tiny": dict(model_type="mixtral", hidden_size=256, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024, num_experts=8,
                     num_experts_per_tok=2, rms_norm_eps=1e-6, rope_theta=10000.0, router_aux_loss_coef=0.01),
    "gpt-debug": dict(**_GPT, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=512),
    "gpt-tiny": dict(**_GPT, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                     max_position_embeddings=1024),
    "gpt2-124m": dict(**_GPT, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      max_position_embeddings=1024, tie_word_embeddings=True),
}


def config_for_flavour(flavour: str, vocab_size: int, **overrides: Any) -> LlamaConfig:
    """The config of a named flavour with the tokenizer's vocabulary and optional field overrides."""
    if flavour not in FLAVOURS:
        raise ValueError(f"model.flavour={flavour!r} is unknown; choose one of {sorted(FLAVOURS)}")
    fields = {**FLAVOURS[flavour], **{k: v for k, v in overrides.items() if v is not None}}
    return LlamaConfig(vocab_size=vocab_size, **fields)
