"""Data mixing in preference alignment (align.mix_ratio, stages/training/preference_batches.py):
general text is the setting's share of the learned tokens of every global batch, it sits after the
answers without changing their log-probs, every layout and every resumed run see the same tokens,
a bad mixing setting names its key, and the stage runs with it and records the share trained."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from align_fixtures import align_section, toy_pairs, write_preference_and_general_text

from stages import align
from stages.config import ConfigError, check_config
from stages.data.mix_sources import load_mix_sources
from stages.data.tokenizer import load_model_tokenizer
from stages.data.validate import DataConfigError, check_mix_datasets
from stages.errors import InputError
from stages.model.labels import IGNORE_INDEX
from stages.model.preference_loss import sequence_logps
from stages.training.families import load_causal_lm
from stages.training.mixed_batches import GeneralText, learned_per_row
from stages.training.preference_batches import PreferenceBatches, encode_pairs


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_preference_and_general_text(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def encoded(debug_model_dir, data_dir):
    """(pairs, pad id, general-text token arrays) of the toy pairs with the debug model's tokenizer."""
    tokenizer = load_model_tokenizer(debug_model_dir)
    pairs, _ = encode_pairs(toy_pairs()[:48], tokenizer, 16, MAX_LENGTH, False, "toy")
    sources = load_mix_sources([str(data_dir / "general.txt")], data_dir, tokenizer, "align.mix_datasets")
    return pairs, tokenizer.pad_token_id, sources


MAX_LENGTH = 48
GLOBAL = 8  # pairs per step


def batches(encoded, ratio: float, seed: int = 0) -> PreferenceBatches:
    pairs, pad, sources = encoded
    general = GeneralText(sources, None, ratio, seed) if ratio else None
    return PreferenceBatches(pairs, pad, seed, None, general, MAX_LENGTH)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5])
def test_the_general_text_share_of_every_global_batch_is_the_setting(encoded, ratio):
    mixed, plain = batches(encoded, ratio), batches(encoded, 0.0)
    assert plain.seq_len < mixed.seq_len <= MAX_LENGTH  # rows widen to hold the chunks
    general_sum = learned_sum = 0
    for step in range(12):
        (ids, labels, reference, mix_labels), = mixed.micro_batches(step, GLOBAL, 0, 1, GLOBAL)
        answers = int(learned_per_row(labels).sum())
        general = int(learned_per_row(mix_labels).sum())
        assert answers == int(learned_per_row(plain.micro_batches(step, GLOBAL, 0, 1, GLOBAL)[0][1]).sum())
        assert general == round(answers * ratio / (1 - ratio))  # exact, so the share is within 1/learned
        assert general / (general + answers) == pytest.approx(ratio, abs=1 / (general + answers))
        general_sum, learned_sum = general_sum + general, learned_sum + general + answers
    # meta.json's share, counted from the chunk sizes alone, is the share of the rows as trained
    assert mixed.token_share(12, GLOBAL) == general_sum / learned_sum
    assert mixed.token_share(12, GLOBAL) == pytest.approx(ratio, abs=0.01)


def test_chunks_follow_the_answers_and_hold_general_text(encoded):
    """The 4-tuple: ids and labels as without mixing up to each row's end, `labels` untouched (the
    answers only), the chunk after the row's eos in ids with `mix_labels` on all of it but its first
    token; chosen rows and rejected rows alike; no mixing: mix_labels all IGNORE_INDEX."""
    mixed, plain = batches(encoded, 0.3), batches(encoded, 0.0)
    (ids, labels, reference, mix_labels), = mixed.micro_batches(3, GLOBAL, 0, 1, GLOBAL)
    (p_ids, p_labels, p_reference, p_mix), = plain.micro_batches(3, GLOBAL, 0, 1, GLOBAL)
    assert ids.dtype == labels.dtype == mix_labels.dtype == torch.int64 and reference.dtype == torch.float64
    assert ids.shape == labels.shape == mix_labels.shape == (2 * GLOBAL, mixed.seq_len)
    assert reference.shape == (2 * GLOBAL,) and torch.equal(reference, p_reference)
    assert p_mix.shape == p_ids.shape and bool((p_mix == IGNORE_INDEX).all())
    text = set(np.concatenate(encoded[2]).tolist())
    chunked = 0
    for r in range(2 * GLOBAL):
        n = int((p_ids[r] != encoded[1]).nonzero().max()) + 1  # the row's real tokens (its eos last)
        assert torch.equal(ids[r, :n], p_ids[r, :n]) and torch.equal(labels[r, :p_ids.shape[1]], p_labels[r])
        assert bool((labels[r, p_ids.shape[1]:] == IGNORE_INDEX).all())
        assert bool((mix_labels[r, :n + 1] == IGNORE_INDEX).all())  # the chunk's first token is context
        learned = (mix_labels[r] != IGNORE_INDEX).nonzero().flatten()
        if len(learned):
            chunked += 1
            end = int(learned.max()) + 1
            assert torch.equal(learned, torch.arange(n + 1, end))  # one contiguous run after the row
            assert torch.equal(mix_labels[r, n + 1:end], ids[r, n + 1:end])
            assert set(ids[r, n:end].tolist()) <= text
    assert chunked > GLOBAL  # the rejected rows take chunks too


