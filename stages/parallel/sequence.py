"""Sequence parallelism's entry into and exit from the decoder layers: the residual stream between
the embeddings and the final norm holds T/tp tokens per tensor-parallel rank.

`apply_tensor_parallel(..., sequence_parallel=True)` sets `model.sequence_parallel` to a
`SequenceSplit`; `stages.model.llama.run_layers` (the one code path of the whole model and of each
pipeline stage) pads the hidden states to a multiple of tp tokens, computes the RoPE tables, masks
and segments of the padded length, hands each rank its tokens (`enter`), runs the layers and
gathers the tokens back (`leave`). The embeddings, the final norm and lm_head see the whole
sequence as under plain TP, and pipeline stages pass the whole sequence to each other.

Padding: a length that tp does not divide gets zero hidden states at its end, with positions that
continue the last example's. Causal attention never lets a real token see a later one, so the
real tokens' outputs, and every gradient, equal the unpadded run's; `leave` cuts the pads off.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stages.parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region


def continued_positions(position_ids: torch.Tensor, extra: int) -> torch.Tensor:
    """position_ids (B, T) with `extra` pads' positions after them, continuing each row's last
    example (never a new example at 0): (B, T + extra)."""
    steps = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
    return torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)


class SequenceSplit:
    """The tensor-parallel group's split of the sequence dimension of (B, T, d) hidden states."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group=group)
        self.length = self.padded = None  # the current forward's real and padded lengths (`pad`)

    def pad(self, x: torch.Tensor, position_ids: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) and position_ids (B, T) padded at the end to a multiple of the group's size."""
        length = x.shape[1]
        extra = -length % self.world
        self.length, self.padded = length, length + extra  # read by `whole` and `part` until the next forward
        if not extra:
            return x, position_ids
        x = F.pad(x, (0, 0, 0, extra))  # (B, T + extra, d), zeros after the last token
        if position_ids is not None:
            position_ids = continued_positions(position_ids, extra)
        return x, position_ids

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (B, T/tp, d) of the padded hidden states every rank holds."""
        return scatter_to_sequence_parallel_region(x, self.group)

    def leave(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's tokens gathered, cut back to the `length` real ones: (B, length, d)."""
        return gather_from_sequence_parallel_region(x, self.group)[:, :length]

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's real tokens (B, length, d) from this rank's (B, T/tp, d), for a block every
        rank runs whole on the whole sequence (a mixture of experts' sparse block: its routing and
        load-balancing loss see every token, as without sequence parallelism); the gradient is split
        back (each rank computes the same one)."""
        return gather_from_sequence_parallel_region(x, self.group)[:, :self.length]

    def part(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's tokens (B, T/tp, d) of a whole-sequence output y (B, length, d), padded as `enter`."""
        return scatter_to_sequence_parallel_region(F.pad(y, (0, 0, 0, self.padded - self.length)), self.group)

    def __repr__(self) -> str:
        return f"SequenceSplit(tp={self.world})"
