"""stages/training/log.py's TensorBoard event files: read back with TensorBoard's own reader, every
scalar equals its train_log.csv value at the same step, for fresh and resumed logs and for a short
real fine-tuning run (with evaluation, resumed from a checkpoint)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from sft_fixtures import finetune_section, write_toy_data
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stages import finetune
from stages.checkpoint.store import checkpoint_name
from stages.training.log import TrainLog, event_files

# train_log.csv column -> tag, as docs/workflow.md lists them (not read from the module, so a
# column the writer drops shows up here).
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
        "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "elapsed_s": "train/elapsed_s",
        "eval_loss": "eval/loss", "eval_exact_match": "eval/exact_match", "eval_bleu4": "eval/bleu4",
        "eval_rouge_l": "eval/rouge_l"}


def csv_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of train_log.csv's filled cells."""
    with open(directory / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    return {tag: {int(r["step"]): float(r[column]) for r in rows if r[column] != ""}
            for column, tag in TAGS.items() if any(r[column] != "" for r in rows)}


def event_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} as TensorBoard reads the directory's one event file."""
    (path,) = event_files(directory)
    events = EventAccumulator(str(path), size_guidance={"scalars": 0}).Reload()  # 0: keep every event
    out = {}
    for tag in events.Tags()["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), f"{tag}: a step written twice: {steps}"
        out[tag] = {e.step: e.value for e in events.Scalars(tag)}
    return out


def assert_events_match_csv(directory: Path) -> dict[str, dict[int, float]]:
    expected, got = csv_scalars(directory), event_scalars(directory)
    assert got.keys() == expected.keys()
    for tag, values in expected.items():
        assert got[tag].keys() == values.keys(), tag
        for step, value in values.items():
            assert got[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-30), (tag, step)
    return got


def log_steps(train_log: TrainLog, steps: range, evaluate_at: tuple[int, ...] = ()) -> None:
    for step in steps:
        evaluation = ({"eval_loss": 3.0 / step, "eval_exact_match": 0.125 * step, "eval_bleu4": 0.0123456789,
                       "eval_rouge_l": 1 / 3} if step in evaluate_at else None)
        train_log.log(step, loss=7.0 / step + 1e-7, lr=3e-4 * step / 7, grad_norm=None if step == 2 else 1.5 * step,
                      tokens=4096 * step, evaluation=evaluation)
        train_log.advance()


def test_every_logged_value_reads_back(tmp_path):
    train_log = TrainLog(tmp_path / "train_log.csv", max_steps=4, flops_per_token=6e6, peak_flops=1e12)
    log_steps(train_log, range(1, 5), evaluate_at=(2, 4))
    train_log.close()
    got = assert_events_match_csv(tmp_path)
    assert set(got) == set(TAGS.values())
    assert sorted(got["train/loss"]) == [1, 2, 3, 4] and sorted(got["eval/loss"]) == [2, 4]
    assert sorted(got["train/grad_norm"]) == [1, 3, 4]  # step 2 had none, as its CSV cell is empty


def test_mfu_counts_the_vocabulary_projection_of_learned_tokens_only(tmp_path):
    """A token whose next one is not learned costs flops_per_token less logits_flops_per_token (the
    step skipped its lm_head); `learned=None` counts every token whole."""
    train_log = TrainLog(tmp_path / "train_log.csv", max_steps=2, flops_per_token=6e6, peak_flops=1e12,
                         logits_flops_per_token=2e6)
    train_log.log(1, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=1000, learned=600)
    train_log.log(2, loss=2.0, lr=1e-3, grad_norm=1.0, tokens=1000)
    train_log.close()
    partly, whole = train_log.rows
    for row, flops in ((partly, 1000 * 6e6 - 400 * 2e6), (whole, 1000 * 6e6)):
        seconds = 1000 / float(row["tokens_per_s"])
        assert float(row["mfu"]) == pytest.approx(flops / seconds / 1e12, rel=1e-3)


def test_columns_without_values_get_no_scalars(tmp_path):
    train_log = TrainLog(tmp_path / "train_log.csv", max_steps=2)  # no peak FLOP/s: no MFU
    log_steps(train_log, range(1, 3))
    train_log.close()
    got = assert_events_match_csv(tmp_path)
    assert not {"train/mfu", "eval/loss", "eval/exact_match"} & set(got)


def test_resumed_log_has_the_whole_curve_in_one_file(tmp_path):
    first = TrainLog(tmp_path / "train_log.csv", max_steps=5)
    log_steps(first, range(1, 5), evaluate_at=(2,))
    first.close()  # stopped after step 4; resumed from its checkpoint of step 2
    resumed = TrainLog(tmp_path / "train_log.csv", max_steps=5, previous=first.rows[:2])
    log_steps(resumed, range(3, 6), evaluate_at=(4,))
    resumed.close()
    got = assert_events_match_csv(tmp_path)  # one event file: the stopped run's is gone
    assert sorted(got["train/loss"]) == [1, 2, 3, 4, 5] and sorted(got["eval/loss"]) == [2, 4]
    assert got["train/elapsed_s"][3] >= got["train/elapsed_s"][2]


def test_other_ranks_write_nothing(tmp_path):
    train_log = TrainLog(tmp_path / "train_log.csv", max_steps=2, enabled=False)
    log_steps(train_log, range(1, 3))
    train_log.close()
    assert list(tmp_path.iterdir()) == []


def test_finetune_run_and_its_resume_write_matching_event_files(debug_model_dir, tmp_path):
    data_dir = write_toy_data(tmp_path / "data")
    section = finetune_section("sft", max_steps=4, save_steps=2, eval_steps=2, eval_with_do_generation=True,
                               num_eval_examples=2, per_device_train_batch_size=4)
    finetune.run("sft", debug_model_dir, data_dir, tmp_path / "out", section, tmp_path / "checkpoints")
    got = assert_events_match_csv(tmp_path / "out")
    assert sorted(got["train/loss"]) == [1, 2, 3, 4] and sorted(got["eval/rouge_l"]) == [2, 4]
    assert not (tmp_path / ".out.log").exists()  # the staging directory was emptied into the output

    (run_dir,) = (tmp_path / "checkpoints").iterdir()
    resumed = section.replace(resume_from_checkpoint=str(run_dir / checkpoint_name(2)))
    metrics = finetune.run("sft", debug_model_dir, data_dir, tmp_path / "resumed", resumed, tmp_path / "checkpoints2")
    assert metrics["resumed_from_step"] == 2
    got = assert_events_match_csv(tmp_path / "resumed")
    assert sorted(got["train/loss"]) == [1, 2, 3, 4] and sorted(got["eval/loss"]) == [2, 4]
