"""Where training batches come from: fixed-length corpus windows (pretraining) and SFT examples
(fine-tuning: padded one to a row, or packed several to a row). All hand each optimizer step the
same global batch whatever the number of data-parallel ranks, so every layout sees the same tokens.

`micro_batches(step, global_batch, rank, world, micro)` returns this rank's micro-batches of
step `step` as (input_ids, labels) pairs of int64 (micro, T) tensors, packed rows adding their
position_ids; labels are -100 where nothing is learned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from stages.model.labels import IGNORE_INDEX


def _epoch_order(start: int, count: int, size: int, seed: int) -> np.ndarray:
    """Items start..start+count of the endless sequence of seeded permutations of range(size)
    (epoch e uses seed + e)."""
    ids, pos = [], start
    while len(ids) < count:
        epoch, offset = divmod(pos, size)
        order = np.random.default_rng(seed + epoch).permutation(size)
        take = min(count - len(ids), size - offset)
        ids.extend(order[offset:offset + take])
        pos += take
    return np.asarray(ids)


def _rank_slice(ids: np.ndarray, rank: int, world: int) -> np.ndarray:
    per_rank = len(ids) // world
    return ids[rank * per_rank:(rank + 1) * per_rank]


@dataclass
class Rows:
    """The rows of one global batch: (G, T) int64 tensors; `position_ids` only for packed rows
    (None: positions count from 0 along the row); `lengths` (G,) counts each row's real tokens."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    lengths: torch.Tensor

    def micro_batches(self, rank: int, world: int, micro: int) -> list[tuple[torch.Tensor, ...]]:
        """Rank `rank`'s contiguous slice of the rows, cut into micro-batches of `micro` rows."""
        per_rank = len(self.input_ids) // world
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        parts = [self.input_ids[lo:hi], self.labels[lo:hi]]
        if self.position_ids is not None:
            parts.append(self.position_ids[lo:hi])
        return [tuple(p[j:j + micro] for p in parts) for j in range(0, hi - lo, micro)]


class WindowSampler:
    """Fixed-length training windows of a token file, in a seeded order, batched globally.

    Window i covers tokens [i*T, (i+1)*T). Optimizer step s consumes the `global_batch` windows
    order[s*G : (s+1)*G] (epochs reshuffle with seed+epoch); rank r of `world` takes the r-th
    contiguous slice of them, cut into micro-batches.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = len(tokens) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"the training split has {len(tokens)} tokens, fewer than one window of "
                             f"pretrain.max_length={seq_len}; lower max_length or add corpus text")

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of step `step`; every token is learned (labels = inputs)."""
        mine = _rank_slice(_epoch_order(step * global_batch, global_batch, self.num_windows, self.seed),
                           rank, world)
        T = self.seq_len
        rows = torch.from_numpy(np.stack([self.tokens[i * T:(i + 1) * T].astype(np.int64) for i in mine]))
        return [(rows[j:j + micro], rows[j:j + micro]) for j in range(0, len(mine), micro)]


