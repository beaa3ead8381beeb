"""The routers of a mixture of experts in training: the loss their step adds, and the load balance.

Each micro-batch's forward leaves its routing on the sparse blocks (`stages.model.moe.RouterRecord`);
`RouterStats.step_loss` turns it into the router loss the step backpropagates (the load-balancing
term, plus the z-loss when configured: `LlamaForCausalLM.router_loss`) and counts the tokens each
expert of each sparse layer received. train_log.csv gets the mean router loss and the load
imbalance since the last logged row (the busiest expert's tokens over an even share, averaged over
the sparse layers: 1.0 is perfect balance, E/k the worst); meta.json the tokens per expert of the
steps this process ran (since the start, or the resume).
"""

from __future__ import annotations

import torch
import torch.distributed

from stages.parallel.mappings import collective_device

COLUMNS = ("router_loss", "expert_imbalance")


class RouterStats:
    """Router loss and expert loads of this rank's micro-batches; `means` sums them over the
    data-parallel ranks (collective, once per logged row)."""

    def __init__(self, dp_group, sparse_layers: int, num_experts: int, cp_group=None):
        self.dp_group = dp_group
        # context parallelism: each rank's micro-batch holds parts of the sequences, and its router
        # loss is its share of theirs (LlamaForCausalLM.router_loss), times cp because DeepSpeed
        # averages the gradients over the data group, which holds the cp ranks of each sequence
        self.cp_group = cp_group
        self.cp = 1 if cp_group is None else torch.distributed.get_world_size(group=cp_group)
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.micro_batches = 0
        self.counts = torch.zeros(sparse_layers, num_experts, dtype=torch.float64)  # since the last row
        self.total = torch.zeros(sparse_layers, num_experts, dtype=torch.float64)  # of the whole run (all ranks)

    columns = COLUMNS

    def step_loss(self, model) -> torch.Tensor:
        """The router loss of `model`'s last forward (to add to the micro-batch's objective), its
        expert loads counted."""
        records = [block.record for block in model.sparse_blocks()]
        counts = torch.stack([r.tokens_per_expert() for r in records]).double()
        loss = model.router_loss(self.cp_group) * self.cp
        # kept on the model's device until `means`: no host sync in the step
        self.counts = self.counts.to(counts.device) + counts
        self.loss_sum = self.loss_sum.to(counts.device) + loss.detach().double()
        self.micro_batches += 1
        return loss

    def means(self) -> dict[str, float]:
        """Mean router loss per micro-batch and the load imbalance since the last call, over every
        data-parallel rank; then reset. Collective."""
        import torch.distributed as dist

        packed = torch.cat([self.loss_sum.reshape(1).cpu(),
                            torch.tensor([float(self.micro_batches)], dtype=torch.float64),
                            self.counts.reshape(-1).cpu()]).to(collective_device(self.dp_group))
        dist.all_reduce(packed, group=self.dp_group)
        packed = packed.cpu()
        counts = packed[2:].reshape(self.counts.shape)
        self.total += counts
        self.loss_sum = torch.zeros_like(self.loss_sum)
        self.counts = torch.zeros_like(self.counts)
        self.micro_batches = 0
        return {"router_loss": float(packed[0]) / max(float(packed[1]), 1.0),
                "expert_imbalance": imbalance(counts)}

    def tokens_per_expert(self) -> list[list[int]]:
        """Per sparse layer, the (token, choice) pairs each expert received since the run started (or
        resumed: a resumed run counts its own steps)."""
        return [[int(c) for c in layer] for layer in self.total]


def imbalance(counts: torch.Tensor) -> float:
    """The busiest expert's tokens over an even share, averaged over layers ((L, E) counts)."""
    per_layer = counts.max(dim=-1).values / counts.mean(dim=-1).clamp(min=1e-12)
    return float(per_layer.mean())
