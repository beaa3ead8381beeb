"""Where preference training batches come from: pairs of SFT-encoded conversations (the same
prompt, a chosen and a rejected last answer), right-padded to one width, drawn in a seeded order
per epoch, the same global batch of pairs whatever the number of data-parallel ranks.

A micro-batch of m pairs is one forward of 2m rows, TRL's concatenated forward:

    (input_ids (2m, T), labels (2m, T), reference (2m,), mix_labels (2m, T))
    rows 0..m-1 chosen, m..2m-1 the rejected sides of the same pairs; reference float64, the rest int64

`reference` holds the reference model's summed log-probs of the rows' learned tokens (the
score_pairs artifact), zeros for the reference-free methods. Labels are -100 on the prompt and
the padding, as fine-tuning encodes them (`stages.data.sft.encode_example`).

With data mixing (`align.mix_ratio`, `stages.training.mixed_batches.GeneralText`), every row
(chosen and rejected alike) is followed, in the room after its answer, by a chunk of general text
that `mix_labels` learns on every token but its first; `labels` keep only the answer, so the pair's
log-probs, and the preference loss on them, are what they are without mixing (causal attention:
the answer never sees the chunk after it). Without mixing, `mix_labels` is -100 everywhere.

    row:        [bos prompt answer eos][chunk0 chunk1 ... chunkc][pad ...]
    labels:     [ -    -    answer eos][  -     -    ...   -   ][ -  ...]
    mix_labels: [ -    -      -     - ][  -   chunk1 ... chunkc][ -  ...]

General text is `mix_ratio` of the learned tokens of every global batch (the answers' tokens of
both sides, as the engine counts them, plus the chunks'), shared out over the 2G rows in
proportion to their answer tokens. Chunks go after the rejected rows too: the two sides of a pair
share one row width, so using both rows' room halves the widening that chunks after the chosen
side alone would need, and a chunk learns only its own tokens (what precedes it is context, as in
a pretraining window), so following a rejected answer teaches nothing of that answer. The row
width grows to hold the chunks (`reserve_for`), up to align.max_length. Everything is a pure
function of (seed, step), computed on the whole global batch before each rank takes its slice:
every layout and every resumed run see the same tokens.
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
from stages.training.batches import _epoch_order
from stages.training.mixed_batches import GeneralText, reserve_for

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
    most max_length, widened by the room for general text) and `micro_batches`; `global_batch`
    counts pairs. `reference` (N, 2): the reference log-probs of each pair's chosen and rejected
    side (None: zeros, reference-free). `general`: the general text mixed in (None: no mixing),
    with rows widened up to `max_length` to hold it."""

    rows_per_item = 2  # a pair is two rows: what the log's token counts multiply by

    def __init__(self, pairs: Sequence[Pair], pad_token_id: int, seed: int, reference: torch.Tensor | None = None,
                 general: GeneralText | None = None, max_length: int | None = None):
        if not pairs:
            raise ValueError("no preference pairs to train on")
        if reference is not None and tuple(reference.shape) != (len(pairs), 2):
            raise ValueError(f"reference log-probs of shape {tuple(reference.shape)} for {len(pairs)} pairs")
        sides = [side for pair in pairs for side in pair]  # chosen, rejected, chosen, ...
        if general is None:
            reserve = [0] * len(sides)
        elif max_length is None:
            raise ValueError("mixing general text into preference rows needs max_length, the widest row")
        else:
            reserve = reserve_for(sides, general.ratio, max_length)
        self.seq_len = max(len(ids) + extra for (ids, _), extra in zip(sides, reserve))
        self.chosen = pad_rows(sides[0::2], self.seq_len, pad_token_id)
        self.rejected = pad_rows(sides[1::2], self.seq_len, pad_token_id)
        self.lengths = torch.tensor([len(ids) for ids, _ in sides]).view(len(pairs), 2)  # real tokens per side
        self.reference = (torch.zeros(len(pairs), 2) if reference is None else reference).to(torch.float64)
        self.seed, self.general = seed, general
        if general is not None:
            general.check_fits(self.seq_len)

    def __len__(self) -> int:
        return len(self.reference)

    @property
    def mix_ratio(self) -> float:
        """The share of the learned tokens that is general text (0.0: no mixing; the engine then logs
        no general-text loss)."""
        return 0.0 if self.general is None else self.general.ratio

    def _order(self, step: int, global_batch: int) -> torch.Tensor:
        """(G,) the pairs of step `step`'s global batch."""
        return torch.from_numpy(_epoch_order(step * global_batch, global_batch, len(self), self.seed))

    def _rows(self, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, labels (2G, T), lengths (2G,)) of the pairs `order`: their chosen sides,
        then their rejected sides (copies: general text is written into them)."""
        ids = torch.cat([self.chosen[0][order], self.rejected[0][order]])
        labels = torch.cat([self.chosen[1][order], self.rejected[1][order]])
        return ids, labels, torch.cat([self.lengths[order, 0], self.lengths[order, 1]])

    def global_rows(self, step: int, global_batch: int) -> tuple[torch.Tensor, ...]:
        """(pairs (G,), input_ids, labels, mix_labels (2G, T)): the whole global batch of step
        `step`, its G chosen rows then its G rejected rows, with their chunks of general text."""
        order = self._order(step, global_batch)
        ids, labels, lengths = self._rows(order)
        mix_labels = torch.full_like(labels, IGNORE_INDEX)
        if self.general is not None:
            counts, _ = self.general.sizes(labels, lengths, self.seq_len)
            for r, chunk in self.general.chunks(step, counts):
                at = int(lengths[r])
                ids[r, at:at + len(chunk)] = chunk
                mix_labels[r, at + 1:at + len(chunk)] = chunk[1:]
        return order, ids, labels, mix_labels

    def micro_batches(self, step: int, global_batch: int, rank: int, world: int,
                      micro: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of step `step`: its contiguous slice of the step's
        `global_batch` pairs, `micro` pairs (2 x micro rows) each, as (input_ids, labels,
        reference, mix_labels) (the module docstring)."""
        order, ids, labels, mix_labels = self.global_rows(step, global_batch)
        per_rank = global_batch // world
        out = []
        for lo in range(rank * per_rank, (rank + 1) * per_rank, micro):
            hi = min(lo + micro, (rank + 1) * per_rank)
            both = torch.cat([torch.arange(lo, hi), global_batch + torch.arange(lo, hi)])  # chosen, then rejected
            pairs = order[lo:hi]
            reference = torch.cat([self.reference[pairs, 0], self.reference[pairs, 1]])
            out.append((ids[both], labels[both], reference, mix_labels[both]))
        return out

    def token_share(self, steps: int, global_batch: int) -> float:
        """Share of the learned tokens that were general text over the first `steps` steps."""
        batches = (self._rows(self._order(step, global_batch)) for step in range(steps))
        return self.general.share(((labels, lengths) for _, labels, lengths in batches), self.seq_len)
