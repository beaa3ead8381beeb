"""Data mixing (stages/training/mixed_batches.py): the share of learned general-text tokens per
global batch is the setting, the examples' own rows are untouched, chunks are real text of the
sources at their weights, and every layout and rerun sees the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.data.sft import IGNORE_INDEX
from stages.training.batches import PackedSftBatches, SftBatches
from stages.training.mixed_batches import MixedSftBatches, allocate, learned_per_row, reserve_for

PAD = 0


def examples(n: int = 40, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompts of 4-9 tokens (ids 1000+), targets of 2-6 tokens (ids 2000+), like the attribute task."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = [1000 + int(t) for t in rng.integers(0, 50, rng.integers(4, 10))]
        target = [2000 + int(t) for t in rng.integers(0, 50, rng.integers(2, 7))]
        out.append((prompt + target, [IGNORE_INDEX] * len(prompt) + target))
    return out


def sources() -> list[np.ndarray]:
    """Two general-text sources told apart by their ids: 5000+ and 7000+, counting up."""
    return [5000 + np.arange(400) % 1000, 7000 + np.arange(900) % 1000]


def mixed(ratio: float, packed: bool = False, weights=(1.0, 1.0), n: int = 40, max_length: int = 64):
    ex = examples(n)
    reserve = reserve_for(ex, ratio, max_length)
    base = (PackedSftBatches if packed else SftBatches)(ex, max_length, PAD, seed=3, reserve=reserve)
    return MixedSftBatches(base, sources(), list(weights), ratio, seed=3), base


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.8])
def test_the_general_text_share_of_every_global_batch_is_the_setting(ratio, packed):
    source, base = mixed(ratio, packed)
    general_sum = learned_sum = 0
    for step in range(12):
        plain = int(learned_per_row(base.global_rows(step, 8).labels).sum())
        learned = int(learned_per_row(source.global_rows(step, 8).labels).sum())
        general = learned - plain
        assert general == round(plain * ratio / (1 - ratio))  # exact, so the share is within 1/learned
        assert general / learned == pytest.approx(ratio, abs=1 / learned)
        general_sum, learned_sum = general_sum + general, learned_sum + learned
    # meta.json's share, counted from the chunk sizes alone, is the share of the rows as trained
    assert source.token_share(12, 8) == general_sum / learned_sum
    assert source.token_share(12, 8) == pytest.approx(ratio, abs=0.01)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_examples_keep_their_tokens_and_chunks_are_source_text(packed):
    source, base = mixed(0.5, packed)
    plain, rows = base.global_rows(5, 8), source.global_rows(5, 8)
    for r in range(8):
        n = int(plain.lengths[r])
        assert torch.equal(rows.input_ids[r, :n], plain.input_ids[r, :n])
        assert torch.equal(rows.labels[r, :n], plain.labels[r, :n])
        chunk = rows.input_ids[r, n:int(rows.lengths[r])]
        assert len(chunk) >= 2
        assert rows.labels[r, n] == IGNORE_INDEX  # the chunk's first token is context, not a target
        assert torch.equal(rows.labels[r, n + 1:int(rows.lengths[r])], chunk[1:])
        assert (rows.labels[r, int(rows.lengths[r]):] == IGNORE_INDEX).all()
        base_id = 5000 if chunk[0] < 7000 else 7000  # a contiguous run of one source
        assert torch.equal(chunk - base_id, (chunk[0] - base_id + torch.arange(len(chunk))) % 1000)
        if packed:  # its own segment: positions restart at the chunk and again at the padding
            assert rows.position_ids[r, n] == 0
            assert torch.equal(rows.position_ids[r, n:n + len(chunk)], torch.arange(len(chunk)))
            end = int(rows.lengths[r])
            assert (rows.position_ids[r, end:] == torch.arange(rows.input_ids.shape[1] - end)).all()


def test_sources_are_drawn_at_their_weights():
    source, _ = mixed(0.5, weights=(3.0, 1.0), n=200)
    first = total = 0
    for step in range(60):
        rows = source.global_rows(step, 16)
        chunk_starts = [int(rows.input_ids[r, int(l)]) for r, l in enumerate(source.base.global_rows(step, 16).lengths)]
        first += sum(5000 <= t < 6000 for t in chunk_starts)
        total += len(chunk_starts)
    assert first / total == pytest.approx(0.75, abs=0.05)


def test_the_same_step_gives_the_same_rows_and_ranks_take_slices():
    source, _ = mixed(0.3)
    again, _ = mixed(0.3)
    whole = source.global_rows(7, 8)
    for name in ("input_ids", "labels"):
        assert torch.equal(getattr(whole, name), getattr(again.global_rows(7, 8), name))
    one = source.micro_batches(7, 8, rank=0, world=1, micro=8)[0]
    halves = [source.micro_batches(7, 8, rank=r, world=2, micro=2) for r in range(2)]
    assert torch.equal(torch.cat([m[0] for h in halves for m in h]), one[0])
    assert torch.equal(torch.cat([m[1] for h in halves for m in h]), one[1])
    assert not torch.equal(source.global_rows(8, 8).input_ids, whole.input_ids)


def test_rows_widen_to_hold_the_chunks_up_to_max_length():
    ex = examples()
    assert SftBatches(ex, 64, PAD, 0).seq_len == max(len(i) for i, _ in ex)
    assert SftBatches(ex, 64, PAD, 0, reserve_for(ex, 0.5, 64)).seq_len > max(len(i) for i, _ in ex)
    assert SftBatches(ex, 20, PAD, 0, reserve_for(ex, 0.9, 20)).seq_len == 20


def test_allocate_shares_in_proportion_within_room():
    assert allocate(10, [1, 1, 2, 1], [9, 9, 9, 9]) == [2, 2, 4, 2]
    assert sum(allocate(7, [3, 1, 1], [9, 9, 9])) == 7
    assert allocate(10, [1, 1], [2, 3]) == [2, 3]  # no more room: short of the wish, never over a row's room
    assert allocate(0, [1, 2], [5, 5]) == [0, 0]


def test_a_bad_ratio_or_a_tiny_source_is_refused():
    with pytest.raises(ValueError, match=r"mix_ratio=1.0 must be in \[0, 1\)"):
        mixed(1.0)
    base = SftBatches(examples(), 64, PAD, 0)
    with pytest.raises(ValueError, match="give mix_datasets more text"):
        MixedSftBatches(base, [np.arange(5)], [1.0], 0.5, 0)
