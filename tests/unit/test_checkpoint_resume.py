"""Checkpoints of the training engine across layouts (real torchrun, gloo, fp32).

Every run trains the same 2-layer model from the same seed on the same global batch of 8 windows
(micro x accumulation x data parallel = 8) for 10 steps and saves at step 5. A layout B resumes
from layout A's checkpoint-5 — found automatically in A's checkpoint directory, because layout
keys are not part of the run's fingerprint — and its steps 6..10 must continue the uninterrupted
single-process curve within 1e-5 relative: the weights and Adam moments were re-split for B.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pretrain_fixtures import (kill_after_checkpoint, make_data_dir, model_section, pretrain_section, requires_fp16,
                               torchrun, torchrun_command)
from runs_in_one_world import start_world
from stages.checkpoint.hf import load_state_dict
from stages.checkpoint.store import StateReader, complete_checkpoints
from stages.merge_tp import merge

COMMON = dict(max_steps=10, warmup_steps=2, max_length=32, seed=7, learning_rate=3e-3, save_steps=5,
              save_total_limit=0)
LAYOUTS = {
    "single": (1, dict(world_size=1, per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "dp2": (2, dict(world_size=2, per_device_train_batch_size=4)),
    "stage1x2": (2, dict(world_size=2, sharding="stage1", per_device_train_batch_size=2, gradient_accumulation_steps=2)),
    "stage3x2": (2, dict(world_size=2, sharding="stage3", per_device_train_batch_size=4)),
    "tp2": (2, dict(world_size=2, tensor_parallel_degree=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)),
    "pp2": (2, dict(world_size=2, pipeline_parallel_degree=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=4)),
    "tp2sp": (2, dict(world_size=2, tensor_parallel_degree=2, sequence_parallel=True, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2)),
    "cp2": (2, dict(world_size=2, context_parallel_degree=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=4)),
    "tp2xpp2": (4, dict(world_size=4, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                        per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "pp2xstage1x2": (4, dict(world_size=4, pipeline_parallel_degree=2, sharding="stage1",
                             per_device_train_batch_size=2, gradient_accumulation_steps=2)),
}
PAIRS = [("tp2sp", "dp2"), ("pp2", "tp2"), ("stage3x2", "single"), ("single", "tp2xpp2"), ("cp2", "stage1x2"),
         ("tp2xpp2", "pp2xstage1x2")]  # the last: ZeRO's fragments under a pipeline, both ways sliced


# the uninterrupted two-rank runs the tests below resume from or compare: (layout, extra settings)
TWO_RANK_RUNS = [("tp2", {}), ("pp2", {}), ("stage3x2", {}), ("cp2", {}), ("tp2", {"unified_checkpoint": False}),
                 ("tp2sp", {})]  # tp2sp: tp2 with sequence parallelism, whose checkpoint resumes in dp2; cp2:
# context parallelism (ZeRO-1 over its 2 context ranks), whose checkpoint resumes in ZeRO-1 over 2 data ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted runs by layout name (run on first use): (train_log, out dir, checkpoint dir).
    The two-rank ones (TWO_RANK_RUNS) run one after another in one torchrun
    (tests/unit/runs_in_one_world.py); every resumed run below starts processes of its own, as a
    rerun after a stop does."""
    data = make_data_dir(tmp_path_factory.mktemp("data"))
    root = tmp_path_factory.mktemp("uninterrupted")

    def where(name: str, extra: dict) -> Path:
        return root / "-".join([name, *(f"{k}={v}" for k, v in sorted(extra.items()))])

    @functools.cache
    def two_rank_world():
        return start_world(2, {where(n, e).name: {"stage": "pretrain", "data": data, "out": where(n, e) / "out",
                                                  "checkpoints": where(n, e) / "ckpt", "model": model_section(),
                                                  "section": pretrain_section(**LAYOUTS[n][1], **COMMON, **e)}
                               for n, e in TWO_RANK_RUNS}, root / "world")

    @functools.cache
    def run(name: str, **extra):
        nproc, layout = LAYOUTS[name]
        if nproc == 2:
            out = two_rank_world().out(where(name, extra).name)
        else:
            out = where(name, extra) / "out"
            torchrun(nproc, data, out, checkpoints=where(name, extra) / "ckpt", **layout, **COMMON, **extra)
        return pd.read_csv(out / "train_log.csv"), out, where(name, extra) / "ckpt"

    run.data = data
    return run


