"""Where training batches come from: fixed-length corpus windows (pretraining) and SFT examples
(fine-tuning: padded one to a row, or packed several to a row). All hand each optimizer step the
same global batch whatever the number of data-parallel ranks, so every layout sees the same tokens.

`micro_batches(step, global_batch, rank, world, micro)` returns this rank's micro-batches of
step `step` as (input_ids, labels) pairs of int64 (micro, T) tensors, packed rows adding their
position_ids; labels are -100 where nothing is learned.
"""

from __future__ import annotations

import numpy as np
import torch

from stages.data.sft import IGNORE_INDEX


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

    def __init__(self, examples: list[tuple[list[int], list[int]]], max_length: int, pad_token_id: int, seed: int):
        if not examples:
            raise ValueError("no SFT examples to train on")
        width = min(max_length, max(len(ids) for ids, _ in examples))
        self.seq_len = width  # tokens per row, padding included
        self.ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
        self.labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, labels) in enumerate(examples):
            self.ids[row, :len(ids)] = torch.tensor(ids[:width])
            self.labels[row, :len(labels)] = torch.tensor(labels[:width])
        self.seed = seed

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mine = torch.from_numpy(_rank_slice(_epoch_order(step * global_batch, global_batch, len(self.ids),
                                                         self.seed), rank, world))
        return [(self.ids[mine[j:j + micro]], self.labels[mine[j:j + micro]]) for j in range(0, len(mine), micro)]


def pack_examples(examples: list[tuple[list[int], list[int]]], max_length: int,
                  seed: int) -> list[list[int]]:
    """Example indices per packed row: first-fit decreasing over a seeded shuffle (ties keep the
    shuffled order), each row holding at most `max_length` tokens. Examples must fit alone."""
    order = np.random.default_rng(seed).permutation(len(examples))
    order = sorted(order, key=lambda i: -len(examples[i][0]))  # stable: the shuffle breaks ties
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        size = len(examples[i][0])
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

    def __init__(self, examples: list[tuple[list[int], list[int]]], max_length: int, pad_token_id: int, seed: int):
        if not examples:
            raise ValueError("no SFT examples to train on")
        self.rows = pack_examples(examples, max_length, seed)
        self.seq_len = max_length
        n = len(self.rows)
        self.ids = torch.full((n, max_length), pad_token_id, dtype=torch.long)
        self.labels = torch.full((n, max_length), IGNORE_INDEX, dtype=torch.long)
        self.position_ids = torch.zeros((n, max_length), dtype=torch.long)
        for r, members in enumerate(self.rows):
            at = 0
            for i in members:
                ids, labels = examples[i]
                self.ids[r, at:at + len(ids)] = torch.tensor(ids)
                self.labels[r, at + 1:at + len(ids)] = torch.tensor(labels[1:len(ids)], dtype=torch.long)
                self.position_ids[r, at:at + len(ids)] = torch.arange(len(ids))
                at += len(ids)
            self.position_ids[r, at:] = torch.arange(max_length - at)  # the padding: one more "example"
        self.seed = seed
        self.tokens = sum(len(ids) for ids, _ in examples)  # real (non-padding) tokens

    @property
    def fill(self) -> float:
        """Share of row positions holding real tokens."""
        return self.tokens / (len(self.rows) * self.seq_len)

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        mine = torch.from_numpy(_rank_slice(_epoch_order(step * global_batch, global_batch, len(self.rows),
                                                         self.seed), rank, world))
        return [(self.ids[mine[j:j + micro]], self.labels[mine[j:j + micro]], self.position_ids[mine[j:j + micro]])
                for j in range(0, len(mine), micro)]
