"""Fine-tuning with general text mixed in (mix_ratio, stages/training/mixed_batches.py) on the
training engine: tensor parallelism and dp2 x ZeRO-3 (real torchrun, gloo) follow the one-process
curve within 1e-5 relative, a resumed run ends bit-identical to an uninterrupted one, meta.json
records the share trained, and the mixed text really is learned (its loss falls)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from runs_in_one_world import start_world
from sft_fixtures import finetune_section, train_losses, write_toy_data

from stages import finetune
from stages.checkpoint.store import checkpoint_name
from stages.config import ConfigError, check_config
from stages.errors import InputError


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    data = write_toy_data(tmp_path_factory.mktemp("data"))
    from pydoc_data.topics import topics

    (data / "general.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:12]))
    return data


def section(data_dir: Path, method: str = "sft", **overrides) -> dict:
    settings = dict(max_steps=5, warmup_steps=1, learning_rate=1e-2, mix_ratio=0.5,
                    mix_datasets=[str(data_dir / "general.txt")], max_length=48)
    return finetune_section(method, **{**settings, **overrides})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, debug_model_dir, data_dir):
    out = tmp_path_factory.mktemp("reference") / "out"
    metrics = finetune.run("sft", debug_model_dir, data_dir, out,
                           section(data_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2))
    return out, metrics


def test_meta_records_the_mixing(reference):
    out, metrics = reference
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["mix_ratio"] == 0.5 and meta["config"]["mix_datasets"][0].endswith("general.txt")
    assert meta["metrics"]["mix_token_share"] == metrics["mix_token_share"] == pytest.approx(0.5, abs=0.02)
    assert meta["metrics"]["mix_rows_length"] <= 48


LAYOUTS = {"tp2": dict(tensor_parallel_degree=2, per_device_train_batch_size=8),
           "dp2_zero3": dict(sharding="stage3", per_device_train_batch_size=4)}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, debug_model_dir, data_dir):
    """name -> output dir of LAYOUTS' two-rank runs, one after another in one torchrun
    (tests/unit/runs_in_one_world.py)."""
    root = tmp_path_factory.mktemp("layouts")
    world = start_world(2, {name: {"stage": "finetune", "method": "sft", "model": debug_model_dir, "data": data_dir,
                                   "out": root / name, "section": dict(section(data_dir, world_size=2, **layout))}
                            for name, layout in LAYOUTS.items()}, root / "world")
    return {name: world.out(name) for name in LAYOUTS}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_layouts_follow_the_one_process_curve(reference, layout_runs, name):
    out, _ = reference
    curve = train_losses(layout_runs[name])
    expected = train_losses(out)
    assert len(curve) == len(expected) == 5
    assert curve == pytest.approx(expected, rel=1e-5)


def test_a_resumed_mixed_run_ends_bit_identical(debug_model_dir, data_dir, tmp_path):
    settings = dict(method="lora", max_steps=6, save_steps=3, save_total_limit=0, lora_dropout=0.1)
    finetune.run("lora", debug_model_dir, data_dir, tmp_path / "ref", section(data_dir, **settings),
                 tmp_path / "ref_checkpoints")
    (run_dir,) = (tmp_path / "ref_checkpoints").iterdir()
    resumed = finetune.run("lora", debug_model_dir, data_dir, tmp_path / "out",
                           section(data_dir, **settings, resume_from_checkpoint=str(run_dir / checkpoint_name(3))),
                           tmp_path / "checkpoints")
    assert resumed["resumed_from_step"] == 3
    ours, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("out", "ref"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert train_losses(tmp_path / "out") == train_losses(tmp_path / "ref")


def test_the_mixed_text_is_learned(debug_model_dir, data_dir, tmp_path):
    """All but a sliver of general text (mix_ratio 0.95): the training loss is the general text's,
    and it falls, where the same steps without mixing train on the task's few target tokens."""
    curve = finetune.run("sft", debug_model_dir, data_dir, tmp_path / "mixed",
                         section(data_dir, mix_ratio=0.95, max_steps=12, max_length=128))
    plain = finetune.run("sft", debug_model_dir, data_dir, tmp_path / "plain",
                         section(data_dir, mix_ratio=0.0, max_steps=12, max_length=128))
    assert curve["mix_token_share"] == pytest.approx(0.95, abs=0.01) and "mix_token_share" not in plain
    assert curve["final_loss_mean_last10"] < curve["first_loss"]
    assert curve["first_loss"] != pytest.approx(plain["first_loss"], rel=1e-3)


def test_bad_mixing_settings_name_the_key(data_dir, debug_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"finetune.sft: mix_weights has 2 entries but mix_datasets has 1"):
        check_config({"experiments": {"x": {"finetune": {"sft": {"mix_ratio": 0.2, "mix_weights": [1, 2]}}}}})
    with pytest.raises(ConfigError, match="builtin:sft_targets, the task's own answers"):
        check_config({"experiments": {"x": {"finetune": {"lora": {"mix_datasets": ["builtin:sft_targets"]}}}}})
    with pytest.raises(InputError, match=r"finetune.sft.mix_datasets\[0\].*matches no file"):
        finetune.run("sft", debug_model_dir, data_dir, tmp_path / "out",
                     section(data_dir, mix_datasets=[str(tmp_path / "missing.txt")]))
    assert not (tmp_path / "out").exists()