@pytest.mark.multiproc
@pytest.mark.parametrize("saved, resumed", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_resume_in_another_layout_continues_the_curve(runs, saved, resumed, tmp_path):
    reference, ref_out, _ = runs("single")
    _, _, ckpt = runs(saved)
    nproc, layout = LAYOUTS[resumed]
    log = torchrun(nproc, runs.data, tmp_path / "out", checkpoints=ckpt, **layout, **COMMON)

    meta = json.loads((tmp_path / "out" / "meta.json").read_text())["metrics"]
    assert meta["resumed_from_step"] == 5  # found in the other layout's directory, not retrained
    # steps 1-5 come from the checkpoint's log; 6-10 were trained in the new layout
    np.testing.assert_allclose(log["loss"][5:], reference["loss"][5:], rtol=1e-5)
    np.testing.assert_allclose(log["lr"], reference["lr"], rtol=1e-12)
    ref, got = load_state_dict(ref_out), load_state_dict(tmp_path / "out")
    assert sorted(got) == sorted(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=2e-5, msg=key)


@pytest.mark.multiproc
def test_checkpoint_is_the_single_device_layout(runs):
    """Whatever wrote it, a unified checkpoint holds whole tensors under HF names, plus Adam's moments."""
    _, out, ckpt = runs("tp2xpp2")
    (checkpoint,) = complete_checkpoints(next(ckpt.iterdir()))
    reader = StateReader(checkpoint)
    final = load_state_dict(out)
    assert sorted(reader.keys("model")) == sorted(final)
    assert len(reader.keys("optimizer")) == 2 * len(final)
    assert all(len(parts) == 1 for parts in reader.tensors.values())
    state = reader.trainer_state
    assert state["global_step"] == 5 and state["optimizer_step"] == 5
    assert state["layout"]["tensor_parallel_degree"] == 2 and state["layout"]["pipeline_parallel_degree"] == 2
    # each of the 4 ranks wrote a share of the model: no process gathered it
    assert len({p[0]["file"] for k, p in reader.tensors.items() if k in final}) == 4
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint)  # config.json + index: a plain HF model dir
    assert torch.equal(hf.state_dict()["model.norm.weight"], reader.get("model.norm.weight"))


@pytest.mark.multiproc
def test_merge_tp_equals_the_unified_checkpoint(runs, tmp_path):
    """The same tp2 run written sharded (unified_checkpoint: false) and unified: merge_tp of the
    slices equals the unified tensors exactly, for the final model and for checkpoint-5."""
    _, unified_out, unified_ckpt = runs("tp2")
    _, sharded_out, sharded_ckpt = runs("tp2", unified_checkpoint=False)
    index = json.loads((sharded_out / "checkpoint_index.json").read_text())
    assert index["format"] == "sharded" and not (sharded_out / "model.safetensors.index.json").exists()

    merge(sharded_out, tmp_path / "merged")
    merged, unified = load_state_dict(tmp_path / "merged"), load_state_dict(unified_out)
    assert sorted(merged) == sorted(unified)
    for key in unified:
        assert torch.equal(merged[key], unified[key]), key
    assert (tmp_path / "merged" / "train_log.csv").read_text() == (sharded_out / "train_log.csv").read_text()
    assert json.loads((tmp_path / "merged" / "meta.json").read_text())["merged_from"]["merged_tensor_parallel"] > 0

    (a,) = complete_checkpoints(next(unified_ckpt.iterdir()))
    (b,) = complete_checkpoints(next(sharded_ckpt.iterdir()))
    ua, sb = StateReader(a), StateReader(b)
    assert any(len(parts) == 2 for parts in sb.tensors.values())  # really split
    assert sorted(ua.tensors) == sorted(sb.tensors)
    for key in ua.tensors:
        assert torch.equal(ua.get(key), sb.get(key)), key


