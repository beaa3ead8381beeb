"""LoRA and prefix tuning checkpoint and resume through the training engine's checkpointer
(stages/training/checkpointing.py, via stages/finetune.py): only the adapter is saved, and a
resumed run ends with the uninterrupted run's adapter, bit for bit."""

from __future__ import annotations

import csv
import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sft_fixtures import finetune_section, signal_after, write_toy_data

from stages import finetune
from stages.checkpoint.store import (
    StateReader,
    checkpoint_name,
    complete_checkpoints,
    problems,
)
from stages.errors import StopRequested


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("data"))


def section(method: str, **overrides) -> dict:
    # Dropout on, so the resumed run must also restore the RNG to match.
    settings = dict(learning_rate=1e-2, save_steps=3, save_total_limit=0)
    if method == "lora":
        settings["lora_dropout"] = 0.1
    return finetune_section(method, **{**settings, **overrides})


def run(method, model_dir, data_dir, out, checkpoints, **overrides) -> dict:
    return finetune.run(method, model_dir, data_dir, out, section(method, **overrides), checkpoints)


def adapter(out) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter_model.safetensors")


def losses(out) -> list[str]:
    with open(out / "train_log.csv") as f:
        return [row["loss"] for row in csv.DictReader(f)]


def assert_same_adapter(a, b) -> None:
    ta, tb = adapter(a), adapter(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory, debug_model_dir, data_dir):
    """An uninterrupted 8-step LoRA run saving at steps 3 and 6: (out, checkpoint run dir, metrics)."""
    root = tmp_path_factory.mktemp("lora_reference")
    metrics = run("lora", debug_model_dir, data_dir, root / "out", root / "checkpoints", max_steps=8)
    (run_dir,) = (root / "checkpoints").iterdir()
    return root / "out", run_dir, metrics


def test_checkpoint_is_in_the_engine_format(lora_reference):
    out, run_dir, metrics = lora_reference
    assert metrics["resumed_from_step"] is None
    assert json.loads((out / "meta.json").read_text())["metrics"]["resumed_from_step"] is None
    assert [p.name for p in complete_checkpoints(run_dir)] == [checkpoint_name(3), checkpoint_name(6)]
    path = run_dir / checkpoint_name(3)
    assert problems(path) == []
    reader = StateReader(path)
    state = reader.trainer_state
    assert reader.index["format"] == "unified" and reader.index["optimizer_step"] == state["optimizer_step"] == 3
    assert state["global_step"] == 3 and len(state["losses"]) == 3 and len(state["train_log"]) == 3
    trainable = set(reader.keys("model"))
    assert trainable and all(".lora_A." in k or ".lora_B." in k for k in trainable)
    assert set(reader.keys("optimizer")) == {f"{k}.{m}" for k in trainable for m in ("exp_avg", "exp_avg_sq")}
    assert (path / "rng_state_0.safetensors").is_file()


@pytest.mark.parametrize("step", [3, 6])
def test_lora_resumed_from_a_path_matches_the_uninterrupted_run(lora_reference, debug_model_dir, data_dir,
                                                                 tmp_path, step):
    ref_out, run_dir, ref_metrics = lora_reference
    metrics = run("lora", debug_model_dir, data_dir, tmp_path / "out", tmp_path / "checkpoints", max_steps=8,
                  resume_from_checkpoint=str(run_dir / checkpoint_name(step)))
    assert metrics["resumed_from_step"] == step
    assert_same_adapter(tmp_path / "out", ref_out)
    assert losses(tmp_path / "out") == losses(ref_out) and len(losses(ref_out)) == 8
    assert (metrics["first_loss"], metrics["final_loss"]) == (ref_metrics["first_loss"], ref_metrics["final_loss"])


def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(lora_reference, debug_model_dir, data_dir,
                                                                 tmp_path, caplog):
    ref_out, run_dir, _ = lora_reference
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(run_dir, checkpoints / run_dir.name)
    newest = checkpoints / run_dir.name / checkpoint_name(6)
    with open(newest / "optimizer.safetensors", "r+b") as f:
        f.truncate(100)
    (checkpoints / run_dir.name / f"{checkpoint_name(9)}.partial").mkdir()  # an interrupted save
    metrics = run("lora", debug_model_dir, data_dir, tmp_path / "out", checkpoints, max_steps=8,
                  resume_from_checkpoint=True)
    assert metrics["resumed_from_step"] == 3
    assert "truncated" in caplog.text and str(newest) in caplog.text
    assert_same_adapter(tmp_path / "out", ref_out)
    assert losses(tmp_path / "out") == losses(ref_out)
    assert not (checkpoints / run_dir.name / f"{checkpoint_name(9)}.partial").exists()
    assert problems(newest) == []  # saved again by the resumed run


