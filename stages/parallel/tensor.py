"""Tensor-parallel layers (Megatron-LM style) and the vocab-parallel cross-entropy.

Every split parameter carries `tensor_model_parallel = True` (DeepSpeed reads this name to count
its gradient norm on every rank) and `partition_dim` (the dimension it is split along, which
checkpoint code reads to merge or split shards). Parameters without the tag are replicated on
every rank of the tensor-parallel group and receive identical gradients.

Layers are built from the dense module (`from_dense`): the full weight is initialised once from
the seed and each rank keeps its contiguous slice, so TP=2 starts from exactly TP=1's weights. A
frozen dense weight stays frozen.

LoRA (`stages.adapters.lora_linear.LoraLinear`) is split the way its base weight is:
column-parallel keeps A whole and splits B by output rows, Y_r += s B_r (A x), the r-wide A x
entering the parallel region like x (its gradient all-reduced); row-parallel splits A by input
columns and keeps B whole, Y += s B (sum_r A_r x_r), the r-wide partial products all-reduced
before B. Replicated factors thus get the same, full gradient on every rank. Under sequence
parallelism the column-parallel A x is computed on the gathered sequence and the row-parallel sum is
reduce-scattered r wide; a replicated tensor whose gradient a rank then sees only in part (column's
A, whose output gradient is this rank's share; row's B and bias, applied to this rank's tokens) has
it summed over the group (`_replicated`).
Shapes: N tokens (any leading dims), tp the group size, r this rank's index in it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from stages.model.labels import IGNORE_INDEX
from stages.model.llama import rms_norm
from stages.model.loss import causal_lm_loss
from stages.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    linear_on_gathered_sequence,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def shard_tensor(full: torch.Tensor, partition_dim: int, rank: int, world: int, chunks: int = 1) -> torch.Tensor:
    """Contiguous slice `rank` of `world` equal parts of `full` along `partition_dim` (a copy). A
    fused tensor of `chunks` blocks stacked along that dimension (GLM's gate_up_proj: [gate; up])
    gives rank r slice r of every block, stacked the same way ([gate_r; up_r])."""
    if full.shape[partition_dim] % (world * chunks):
        raise ValueError(f"dimension {partition_dim} of size {full.shape[partition_dim]} ({chunks} fused block(s)) "
                         f"is not divisible by tensor_parallel_degree={world}")
    if chunks == 1:
        return full.chunk(world, dim=partition_dim)[rank].clone()
    return torch.cat([block.chunk(world, dim=partition_dim)[rank] for block in full.chunk(chunks, dim=partition_dim)],
                     dim=partition_dim)


def join_shards(parts: list[torch.Tensor], partition_dim: int, chunks: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's `shard_tensor` slice, in rank order."""
    if chunks == 1:
        return torch.cat(parts, dim=partition_dim)
    blocks = [part.chunk(chunks, dim=partition_dim) for part in parts]  # rank -> its slice of each block
    return torch.cat([blocks[r][c] for c in range(chunks) for r in range(len(parts))], dim=partition_dim)


def partition_dim(param: torch.Tensor) -> int | None:
    """The dimension a tensor-parallel parameter is split along; None for a replicated one."""
    return getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None


def partition_chunks(param: torch.Tensor) -> int:
    """How many fused blocks a split parameter stacks along its partition_dim (1: a plain split)."""
    return getattr(param, "partition_chunks", 1)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, chunks: int = 1) -> nn.Parameter:
    """Tag a parameter as split along `partition_dim` across the tensor-parallel group (each of
    `chunks` fused blocks split on its own, see `shard_tensor`)."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_chunks = chunks
    return param


class _TensorParallelModule(nn.Module):
    """Holds the group and this rank's coordinates (read by shard_state_dict)."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.tp_rank = dist.get_rank(group=group)
        self.tp_size = dist.get_world_size(group=group)
        self.lora_A = self.lora_B = None  # LoRA factors, from attach_lora
        self.sequence_parallel = False  # the linear layers' switch (apply_tensor_parallel's sequence_parallel)

    def attach_lora(self, dense: nn.Module, split_a: bool) -> None:
        """Take over `dense`'s LoRA factors (a LoraLinear), A split along its input (`split_a`,
        row-parallel) or B along its output (column-parallel), the other factor replicated."""
        a, b = dense.lora_A.weight, dense.lora_B.weight  # (r, in), (out, r)
        if split_a:
            a = mark_tensor_parallel(nn.Parameter(shard_tensor(a.detach(), 1, self.tp_rank, self.tp_size)), 1)
            b = nn.Parameter(b.detach().clone())
        else:
            chunks = partition_chunks(self.weight)  # B's rows are the weight's output rows
            a = nn.Parameter(a.detach().clone())
            b = mark_tensor_parallel(nn.Parameter(shard_tensor(b.detach(), 0, self.tp_rank, self.tp_size, chunks)),
                                     0, chunks)
        self.lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False, device="meta")
        self.lora_B = nn.Linear(b.shape[1], b.shape[0], bias=False, device="meta")
        self.lora_A.weight, self.lora_B.weight = a, b
        self.lora_dropout, self.lora_scaling = dense.lora_dropout, dense.lora_scaling

    def _replicated(self, param: torch.Tensor) -> torch.Tensor:
        """A replicated parameter as this layer applies it: under sequence parallelism to this rank's
        tokens only, so its gradient is summed over the group (copy_to_tensor_parallel_region's
        backward); else to every token, its gradient already whole."""
        if self.sequence_parallel:
            return copy_to_tensor_parallel_region(param, self.group)
        return param

    def _freeze_like(self, dense: nn.Module) -> None:
        for name in ("weight", "bias"):
            mine, theirs = getattr(self, name, None), getattr(dense, name, None)
            if mine is not None and theirs is not None:
                mine.requires_grad_(theirs.requires_grad)

    def _load_shards(self, full: dict[str, torch.Tensor | None]) -> None:
        with torch.no_grad():
            for name, tensor in full.items():
                param = getattr(self, name)
                if tensor is None or param is None:
                    continue
                dim = getattr(param, "partition_dim", None)
                param.copy_(tensor if dim is None else
                            shard_tensor(tensor, dim, self.tp_rank, self.tp_size, partition_chunks(param)))


