"""The tensor-parallel plan of the Llama family, applied to a built model, and shard merge/split.

`apply_tensor_parallel` swaps modules in place under their own names, so the sharded model's
state-dict keys equal the single-device (= Hugging Face) names; `gather_full_state_dict` and
`shard_state_dict` convert between the two layouts by reading each parameter's `partition_dim`,
without any per-model table.

Megatron's pairing inside a block: q/k/v and gate/up are column-parallel (each rank owns
heads/tp query heads, kv_heads/tp KV heads and intermediate/tp MLP channels), o_proj and down_proj
are row-parallel (their all-reduce restores the replicated residual stream). Norm weights stay
replicated. Biases follow their weight: q/k/v (and gate/up with mlp_bias) are split with the
columns; o_proj (Llama's attention_bias) and down_proj (mlp_bias) keep one replicated bias that
RowParallelLinear adds once, after the all-reduce, never once per rank. Attention reads its head
counts from the projection widths, so the unchanged `Attention.forward` (sliding windows included)
runs on the local heads; GQA's query-to-KV grouping survives the split because rank r holds query
heads [r*H/tp, ...) and exactly their KV heads [r*K/tp, ...).
"""

from __future__ import annotations

import fnmatch
import functools

import torch
import torch.distributed as dist
from torch import nn

from stages.parallel.tensor import (
    ColumnParallelLinear,
    GroupSummedNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    WidthSplitRMSNorm,
    _TensorParallelModule,
    mark_tensor_parallel,
    join_shards,
    partition_chunks,
    partition_dim,
    shard_tensor,
    vocab_parallel_causal_lm_loss,
)
from stages.parallel.sequence import SequenceSplit
from stages.parallel.topology import ParallelDegrees, Topology

COLUMN, ROW, VOCAB, OUTPUT, HEAD_NORM, SEQUENCE_NORM = "column", "row", "vocab", "output", "head_norm", "sequence_norm"
WIDTH_NORM = "width_norm"
COLUMN_FUSED2, COLUMN_FUSED3 = "column_fused2", "column_fused3"
FUSED_BLOCKS = {COLUMN_FUSED2: 2, COLUMN_FUSED3: 3}  # fused column styles -> blocks stacked in the layer

# Module-name pattern (fnmatch, against `named_modules()` names) -> parallel style.
# OUTPUT is column-parallel with the logits gathered, or left vocab-split with tensor_parallel_output.
# COLUMN_FUSED2 splits each half of a fused [gate; up] layer (GLM), so rank r's output is
# [gate_r | up_r] and the SwiGLU product stays local, as for separate gate/up layers (transformers'
# own plan gathers GLM's whole gate_up output on every rank instead); COLUMN_FUSED3 likewise splits each
# third of GPT-2's fused [q; k; v] projection, so a rank holds its heads' q, k and v. HEAD_NORM: a norm shared by the
# split heads (Qwen3's q_norm / k_norm), replicated with its gradient summed over the group; on a model whose q/k
# norms span every head (OLMoE's `qk_norm_whole`) they are WIDTH_NORM instead: split with the heads, the mean square
# summed over the group. SEQUENCE_NORM: a norm
# of the residual stream, left as it is without sequence parallelism; with it each rank normalises its own tokens,
# the replicated weights' gradient summed over the group as HEAD_NORM's.
LLAMA_TP_PLAN: dict[str, str] = {
    "model.embed_tokens": VOCAB,
    "model.layers.*.self_attn.q_proj": COLUMN,
    "model.layers.*.self_attn.k_proj": COLUMN,
    "model.layers.*.self_attn.v_proj": COLUMN,
    "model.layers.*.self_attn.qkv_proj": COLUMN_FUSED3,
    "model.layers.*.self_attn.q_norm": HEAD_NORM,
    "model.layers.*.self_attn.k_norm": HEAD_NORM,
    "model.layers.*.self_attn.o_proj": ROW,
    "model.layers.*.mlp.gate_proj": COLUMN,
    "model.layers.*.mlp.up_proj": COLUMN,
    "model.layers.*.mlp.gate_up_proj": COLUMN_FUSED2,
    "model.layers.*.mlp.down_proj": ROW,
    "model.layers.*.input_layernorm": SEQUENCE_NORM,
    "model.layers.*.post_attention_layernorm": SEQUENCE_NORM,
    "model.layers.*.post_self_attn_layernorm": SEQUENCE_NORM,
    "model.layers.*.post_mlp_layernorm": SEQUENCE_NORM,
    "lm_head": OUTPUT,
}


