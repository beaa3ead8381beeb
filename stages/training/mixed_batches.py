"""Fine-tuning rows with general text mixed in (`mix_ratio`): what keeps a fine-tuned model a
language model (LLaMA-Factory's dataset mixing, Megatron's blended data sets).

Every row of an SFT global batch (padded or packed) is followed, in the room after its real
tokens, by a chunk of general text read from a random place of one of the mix sources, learned on
every token but its first:

    row:    [bos src tgt eos][chunk0 chunk1 ... chunkc][pad ...]
    labels: [ -   -  tgt eos][  -    chunk1 ... chunkc][ -  ...]

Under causal attention the example never sees the chunk after it, so its own loss is what it was
without mixing; the chunk sees the example before it as a pretraining window sees the documents
before it (packed rows give the chunk its own positions, so it does not). The chunks are sized so
that general text carries `mix_ratio` of the learned tokens of every global batch: with N target
tokens in the batch, round(N * ratio / (1 - ratio)) chunk tokens, shared out over the rows in
proportion to their targets. Everything is a pure function of (seed, step), computed on the whole
global batch before each rank takes its slice: every layout and every resumed run see the same
tokens.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from stages.model.labels import IGNORE_INDEX
from stages.training.batches import PackedSftBatches, Rows, SftBatches

Example = tuple[list[int], list[int]]


def chunk_share(ratio: float) -> float:
    """General-text tokens per target token that make `ratio` of the learned tokens general text."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"mix_ratio={ratio} must be in [0, 1): the share of learned tokens taken from general text")
    return ratio / (1.0 - ratio)


def learned_per_row(labels: torch.Tensor) -> torch.Tensor:
    """(G,) learned (next-token) positions of each row, as the loss counts them."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)


def reserve_for(examples: Sequence[Example], ratio: float, max_length: int) -> list[int]:
    """Room to keep after each example for its chunk: its share of chunk tokens plus the chunk's
    unlearned first token, within `max_length`."""
    per_target = chunk_share(ratio)
    room = []
    for ids, labels in examples:
        targets = sum(label != IGNORE_INDEX for label in labels[1:])
        room.append(max(0, min(math.ceil(per_target * targets) + 1, max_length - len(ids))))
    return room


def allocate(want: int, targets: Sequence[int], room: Sequence[int]) -> list[int]:
    """Chunk tokens per row: `want` in all, in proportion to each row's `targets`, each row at
    most its `room`; the rounding remainder goes to the rows furthest below their share (row order
    breaks ties). Returns fewer than `want` in all only when the rows have no more room."""
    total = sum(targets)
    ideal = [want * t / total if total else want / len(targets) for t in targets]
    out = [min(r, math.floor(x)) for x, r in zip(ideal, room)]
    missing = want - sum(out)
    while missing > 0:
        open_rows = [i for i in range(len(out)) if out[i] < room[i]]
        if not open_rows:
            break
        open_rows.sort(key=lambda i: (out[i] - ideal[i], i))
        for i in open_rows[:missing]:
            out[i] += 1
        missing = want - sum(out)
    return out


class MixedSftBatches:
    """An SFT batch source (`SftBatches` or `PackedSftBatches`, built with `reserve_for`'s room)
    whose rows also carry general text, `ratio` of the learned tokens of every global batch.

    `sources` are flat token arrays (documents joined by eos), chosen per row with probability
    proportional to `weights` (Megatron's blend weights). Same `micro_batches` contract as the
    base source."""

    def __init__(self, base: SftBatches | PackedSftBatches, sources: Sequence[np.ndarray],
                 weights: Sequence[float], ratio: float, seed: int):
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"{len(sources)} mix sources but {len(weights)} weights")
        self.base, self.sources, self.seed = base, list(sources), seed
        self.per_target = chunk_share(ratio)
        self.ratio = ratio
        self.probs = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.seq_len = base.seq_len
        self.packed = isinstance(base, PackedSftBatches)
        shortest = min(len(s) for s in self.sources)
        if shortest < self.seq_len:
            raise ValueError(f"a mix source holds {shortest} tokens, fewer than one row of {self.seq_len}; "
                             "give mix_datasets more text")

    def _chunk_sizes(self, rows: Rows) -> tuple[list[int], int]:
        """Learned chunk tokens per row of the base rows, and the base rows' learned target tokens."""
        targets = learned_per_row(rows.labels)
        want = round(self.per_target * int(targets.sum()))
        room = (self.seq_len - rows.lengths - 1).clamp(min=0)  # one unlearned token opens each chunk
        return allocate(want, targets.tolist(), room.tolist()), int(targets.sum())

    def global_rows(self, step: int, global_batch: int) -> Rows:
        rows = self.base.global_rows(step, global_batch)
        counts, _ = self._chunk_sizes(rows)
        rng = np.random.default_rng([self.seed, step])
        for r, count in enumerate(counts):
            if count:
                self._place(rows, r, count, rng)
        return rows

    def _place(self, rows: Rows, r: int, count: int, rng: np.random.Generator) -> None:
        """Write a chunk of count + 1 tokens after row r's real tokens, count of them learned."""
        tokens = self.sources[rng.choice(len(self.sources), p=self.probs)]
        start = int(rng.integers(0, len(tokens) - count))
        chunk = torch.from_numpy(tokens[start:start + count + 1].astype(np.int64))
        at = int(rows.lengths[r])
        end = at + count + 1
        rows.input_ids[r, at:end] = chunk
        rows.labels[r, at + 1:end] = chunk[1:]
        if rows.position_ids is not None:  # the chunk is a segment of its own, and so is the padding after it
            rows.position_ids[r, at:end] = torch.arange(count + 1)
            rows.position_ids[r, end:] = torch.arange(self.seq_len - end)
        rows.lengths[r] = end

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, ...]]:
        return self.global_rows(step, global_batch).micro_batches(rank, world, micro)

    def token_share(self, steps: int, global_batch: int) -> float:
        """Share of the learned tokens that were general text over the first `steps` steps."""
        general = total = 0
        for step in range(steps):  # the sizes only: no chunk is read or written
            counts, targets = self._chunk_sizes(self.base.global_rows(step, global_batch))
            general += sum(counts)
            total += sum(counts) + targets
        return general / max(total, 1)
