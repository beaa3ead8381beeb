"""Communication into and out of the tensor-parallel region, as paired autograd functions.

Three layers, as in Megatron-LM: private collectives (return early for a group of one), autograd
functions whose backward is the forward's adjoint, and lowercase public wrappers that take the
process group explicitly. "Parallel region" means the activations between a column-parallel and a
row-parallel layer, where each rank holds its own slice of the features.

Sequence-parallel variants (scatter / gather on the sequence dimension with reduce-scatter) are
not provided: gloo has no reduce-scatter, and the CPU/debug path does not need them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def _split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the last dimension."""
    world = _world(group)
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the group size {world}")
    return x.chunk(world, dim=-1)[dist.get_rank(group=group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """The concatenation of every rank's x along the last dimension, in group-rank order."""
    world = _world(group)
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


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


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice of the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


# -- public wrappers -----------------------------------------------------------------------------
def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the parallel region with a replicated input (before a column-parallel matmul)."""
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the parallel region by summing partial outputs (after a row-parallel matmul)."""
    return _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Enter the parallel region by splitting a replicated input along its last dimension."""
    return _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Leave the parallel region by concatenating the ranks' last-dimension slices."""
    return _GatherFromTensorParallelRegion.apply(x, group)
