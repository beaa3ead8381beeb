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

`GeneralText` is the part every mixing source shares (how many chunk tokens each row of a global
batch gets, and which ones): `MixedSftBatches` here, and preference alignment's rows
(`stages.training.preference_batches`), whose chunks carry labels of their own.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any, Sequence

import numpy as np
import torch

from stages.model.labels import IGNORE_INDEX
from stages.training.batches import PackedSftBatches, Rows, SftBatches

log = logging.getLogger(__name__)

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


class GeneralText:
    """The general text of a run (`sources`: flat token arrays, documents joined by eos) and how a
    global batch takes it in: `ratio` of its learned tokens, shared out over its rows in proportion
    to their targets, each row's chunk from a source chosen with probability proportional to
    `weights` (Megatron's blend weights; None: equal) and read from a random place, all drawn from
    (seed, step)."""

    def __init__(self, sources: Sequence[np.ndarray], weights: Sequence[float] | None, ratio: float, seed: int):
        weights = [1.0] * len(sources) if weights is None else weights
        if len(sources) != len(weights) or not sources:
            raise ValueError(f"{len(sources)} mix sources but {len(weights)} weights")
        self.sources, self.seed, self.ratio = list(sources), seed, ratio
        self.per_target = chunk_share(ratio)
        self.probs = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))

    def check_fits(self, seq_len: int) -> None:
        """ValueError unless every source holds a chunk of a whole row of `seq_len` tokens."""
        shortest = min(len(s) for s in self.sources)
        if shortest < seq_len:
            raise ValueError(f"a mix source holds {shortest} tokens, fewer than one row of {seq_len}; "
                             "give mix_datasets more text")

    def sizes(self, labels: torch.Tensor, lengths: torch.Tensor, seq_len: int) -> tuple[list[int], int]:
        """(learned chunk tokens per row, the rows' learned target tokens) of a global batch's rows:
        `labels` (G, T) and `lengths` (G,) real tokens, in rows of `seq_len` tokens."""
        targets = learned_per_row(labels)
        want = round(self.per_target * int(targets.sum()))
        room = (seq_len - lengths - 1).clamp(min=0)  # one unlearned token opens each chunk
        return allocate(want, targets.tolist(), room.tolist()), int(targets.sum())

    def chunks(self, step: int, counts: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        """(row, its chunk: count + 1 tokens, int64) for every row of step `step` whose count is
        not 0, in row order: the first token opens the chunk, the other `count` are learned."""
        rng = np.random.default_rng([self.seed, step])
        for r, count in enumerate(counts):
            if count:
                tokens = self.sources[rng.choice(len(self.sources), p=self.probs)]
                start = int(rng.integers(0, len(tokens) - count))
                yield r, torch.from_numpy(tokens[start:start + count + 1].astype(np.int64))

    def share(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], seq_len: int) -> float:
        """Share of the learned tokens that is general text over global batches of (labels,
        lengths) without their chunks (the sizes only: no chunk is read)."""
        general = total = 0
        for labels, lengths in batches:
            counts, targets = self.sizes(labels, lengths, seq_len)
            general += sum(counts)
            total += sum(counts) + targets
        return general / max(total, 1)


class MixedSftBatches:
    """An SFT batch source (`SftBatches` or `PackedSftBatches`, built with `reserve_for`'s room)
    whose rows also carry general text, `ratio` of the learned tokens of every global batch
    (`GeneralText` of `sources` at `weights`). Same `micro_batches` contract as the base source."""

    def __init__(self, base: SftBatches | PackedSftBatches, sources: Sequence[np.ndarray],
                 weights: Sequence[float] | None, ratio: float, seed: int):
        self.base, self.seed, self.ratio = base, seed, ratio
        self.text = GeneralText(sources, weights, ratio, seed)
        self.seq_len = base.seq_len
        self.packed = isinstance(base, PackedSftBatches)
        self.text.check_fits(self.seq_len)

    def global_rows(self, step: int, global_batch: int) -> Rows:
        rows = self.base.global_rows(step, global_batch)
        counts, _ = self.text.sizes(rows.labels, rows.lengths, self.seq_len)
        for r, chunk in self.text.chunks(step, counts):
            self._place(rows, r, chunk)
        return rows

    def _place(self, rows: Rows, r: int, chunk: torch.Tensor) -> None:
        """Write `chunk` after row r's real tokens, all but its first token learned."""
        at = int(rows.lengths[r])
        end = at + len(chunk)
        rows.input_ids[r, at:end] = chunk
        rows.labels[r, at + 1:end] = chunk[1:]
        if rows.position_ids is not None:  # the chunk is a segment of its own, and so is the padding after it
            rows.position_ids[r, at:end] = torch.arange(len(chunk))
            rows.position_ids[r, end:] = torch.arange(self.seq_len - end)
        rows.lengths[r] = end

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, ...]]:
        return self.global_rows(step, global_batch).micro_batches(rank, world, micro)

    def token_share(self, steps: int, global_batch: int) -> float:
        """Share of the learned tokens that were general text over the first `steps` steps."""
        rows = (self.base.global_rows(step, global_batch) for step in range(steps))
        return self.text.share(((r.labels, r.lengths) for r in rows), self.seq_len)


def mixing_metrics(section: Mapping[str, Any], source, global_batch: int) -> dict[str, Any]:
    """meta.json's record of a training section's mixing (fine-tuning's or alignment's): the share
    of learned tokens that was general text over the run's global batches, as `source` (with its
    `token_share` and `seq_len`) trains them, and the row width; {} without mixing."""
    if not section["mix_ratio"]:
        return {}
    share = source.token_share(section["max_steps"], global_batch)
    if abs(share - section["mix_ratio"]) > 0.02:
        log.warning("mix_ratio=%.3f but general text was %.3f of the learned tokens: the rows (max_length=%d) "
                    "have too little room after the examples; raise max_length", section["mix_ratio"], share,
                    section["max_length"])
    return {"mix_token_share": share, "mix_rows_length": source.seq_len}