class SftBatches:
    """Encoded SFT examples, right-padded to one fixed length (pipeline stages need a fixed shape):
    the longest example, at most `max_length`; in a seeded order per epoch; labels are -100 on
    prompts and padding. Padding after a sequence never changes its loss under causal attention."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], max_length: int, pad_token_id: int, seed: int,
                 reserve: Sequence[int] | None = None):
        """`reserve[i]`: tokens of room to leave after example i (`MixedSftBatches` fills them with
        general text); the row width grows to hold them, up to `max_length`."""
        if not examples:
            raise ValueError("no SFT examples to train on")
        reserve = reserve if reserve is not None else [0] * len(examples)
        width = min(max_length, max(len(ids) + extra for (ids, _), extra in zip(examples, reserve)))
        self.seq_len = width  # tokens per row, padding included
        self.ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
        self.labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        self.lengths = torch.tensor([min(len(ids), width) for ids, _ in examples])  # real tokens per row
        for row, (ids, labels) in enumerate(examples):
            self.ids[row, :len(ids)] = torch.tensor(ids[:width])
            self.labels[row, :len(labels)] = torch.tensor(labels[:width])
        self.seed = seed

    def global_rows(self, step: int, global_batch: int) -> Rows:
        """The whole global batch of step `step` (copies: a caller may write into them)."""
        rows = torch.from_numpy(_epoch_order(step * global_batch, global_batch, len(self.ids), self.seed))
        return Rows(self.ids[rows], self.labels[rows], None, self.lengths[rows])

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.global_rows(step, global_batch).micro_batches(rank, world, micro)


def pack_examples(examples: list[tuple[list[int], list[int]]], max_length: int,
                  seed: int, reserve: Sequence[int] | None = None) -> list[list[int]]:
    """Example indices per packed row: first-fit decreasing over a seeded shuffle (ties keep the
    shuffled order), each row holding at most `max_length` tokens, counting `reserve[i]` tokens of
    room for example i. Examples must fit alone."""
    sizes = [len(ids) + (reserve[i] if reserve is not None else 0) for i, (ids, _) in enumerate(examples)]
    order = np.random.default_rng(seed).permutation(len(examples))
    order = sorted(order, key=lambda i: -sizes[i])  # stable: the shuffle breaks ties
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        size = sizes[i]
        if size > max_length:
            raise ValueError(f"example {i} has {size} tokens, more than max_length={max_length}")
        for r, room in enumerate(free):
            if size <= room:
                rows[r].append(int(i))
                free[r] -= size
                break
        else:
            rows.append([int(i)])
            free.append(max_length - size)
    return rows


class PackedSftBatches:
    """SFT examples packed several to a row of `max_length` tokens (PaddleNLP's intokens, zero
    padding): micro-batches are (input_ids, labels, position_ids). Position ids restart at 0 for
    every example, which our model reads as example boundaries (attention stays inside each
    example, `stages.model.llama.segment_ids`); the first token of every example is never a label,
    so no example learns from the one before it. The rows are packed once (seeded) and drawn in a
    seeded order per epoch, like `SftBatches`' examples."""

    def __init__(self, examples: list[tuple[list[int], list[int]]], max_length: int, pad_token_id: int, seed: int,
                 reserve: Sequence[int] | None = None):
        """`reserve[i]`: tokens of room kept free in example i's row (`MixedSftBatches`)."""
        if not examples:
            raise ValueError("no SFT examples to train on")
        self.rows = pack_examples(examples, max_length, seed, reserve)
        self.seq_len = max_length
        n = len(self.rows)
        self.ids = torch.full((n, max_length), pad_token_id, dtype=torch.long)
        self.labels = torch.full((n, max_length), IGNORE_INDEX, dtype=torch.long)
        self.position_ids = torch.zeros((n, max_length), dtype=torch.long)
        self.lengths = torch.zeros(n, dtype=torch.long)  # real tokens per row
        for r, members in enumerate(self.rows):
            at = 0
            for i in members:
                ids, labels = examples[i]
                self.ids[r, at:at + len(ids)] = torch.tensor(ids)
                self.labels[r, at + 1:at + len(ids)] = torch.tensor(labels[1:len(ids)], dtype=torch.long)
                self.position_ids[r, at:at + len(ids)] = torch.arange(len(ids))
                at += len(ids)
            self.position_ids[r, at:] = torch.arange(max_length - at)  # the padding: one more "example"
            self.lengths[r] = at
        self.seed = seed
        self.tokens = sum(len(ids) for ids, _ in examples)  # real (non-padding) tokens

    @property
    def fill(self) -> float:
        """Share of row positions holding real tokens."""
        return self.tokens / (len(self.rows) * self.seq_len)

    def global_rows(self, step: int, global_batch: int) -> Rows:
        """The whole global batch of step `step` (copies: a caller may write into them)."""
        rows = torch.from_numpy(_epoch_order(step * global_batch, global_batch, len(self.rows), self.seed))
        return Rows(self.ids[rows], self.labels[rows], self.position_ids[rows], self.lengths[rows])

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self.global_rows(step, global_batch).micro_batches(rank, world, micro)