@pytest.mark.multiproc
def test_sharded_checkpoint_resumes_in_one_process(runs, tmp_path):
    reference, _, _ = runs("single")
    _, _, sharded_ckpt = runs("tp2", unified_checkpoint=False)
    nproc, layout = LAYOUTS["single"]
    log = torchrun(nproc, runs.data, tmp_path / "out", checkpoints=sharded_ckpt, **layout, **COMMON)
    np.testing.assert_allclose(log["loss"][5:], reference["loss"][5:], rtol=1e-5)


MIXED = {  # DeepSpeed keeps the fp32 masters in two different places here: FP16_UnfusedOptimizer
    # (no ZeRO) and the ZeRO-1 flat partitions, with fp16's dynamic loss scaler
    "bf16_tp2": (2, dict(world_size=2, tensor_parallel_degree=2, bf16=True, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2)),
    "fp16_stage1x2": (2, dict(world_size=2, sharding="stage1", fp16=True, per_device_train_batch_size=4)),
    # fp16 without ZeRO: the loss scale lives in FP16_UnfusedOptimizer's loss_scale_config
    "fp16_one_process": (1, dict(world_size=1, sharding="none", fp16=True, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=2)),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [pytest.param(n, marks=requires_fp16) if "fp16" in n else n for n in MIXED])
def test_mixed_precision_resumes_bit_identically(runs, name, tmp_path):
    """Same layout, bf16/fp16: the resumed run's weights (the fp32 masters) equal the uninterrupted run's bit for bit."""
    nproc, layout = MIXED[name]
    full = torchrun(nproc, runs.data, tmp_path / "full", checkpoints=tmp_path / "ckpt", **layout, **COMMON)
    resumed = torchrun(nproc, runs.data, tmp_path / "resumed", checkpoints=tmp_path / "ckpt", **layout, **COMMON)
    assert json.loads((tmp_path / "resumed" / "meta.json").read_text())["metrics"]["resumed_from_step"] == 5
    assert (resumed["loss"] == full["loss"]).all()
    a, b = load_state_dict(tmp_path / "full"), load_state_dict(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["tp2sp", "cp2"])
