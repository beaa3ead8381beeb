"""Per-device memory of a training layout: the model behind the memory planner (`stages.plan`).

`estimate_memory(arch, section, vocab_size=...)` returns the bytes one device holds at the peak of
a training step in the section's layout, split into parameters, gradients, optimizer state,
activations and buffers, and the optimizer state that ZeRO-Offload keeps in host memory instead.
`nearest_fitting_layout` finds the closest layout of the same world size that fits a device, and
`parameter_count` counts the model's parameters. Pure arithmetic: no torch, so it runs when
Snakemake parses the workflow.

The model follows what this project's code allocates, not a textbook formula (each line is checked
against a real run in tests/unit/test_memory_plan.py and bench/memory_plan.py):

- Model states (the ZeRO paper's accounting, `zero_model_states`; P trained parameters, p bytes of
  the training dtype, dp data-parallel ranks): DeepSpeed keeps the module in the training dtype
  (p = 2 with bf16/fp16, 4 in fp32), torch AdamW's moments in fp32 (8 bytes) and, under mixed
  precision or any ZeRO stage, an fp32 master copy (4 bytes; ZeRO keeps its fp32 partition even
  when the model is fp32). ZeRO-1 splits master and moments over dp, ZeRO-2 also the gradients,
  ZeRO-3 also the parameters, except those of at most 1e5 elements (norms), which stay whole.
  Gradients are held whole across the micro-batches of an accumulation (none, stage1) or as the
  reduced partition (stage2, stage3). A frozen base (LoRA, prefix) has parameters only.
- Activations, per micro-batch and decoder layer, are the tensors autograd saves in
  `stages.model.llama`: each RMSNorm its fp32 input and 1/rms, the normalised x and its output (what
  the next Linear saves; GPT-2's LayerNorm its input, mean and 1/std and its output; Qwen3's q/k
  head norms and GLM-4's norms after each sub-block feed no Linear), SDPA's q, k and v (under GQA:
  the KV heads' own on a CPU and for a GPU's flash kernel, else repeated to every query head), output and
  log-sum-exp (and o_proj's input where attention ran in fp32 and its output was cast back),
  SwiGLU's gate, silu(gate), up and their product; with a frozen base only what the input gradients
  and the adapter need (under ZeRO-3 every projection's input: DeepSpeed swaps in a linear that
  saves it). With recompute a layer keeps only its input, and one layer is rebuilt at a time. Tensor
  parallelism splits the attention and MLP parts; sequence parallelism also the norms' inputs,
  outputs and statistics (the projections save their rank's tokens, not the sequence they gather)
  and a recomputed layer's input (the residual stream is gathered before the final norm). Context
  parallelism divides every token's tensors by cp (the rank's zigzag share of each padded row, to
  the loss): attention's core is recomputed in backward, so a layer keeps its rank's q, k and v,
  and one core at a time holds the keys and values gathered from the group and its mask, (B, 1,
  T/cp, T) in the attention's dtype (with recompute, the rebuilt layer holds them); Ulysses' core
  saves the whole row for cp-th of the heads (the same bytes) and o_proj its own input; ring
  attention's saves the rank's q, k and v, its output (which o_proj saves as its input) and fp32
  log-sum-exp (no mask, no gathered keys), and one layer's backward at a time holds a block's fp32 scores,
  softmax and their gradient (B, heads, T/cp, T/cp) with the blocks of keys, values and their
  gradients passed around the ring. The loss:
  logits (gathered over the vocabulary unless tensor_parallel_output), their fp32 copy and
  log-softmax, then three fp32 (tokens x vocab) tensors when backward starts.
- Pipeline parallelism (1F1B, interleaved 1F1B as torch.distributed.pipelining schedules them):
  rank r holds min(m, pp - r) micro-batches in flight (interleaved: its warm-up + 1 chunk
  micro-batches), the last stage keeps its logits until their backward, and every stage keeps one
  receive buffer per micro-batch for activations and for their gradients. The worst rank is
  reported.
- A mixture of experts: its total parameters (this rank's E / `expert_parallel_degree` experts per
  sparse layer) and what the active ones save per token (router logits and softmax, the dispatched
  copy of each choice's input, the experts' SwiGLU and weighted outputs); under expert parallelism
  the all-to-all's send and receive buffers (k rows per token each way) while backward runs through
  a sparse layer.
- Buffers at DeepSpeed 0.19's defaults, which the engine's `deepspeed_config` does not change:
  ZeRO-1/2 allocate a 5e8-element gradient bucket in the training dtype for each backward (ZeRO-1
  keeps it across an accumulation), ZeRO-3 keeps one for the whole run, and keeps the parameters
  it gathered in forward for their reuse in backward (up to 1e9 elements).
- Four moments of a step can peak (`estimate_phases`): the loss's backward starting with every
  activation saved; backward reaching the layers (the bucket allocated, a layer rebuilt under
  recompute); the reduction of the gradients (under mixed precision with an fp32 copy of the
  bucket being summed: the engine sums gradients in fp32); the optimizer step (the fp32 gradient copies the
  wrappers make; the fused AdamW of `stages.training.deepspeed_engine.adamw` needs no temporaries).

Precision follows the section (bf16/fp16 or fp32) on both devices, as the engine runs it; `bf16:
auto`, which the training job decides on its own machine, is planned both ways and the larger peak
kept (`stages.training.capabilities.bf16_choices`: neither is always larger). `device`
changes only what differs between a GPU and a CPU: ZeRO-Offload (on a CPU the "offloaded" state
stays in the same memory), the fp32 copies a bf16 model's attention saves where it runs in fp32 on a
CPU (`_attention_bytes`) and the width of k and v SDPA saves under GQA. Checked against the engine's
real peaks on CPU, estimate / measured 0.990-1.034 on 2026-11-28 (bench/memory_plan.py, 2 gloo
ranks: every ZeRO stage, tp2, pp2, recompute, bf16, LoRA, prefix) and on one H100 (`--device cuda`:
the 1b flavour, bf16 and fp32, ZeRO 0-3, offload, recompute, LoRA). Not modelled: torch.compile, the
allocator's fragmentation and the CUDA context (leave headroom), the transient of building the whole
model on every rank before it is split, and evaluation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from itertools import product
from typing import Any

from stages.adapters.targets import ALL_LINEAR, expert_parameters_selected, selected
from stages.model.attention_shapes import RING_QUERY_TILE, fp32_attention_shape, ulysses_head_conflict
from stages.model.registry import BY_MODEL_TYPE, Family
from stages.sections import (
    AlignSettings,
    LoraSettings,
    PrefixSettings,
    SftSettings,
    TrainingSettings,
    training_section,
)
from stages.training.capabilities import bf16_choices

GiB, MiB = 2**30, 2**20
REDUCE_BUCKET_SIZE = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size (ZeRO-1/2/3)
PARAM_PERSISTENCE_THRESHOLD = 100_000  # ZeRO-3: parameters this small stay whole on every rank
MAX_LIVE_PARAMETERS = 1_000_000_000  # ZeRO-3: max_live_parameters and max_reuse_distance (elements)
MASTER_BYTES = 4  # fp32 master copy per trained parameter
ADAM_BYTES = 8  # exp_avg and exp_avg_sq, fp32
ZERO_STAGES = {"none": 0, "stage1": 1, "stage2": 2, "stage3": 3}
# Our Llama's projections by their names inside a decoder layer: (in, out, column-parallel?) as
# functions of the shape, for the parameter count, tensor parallelism and LoRA's targets. GLM and
# GLM-4 compute gate and up in one `mlp.gate_up_proj` (2 x intermediate rows).
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
FUSED_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_up_proj", "mlp.down_proj")
# What each family's blocks add to Llama's (q/k/v and o_proj bias, q/k norm, fused gate_up, sandwich
# norms) is its entry in stages/model/registry.py, as LlamaConfig reads it; a config.json that omits
# attention_bias or head_dim takes its family's default there.
# GPT-2 on our model (stages.model.gpt2_layout): one fused [q; k; v] projection, a GELU MLP without
# gate, biases everywhere, LayerNorm (weight and bias), learned positions
GPT2_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
# The families that train through transformers' model, sized as GPT-2-like blocks (every projection
# with a bias, a two-matrix GELU MLP, LayerNorm): config.json key -> our field, and their defaults.
GPT_LIKE_KEYS: dict[str, dict[str, tuple[str, Any]]] = {
    "gpt2": {"hidden_size": ("n_embd", 768), "num_hidden_layers": ("n_layer", 12),
             "num_attention_heads": ("n_head", 12), "intermediate_size": ("n_inner", None),
             "max_position_embeddings": ("n_positions", 1024), "tie_word_embeddings": ("tie_word_embeddings", True)},
    "opt": {"intermediate_size": ("ffn_dim", 3072), "tie_word_embeddings": ("tie_word_embeddings", True)},
    "bloom": {"hidden_size": ("n_embed", 64), "num_hidden_layers": ("n_layer", 2), "num_attention_heads": ("n_head", 8),
              "intermediate_size": ("intermediate_size", None), "tie_word_embeddings": ("tie_word_embeddings", True)},
    "gpt_neox": {"tie_word_embeddings": ("tie_word_embeddings", False)},
}
# nearest_fitting_layout's order of preference: the knobs it turns, cheapest first.
PREFERENCE = ("sequence_parallel", "sharding", "recompute", "tensor_parallel_degree", "pipeline_parallel_degree",
              "sharding_offload", "per_device_train_batch_size")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds at the peak of a training step (the worst pipeline rank), by kind;
    `phase` names the moment of the peak (see `estimate_phases`)."""

    parameters: int  # this rank's parameters in the training dtype (ZeRO-3: its partition)
    gradients: int  # gradients held at the peak (accumulated, or the reduced partition)
    optimizer: int  # fp32 master copy (ZeRO: its partition) and AdamW moments kept on the device
    activations: int  # saved activations of the micro-batches in flight, plus the loss's tensors
    buffers: int  # gradient buckets, gathered ZeRO-3 parameters, pipeline receive buffers, step copies
    offloaded: int  # host bytes ZeRO-Offload keeps off the device (fp32 master, moments, gradients)
    phase: str = "backward"  # "backward", "layers", "reduce" or "step" (see estimate_phases)
    pipeline_rank: int = 0  # the pipeline rank these numbers belong to

    @property
    def total(self) -> int:
        """Device bytes at the peak."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict[str, Any]:
        """Plain ints (bytes), the phase and rank, the total and the total in GiB."""
        return {**asdict(self), "total": self.total, "total_gib": round(self.total / GiB, 3)}


@dataclass(frozen=True)
class _Shape:
    """The architecture fields the estimate reads (Hugging Face names in `_shape`)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3: q_norm, k_norm (head_dim each)
    fused_gate_up: bool = False  # GLM: mlp.gate_up_proj for gate_proj and up_proj
    sandwich_norms: bool = False  # GLM-4: post_self_attn_layernorm, post_mlp_layernorm
    gpt_blocks: bool = False  # GPT-2-like blocks (GPT2_PROJECTIONS, LayerNorm with bias)
    positions: int = 0  # rows of a learned position table (GPT-2), beside the token embedding
    # a mixture of experts (stages/model/moe.py): `sparse` of the layers hold a router and `experts`
    # experts of width `expert_width` in place of the MLP, each token running `top_k` of them
    # (Qwen2-MoE: plus a shared expert of width `shared_width` and its one-output gate)
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    shared_width: int = 0
    sparse: int = 0
    qk_norm_whole: bool = False  # OLMoE: q_norm and k_norm over the whole projections

    @property
    def projections(self) -> tuple[str, ...]:
        if self.gpt_blocks:
            return GPT2_PROJECTIONS
        return FUSED_PROJECTIONS if self.fused_gate_up else PROJECTIONS


