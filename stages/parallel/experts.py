"""Expert parallelism: a mixture of experts' experts split over the ranks of an expert group, tokens
sent to the rank holding their expert and back (all-to-all), as DeepSpeed-MoE, Megatron-Core and
torchtitan do.

Expert rank r of ep holds experts [r E/ep, (r+1) E/ep) of every sparse block, under their global
indices (`ShardedExperts`, a ModuleDict keyed "2", "3", ...), so parameter names stay those of the
single-device model (`model.layers.0.block_sparse_moe.experts.3.w1.weight`) and checkpoints, resume
and materialisation read and write whole experts by name. Each parameter carries `expert_parallel`
(the training engine hands these to DeepSpeed as expert parameters: averaged and ZeRO-sharded over
the expert-data group, not the data group).

One sparse layer's forward on each rank of the group (`ShardedExperts.dispatch`):
1. the rank's (token, choice) pairs are sorted by expert (`stages.model.moe.group_by_expert`: the order
   one process runs them in) and each expert rank's share counted; the counts per expert go
   all-to-all (every rank learns how many rows each other rank sends to each of its experts);
2. the rows go all-to-all (autograd-aware: the backward sends the gradients back the same way);
3. each local expert runs once on the rows every rank sent it, grouped by expert (an expert no
   token reached runs on none, so its weights get a zero gradient, as DeepSpeed expects);
4. the outputs go back all-to-all, are weighted by the router's weights and summed per token.

Every rank of the group must run the same sparse layers in the same order (they do: the same
model, the same number of micro-batches); dev evaluation, where every rank forwards the same
batch, exchanges the same way. Routing, the auxiliary losses and the shared expert stay per rank
on its own tokens, so an expert-parallel step equals the data-parallel one (tests/unit/test_pretrain_moe.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from stages.model.moe import SparseMoeBlock, group_by_expert


def local_experts(num_experts: int, rank: int, world: int) -> range:
    """The global indices of the experts expert rank `rank` of `world` holds."""
    if num_experts % world:
        raise ValueError(f"expert_parallel_degree={world} does not divide num_experts={num_experts}")
    share = num_experts // world
    return range(rank * share, (rank + 1) * share)


class ShardedExperts(nn.ModuleDict):
    """This rank's experts of one sparse block, keyed by global index, and the exchange that brings
    them every rank's tokens (`dispatch`)."""

    def __init__(self, experts: dict[str, nn.Module], num_experts: int, group, rank: int, world: int):
        super().__init__(experts)
        self.num_experts, self.group, self.rank, self.world = num_experts, group, rank, world
        self.local = local_experts(num_experts, rank, world)

    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """`stages.model.moe.run_experts` over the expert group: (N, d) from this rank's tokens x (N, d),
        their chosen experts and weights (N, k) and the capacity mask `keep`."""
        share = len(self.local)
        order, counts = group_by_expert(chosen, keep, self.num_experts)  # pairs sorted by expert, (E,) counts
        tokens = order // chosen.shape[1]
        # how many of this rank's rows each rank's experts get, and, from every rank, how many rows each
        # of this rank's experts gets (rank-major: source s's counts for local experts 0..share-1)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.reshape(self.world, share).cpu()  # the split sizes are host numbers anyway
        send_splits = counts.reshape(self.world, share).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        rows = _exchange(x[tokens], recv_splits, send_splits, self.group)
        by_expert = _expert_major(received).to(x.device)  # rows grouped by local expert, each source in rank order
        outputs = []
        start = 0
        for index, count in zip(self.local, received.sum(0).tolist()):
            outputs.append(self[str(index)](rows[by_expert[start:start + count]]))
            start += count
        back = torch.cat(outputs)[torch.argsort(by_expert)]  # the rows in the order they arrived
        out = _exchange(back, send_splits, recv_splits, self.group)
        y = torch.zeros_like(x)
        flat_weights = weights.reshape(-1)[order]
        y.index_add_(0, tokens, (out * flat_weights[:, None]).to(y.dtype))
        return y


def _exchange(rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """All-to-all of `rows` (send_splits[j] of them to rank j; recv_splits[j] arrive from it), in the
    autograd graph: the backward sends the gradients back the same way (torch's functional
    collective; the older torch.distributed.nn one is deprecated)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, group))


def _expert_major(received: torch.Tensor) -> torch.Tensor:
    """Indices that reorder rows arrived source-major (source s: its rows for local expert 0, 1, ...)
    into expert-major order (local expert e: its rows from source 0, 1, ...), from the counts
    (sources, local experts): each row's local expert, stably sorted."""
    sources, share = received.shape
    expert_of_row = torch.arange(share).repeat(sources).repeat_interleave(received.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


def apply_expert_parallel(model: nn.Module, group, rank: int, world: int) -> None:
    """Keep, in every sparse block of `model`, only expert rank `rank`'s experts of `world`, in place;
    their parameters marked `expert_parallel`. Works on a meta model (materialised afterwards)."""
    for block in list(model.modules()):  # the blocks' children change below
        if not isinstance(block, SparseMoeBlock):
            continue
        keep = local_experts(block.num_experts, rank, world)
        block.experts = ShardedExperts({str(e): block.experts[e] for e in keep}, block.num_experts, group, rank, world)
        for param in block.experts.parameters():
            param.expert_parallel = True
