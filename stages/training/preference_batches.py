"""Where preference training batches come from: pairs of SFT-encoded conversations (the same
prompt, a chosen and a rejected last answer), right-padded to one width, drawn in a seeded order
per epoch, the same global batch of pairs whatever the number of data-parallel ranks.

A micro-batch of m pairs is one forward of 2m rows, TRL's concatenated forward:

    (input_ids (2m, T), labels (2m, T), reference (2m,))    rows 0..m-1 chosen, m..2m-1 rejected

`reference` holds the reference model's summed log-probs of the rows' learned tokens (the
score_pairs artifact), zeros for the reference-free methods. Labels are -100 on the prompt and
the padding, as fine-tuning encodes them (`stages.data.sft.encode_example`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from stages.data.preference import PreferenceRecord
from stages.data.sft import encode_example
from stages.errors import InputError
from stages.model.labels import IGNORE_INDEX
from stages.training.batches import _epoch_order, _rank_slice

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # (input_ids, labels)
Pair = tuple[Example, Example]  # (chosen, rejected)


def _learns(example: Example) -> bool:
    return any(label != IGNORE_INDEX for label in example[1][1:])


def encode_pairs(records: Sequence[PreferenceRecord], tokenizer, src_length: int, max_length: int,
                 chat: bool, where: str) -> tuple[list[Pair], list[int]]:
    """(encoded pairs, the index of each one's record). Each side is encoded as fine-tuning
    encodes a conversation and cut to `max_length` tokens (a warning counts the cut pairs); a pair
    one of whose answers was cut off entirely carries no preference and is dropped (a warning
    counts them). InputError, naming `where`, when no pair is left."""
    pairs, index, cut = [], [], 0
    for i, record in enumerate(records):
        sides = [encode_example(tokenizer, record.conversation(answer), src_length, 10**9, chat)
                 for answer in (record.chosen, record.rejected)]
        cut += any(len(ids) > max_length for ids, _ in sides)
        chosen, rejected = ((ids[:max_length], labels[:max_length]) for ids, labels in sides)
        if _learns(chosen) and _learns(rejected):
            pairs.append((chosen, rejected))
            index.append(i)
    if cut:
        log.warning("%s: %d of %d pairs have a side longer than max_length=%d, truncated", where, cut,
                    len(records), max_length)
    if len(pairs) < len(records):
        log.warning("%s: dropped %d of %d pairs with an answer cut off entirely by max_length=%d", where,
                    len(records) - len(pairs), len(records), max_length)
    if not pairs:
        raise InputError(f"{where}: no pair keeps an answer token of both sides within max_length={max_length}; "
                         "raise align.max_length or lower align.src_length")
    return pairs, index


def global_batch_of(section) -> int:
    """Pairs per optimizer step of a training section: per device x accumulation x data parallel."""
    dp = section.world_size // (section.tensor_parallel_degree * section.pipeline_parallel_degree)
    return section.per_device_train_batch_size * section.gradient_accumulation_steps * dp


def pairs_seen(num_pairs: int, section) -> np.ndarray:
    """The sorted indices of the pairs a run of `section` draws in its max_steps global batches
    (`PreferenceBatches`' seeded order): all of them once the run passes an epoch."""
    return np.unique(_epoch_order(0, section.max_steps * global_batch_of(section), num_pairs, section.seed))


def pad_rows(examples: Sequence[Example], width: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels), int64 (len(examples), width)."""
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, :len(x)] = torch.tensor(x, dtype=torch.long)
        labels[row, :len(y)] = torch.tensor(y, dtype=torch.long)
    return ids, labels


class PreferenceBatches:
    """Encoded pairs for the training engine: `seq_len` (the row width: the longest side, at
    most max_length) and `micro_batches`; `global_batch` counts pairs. `reference` (N, 2): the
    reference log-probs of each pair's chosen and rejected side (None: zeros, reference-free)."""

    rows_per_item = 2  # a pair is two rows: what the log's token counts multiply by

    def __init__(self, pairs: Sequence[Pair], pad_token_id: int, seed: int, reference: torch.Tensor | None = None):
        if not pairs:
            raise ValueError("no preference pairs to train on")
        if reference is not None and tuple(reference.shape) != (len(pairs), 2):
            raise ValueError(f"reference log-probs of shape {tuple(reference.shape)} for {len(pairs)} pairs")
        self.seq_len = max(len(ids) for pair in pairs for ids, _ in pair)
        self.chosen = pad_rows([c for c, _ in pairs], self.seq_len, pad_token_id)
        self.rejected = pad_rows([r for _, r in pairs], self.seq_len, pad_token_id)
        self.reference = (torch.zeros(len(pairs), 2) if reference is None else reference).to(torch.float64)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.reference)

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of step `step`: its contiguous slice of the step's
        `global_batch` pairs, `micro` pairs (2 x micro rows) each."""
        mine = torch.from_numpy(_rank_slice(_epoch_order(step * global_batch, global_batch, len(self), self.seed),
                                            rank, world))
        out = []
        for j in range(0, len(mine), micro):
            rows = mine[j:j + micro]
            ids = torch.cat([self.chosen[0][rows], self.rejected[0][rows]])
            labels = torch.cat([self.chosen[1][rows], self.rejected[1][rows]])
            reference = torch.cat([self.reference[rows, 0], self.reference[rows, 1]])
            out.append((ids, labels, reference))
        return out