def test_the_answers_log_probs_are_unchanged_by_the_chunks(encoded, debug_model_dir):
    mixed, plain = batches(encoded, 0.5), batches(encoded, 0.0)
    (ids, labels, _, mix_labels), = mixed.micro_batches(0, GLOBAL, 0, 1, GLOBAL)
    (p_ids, p_labels, _, _), = plain.micro_batches(0, GLOBAL, 0, 1, GLOBAL)
    assert int((mix_labels != IGNORE_INDEX).sum()) > 0
    model = load_causal_lm(debug_model_dir).eval()
    with torch.no_grad():
        with_text = sequence_logps(model(input_ids=ids), labels)
        without = sequence_logps(model(input_ids=p_ids), p_labels)
    assert torch.equal(with_text.tokens, without.tokens)
    torch.testing.assert_close(with_text.total, without.total, rtol=1e-5, atol=1e-5)


def test_every_layout_and_a_resumed_run_see_the_same_tokens(encoded):
    """Ranks of dp2 (micro-batches of 2 pairs) slice the one-process global batch; a new source (a
    resumed run) gives the same step the same tokens; another step other tokens."""
    source = batches(encoded, 0.3)
    whole, = source.micro_batches(5, GLOBAL, 0, 1, GLOBAL)
    parts = [m for rank in range(2) for m in source.micro_batches(5, GLOBAL, rank, 2, 2)]
    assert len(parts) == 4
    for k in (0, 1, 2, 3):  # ids, labels, reference, mix_labels: chosen halves, then rejected halves
        chosen = torch.cat([m[k][:len(m[k]) // 2] for m in parts])
        rejected = torch.cat([m[k][len(m[k]) // 2:] for m in parts])
        assert torch.equal(torch.cat([chosen, rejected]), whole[k])
    resumed = batches(encoded, 0.3).micro_batches(5, GLOBAL, 0, 1, GLOBAL)[0]
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole))
    assert not torch.equal(source.micro_batches(6, GLOBAL, 0, 1, GLOBAL)[0][0], whole[0])


def test_bad_mixing_settings_name_the_key(data_dir, debug_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"experiments\.x\.align: mix_weights has 2 entries but mix_datasets has 1"):
        check_config({"experiments": {"x": {"align": {"enabled": True, "mix_ratio": 0.2, "mix_weights": [1, 2]}}}})
    with pytest.raises(ConfigError, match=r"experiments\.x\.align: mix_datasets lists builtin:sft_targets"):
        check_config({"experiments": {"x": {"align": {"enabled": True, "mix_datasets": ["builtin:sft_targets"]}}}})
    with pytest.raises(ConfigError, match=r"align\.mix_ratio.: 1\.0 is greater than or equal to the maximum"):
        align_section(mix_ratio=1.0)
    missing = str(tmp_path / "missing.txt")
    exp = check_config({"experiments": {"x": {"align": {"enabled": True, "mix_ratio": 0.2,
                                                        "mix_datasets": [missing]}}}})["experiments"]["x"]
    with pytest.raises(DataConfigError, match=r"experiments\.x\.align\.mix_datasets\[0\].*matches no file"):
        check_mix_datasets(exp, "x", tmp_path)  # the workflow's check, before any job
    with pytest.raises(InputError, match=r"align\.mix_datasets\[0\].*matches no file"):
        align.run(debug_model_dir, data_dir, tmp_path / "out",
                  align_section(method="simpo", mix_ratio=0.2, mix_datasets=[missing]))
    assert not (tmp_path / "out").exists()


def test_the_stage_runs_with_mixing_and_records_the_share(tmp_path, debug_model_dir, data_dir):
    """simpo (reference-free) with mix_ratio 0.2: meta.json records the share trained; a rerun
    resumes from the run's checkpoint (step 2), but not once the general text's file has other text."""
    general = tmp_path / "general.txt"
    general.write_text((data_dir / "general.txt").read_text())
    section = align_section(method="simpo", mix_ratio=0.2, mix_datasets=[str(general)], max_length=MAX_LENGTH,
                            max_steps=4, save_steps=2, save_total_limit=0, per_device_train_batch_size=4,
                            gradient_accumulation_steps=2)
    out, checkpoints = tmp_path / "align", tmp_path / "checkpoints"
    metrics = align.run(debug_model_dir, data_dir, out, section, None, checkpoints)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["mix_ratio"] == 0.2
    assert meta["metrics"]["mix_token_share"] == metrics["mix_token_share"] == pytest.approx(0.2, abs=0.02)
    assert meta["metrics"]["mix_rows_length"] <= MAX_LENGTH
    with open(out / "train_log.csv") as f:  # the general text's loss, beside the preference statistics
        assert all(math.isfinite(float(row["mix_loss"])) for row in csv.DictReader(f))
    assert "mix_token_share" not in align.run(debug_model_dir, data_dir, tmp_path / "plain", section | {"mix_ratio": 0.0})
    assert align.run(debug_model_dir, data_dir, tmp_path / "same", section, None, checkpoints)["resumed_from_step"] == 2
    general.write_text(general.read_text()[::-1])  # other general text: another run
    assert align.run(debug_model_dir, data_dir, tmp_path / "other", section, None, checkpoints)["resumed_from_step"] \
        is None
