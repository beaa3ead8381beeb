"""Communication into and out of the tensor-parallel region, as paired autograd functions.

Three layers, as in Megatron-LM: private collectives (return early for a group of one), autograd
functions whose backward is the forward's adjoint, and lowercase public wrappers that take the
process group explicitly. "Parallel region" means the activations between a column-parallel and a
row-parallel layer, where each rank holds its own slice of the features.

Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022) works on the sequence dimension
(dim 1 of (B, T, d)): the residual stream, norms and dropout hold a rank's T/tp tokens. Split and
gather are the TP pair on that dimension (in and out of the decoder layers); a column-parallel
layer all-gathers the tokens inside its own autograd function (`linear_on_gathered_sequence`:
backward keeps only the rank's tokens, gathers them again and reduce-scatters the input's
gradient, as Megatron's linear does); a row-parallel one reduce-scatters its partial sums
(backward: all-gather), so the all-reduce of plain TP becomes a reduce-scatter plus an all-gather
of the same volume. Gloo has no reduce-scatter:
there it is an all-reduce and a slice (the same result, twice the traffic; NCCL runs
`reduce_scatter_tensor`).

Context parallelism (`stages.parallel.context`) gathers every rank's keys and values along the
sequence; each rank's queries read all of them, so the backward reduce-scatters (sums) their
gradients (`gather_from_context_parallel_region`). Its Ulysses mode trades the sequence split for a
head split and back with all-to-alls (`all_to_all`; backward: the all-to-all the other way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQUENCE_DIM = 1  # of the (B, T, d) hidden states


# -- collectives ---------------------------------------------------------------------------------
def collective_device(group=None) -> torch.device:
    """The device a collective's tensors must live on: the current CUDA device under NCCL (which
    reduces CUDA tensors only: "No backend type associated with device type cpu"), else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world(group) -> int:
    return dist.get_world_size(group=group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over the group (a new tensor: the input may be saved or shared elsewhere)."""
    if _world(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous slice of dimension `dim`."""
    world = _world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {world}")
    return x.chunk(world, dim=dim)[dist.get_rank(group=group)].contiguous()


def _gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The concatenation of every rank's x along `dim`, in group-rank order."""
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _all_to_all_dims(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Slice `scatter_dim` into one part per rank, send part r to rank r, and concatenate the parts
    received along `gather_dim`, in group-rank order."""
    world = _world(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} is not divisible by the group "
                         f"size {world}")
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # (world, ...)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice along `dim` of the sum of x over the group."""
    world = _world(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {world}")
    if dist.get_backend(group) == "nccl":
        whole = x.movedim(dim, 0).contiguous()
        out = torch.empty((whole.shape[0] // world, *whole.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, whole, op=dist.ReduceOp.SUM, group=group)
        return out.movedim(0, dim).contiguous()
    return _split_dim(_all_reduce(x, group), dim, group)  # gloo: no reduce-scatter


# -- autograd functions --------------------------------------------------------------------------
class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (each rank's slice contributed to the input's grad)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-reduce (sum the partial results). Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Split(torch.autograd.Function):
    """Forward: keep this rank's slice of dimension `dim`. Backward: all-gather that dimension."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather dimension `dim` (rank-major). Backward: this rank's slice of the gradient:
    kept as it is where every rank's consumer of the whole tensor is the same computation (each holds
    the whole gradient), summed over the group (reduce-scatter) with `summed` where each rank's
    consumer differs (context parallelism's queries of the rank's own tokens)."""

    @staticmethod
    def forward(ctx, x, dim, group, summed):
        ctx.dim, ctx.group, ctx.summed = dim, group, summed
        return _gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        part = _reduce_scatter_dim if ctx.summed else _split_dim
        return part(grad, ctx.dim, ctx.group), None, None, None


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all from `scatter_dim` to `gather_dim`. Backward: the all-to-all back."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all_dims(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all_dims(grad, gather_dim, scatter_dim, ctx.group), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward: sum the partial results and keep this rank's tokens. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim(x, SEQUENCE_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_dim(grad, SEQUENCE_DIM, ctx.group), None


class _LinearOnGatheredSequence(torch.autograd.Function):
    """Y = gather(X) W^T + b for X this rank's tokens (B, T/tp, in): the input of a column-parallel
    layer under sequence parallelism, as Megatron-LM's linear computes it. Forward all-gathers the
    tokens and saves only this rank's (the whole sequence is not kept for backward); backward
    all-gathers them again for W's gradient and reduce-scatters the input's gradient (each rank's
    is a partial sum over its own output columns)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_dim(x, SEQUENCE_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _reduce_scatter_dim(grad.matmul(weight), SEQUENCE_DIM, ctx.group)
        rows = grad.reshape(-1, grad.shape[-1])  # (B*T, out)
        if ctx.needs_input_grad[1]:
            whole = _gather_dim(x, SEQUENCE_DIM, ctx.group)
            grad_weight = rows.t().matmul(whole.reshape(-1, whole.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias, None


# -- public wrappers -----------------------------------------------------------------------------
def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the parallel region with a replicated input (before a column-parallel matmul)."""
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the parallel region by summing partial outputs (after a row-parallel matmul)."""
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the parallel region by splitting a replicated input along its last dimension."""
    return _Split.apply(x, -1, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the parallel region by concatenating the ranks' last-dimension slices."""
    return _Gather.apply(x, -1, group, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Split the replicated hidden states (B, T, d) into this rank's tokens (B, T/tp, d)."""
    return _Split.apply(x, SEQUENCE_DIM, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All ranks' tokens (B, T, d) from this rank's (B, T/tp, d), for a consumer every rank runs
    whole (the final norm and lm_head); its gradient is split back. A column-parallel layer gathers
    inside `linear_on_gathered_sequence` instead."""
    return _Gather.apply(x, SEQUENCE_DIM, group, False)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the parallel region by summing partial outputs (B, T, d) into this rank's tokens (B, T/tp, d)."""
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def linear_on_gathered_sequence(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                group) -> torch.Tensor:
    """F.linear of the whole sequence all-gathered from this rank's tokens x (B, T/tp, in) ->
    (B, T, out): a column-parallel layer's matmul under sequence parallelism, keeping only x for
    backward (`_LinearOnGatheredSequence`)."""
    return _LinearOnGatheredSequence.apply(x, weight, bias, group)


def gather_from_context_parallel_region(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's slices of dimension `dim` concatenated in group-rank order, for a consumer that
    differs on each rank (context parallelism's queries of the rank's own tokens): backward sums the
    group's gradients and keeps this rank's slice."""
    return _Gather.apply(x, dim, group, True)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Each rank's slice r of `scatter_dim` goes to rank r; the slices received are concatenated
    along `gather_dim` in group-rank order (Ulysses' switch between a sequence and a head split)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)