def test_killed_sequence_and_context_parallel_runs_resume_bit_identically(runs, name, tmp_path):
    """tp2 with sequence parallelism, and cp2 (ZeRO-1 over its 2 context ranks), SIGKILLed once
    checkpoint-5 is written and started again with the same command: the curve, the learning rates
    and the written weights equal the uninterrupted run's bit for bit (each rank's share of the
    sequence, its data position and RNG come back with the checkpoint)."""
    nproc, layout = LAYOUTS[name]
    straight, straight_out, _ = runs(name)
    cmd, env = torchrun_command(nproc, runs.data, tmp_path / "out", checkpoints=tmp_path / "ckpt", **layout, **COMMON)
    kill_after_checkpoint(cmd, env, tmp_path / "ckpt", 5)
    assert not (tmp_path / "out").exists()
    resumed = torchrun(nproc, runs.data, tmp_path / "out", checkpoints=tmp_path / "ckpt", **layout, **COMMON)
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["metrics"]["resumed_from_step"] == 5
    assert (resumed["loss"] == straight["loss"]).all() and (resumed["lr"] == straight["lr"]).all()
    assert (resumed["grad_norm"] == straight["grad_norm"]).all()
    a, b = load_state_dict(straight_out), load_state_dict(tmp_path / "out")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_every_skipped_checkpoint_is_logged_with_its_path_and_reason(tmp_path, caplog):
    """Resume takes the newest checkpoint that is complete and intact; each newer candidate (an
    interrupted save, a directory without its completion marker, one whose files do not match the
    index) is logged as one `skipping checkpoint <path>: <reason>` line, newest first."""
    import logging
    import shutil

    from stages.checkpoint.store import COMPLETE, UNIFIED, checkpoint_name, finalize
    from stages.training.checkpointing import RankPart, build_index, choose_checkpoint, write_part

    def save(step: int):
        part = RankPart(0)
        part.add("model.safetensors", "weight", torch.full((2, 4), float(step)))
        partial, final = tmp_path / f"{checkpoint_name(step)}.partial", tmp_path / checkpoint_name(step)
        index = build_index({"format": UNIFIED, "step": step, "optimizer_step": step}, [write_part(partial, part)])
        finalize(partial, final, index=index, trainer_state={"global_step": step}, hf_index=False)
        return final

    good, corrupt, unmarked = (save(step) for step in (1, 2, 3))
    (unmarked / COMPLETE).unlink()  # killed between the rename and the marker
    with open(corrupt / "model.safetensors", "r+b") as f:  # a flipped byte
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    interrupted = tmp_path / f"{checkpoint_name(4)}.partial"
    shutil.copytree(good, interrupted)

    with caplog.at_level(logging.WARNING, logger="stages.training.checkpointing"):
        assert choose_checkpoint(tmp_path, True) == good
        assert choose_checkpoint(tmp_path, True) == good  # asked again: the same answer, logged again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping checkpoint")]
    assert lines[:2] == [f"skipping checkpoint {interrupted}: the save was interrupted (removed)",
                         f"skipping checkpoint {unmarked}: no {COMPLETE} (the save did not finish)"]
    assert lines[2].startswith(f"skipping checkpoint {corrupt}: {corrupt / 'model.safetensors'}") and "sha256" in lines[2]
    assert lines[3:] == lines[1:3] and not interrupted.exists()  # the second find: the partial save is gone


def test_fp16_loss_scale_without_zero_is_in_the_training_state():
    """FP16_UnfusedOptimizer (fp16 without ZeRO) keeps its dynamic loss scale in `loss_scale_config`,
    not in a `loss_scaler` as ZeRO does; the training state (saved with a checkpoint, restored
    through the same holders) carries it, so a resumed run does not restart from 2^16."""
    from types import SimpleNamespace

    from stages.training.checkpointing import engine_state

    def engine(scale: float, it: int, overflow: int):
        config = SimpleNamespace(cur_scale=scale, cur_iter=it, last_overflow_iter=overflow)
        return SimpleNamespace(optimizer=SimpleNamespace(loss_scale_config=config), global_steps=it,
                               global_samples=8 * it, skipped_steps=1)

    scheduler = SimpleNamespace(state_dict=lambda: {})
    state = engine_state(engine(32768.0, 7, 4), scheduler)
    assert state["loss_scaler"] == {"cur_scale": 32768.0, "cur_iter": 7, "last_overflow_iter": 4}


@pytest.mark.parametrize("fused", [True, False])
def test_restored_adam_step_lives_where_torch_keeps_it(fused):
    """Resume recreates Adam's state (`OptimizerAccess.ensure_state`) before it copies the saved moments in:
    a fused AdamW keeps `step` on the parameters' device (on a GPU its kernel refuses a CPU step: an H200
    resume failed so on 2026-12-01), the unfused one on the CPU, as torch's own _init_group places it.
    A GPU is stood in for by the meta device: the parameters are moved there after the optimizer is built."""
    from types import SimpleNamespace

    from stages.training.checkpointing import OptimizerAccess

    module = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=fused)
    optimizer.param_groups[0]["params"] = [torch.nn.Parameter(p.detach().to("meta"))
                                           for p in optimizer.param_groups[0]["params"]]
    access = OptimizerAccess(SimpleNamespace(optimizer=optimizer, module=module))
    access.ensure_state(5)
    for hp in optimizer.param_groups[0]["params"]:
        step = optimizer.state[hp]["step"]
        assert step.device.type == ("meta" if fused else "cpu") and step.dtype == torch.float32
        assert optimizer.state[hp]["exp_avg"].device.type == "meta"
    if not fused:  # a meta step has no value to read
        assert access.step_count() == 5