@dataclass(frozen=True)
class _Layout:
    """The layout keys of a training section."""

    world: int
    tp: int
    pp: int
    vpp: int
    zero: int
    offload: bool
    micro: int
    accum: int
    seq: int
    recompute: bool
    param_bytes: int  # 2 with bf16/fp16, else 4
    tp_output: bool
    packing: bool
    sp: bool = False  # sequence parallelism (a switch of tp)
    cp: int = 1  # context parallelism: ranks that split every sequence
    ulysses: bool = False  # context_parallel_mode: ulysses (all-to-all to a head split) rather than all_gather
    ring: bool = False  # context_parallel_mode: ring (blocks of keys and values passed around the group)
    ep: int = 1  # expert parallelism: ranks of the data group that split a mixture's experts

    @property
    def dp(self) -> int:
        """The ranks ZeRO shards over and DeepSpeed averages gradients over: data x sharding x context."""
        return self.world // (self.tp * self.pp)

    @property
    def local_seq(self) -> int:
        """Tokens of a row this rank holds: all of them, or under context parallelism its zigzag
        share of the row padded to 2 x cp (x tp with sequence parallelism) tokens."""
        if self.cp == 1:
            return self.seq
        multiple = 2 * self.cp * self.token_split
        return -(-self.seq // multiple) * multiple // self.cp

    @property
    def key_seq(self) -> int:
        """Keys every query may read: the whole (padded) row, gathered under context parallelism."""
        return self.local_seq * self.cp

    @property
    def token_split(self) -> int:
        """How many ranks share the tokens of the decoder layers' residual stream and norms."""
        return self.tp if self.sp else 1


@dataclass(frozen=True)
class _Adapter:
    """What trains: "full", or an adapter on a frozen base ("lora": `rank` on the `targets`
    projections; "prefix": `prefix` keys and values per layer, or with `projection` their MLP,
    `projection_hidden` wide, 0: the KV width)."""

    trained: str = "full"
    rank: int = 0
    targets: frozenset[str] = frozenset()
    experts: tuple[str, ...] = ()  # the routed experts' parameters LoRA adapts (target_parameters)
    prefix: int = 0
    projection: bool = False
    projection_hidden: int = 0

    @property
    def full(self) -> bool:
        return self.trained == "full"


def _adapter(trained: str, lora_rank: int | None, num_prefix_tokens: int | None,
             section: TrainingSettings) -> _Adapter:
    """The adapter of a training rule; LoRA's targets: the projections the section's
    `target_modules` selects in a decoder layer (`stages.adapters.targets`), and the routed experts'
    parameters its `target_parameters` names."""
    if trained not in ("full", "lora", "prefix"):
        raise ValueError(f"trained={trained!r}: expected 'full', 'lora' or 'prefix'")
    if trained == "lora":
        if not lora_rank:
            raise ValueError("trained='lora' needs lora_rank")
        wanted = section.target_modules if isinstance(section, (LoraSettings, AlignSettings)) else ALL_LINEAR
        names = dict.fromkeys(PROJECTIONS + FUSED_PROJECTIONS + GPT2_PROJECTIONS)  # _Shape.projections picks
        targets = frozenset(p for p in names if selected(f"model.layers.0.{p}", wanted))
        experts = expert_parameters_selected(getattr(section, "target_parameters", None))
        return _Adapter("lora", rank=lora_rank, targets=targets, experts=experts)
    if trained == "prefix":
        if not num_prefix_tokens:
            raise ValueError("trained='prefix' needs num_prefix_tokens")
        if not isinstance(section, PrefixSettings):
            return _Adapter("prefix", prefix=num_prefix_tokens)
        return _Adapter("prefix", prefix=num_prefix_tokens, projection=section.prefix_projection,
                        projection_hidden=section.prefix_projection_hidden_size or 0)
    return _Adapter()


def _shape(arch: dict[str, Any], vocab_size: int) -> _Shape:
    """Read a flavour's fields (`stages.config.architecture`) or a checkpoint's config.json; the keys
    it omits take the family's defaults, as our config reader does."""
    model_type = arch.get("model_type", "llama")
    if model_type in GPT_LIKE_KEYS:
        return _gpt_like_shape(arch, vocab_size, model_type)
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
               if arch.get(k) is None]
    if missing:
        raise ValueError(f"the memory model needs {missing} in the architecture (Llama-family config fields)")
    heads = arch["num_attention_heads"]
    family = BY_MODEL_TYPE.get(model_type) or Family(model_type, model_type, "", ours=False)  # no switches
    defaults = family.hf_defaults
    # attention_bias (Qwen2-MoE's config.json: qkv_bias), else the family's default
    bias_key = next((k for k, v in family.hf_renames.items() if v == "attention_bias"), "attention_bias")
    bias = bool(arch.get("attention_bias", arch.get(bias_key, defaults.get(bias_key))))
    return _Shape(**_moe_fields(arch, family), hidden=arch["hidden_size"], intermediate=arch["intermediate_size"],
                  layers=arch["num_hidden_layers"], heads=heads, kv_heads=arch.get("num_key_value_heads") or heads,
                  head_dim=arch.get("head_dim", defaults.get("head_dim")) or arch["hidden_size"] // heads,
                  vocab=vocab_size, tied=bool(arch.get("tie_word_embeddings")),
                  qkv_bias={"always": True, "never": False}.get(family.qkv_bias, bias),
                  o_bias=bias and family.o_proj_bias,
                  mlp_bias=bool(arch.get("mlp_bias")), qk_norm=family.qk_norm, fused_gate_up=family.fused_gate_up,
                  sandwich_norms=family.sandwich_norms)