def _style_of(name: str, plan: dict[str, str]) -> str | None:
    styles = {style for pattern, style in plan.items() if fnmatch.fnmatchcase(name, pattern)}
    if len(styles) > 1:
        raise ValueError(f"module {name!r} matches several tensor-parallel styles {sorted(styles)}")
    return styles.pop() if styles else None


def _parallel_module(module: nn.Module, style: str, group, tensor_parallel_output: bool,
                     sequence_parallel: bool) -> nn.Module | None:
    """The parallel counterpart of `module` in `style`; None where the style leaves it as it is."""
    sp = sequence_parallel
    if style == VOCAB:
        return VocabParallelEmbedding.from_dense(module, group)
    if style == COLUMN:
        return ColumnParallelLinear.from_dense(module, group, gather_output=False, sequence_parallel=sp)
    if style in FUSED_BLOCKS:
        return ColumnParallelLinear.from_dense(module, group, gather_output=False, chunks=FUSED_BLOCKS[style],
                                               sequence_parallel=sp)
    if style == HEAD_NORM:
        return GroupSummedNorm.from_dense(module, group)
    if style == WIDTH_NORM:
        return WidthSplitRMSNorm.from_dense(module, group)
    if style == SEQUENCE_NORM:
        return GroupSummedNorm.from_dense(module, group) if sp else None
    if style == OUTPUT:  # after the residual stream's tokens are gathered (SequenceSplit.leave)
        return ColumnParallelLinear.from_dense(module, group, gather_output=not tensor_parallel_output)
    if style == ROW:
        return RowParallelLinear.from_dense(module, group, input_is_parallel=True, sequence_parallel=sp)
    styles = (COLUMN, COLUMN_FUSED2, COLUMN_FUSED3, ROW, VOCAB, OUTPUT, HEAD_NORM, WIDTH_NORM, SEQUENCE_NORM)
    raise ValueError(f"tensor-parallel style {style!r} is unknown; choose one of {styles}")


def apply_tensor_parallel(model: nn.Module, topology_or_group, tensor_parallel_output: bool = False,
                          plan: dict[str, str] | None = None, sequence_parallel: bool = False) -> nn.Module:
    """Shard `model` (built with its full weights) over the tensor-parallel group, in place.

    Each planned module is replaced by its parallel counterpart holding this rank's slice of the
    full weights; names are unchanged. With `tensor_parallel_output` the logits stay split along
    the vocabulary and the model's `loss_function` becomes the vocab-parallel loss; otherwise
    the logits are gathered and the model's own loss applies. Tied embeddings stay tied (both are split by vocabulary rows).
    With `sequence_parallel` (Megatron's, a switch of TP) the decoder layers' residual stream,
    norms and dropout hold T/tp tokens per rank: `model.sequence_parallel` (a `SequenceSplit`)
    splits the embeddings' output into the ranks' tokens before the first layer and gathers them
    after the last (`stages.model.llama.run_layers`); the column-parallel projections all-gather
    the tokens inside their matmul (keeping only this rank's for backward), the row-parallel ones
    reduce-scatter their output, and the layers' norms sum their weights' gradient over the group. Parameter
    names and shapes do not change, so checkpoints are those of plain TP. Returns the model.
    """
    group = topology_or_group.tp_group if isinstance(topology_or_group, Topology) else topology_or_group
    tp = dist.get_world_size(group=group)
    config = model.config
    ParallelDegrees(world_size=tp, tensor_parallel_degree=tp).validate_for_model(config)
    plan = LLAMA_TP_PLAN if plan is None else plan
    tied = getattr(config, "tie_word_embeddings", False)

    for name, module in list(model.named_modules()):
        style = _style_of(name, plan)
        if style is None:
            continue
        if style == HEAD_NORM and getattr(config, "qk_norm_whole", False):
            style = WIDTH_NORM
        if isinstance(module, _TensorParallelModule):
            raise ValueError(f"module {name!r} is already tensor-parallel")
        replacement = _parallel_module(module, style, group, tensor_parallel_output, sequence_parallel and tp > 1)
        if replacement is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, replacement)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight  # same rows on this rank
    rank = dist.get_rank(group=group)
    for module in model.modules():  # informational only: forward reads widths, not these
        if hasattr(module, "num_kv_heads") and hasattr(module, "num_heads"):
            module.num_heads //= tp
            module.num_kv_heads //= tp
            _shard_prefix(module, rank, tp)

    model.tensor_parallel_degree = tp
    if sequence_parallel and tp > 1:
        model.sequence_parallel = SequenceSplit(group)
        for block in getattr(model, "sparse_blocks", list)():  # a mixture of experts routes the whole sequence
            block.sequence = model.sequence_parallel
    if tensor_parallel_output and tp > 1:
        # the model's forward(input_ids, labels) then returns the vocab-parallel loss
        model.loss_function = functools.partial(_causal_lm_loss_with_group, group=group)
    return model