class ColumnParallelLinear(_TensorParallelModule):
    """Y = XA + b with A split along its output (column) dimension: rank r computes Y_r = X A_r + b_r.

    The input X is replicated. With `sequence_parallel` X is this rank's tokens (B, T/tp, in): the
    matmul all-gathers them and reduce-scatters X's gradient, keeping only X for backward
    (`linear_on_gathered_sequence`; Y holds the whole sequence). With gather_output the full Y is
    all-gathered on every rank; without it Y stays split along its last dimension (to feed a
    RowParallelLinear).
    Weight (out/tp, in), partition_dim 0; bias (out/tp,), partition_dim 0. A fused layer of
    `chunks` stacked outputs (GLM's gate_up_proj, chunks=2) splits each block: rank r computes
    [gate_r | up_r], and its `.chunk(2, -1)` gives the gate and up channels that pair up on it.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 gather_output: bool = False, dtype: torch.dtype | None = None, chunks: int = 1,
                 sequence_parallel: bool = False):
        super().__init__(group)
        self.sequence_parallel = sequence_parallel
        if out_features % (self.tp_size * chunks):
            raise ValueError(f"out_features={out_features} ({chunks} fused block(s)) is not divisible by "
                             f"tensor_parallel_degree={self.tp_size}")
        if gather_output and chunks > 1:
            raise ValueError("a fused column-parallel layer cannot gather its output (the slices interleave)")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        local = out_features // self.tp_size
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(local, in_features, dtype=dtype)), 0, chunks)
        self.bias = mark_tensor_parallel(nn.Parameter(torch.zeros(local, dtype=dtype)), 0, chunks) if bias else None

    @classmethod
    def from_dense(cls, dense: nn.Linear, group, gather_output: bool = False,
                   chunks: int = 1, sequence_parallel: bool = False) -> "ColumnParallelLinear":
        with torch.device(dense.weight.device):  # built in place: a move would drop the partition tags
            layer = cls(dense.in_features, dense.out_features, group, bias=dense.bias is not None,
                        gather_output=gather_output, dtype=dense.weight.dtype, chunks=chunks,
                        sequence_parallel=sequence_parallel)
        layer._load_shards({"weight": dense.weight, "bias": dense.bias})
        layer._freeze_like(dense)
        if getattr(dense, "lora_A", None) is not None:
            layer.attach_lora(dense, split_a=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x: this rank's tokens, gathered inside the matmul
            y = linear_on_gathered_sequence(x, self.weight, self.bias, self.group)  # (B, T, out/tp)
        else:
            y = F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)  # (N, out/tp)
        if self.lora_A is not None:
            if self.sequence_parallel:  # A's gradient from this rank's B_r only: summed by _replicated
                h = linear_on_gathered_sequence(self.lora_dropout(x), self._replicated(self.lora_A.weight), None,
                                                self.group)
            else:
                h = copy_to_tensor_parallel_region(self.lora_A(self.lora_dropout(x)), self.group)  # (N, r)
            y = y + self.lora_B(h) * self.lora_scaling
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[0]}), bias={self.bias is not None}, gather_output={self.gather_output}"
                + (", sequence_parallel" if self.sequence_parallel else ""))


class RowParallelLinear(_TensorParallelModule):
    """Y = XA + b with A split along its input (row) dimension: Y = sum_r X_r A_r + b.

    X arrives split along its last dimension (input_is_parallel, the output of a
    ColumnParallelLinear) or replicated (it is scattered first). The partial products are
    all-reduced, then the replicated bias is added once. With `sequence_parallel` they are
    reduce-scattered instead: Y is this rank's tokens (B, T/tp, out), and the bias, added to those
    tokens only, has its gradient summed over the group.
    Weight (out, in/tp), partition_dim 1; bias (out,) replicated.
    """

    def __init__(self, in_features: int, out_features: int, group, bias: bool = True,
                 input_is_parallel: bool = True, dtype: torch.dtype | None = None, sequence_parallel: bool = False):
        super().__init__(group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel row-parallel layer takes the output of a column-parallel one "
                             "(input_is_parallel=True)")
        self.sequence_parallel = sequence_parallel
        if in_features % self.tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tensor_parallel_degree={self.tp_size}")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        local = in_features // self.tp_size
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(out_features, local, dtype=dtype)), 1)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    @classmethod
    def from_dense(cls, dense: nn.Linear, group, input_is_parallel: bool = True,
                   sequence_parallel: bool = False) -> "RowParallelLinear":
        with torch.device(dense.weight.device):  # built in place: a move would drop the partition tags
            layer = cls(dense.in_features, dense.out_features, group, bias=dense.bias is not None,
                        input_is_parallel=input_is_parallel, dtype=dense.weight.dtype,
                        sequence_parallel=sequence_parallel)
        layer._load_shards({"weight": dense.weight, "bias": dense.bias})
        layer._freeze_like(dense)
        if getattr(dense, "lora_A", None) is not None:
            layer.attach_lora(dense, split_a=True)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)  # (N, out), this rank's share of the sum
        y = self._leave(partial)
        if self.lora_A is not None:
            h = self._leave(self.lora_A(self.lora_dropout(x)))  # (N, r)
            y = y + F.linear(h, self._replicated(self.lora_B.weight)) * self.lora_scaling
        return y if self.bias is None else y + self._replicated(self.bias)

    def _leave(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return reduce_from_tensor_parallel_region(partial, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features="
                f"{self.out_features}, bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
                + (", sequence_parallel" if self.sequence_parallel else ""))


class GroupSummedNorm(_TensorParallelModule):
    """A norm with replicated weights whose ranks each see part of what the single device
    normalises: Qwen3's q_norm / k_norm (one RMSNorm over head_dim shared by every head) when the
    heads are split over the group, and under sequence parallelism the norms of the residual stream
    (RMSNorm, or GPT-2's LayerNorm), each rank holding its own tokens. Each rank's gradient of the
    weights covers only its heads or tokens: they enter the forward through
    copy_to_tensor_parallel_region, whose backward sums the gradient over the group, so every rank
    holds the full gradient as the single device computes it. Weight (and LayerNorm's bias) keep
    the dense module's names and shapes, replicated.
    """

    def __init__(self, dim: int, eps: float, group, dtype: torch.dtype | None = None, layer_norm: bool = False):
        super().__init__(group)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype)) if layer_norm else None
        self.eps = eps

    @classmethod
    def from_dense(cls, dense: nn.Module, group) -> "GroupSummedNorm":
        layer_norm = isinstance(dense, nn.LayerNorm)
        if layer_norm and (dense.weight is None or dense.bias is None):
            raise ValueError("a LayerNorm without affine weight and bias has nothing to sum over the group")
        with torch.device(dense.weight.device):
            layer = cls(dense.weight.shape[0], dense.eps, group, dtype=dense.weight.dtype, layer_norm=layer_norm)
        layer._load_shards({"weight": dense.weight, "bias": dense.bias if layer_norm else None})
        layer._freeze_like(dense)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_parallel_region(self.weight, self.group)
        if self.bias is None:
            return rms_norm(x, weight, self.eps)
        bias = copy_to_tensor_parallel_region(self.bias, self.group)
        return F.layer_norm(x, self.weight.shape, weight, bias, self.eps)

    def extra_repr(self) -> str:
        kind = "LayerNorm" if self.bias is not None else "RMSNorm"
        return f"{kind} {tuple(self.weight.shape)}, eps={self.eps}, gradient summed over the tensor-parallel group"


class WidthSplitRMSNorm(_TensorParallelModule):
    """An RMSNorm over a whole projection whose columns are split over the group: OLMoE's q_norm /
    k_norm, one norm over every query (key) head at once, when the heads are split. Rank r holds its
    heads' slice of the weight (split as the projection's columns, partition_dim 0) and of x; the
    sum of squares is summed over the group before the mean, so every rank divides by the whole
    width's mean square, as the single device does. That sum enters the forward through an
    all-reduce whose backward all-reduces too (reduce_from then copy_to): each rank's output depends
    on every rank's x, and each rank's backward sees only its own heads' share of the gradient.
    """

    def __init__(self, dim: int, eps: float, group, dtype: torch.dtype | None = None):
        super().__init__(group)
        if dim % self.tp_size:
            raise ValueError(f"a norm over {dim} columns cannot be split evenly over {self.tp_size} ranks")
        self.dim, self.eps = dim, eps
        self.weight = mark_tensor_parallel(nn.Parameter(torch.ones(dim // self.tp_size, dtype=dtype)), 0)

    @classmethod
    def from_dense(cls, dense: nn.Module, group) -> "WidthSplitRMSNorm":
        with torch.device(dense.weight.device):
            layer = cls(dense.weight.shape[0], dense.eps, group, dtype=dense.weight.dtype)
        layer._load_shards({"weight": dense.weight})
        layer._freeze_like(dense)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        squares = reduce_from_tensor_parallel_region(x.pow(2).sum(-1, keepdim=True), self.group)
        squares = copy_to_tensor_parallel_region(squares, self.group)
        x = x * torch.rsqrt(squares / self.dim + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"RMSNorm over {self.dim} columns (local {self.weight.shape[0]}), eps={self.eps}"


class VocabParallelEmbedding(_TensorParallelModule):
    """E[ids] with E's rows (the vocabulary) split: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids in its range, writes zeros for the others, and the results are
    all-reduced (exactly one rank contributes each row). Weight (V/tp, d), partition_dim 0.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group, dtype: torch.dtype | None = None):
        super().__init__(group)
        if num_embeddings % self.tp_size:
            raise ValueError(f"vocab_size={num_embeddings} is not divisible by tensor_parallel_degree={self.tp_size}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = num_embeddings // self.tp_size
        self.vocab_start, self.vocab_end = self.tp_rank * local, (self.tp_rank + 1) * local
        self.weight = mark_tensor_parallel(nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype)), 0)

    @classmethod
    def from_dense(cls, dense: nn.Embedding, group) -> "VocabParallelEmbedding":
        with torch.device(dense.weight.device):  # built in place: a move would drop the partition tags
            layer = cls(dense.num_embeddings, dense.embedding_dim, group, dtype=dense.weight.dtype)
        layer._load_shards({"weight": dense.weight})
        layer._freeze_like(dense)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (..., d)
        return reduce_from_tensor_parallel_region(x, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local rows [{self.vocab_start}, {self.vocab_end})"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split along the vocabulary (last) dim; grad softmax - onehot."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        # logits (N, V/tp) on each rank, target (N,) global vocabulary ids
        logits = logits.float()
        local_v = logits.shape[-1]
        start = dist.get_rank(group=group) * local_v
        # Subtract the global max per row for a stable exp; it cancels in softmax and in the loss.
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)  # (N, V/tp)
        outside = (target < start) | (target >= start + local_v)  # includes ignore_index
        local_t = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)  # exactly one rank holds it
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)  # (N,)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d logits = softmax - onehot(target)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (~outside).to(grad.dtype)
        grad *= grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token loss (N,) of vocab-split logits (N, V/tp) against global targets (N,); 0 where
    target == ignore_index. Equals F.cross_entropy(full_logits, target, reduction='none')."""
    if dist.get_world_size(group=group) == 1:
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)


def vocab_parallel_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
    """The mean next-token loss of `stages.model.loss.causal_lm_loss`, for logits (B, T, V/tp)
    split along the vocabulary (lm_head with tensor_parallel_output)."""
    return causal_lm_loss(logits, labels, per_token=functools.partial(vocab_parallel_cross_entropy, group=group))