def _moe_fields(arch: dict[str, Any], family: Family) -> dict[str, Any]:
    """The `_Shape` fields of a mixture of experts (a flavour's or config.json's, either spelling of
    the expert count), as LlamaConfig reads them; none for a dense family."""
    if not family.moe:
        return {}
    defaults = family.hf_defaults
    experts = arch.get("num_experts", arch.get("num_local_experts", defaults.get(family.experts_key)))
    layers = arch["num_hidden_layers"]
    dense = set(arch.get("mlp_only_layers") or [])
    step = arch.get("decoder_sparse_step", 1) if family.sparse_step else 1
    sparse = sum(i not in dense and (i + 1) % step == 0 for i in range(layers))
    width = arch.get("moe_intermediate_size", defaults.get("moe_intermediate_size")) if family.sparse_step \
        else arch["intermediate_size"]
    return dict(experts=experts, top_k=arch.get("num_experts_per_tok", defaults.get("num_experts_per_tok")),
                expert_width=width, sparse=sparse, qk_norm_whole=family.qk_norm_whole,
                shared_width=arch.get("shared_expert_intermediate_size", 0) if family.shared_expert else 0)


def _gpt_like_shape(arch: dict[str, Any], vocab_size: int, model_type: str) -> _Shape:
    """GPT-2 (a flavour's fields, or its config.json's own names), and OPT / Bloom / GPT-NeoX sized
    as GPT-2-like blocks (their transformers models differ in details a memory plan can ignore)."""
    fields = {field: arch.get(field, arch.get(key, default))
              for field, (key, default) in GPT_LIKE_KEYS[model_type].items()}
    if model_type == "gpt2" and "n_embd" not in arch:  # a gpt-* flavour: our fields, untied unless it says
        fields["tie_word_embeddings"] = bool(arch.get("tie_word_embeddings"))
    d = fields.get("hidden_size") or arch.get("hidden_size")
    heads = fields.get("num_attention_heads") or arch.get("num_attention_heads")
    layers = fields.get("num_hidden_layers") or arch.get("num_hidden_layers")
    if not (d and heads and layers):
        raise ValueError(f"the memory model needs the width, heads and layers of this {model_type} config.json")
    f = fields.get("intermediate_size") or arch.get("intermediate_size") or 4 * d
    positions = {"gpt2": fields.get("max_position_embeddings") or 0,  # OPT's table has 2 offset rows
                 "opt": arch.get("max_position_embeddings", 2048) + 2}.get(model_type, 0)
    return _Shape(hidden=d, intermediate=f, layers=layers, heads=heads, kv_heads=heads, head_dim=d // heads,
                  vocab=vocab_size, tied=bool(fields["tie_word_embeddings"]), qkv_bias=True, o_bias=True,
                  mlp_bias=True, gpt_blocks=True, positions=positions)


def rows_per_example(section: TrainingSettings) -> int:
    """Sequences one example of the batch runs: 2 for preference alignment (a pair's chosen and
    rejected answers, in one forward), else 1."""
    return 2 if isinstance(section, AlignSettings) else 1


def _layout(section: TrainingSettings, bf16: bool | None = None) -> _Layout:
    """The layout of `section` in one precision: fp16 where the section says so, else bf16 or fp32 as
    `bf16` says (one of `bf16_choices(section.bf16)`; by default the first, where only the degrees
    and the batch are read). `micro` counts rows: per_device_train_batch_size examples of
    `rows_per_example` sequences each."""
    bf16 = bf16_choices(section.bf16)[0] if bf16 is None else bf16
    return _Layout(world=section.world_size, tp=section.tensor_parallel_degree, pp=section.pipeline_parallel_degree,
                   vpp=section.virtual_pp_degree, zero=ZERO_STAGES[section.sharding], offload=section.sharding_offload,
                   micro=section.per_device_train_batch_size * rows_per_example(section),
                   accum=section.gradient_accumulation_steps,
                   seq=section.max_length, recompute=section.recompute,
                   param_bytes=2 if bf16 or section.fp16 else 4,
                   tp_output=section.tensor_parallel_output,
                   packing=isinstance(section, SftSettings) and section.packing,
                   sp=section.sequence_parallel and section.tensor_parallel_degree > 1,
                   cp=section.context_parallel_degree,
                   ulysses=section.context_parallel_mode == "ulysses",
                   ring=section.context_parallel_mode == "ring",
                   ep=section.expert_parallel_degree)


# -- parameters ---------------------------------------------------------------------------------

def _projection_shapes(s: _Shape) -> dict[str, tuple[int, int, bool]]:
    """(in, out, column-parallel?) of each projection of a decoder layer."""
    d, f, q, kv = s.hidden, s.intermediate, s.heads * s.head_dim, s.kv_heads * s.head_dim
    if s.gpt_blocks:  # qkv_proj, o_proj, up_proj, down_proj
        return dict(zip(s.projections, [(d, q + 2 * kv, True), (q, d, False), (d, f, True), (f, d, False)]))
    mlp = [(d, 2 * f, True)] if s.fused_gate_up else [(d, f, True), (d, f, True)]  # [gate; up] or each
    shapes = [(d, q, True), (d, kv, True), (d, kv, True), (q, d, False), *mlp, (f, d, False)]
    return dict(zip(s.projections, shapes))