def test_a_changed_recipe_starts_afresh(lora_reference, debug_model_dir, data_dir, tmp_path):
    _, run_dir, _ = lora_reference
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(run_dir, checkpoints / run_dir.name)
    metrics = run("lora", debug_model_dir, data_dir, tmp_path / "out", checkpoints, max_steps=4)
    assert metrics["resumed_from_step"] is None and len(list(checkpoints.iterdir())) == 2


@pytest.mark.parametrize("recipe", [dict(learning_rate=3e-1), dict(learning_rate=1e-2, prefix_projection=True)],
                         ids=["prefix", "projection"])
def test_prefix_tuning_resumes(debug_model_dir, data_dir, tmp_path, recipe):
    ref = run("prefix", debug_model_dir, data_dir, tmp_path / "ref", tmp_path / "ref_checkpoints",
              max_steps=5, save_steps=2, **recipe)
    (run_dir,) = (tmp_path / "ref_checkpoints").iterdir()
    resumed = run("prefix", debug_model_dir, data_dir, tmp_path / "out", tmp_path / "checkpoints",
                  max_steps=5, save_steps=2, **recipe, resume_from_checkpoint=str(run_dir / checkpoint_name(2)))
    assert resumed["resumed_from_step"] == 2 and ref["resumed_from_step"] is None
    assert_same_adapter(tmp_path / "out", tmp_path / "ref")
    assert losses(tmp_path / "out") == losses(tmp_path / "ref")


def test_a_bad_resume_path_is_a_clear_error(debug_model_dir, data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=.*has no checkpoint_complete.json"):
        run("lora", debug_model_dir, data_dir, tmp_path / "out", tmp_path / "checkpoints", max_steps=2,
            resume_from_checkpoint=str(tmp_path / "nowhere"))
    assert not (tmp_path / "out").exists()


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return {f"{f.name}:{k}": v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("method", ["sft", "lora", "prefix"])
def test_a_signal_stops_finetuning_at_a_step_with_a_checkpoint_and_the_rerun_ends_bit_identical(
        method, debug_model_dir, data_dir, tmp_path):
    """The graceful stop of every fine-tuning method (pretraining's is tested through Snakemake and
    SLURM): SIGUSR1 mid-run saves a checkpoint at the step it lands after and raises StopRequested;
    the same call again resumes there and ends with the uninterrupted run's weights, bit for bit."""
    # 80 steps: the signal, sent once 3 are logged, must land before the run ends; with 12 the debug
    # model's remaining 9 steps (~20 ms each) once finished first on a loaded 2-core machine
    settings = dict(max_steps=80, save_steps=0, logging_steps=1)
    run(method, debug_model_dir, data_dir, tmp_path / "ref", tmp_path / "ref_checkpoints", **settings)
    out, checkpoints = tmp_path / "out", tmp_path / "checkpoints"
    sender = signal_after(3, out.parent / f".{out.name}.log" / "train_log.csv", signal.SIGUSR1)
    with pytest.raises(StopRequested) as stopped:
        run(method, debug_model_dir, data_dir, out, checkpoints, **settings)
    sender.join()
    step = stopped.value.step
    assert stopped.value.reason == "SIGUSR1" and 3 <= step < 80, stopped.value
    assert not out.exists()  # nothing published before the run is done
    (run_dir,) = checkpoints.iterdir()
    assert complete_checkpoints(run_dir) == [run_dir / checkpoint_name(step)]  # the stop's checkpoint only

    resumed = run(method, debug_model_dir, data_dir, out, checkpoints, **settings)
    assert resumed["resumed_from_step"] == step and resumed["stops"] == [{"step": step, "reason": "SIGUSR1"}]
    ref, got = _weights(tmp_path / "ref"), _weights(out)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert losses(out) == losses(tmp_path / "ref")