def _shard_prefix(attention: nn.Module, rank: int, tp: int) -> None:
    """A prefix-tuned attention layer keeps the prefix keys/values of its own KV heads (K, P, hd)."""
    for name in ("prefix_key", "prefix_value"):
        full = getattr(attention, name, None)
        if full is not None:
            local = nn.Parameter(shard_tensor(full.detach(), 0, rank, tp), requires_grad=full.requires_grad)
            setattr(attention, name, mark_tensor_parallel(local, 0))


def _causal_lm_loss_with_group(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    return vocab_parallel_causal_lm_loss(logits, labels, group)


def _partition_dims(model: nn.Module) -> dict[str, int | None]:
    """State-dict key -> partition_dim (None for replicated tensors), tied names included."""
    dims: dict[str, int | None] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        dims[name] = partition_dim(p)
    return dims


def _partition_chunks(model: nn.Module) -> dict[str, int]:
    return {name: partition_chunks(p) for name, p in model.named_parameters(remove_duplicate=False)}


def gather_full_state_dict(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """The single-device state dict of a tensor-parallel model, on every rank of `group`
    (split tensors are all-gathered along their partition_dim; a collective call)."""
    dims, chunks = _partition_dims(model), _partition_chunks(model)
    world = dist.get_world_size(group=group)
    full = {}
    for key, tensor in model.state_dict().items():
        dim = dims.get(key)
        tensor = tensor.detach()
        if dim is None or world == 1:
            full[key] = tensor.clone()
            continue
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        full[key] = join_shards(parts, dim, chunks[key])
    return full


def shard_state_dict(full_state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's slice of a single-device state dict, for `model.load_state_dict` of a model
    parallelised by `apply_tensor_parallel` (ranks are read from its parallel modules)."""
    owners: dict[str, _TensorParallelModule] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _TensorParallelModule):
            for p_name, _ in module.named_parameters(recurse=False):
                owners[f"{mod_name}.{p_name}" if mod_name else p_name] = module
    dims, chunks = _partition_dims(model), _partition_chunks(model)
    local = {}
    for key in model.state_dict():
        if key not in full_state:
            raise ValueError(f"the full state dict has no {key!r}")
        dim = dims.get(key)
        if dim is None:
            local[key] = full_state[key]
        elif key not in owners:
            raise ValueError(f"{key!r} is split (partition_dim={dim}) but not held by a tensor-parallel module")
        else:
            owner = owners[key]
            local[key] = shard_tensor(full_state[key], dim, owner.tp_rank, owner.tp_size, chunks[key])
    return local
