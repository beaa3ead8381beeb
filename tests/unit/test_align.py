"""Preference alignment on the training engine (stages.score_pairs, stages.align), one process:
the per-row log-probs the step uses equal `sequence_logps`; the first step's loss equals the
objective computed directly on the first global batch of pairs (every method, with gradient
accumulation); DPO starts at log 2 against its own reference; training raises the reward accuracy
and the margin; a LoRA alignment is a peft adapter that peft loads; stale reference log-probs and
a missing reference are refused with the fix. The layouts' parity is tests/unit/test_align_layouts.py."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import signal

import pytest
import torch
from align_fixtures import align_section, toy_pairs, write_preference_data
from safetensors.torch import load_file
from sft_fixtures import signal_after

from stages import align, merge, score_pairs
from stages.data.preference import write_preference_file
from stages.data.tokenizer import load_model_tokenizer
from stages.errors import InputError, StopRequested
from stages.model.labels import IGNORE_INDEX
from stages.model.loss import causal_lm_loss, counted_tokens
from stages.model.preference_loss import (
    PreferenceObjective,
    SequenceLogps,
    orpo_nll,
    sequence_logps,
)
from stages.training import reference_logps
from stages.training.families import load_causal_lm
from stages.training.preference_batches import PreferenceBatches, encode_pairs, pad_rows
from stages.training.preference_step import STATS, row_logps


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory, debug_model_dir, data_dir):
    out = tmp_path_factory.mktemp("reference") / "align_reference"
    score_pairs.run(debug_model_dir, data_dir, out, align_section(max_steps=100))  # every pair drawn
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    output = model(input_ids=ids)  # our model returns the logits, a transformers model a ModelOutput
    return output if torch.is_tensor(output) else output.logits


def _encoded(model_dir, section):
    tokenizer = load_model_tokenizer(model_dir)
    pairs, _ = encode_pairs(toy_pairs()[:48], tokenizer, section.src_length, section.max_length, False, "toy")
    return pairs, tokenizer.pad_token_id


def test_row_logps_equal_sequence_logps(debug_model_dir):
    section = align_section()
    pairs, pad = _encoded(debug_model_dir, section)
    model = load_causal_lm(debug_model_dir).eval()
    ids, labels = pad_rows([c for c, _ in pairs[:6]] + [r for _, r in pairs[:6]], 24, pad)
    with torch.no_grad():
        ours = row_logps(model, ids, labels).logps
        theirs = sequence_logps(_logits(model, ids), labels)
    assert torch.equal(ours.tokens, theirs.tokens) and bool((ours.tokens > 0).all())
    torch.testing.assert_close(ours.total, theirs.total, rtol=1e-5, atol=1e-5)


def test_general_text_after_the_answers_leaves_their_logps_and_is_scored_apart(debug_model_dir):
    """Data mixing's rows: general text in the room after each answer (mix_labels) changes no
    answer's log-prob (causal attention), and its summed NLL is the causal LM loss of those tokens."""
    section = align_section()
    pairs, pad = _encoded(debug_model_dir, section)
    model = load_causal_lm(debug_model_dir).eval()
    rows = [c for c, _ in pairs[:4]] + [r for _, r in pairs[:4]]
    ids, labels = pad_rows(rows, 40, pad)
    mixed, mix_labels = ids.clone(), torch.full_like(labels, IGNORE_INDEX)
    generator = torch.Generator().manual_seed(0)
    for row, (x, _) in enumerate(rows):  # a chunk of random tokens after the row's eos, its first not learned
        chunk = torch.randint(3, model.config.vocab_size, (40 - len(x) - 2,), generator=generator)
        mixed[row, len(x):len(x) + len(chunk)] = chunk
        mix_labels[row, len(x) + 1:len(x) + len(chunk)] = chunk[1:]
    with torch.no_grad():
        plain, with_text = row_logps(model, ids, labels), row_logps(model, mixed, labels, mix_labels=mix_labels)
        lm_nll = causal_lm_loss(_logits(model, mixed), mix_labels, reduction="sum")
    assert plain.mix_tokens == 0 and float(plain.mix_nll) == 0.0
    assert torch.equal(with_text.logps.tokens, plain.logps.tokens)
    torch.testing.assert_close(with_text.logps.total, plain.logps.total, rtol=1e-5, atol=1e-5)
    assert with_text.mix_tokens == int(counted_tokens(mix_labels)) > 0
    torch.testing.assert_close(with_text.mix_nll, lm_nll, rtol=1e-5, atol=1e-4)