def _has_bias(s: _Shape, name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return ((s.qkv_bias and leaf in ("q_proj", "k_proj", "v_proj", "qkv_proj")) or (s.o_bias and leaf == "o_proj")
            or (s.mlp_bias and leaf in ("gate_proj", "up_proj", "gate_up_proj", "down_proj")))


def _layer_tensors(s: _Shape, tp: int, ad: _Adapter, sparse: bool = False, ep: int = 1) -> list[tuple[int, bool]]:
    """(elements on one tensor-parallel rank, trained?) of every parameter of one decoder layer,
    as `stages.parallel.plan` splits them: column-parallel weights and biases by output rows,
    row-parallel weights by input columns (their bias and the norms replicated); LoRA's A whole and
    B split beside a column-parallel base, A split and B whole beside a row-parallel one; prefix
    keys and values by KV head. `sparse`: a mixture of experts' sparse layer (router and experts,
    whole on every tensor-parallel rank; LoRA on the experts only with `target_parameters`, each
    expert's factors whole: `stages.adapters.expert_lora`), this rank's E / `ep` experts under expert
    parallelism."""
    out = [(s.hidden, ad.full)] * (4 if s.sandwich_norms or s.gpt_blocks else 2)  # RMSNorm weights (LayerNorm: + bias)
    if s.qk_norm:
        out += [(s.head_dim, ad.full)] * 2  # q_norm, k_norm: one head_dim weight each, on every rank
    if s.qk_norm_whole:
        out += [(s.heads * s.head_dim, ad.full), (s.kv_heads * s.head_dim, ad.full)]  # OLMoE's over all heads
    if sparse:
        d = s.hidden
        out.append((s.experts * d, ad.full))  # the router
        out += [(d * s.expert_width, ad.full)] * (3 * s.experts // ep)  # each expert's gate, up, down
        for parameter in ad.experts:  # LoRA per expert: A (r, in), B (out, r); gate and up share one A
            fan_in, fan_out = (d, 2 * s.expert_width) if parameter == "gate_up_proj" else (s.expert_width, d)
            out += [(ad.rank * fan_in, True), (fan_out * ad.rank, True)] * (s.experts // ep)
        if s.shared_width:
            out += [(d * s.shared_width, ad.full)] * 3 + [(d, ad.full)]  # the shared expert and its gate
    for name, (fan_in, fan_out, column) in _projection_shapes(s).items():
        if sparse and name.startswith("mlp."):
            continue
        out.append((fan_in * fan_out // tp, ad.full))
        if _has_bias(s, name):
            out.append((fan_out // tp if column else fan_out, ad.full))
        if name in ad.targets:  # lora_A (r, in), lora_B (out, r)
            out += [(ad.rank * fan_in // (1 if column else tp), True),
                    (fan_out // (tp if column else 1) * ad.rank, True)]
    if ad.prefix and not ad.projection:
        out += [(s.kv_heads // tp * ad.prefix * s.head_dim, True)] * 2  # prefix_key, prefix_value
    return out


def _projection_tensors(s: _Shape, ad: _Adapter) -> list[tuple[int, bool]]:
    """A prefix projection's tensors (`stages.adapters.prefix_kv.PrefixProjection`, whole): the
    embedding (P, w), Linear(w, h) and Linear(h, L * 2 * w), w the KV width."""
    w = s.kv_heads * s.head_dim
    h = ad.projection_hidden or w
    return [(ad.prefix * w, True), (w * h, True), (h, True), (h * s.layers * 2 * w, True), (s.layers * 2 * w, True)]


def _chunk_layers(layers: int, chunks: int) -> list[int]:
    """Layers of each pipeline chunk: `stages.parallel.pipeline.split_layers` with its default
    weights (the first L % n chunks get one more)."""
    return [layers // chunks + (1 if c < layers % chunks else 0) for c in range(chunks)]


def _chunks_of(lay: _Layout, rank: int) -> list[int]:
    """The model chunks pipeline rank `rank` runs: chunk c on rank c % pp."""
    return [c for c in range(lay.pp * lay.vpp) if c % lay.pp == rank]


def _rank_layers(s: _Shape, lay: _Layout, rank: int) -> tuple[int, int]:
    """(decoder layers, of them sparse ones) pipeline rank `rank` holds; a mixture of experts trains on
    one pipeline stage, so all of its sparse layers."""
    layers = sum(_chunk_layers(s.layers, lay.pp * lay.vpp)[c] for c in _chunks_of(lay, rank))
    return layers, round(s.sparse * layers / s.layers)


def _rank_tensors(s: _Shape, lay: _Layout, rank: int, ad: _Adapter) -> list[tuple[int, bool]]:
    """(elements, trained?) of every parameter tensor pipeline rank `rank` holds."""
    chunks, mine = lay.pp * lay.vpp, _chunks_of(lay, rank)
    layers, sparse = _rank_layers(s, lay, rank)
    out = _layer_tensors(s, lay.tp, ad) * (layers - sparse) + \
        _layer_tensors(s, lay.tp, ad, sparse=True, ep=lay.ep) * sparse
    if 0 in mine:
        out.append((s.vocab * s.hidden // lay.tp, ad.full))  # embed_tokens, split by vocabulary rows
        if s.positions:
            out.append((s.positions * s.hidden, ad.full))  # GPT-2's position table, replicated
        if ad.projection:
            out += _projection_tensors(s, ad)
    if chunks - 1 in mine:
        out += [(s.hidden, ad.full)] * (2 if s.gpt_blocks else 1)  # final norm (LayerNorm: + bias)
        if not (s.tied and chunks == 1):  # a tied lm_head is the embedding's tensor
            out.append((s.vocab * s.hidden // lay.tp, ad.full))
    return out


# The whole model on one device (for counting its tensors).
_ONE_DEVICE = _Layout(world=1, tp=1, pp=1, vpp=1, zero=0, offload=False, micro=1, accum=1, seq=1,
                      recompute=False, param_bytes=4, tp_output=False, packing=False)


def parameter_count(arch: dict[str, Any], vocab_size: int) -> int:
    """Parameters of the whole model (a tied lm_head counted once), as `LlamaForCausalLM` has them."""
    s = _shape(arch, vocab_size)
    return sum(n for n, _ in _rank_tensors(s, _ONE_DEVICE, 0, _Adapter()))


def host_build_bytes(arch: dict[str, Any], section: Mapping[str, Any], *, vocab_size: int) -> int:
    """Host bytes (fp32) a rank needs to build its model before the engine takes it. Our model is
    built on the meta device and only this rank's tensor/pipeline slice is filled, one whole tensor
    at a time (`stages.training.materialize`): the largest pipeline rank's slice plus the largest
    single tensor. A prefix that starts from the base's KV cache (`prefix_init: tokens`) needs the
    whole base first. Adapter factors are left out (a few MB)."""
    s, section = _shape(arch, vocab_size), training_section(section)
    whole = [n for n, _ in _rank_tensors(s, _ONE_DEVICE, 0, _Adapter())]
    if isinstance(section, PrefixSettings) and section.prefix_init == "tokens":
        return 4 * sum(whole)
    lay = _layout(section)
    own = max(sum(n for n, _ in _rank_tensors(s, lay, rank, _Adapter())) for rank in range(lay.pp))
    return 4 * (own + max(whole))


def zero_model_states(num_parameters: int, zero_stage: int, data_parallel: int, *, param_bytes: int = 2,
                      optimizer_bytes: int = MASTER_BYTES + ADAM_BYTES) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state per data-parallel rank for Psi =
    `num_parameters` under ZeRO stage 0-3 (Rajbhandari et al. 2020, Fig. 1: (2 + 2 + K) Psi with
    K = 12 for mixed-precision Adam; stage 1 divides K Psi by Nd, stage 2 also the gradients,
    stage 3 also the parameters)."""
    shard = math.ceil(num_parameters / data_parallel)
    whole = num_parameters
    return {"parameters": param_bytes * (shard if zero_stage >= 3 else whole),
            "gradients": param_bytes * (shard if zero_stage >= 2 else whole),
            "optimizer": optimizer_bytes * (shard if zero_stage >= 1 else whole)}


# -- activations ----------------------------------------------------------------------------------

def _attention_bytes(s: _Shape, lay: _Layout, ad: _Adapter, device: str) -> int:
    """Bytes per value of the q, k, v, output and mask SDPA saves: the activations' own, or 4 where
    a bf16 model's attention runs in fp32 on a CPU (stages.model.attention_precision). Counted
    wherever 2-byte activations have those shapes on a CPU, the larger figure: also on AMX CPUs,
    which keep bf16, for fp16 and for transformers models, whose attention is their own."""
    if device == "cpu" and lay.param_bytes == 2 and fp32_attention_shape(s.head_dim, lay.key_seq + ad.prefix):
        return 4
    return lay.param_bytes


def _core_recomputed(lay: _Layout) -> bool:
    """Whether attention's core is recomputed in backward on its own: under all-gather context
    parallelism, unless the whole layer is (`stages.parallel.context.ContextAttention.core`)."""
    return lay.cp > 1 and not lay.recompute and not lay.ulysses and not lay.ring


def _layer_activation_bytes(s: _Shape, lay: _Layout, ad: _Adapter, device: str, core_only: bool = False) -> int:
    """Bytes autograd saves in one decoder layer for one micro-batch (see the module docstring);
    `core_only`: those of attention's core alone (SDPA's and its mask), which a layer whose core is
    recomputed holds for one layer at a time in backward.
    With a frozen base a norm's normalised x is not saved (its weight gets no gradient), and a
    projection saves its input only when LoRA trains beside it (plus LoRA's r-wide A x), or
    always under ZeRO-3, whose memory-efficient linear (it replaces torch.nn.functional.linear)
    saves its input whatever trains."""
    a, tp, tokens = lay.param_bytes, lay.tp, lay.micro * lay.local_seq
    d, f, q, kv = s.hidden, s.intermediate, s.heads * s.head_dim, s.kv_heads * s.head_dim
    # keys per query token: prefix keys/values come before the real ones; under context parallelism
    # SDPA saves the group's gathered keys and values, cp times this rank's tokens
    # (Ulysses: the whole row's keys for cp-th of the heads, the bytes of the rank's own)
    kv_len = ((lay.local_seq if lay.ulysses else lay.key_seq) + ad.prefix) / lay.local_seq
    sdpa = _attention_bytes(s, lay, ad, device)
    mask = _mask_bytes(lay, ad, sdpa)
    # q, output; k, v; log-sum-exp. Under GQA the kernels that read the shared heads in place save k
    # and v of the KV heads: a CPU's, and a GPU's flash kernel (half precision, no mask); for the
    # others the model repeats them to every query head first (stages.model.llama.gqa_in_place)
    kv_saved = kv if device == "cpu" or (sdpa == 2 and not mask) else q
    attention = (2 * q * sdpa + 2 * kv_saved * kv_len * sdpa + s.heads * 4) / tp
    # Sequence parallelism: the residual stream's norms run on this rank's tokens (1/sp of them), and
    # the column-parallel projections save those tokens, not the sequence they gather
    sp = lay.token_split
    # Norms whose output no Linear saves: Qwen3's q/k head norms (RoPE follows) and GLM-4's norms of
    # each sub-block's output (the residual add follows); widths summed
    unread_norms = (q + kv) / tp * s.qk_norm + 2 * d * s.sandwich_norms / sp
    # each RMSNorm's fp32 1/rms; GPT-2's LayerNorm keeps mean and 1/std in the activations' dtype
    rms_norms = (2 + 2 * s.sandwich_norms) / sp + (s.heads + s.kv_heads) / tp * s.qk_norm
    stats = 2 * 2 * a / sp if s.gpt_blocks else 4 * rms_norms
    layer_projections = frozenset(s.projections)
    targets = ad.targets & layer_projections
    reads = layer_projections if ad.full or lay.zero == 3 else targets  # projections that save their input
    if lay.cp > 1 and lay.ring:  # stages.parallel.ring_attention saves q, k, v, its output (o_proj's input) and lse
        attention, mask = ((2 * q + 2 * kv) * a + s.heads * 4) / tp, 0
        if core_only:  # a block's backward: fp32 p, dp, ds of a tile of query rows; dq, dO, q; blocks in flight
            rows = min(RING_QUERY_TILE, lay.local_seq)
            block = lay.micro * s.heads / tp * rows * lay.local_seq * 4 * 3
            return int(block + tokens * (3 * q * 4 + kv * (4 * a + 4 * 4)) / tp)
    if core_only:
        return int(tokens * attention) + mask
    if _core_recomputed(lay):  # the core keeps this rank's q, k and v; o_proj the output if it reads it
        attention, mask = (q + 2 * kv) * a / tp + q * a / tp * ("self_attn.o_proj" in reads), 0
    elif (sdpa != a or lay.ulysses) and "self_attn.o_proj" in reads and not (lay.cp > 1 and lay.ring):
        # o_proj's input is not SDPA's output: the output cast back, or Ulysses' all-to-all of it
        attention += q * a / tp
    if ad.full:
        # RMSNorm: fp32 input, normalised x, output (the next Linear's input); LayerNorm: input, output
        norms = 2 * d * (2 * a if s.gpt_blocks else 4 + 2 * a) / sp
        norms += unread_norms * (4 + a)  # fp32 input, normalised x
        mlp_saved = (2 if s.gpt_blocks else 4) * f * a / tp  # GELU: up, gelu(up); SwiGLU: gate, silu, up, product
        if s.sparse:  # the layers' mean: a sparse one saves its experts' SwiGLU for each of a token's k choices
            mlp_saved += s.sparse / s.layers * (_sparse_mlp_bytes(s, a) - mlp_saved)
        return int(tokens * (norms + stats + attention + mlp_saved)) + mask
    norm_outputs = sum(any(f"{part}.{leaf}" in reads for leaf in leaves)
                       for part, leaves in (("self_attn", ("q_proj", "k_proj", "v_proj")),
                                            ("mlp", ("gate_proj", "up_proj", "gate_up_proj"))))
    norms = d * (2 * 4 + a * norm_outputs) / sp + unread_norms * 4  # fp32 inputs; an output a projection saves
    mlp = (3 + ("mlp.down_proj" in reads)) * f * a / tp  # gate, silu(gate), up; down's input
    if s.sparse and ad.experts:  # LoRA on the experts: each choice's SwiGLU and LoRA's r-wide A x saved
        expert_lora = _sparse_mlp_bytes(s, a) + s.top_k * len(ad.experts) * ad.rank * a
        mlp += s.sparse / s.layers * (expert_lora - mlp)
    return int(tokens * (norms + stats + attention + mlp + len(targets) * ad.rank * a)) + mask


def _sparse_mlp_bytes(s: _Shape, a: int) -> float:
    """Bytes per token a sparse MoE layer saves in full training (stages.model.moe): the router's
    logits and fp32 softmax, and for each of the token's k choices the dispatched copy of its input
    (the gate and up projections' input), the expert's SwiGLU (gate, silu, up, product) and its
    output (scaled by the routing weight: both saved); a shared expert's SwiGLU and gate on top."""
    router = s.experts * (a + 4)
    routed = s.top_k * (2 * s.hidden * a + 4 * s.expert_width * a)
    shared = (4 * s.shared_width * a + 2 * a) if s.shared_width else 0
    return router + routed + shared


def _mask_bytes(lay: _Layout, ad: _Adapter, value_bytes: int) -> int:
    """The attention mask SDPA keeps when the causal fast path is off, in the dtype attention runs
    in (`value_bytes`; it turns the boolean mask into an additive one): (B, 1, T, T) for packed
    rows, (T, P + T) with a prefix; under context parallelism always, (B, 1, T/cp, P + T)."""
    if lay.cp > 1 and lay.ulysses:  # the whole row's mask on every rank, for packed rows (no prefix)
        return lay.micro * lay.key_seq * lay.key_seq * value_bytes if lay.packing else 0
    if lay.cp > 1:
        return lay.micro * lay.local_seq * (lay.key_seq + ad.prefix) * value_bytes
    if lay.packing:
        return lay.micro * lay.seq * (lay.seq + ad.prefix) * value_bytes
    return lay.seq * (lay.seq + ad.prefix) * value_bytes if ad.prefix else 0


def _head_bytes(s: _Shape, lay: _Layout, ad: _Adapter, keeps_logits: bool) -> tuple[int, int]:
    """The final norm's saved tensors and the loss's peak for one micro-batch. In forward: the
    logits, their fp32 copy and log-softmax (the vocab-parallel loss of tensor_parallel_output
    instead makes the shifted logits, their exp and the softmax it saves); the all-gather of
    tensor-parallel logits. When backward starts: log-softmax (softmax), its gradient and the
    logits' gradient, fp32 tokens x vocab each; a pipeline's last stage still holds its logits."""
    a, tokens = lay.param_bytes, lay.micro * lay.local_seq
    vocab = s.vocab // lay.tp if lay.tp_output else s.vocab
    logits = tokens * vocab * a
    # the last position of a row learns nothing; under context parallelism the rank's share of the rest
    fp32 = lay.micro * (lay.seq - 1 if lay.cp == 1 else lay.local_seq) * vocab * 4
    gather = logits // lay.tp + 2 * logits if lay.tp > 1 and not lay.tp_output else 0
    forward = logits + (4 if lay.tp_output and lay.tp > 1 else 2) * fp32
    loss = max(forward, 3 * fp32 + (logits if keeps_logits else 0), gather)
    norm = tokens * s.hidden * (4 + (2 * a if ad.full else 0))  # lm_head saves its input if it trains
    return norm, loss


def _in_flight(lay: _Layout, rank: int) -> int:
    """Chunk micro-batches pipeline rank `rank` holds at once (1 without a pipeline)."""
    m = lay.accum if lay.pp > 1 else 1
    if lay.vpp == 1:
        return min(m, lay.pp - rank)
    rounds = max(1, m // lay.pp)
    warmup = (lay.vpp - 1) * (m // rounds) + 2 * (lay.pp - 1 - rank)
    return min(warmup + 1, m * lay.vpp)


def _activation_bytes(s: _Shape, lay: _Layout, rank: int, ad: _Adapter, device: str) -> tuple[int, int, int]:
    """(saved, loss, rebuilt) activations of pipeline rank `rank` at its busiest moment (the most
    micro-batches in flight): what its layers and the final norm keep saved (with recompute only
    each layer's input), the loss's tensors on top when its backward starts (last stage only), and
    with recompute the one layer rebuilt at a time once the loss's tensors are gone (under context
    parallelism without it, one attention core)."""
    chunks, mine = lay.pp * lay.vpp, _chunks_of(lay, rank)
    per_chunk = max(_chunk_layers(s.layers, chunks)[c] for c in mine)
    layer = _layer_activation_bytes(s, lay, ad, device)
    kept = lay.micro * lay.local_seq * s.hidden * lay.param_bytes // lay.token_split if lay.recompute else layer
    saved = _in_flight(lay, rank) * per_chunk * kept
    norm, loss = _head_bytes(s, lay, ad, keeps_logits=lay.pp > 1) if chunks - 1 in mine else (0, 0)
    if _core_recomputed(lay) or (lay.cp > 1 and lay.ring and not lay.recompute):
        return saved + norm, loss, _layer_activation_bytes(s, lay, ad, device, core_only=True)
    if lay.cp > 1 and lay.ring:  # the rebuilt layer, and its ring's block working set in its backward
        return saved + norm, loss, layer + _layer_activation_bytes(s, lay, ad, device, core_only=True)
    return saved + norm, loss, layer if lay.recompute else 0


# -- the estimate ---------------------------------------------------------------------------------

def _pipeline_buffers(s: _Shape, lay: _Layout, rank: int) -> int:
    """torch.distributed.pipelining's receive buffers: one per micro-batch for each chunk's input
    activations (all but the first chunk) and output gradients (all but the last)."""
    if lay.pp == 1:
        return 0
    chunks = lay.pp * lay.vpp
    hidden = lay.micro * lay.local_seq * s.hidden * lay.param_bytes
    return lay.accum * hidden * sum((c > 0) + (c < chunks - 1) for c in _chunks_of(lay, rank))


def _dispatch_bytes(s: _Shape, lay: _Layout, rank: int) -> int:
    """Expert parallelism's all-to-all buffers in a sparse layer's backward (stages.parallel.experts):
    the rows a rank sends and the rows it receives, one per choice of each of its tokens (k x tokens
    rows of `hidden` each way, as many as it sends on average when routing is balanced) while the
    gradients go back the way the tokens came."""
    if lay.ep == 1 or not _rank_layers(s, lay, rank)[1]:
        return 0
    return 2 * lay.micro * lay.local_seq * s.top_k * s.hidden * lay.param_bytes


@dataclass(frozen=True)
class _Held:
    """What a rank holds through a step (bytes), and what its moments are built from."""

    parameters: int  # in the training dtype (ZeRO-3: the partition and the small parameters)
    optimizer: int  # on the device
    offloaded: int  # on the host
    whole: int  # every trained gradient in the training dtype
    part: int  # the gradient partition in the training dtype (0 when offloaded)
    shard: int  # trained parameters in this rank's partition (elements)
    trained: tuple[int, ...]  # elements of each trained tensor
    bucket: int  # DeepSpeed's gradient bucket (ZeRO only)
    persistent: int  # buffers alive all step: ZeRO-3's bucket, pipeline receive buffers
    gathered: int  # parameters ZeRO-3 keeps gathered between forward and backward


def _held(s: _Shape, lay: _Layout, rank: int, ad: _Adapter, device: str, bucket_size: int) -> _Held:
    tensors = _rank_tensors(s, lay, rank, ad)
    p, dp, zero, offload = lay.param_bytes, lay.dp, lay.zero, lay.offload and device != "cpu"
    trained = tuple(n for n, t in tensors if t)
    # under expert parallelism ZeRO shards the experts over the dp / ep ranks holding the same ones
    experts = _expert_elements(s, lay, rank) if ad.full and lay.ep > 1 else 0
    shard = math.ceil((sum(trained) - experts) / dp) + math.ceil(experts / (dp // lay.ep))
    optimizer_bytes = ADAM_BYTES + (MASTER_BYTES if zero or p != 4 else 0)
    dense_states = zero_model_states(sum(trained) - experts, zero, dp, param_bytes=p, optimizer_bytes=optimizer_bytes)
    expert_states = zero_model_states(experts, zero, dp // lay.ep, param_bytes=p, optimizer_bytes=optimizer_bytes)
    states = {key: dense_states[key] + expert_states[key] for key in dense_states}
    if zero == 3:  # every parameter is partitioned; small ones also stay whole
        small = sum(n for n, _ in tensors if n <= PARAM_PERSISTENCE_THRESHOLD)
        parameters = (math.ceil(sum(n for n, _ in tensors) / dp) + small) * p
    else:
        parameters = sum(n for n, _ in tensors) * p
    bucket = bucket_size * p if zero else 0
    # ZeRO-3 keeps the parameters it gathered in forward for their reuse in backward, up to
    # max_reuse_distance / max_live_parameters (1e9 elements each by default); one rank has
    # nothing to gather
    large = sum(n for n, _ in tensors if n > PARAM_PERSISTENCE_THRESHOLD)
    gathered = min(large, MAX_LIVE_PARAMETERS) * p if zero == 3 and dp > 1 else 0
    return _Held(parameters=parameters, optimizer=0 if offload else states["optimizer"],
                 offloaded=(MASTER_BYTES + ADAM_BYTES + 4) * shard if offload else 0,  # + fp32 gradients
                 whole=sum(trained) * p, part=0 if offload else shard * p, shard=shard, trained=trained,
                 bucket=bucket, persistent=(bucket if zero == 3 else 0) + _pipeline_buffers(s, lay, rank),
                 gathered=gathered)


def _expert_elements(s: _Shape, lay: _Layout, rank: int) -> int:
    """Elements of the routed experts pipeline rank `rank` holds (E / ep per sparse layer)."""
    return _rank_layers(s, lay, rank)[1] * 3 * s.experts // lay.ep * s.hidden * s.expert_width


def _rank_phases(s: _Shape, lay: _Layout, rank: int, ad: _Adapter, device: str,
                 bucket_size: int) -> dict[str, MemoryEstimate]:
    """Pipeline rank `rank`'s memory at the moments of a step that can peak: "backward" (the last
    micro-batch's loss backward starts, every activation saved), "layers" (backward reaches the
    decoder layers: the loss's tensors freed, the gradient bucket allocated, a layer rebuilt with
    recompute), "reduce" (backward ends: gradients whole or being reduced) and "step" (the
    optimizer step)."""
    h = _held(s, lay, rank, ad, device, bucket_size)
    zero, mixed, offload = lay.zero, lay.param_bytes != 4, lay.offload and device != "cpu"

    def at(phase: str, gradients: int, activations: int, buffers: int) -> MemoryEstimate:
        return MemoryEstimate(h.parameters, gradients, h.optimizer, activations, buffers + h.persistent,
                              h.offloaded, phase, rank)

    # backward: gradients kept from earlier micro-batches (none, stage1) or the reduced partition
    # (stage2, 3). ZeRO-1 keeps its bucket from the first micro-batch's backward to the reduction;
    # ZeRO-2 (and ZeRO-1 without accumulation) allocates it at the first gradient, when the loss's
    # tensors are gone: the "layers" moment, which with recompute also rebuilds one layer.
    held = (h.whole if lay.accum > 1 else 0) if zero < 2 else h.part
    saved, loss, rebuilt = _activation_bytes(s, lay, rank, ad, device)
    early_bucket = h.bucket if zero == 1 and lay.accum > 1 else 0
    first_grad = s.vocab * s.hidden // lay.tp * lay.param_bytes if ad.full else 0  # lm_head's
    late_bucket = h.bucket if zero in (1, 2) else 0
    dispatch = _dispatch_bytes(s, lay, rank)
    phases = [at("backward", held, saved + loss, early_bucket + h.gathered),
              at("layers", held + first_grad, saved + rebuilt, late_bucket + h.gathered + dispatch)]

    # reduce: none all-reduces a flat copy of the whole gradients; stage1 reduces them through the
    # bucket into the partition; stage2/3 reduce-scatter the last bucket's content (a flat copy).
    # Mixed precision sums in fp32 (communication_data_type): an fp32 copy of the flat bucket.
    fp32_sum = 4 * min(sum(h.trained), REDUCE_BUCKET_SIZE) if mixed else 0
    if zero == 0:
        phases.append(at("reduce", h.whole, 0, h.whole + fp32_sum))
    elif zero == 1:
        phases.append(at("reduce", h.whole + h.part, 0, h.bucket + fp32_sum))
    else:
        flat = min(sum(h.trained), REDUCE_BUCKET_SIZE) * lay.param_bytes
        phases.append(at("reduce", h.part, 0, late_bucket + h.gathered + 2 * flat + fp32_sum))

    # step: without ZeRO the mixed-precision wrapper copies every gradient to fp32 beside the
    # low-precision ones; ZeRO converts its partition to fp32 and frees the low-precision one
    # before AdamW runs. The fused AdamW updates in place: no temporaries.
    if zero == 0:
        phases.append(at("step", h.whole, 0, 4 * sum(h.trained) if mixed else 0))
    elif offload:  # the fp32 gradients and AdamW are on the host
        phases.append(at("step", 0, 0, 0))
    else:
        phases.append(at("step", 4 * h.shard, 0, h.part if mixed else 0))
    return {e.phase: e for e in phases}


def estimate_phases(arch: dict[str, Any], section: Mapping[str, Any], *, vocab_size: int, trained: str = "full",
                    lora_rank: int | None = None, num_prefix_tokens: int | None = None, device: str = "cuda",
                    pipeline_rank: int | None = None,
                    reduce_bucket_size: int = REDUCE_BUCKET_SIZE) -> dict[str, MemoryEstimate]:
    """The estimate at each moment of a step that can peak ("backward", "layers", "reduce", "step";
    see `_rank_phases`) for `pipeline_rank`, or for the rank that needs the most (None).
    `reduce_bucket_size`: DeepSpeed's gradient bucket in elements (the engine keeps DeepSpeed's
    default; bench/memory_plan.py passes 0 to compare without it). With `bf16: auto` the precision
    whose peak is larger (`bf16_choices`). Other arguments as for `estimate_memory`."""
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device={device!r}: expected 'cuda' or 'cpu'")
    section = training_section(section)
    ad = _adapter(trained, lora_rank, num_prefix_tokens, section)
    s, layouts = _shape(arch, vocab_size), [_layout(section, bf16) for bf16 in bf16_choices(section.bf16)]
    lay = layouts[0]  # the degrees are the same in each precision
    if lay.world % (lay.tp * lay.pp):
        raise ValueError(f"world_size={lay.world} is not divisible by tensor_parallel_degree={lay.tp} x "
                         f"pipeline_parallel_degree={lay.pp}")
    if pipeline_rank is not None and not 0 <= pipeline_rank < lay.pp:
        raise ValueError(f"pipeline_rank={pipeline_rank} is outside pipeline_parallel_degree={lay.pp}")
    # the first rank holds the most micro-batches in flight and the embedding, the last the logits;
    # the ranks between hold less than the first
    ranks = sorted({0, lay.pp - 1}) if pipeline_rank is None else [pipeline_rank]
    phases = [_rank_phases(s, precision, r, ad, device, reduce_bucket_size) for precision in layouts for r in ranks]
    return max(phases, key=lambda ph: max(e.total for e in ph.values()))


def estimate_memory(arch: dict[str, Any], section: Mapping[str, Any], *, vocab_size: int, trained: str = "full",
                    lora_rank: int | None = None, num_prefix_tokens: int | None = None,
                    device: str = "cuda") -> MemoryEstimate:
    """Per-device bytes at the peak of a training step of `arch` (a flavour's fields from
    `stages.config.architecture`, or a checkpoint's config.json) in the layout of the training
    `section` (a typed section, or a mapping completed by `stages.sections.training_section`: keys
    it leaves out take their schema defaults), for the pipeline rank that needs the most. `trained`: "full" (pretrain,
    sft), "lora" (`lora_rank` on the projections the section's `target_modules` names, default
    all of them; the base frozen) or "prefix" (`num_prefix_tokens` keys and values per layer).
    `device`: "cuda" or "cpu" (see the module docstring). The returned estimate is the phase that
    peaks (`.phase`)."""
    phases = estimate_phases(arch, section, vocab_size=vocab_size, trained=trained, lora_rank=lora_rank,
                             num_prefix_tokens=num_prefix_tokens, device=device)
    return max(phases.values(), key=lambda e: e.total)


def bucket_bytes(section: Mapping[str, Any]) -> set[int]:
    """Sizes in bytes of the DeepSpeed gradient buckets the section's ZeRO stage allocates (empty
    without ZeRO; with `bf16: auto` the size in either precision); bench/memory_plan.py reports the
    peak with and without them."""
    section = training_section(section)
    layouts = [_layout(section, bf16) for bf16 in bf16_choices(section.bf16)]
    return {REDUCE_BUCKET_SIZE * lay.param_bytes for lay in layouts if lay.zero}


# -- the nearest layout that fits -------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _allowed(s: _Shape, lay: _Layout, section: TrainingSettings, trained: str) -> bool:
    """The project's layout rules (`stages.config._check_layout`, `_check_finetune`, the engine's
    checks) for a candidate layout."""
    if lay.world % (lay.tp * lay.cp * lay.pp) or lay.accum < 1 or (lay.offload and not lay.zero):
        return False
    if lay.cp > 1 and isinstance(section, AlignSettings):  # stages.config.check_align_section
        return False
    if lay.cp > 1 and lay.ulysses and ulysses_head_conflict(lay.cp, lay.tp, s.heads, s.kv_heads):
        return False
    if any(n % lay.tp for n in (s.heads, s.kv_heads, s.intermediate, s.vocab)):
        return False
    if lay.ep > 1 and ((lay.world // (lay.tp * lay.pp)) % lay.ep or s.experts % lay.ep or lay.zero == 3):
        return False
    if lay.pp * lay.vpp > s.layers or (lay.vpp > 1 and lay.accum % max(1, lay.accum // lay.pp)):
        return False
    if lay.pp > 1:  # align: not supported yet (stages.config.check_align_section)
        return (lay.zero <= 1 and not isinstance(section, AlignSettings) and lay.accum >= lay.pp and not s.tied and trained == "full"
                and not section.fp16 and not lay.packing)
    return True


def _moves(section: TrainingSettings, s: _Shape, devices_per_node: int, trained: str):
    """Every candidate layout of the same world size and global batch reachable by the knobs of
    PREFERENCE, each with its changed keys and its rank: fewest knobs turned first; then the knobs
    earliest in PREFERENCE; then the smallest moves (stage2 before stage3, tp 2 before 4). A
    candidate is `section` with those keys replaced and not checked against the schema again (each
    value is one the schema allows; `Section.replace` would check hundreds of candidates)."""
    cur = _layout(section)
    micro = section.per_device_train_batch_size  # examples (cur.micro counts rows)
    batch = micro * cur.accum
    options = {
        "sequence_parallel": sorted({section.sequence_parallel, True}),
        "sharding": [z for z in range(cur.zero, 4)],
        "recompute": sorted({cur.recompute, True}),
        "tensor_parallel_degree": [t for t in _divisors(cur.world) if t == cur.tp or cur.tp < t <= devices_per_node],
        "pipeline_parallel_degree": [p for p in _divisors(cur.world)
                                     if p == cur.pp or (p > cur.pp and s.layers % p == 0)],
        "sharding_offload": sorted({cur.offload, True}),
        "per_device_train_batch_size": [m for m in _divisors(batch) if m <= micro],
    }
    stage_names = {v: k for k, v in ZERO_STAGES.items()}
    for sp, zero, recompute, tp, pp, offload, examples in product(*options.values()):
        if sp and not section.sequence_parallel and tp == 1:
            continue  # a switch of tensor parallelism: nothing to turn on without it
        trial = dataclasses.replace(section, sequence_parallel=sp, sharding=stage_names[zero], recompute=recompute,
                                    tensor_parallel_degree=tp, pipeline_parallel_degree=pp, sharding_offload=offload,
                                    per_device_train_batch_size=examples, gradient_accumulation_steps=batch // examples)
        if not _allowed(s, _layout(trial), trial, trained):
            continue
        changes = {k: getattr(trial, k) for k in (*PREFERENCE, "gradient_accumulation_steps")
                   if getattr(trial, k) != getattr(section, k)}
        steps = (int(sp) - int(section.sequence_parallel), zero - cur.zero, int(recompute) - int(cur.recompute),
                 math.log2(tp / cur.tp),
                 math.log2(pp / cur.pp), int(offload) - int(cur.offload), math.log2(micro / examples))
        turned = tuple(i for i, step in enumerate(steps) if step)
        yield (len(turned), turned, steps), changes, trial


def nearest_fitting_layout(arch: dict[str, Any], section: Mapping[str, Any], *, vocab_size: int, device_memory: int,
                           devices_per_node: int, trained: str = "full", lora_rank: int | None = None,
                           num_prefix_tokens: int | None = None, device: str = "cuda") -> dict[str, Any] | None:
    """The layout closest to `section` whose estimate fits `device_memory` bytes, as the section
    keys to change (`{}`: the section fits as it is; None: no layout of this world size does).

    Keeps world_size and the global batch. Turns, in this order of preference (PREFERENCE):
    sequence parallelism on (with tensor parallelism: no extra compute, the same traffic), the ZeRO
    stage up, recompute on, tensor parallelism up within a node (`devices_per_node`; dividing
    the heads, KV heads, intermediate size and vocabulary), pipeline parallelism up (dividing the
    layers; sharding none/stage1, gradient_accumulation_steps >= pp, full training only), ZeRO-Offload
    on, and the micro-batch down with gradient_accumulation_steps up. The closest layout turns the
    fewest knobs, then the earliest ones, then by the smallest steps."""
    s, section = _shape(arch, vocab_size), training_section(section)

    def fits(candidate: TrainingSettings) -> bool:
        return estimate_memory(arch, candidate, vocab_size=vocab_size, trained=trained, lora_rank=lora_rank,
                               num_prefix_tokens=num_prefix_tokens, device=device).total <= device_memory

    if fits(section):
        return {}
    for _, changes, trial in sorted(_moves(section, s, devices_per_node, trained), key=lambda m: m[0]):
        if changes and fits(trial):
            return changes
    return None