def _first_batch_loss(model_dir, section, reference: torch.Tensor | None) -> float:
    """The objective on the first global batch of pairs, computed directly (one forward, no engine)."""
    pairs, pad = _encoded(model_dir, section)
    source = PreferenceBatches(pairs, pad, section.seed, reference)
    global_batch = section.per_device_train_batch_size * section.gradient_accumulation_steps
    (ids, labels, ref, _), = source.micro_batches(0, global_batch, 0, 1, global_batch)  # no mixing: no general text
    model = load_causal_lm(model_dir).eval()
    with torch.no_grad():
        logps = sequence_logps(_logits(model, ids), labels)
    m = global_batch
    chosen, rejected = SequenceLogps(logps.total[:m], logps.tokens[:m]), SequenceLogps(logps.total[m:], logps.tokens[m:])
    objective = PreferenceObjective(section.method, section.beta, section.label_smoothing, section.simpo_gamma)
    ref_c = SequenceLogps(ref[:m].float(), logps.tokens[:m])
    ref_r = SequenceLogps(ref[m:].float(), logps.tokens[m:])
    loss = objective.pair_terms(chosen, rejected, ref_c, ref_r).loss.mean()
    if section.method == "orpo":
        loss = loss + orpo_nll(chosen)
    return float(loss)


@pytest.mark.parametrize("method", ["dpo", "ipo", "simpo", "orpo"])
def test_the_first_step_loss_is_the_objective_on_the_first_batch(method, tmp_path, debug_model_dir, data_dir,
                                                                 reference_dir):
    section = align_section(method=method, max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                            label_smoothing=0.1 if method in ("dpo", "simpo") else 0.0)
    reference = reference_logps.read_reference(reference_dir, _encoded(debug_model_dir, section)[0], section)
    metrics = align.run(debug_model_dir, data_dir, tmp_path / "out", section,
                        reference_dir if method in ("dpo", "ipo") else None)
    expected = _first_batch_loss(debug_model_dir, section, reference)
    assert metrics["first_loss"] == pytest.approx(expected, rel=1e-5)
    if method == "dpo":  # the policy is its own reference: z = 0, loss log 2 whatever the smoothing
        assert metrics["first_loss"] == pytest.approx(math.log(2), rel=1e-5)


def test_dpo_training_raises_the_reward_accuracy_and_margin(tmp_path, debug_model_dir, data_dir, reference_dir):
    out = tmp_path / "align"
    metrics = align.run(debug_model_dir, data_dir, out, align_section(max_steps=20, learning_rate=5e-3),
                        reference_dir, tmp_path / "checkpoints")
    with open(out / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(STATS) <= set(rows[0])
    first, last = rows[0], rows[-1]
    assert float(first["rewards_margin"]) == pytest.approx(0.0, abs=1e-6)  # the first step's policy is the reference
    assert float(last["rewards_accuracy"]) >= 0.9 and float(last["rewards_margin"]) > 0.2  # beta x log-ratio: 4 nats
    assert metrics["final_loss"] < 0.8 * math.log(2)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "align" and meta["config"]["method"] == "dpo"
    assert meta["metrics"]["final_rewards_accuracy"] == float(last["rewards_accuracy"])
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()


def test_lora_alignment_writes_an_adapter_peft_loads(tmp_path, debug_model_dir, data_dir):
    import peft
    from transformers import AutoModelForCausalLM

    out = tmp_path / "align"
    align.run(debug_model_dir, data_dir, out, align_section(method="simpo", tuning="lora", lora_rank=4,
                                                             max_steps=3, learning_rate=1e-2))
    base = AutoModelForCausalLM.from_pretrained(debug_model_dir)
    adapted = peft.PeftModel.from_pretrained(base, out).eval()
    ours = load_causal_lm(debug_model_dir)
    ids = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        moved = adapted(input_ids=ids).logits
        plain = _logits(ours, ids)
    assert not torch.allclose(moved, plain, atol=1e-4)  # the adapter changed the model
    # the align-merged variant: stages.merge folds it into the model it aligned, as merge_align runs it
    metrics = merge.main(["--adapter", str(out), "--base", str(debug_model_dir), "--out", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, moved, rtol=1e-4, atol=1e-4)
    assert metrics["rel_err"] <= metrics["rtol"]


def test_stale_or_missing_reference_is_refused(tmp_path, debug_model_dir, data_dir, reference_dir):
    with pytest.raises(InputError, match="--reference"):
        align.run(debug_model_dir, data_dir, tmp_path / "a", align_section(method="dpo"))
    swapped = tmp_path / "swapped"  # other pairs than the reference scored: each answer swapped
    write_preference_file(swapped / "preference" / "train.json",
                          [dataclasses.replace(p, chosen=p.rejected, rejected=p.chosen) for p in toy_pairs()[:48]])
    with pytest.raises(InputError, match="rerun python -m stages.score_pairs"):
        align.run(debug_model_dir, swapped, tmp_path / "b", align_section(), reference_dir)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_sigterm_saves_a_checkpoint_and_the_rerun_ends_bit_identical(tuning, tmp_path, debug_model_dir, data_dir,
                                                                     reference_dir):
    """Alignment stops as every training stage does: SIGTERM mid-run saves a checkpoint at the step
    it lands after and raises StopRequested; the same call again resumes there (the preference
    statistics of the log included) and ends with the uninterrupted run's weights, bit for bit."""
    section = align_section(max_steps=80, save_steps=0, tuning=tuning, lora_rank=4)
    align.run(debug_model_dir, data_dir, tmp_path / "ref", section, reference_dir, tmp_path / "ref_checkpoints")
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    sender = signal_after(3, out.parent / f".{out.name}.log" / "train_log.csv", signal.SIGTERM)
    with pytest.raises(StopRequested) as stopped:
        align.run(debug_model_dir, data_dir, out, section, reference_dir, checkpoints)
    sender.join()
    step = stopped.value.step
    assert stopped.value.reason == "SIGTERM" and 3 <= step < 80 and not out.exists()
    resumed = align.run(debug_model_dir, data_dir, out, section, reference_dir, checkpoints)
    assert resumed["resumed_from_step"] == step
    ref, got = _all_weights(tmp_path / "ref"), _all_weights(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    with open(tmp_path / "ref" / "train_log.csv") as a, open(out / "train_log.csv") as b:
        columns = ("step", "loss", *STATS)
        assert [[r[c] for c in columns] for r in csv.DictReader(a)] == [[r[c] for c in columns] for r in csv.DictReader(b)]


def _all_weights(out) -> dict[str, torch.Tensor]:
    return {f"{f.name}:{k}": v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_score_pairs_scores_only_the_pairs_the_run_draws(tmp_path, debug_model_dir, data_dir, reference_dir):
    """2 steps of 8 pairs draw 16 of the 48: only those are scored (the same values as when every
    pair is), and a run drawing more is refused with the rule to rerun."""
    from safetensors.torch import load_file

    section = align_section(max_steps=2)
    out = tmp_path / "some"
    metrics = score_pairs.run(debug_model_dir, data_dir, out, section)
    some, every = load_file(out / score_pairs.REFERENCE_FILE)["logps"], load_file(
        reference_dir / score_pairs.REFERENCE_FILE)["logps"]
    scored = ~torch.isnan(some).any(dim=1)
    assert metrics["pairs_scored"] == int(scored.sum()) == 16 and len(some) == 48
    torch.testing.assert_close(some[scored], every[scored], rtol=1e-6, atol=1e-6)  # batched in other company
    align.run(debug_model_dir, data_dir, tmp_path / "ok", section, out)
    with pytest.raises(InputError, match="were not scored"):
        align.run(debug_model_dir, data_dir, tmp_path / "more", align_section(max_steps=3), out)
