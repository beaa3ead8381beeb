"""Qwen3, GLM, GLM-4 and OLMoE on the training engine: every parallel layout follows the single-process
run, the written model is transformers' own class with our model's logits, and a killed tensor-
parallel run resumes bit-identically from a sharded checkpoint (real torchrun, gloo, fp32).

These families have no flavour: each run is continued pretraining from a tiny random-init checkpoint
saved by the installed transformers (`checkpoint_fixtures.save_checkpoint`: hidden 64, 4 layers,
4 heads of 16 dimensions, 2 KV heads), imported by `import_base`, on data prepared with its
tokenizer. Every layout sees the same global batch of 8 windows per step (micro-batch x gradient
accumulation x data-parallel degree), as in test_pretrain.py.

What each family adds to the Llama layouts: Qwen3's q_norm / k_norm (HEAD_NORM: replicated, the
gradient summed over the tensor-parallel group), OLMoE's (WIDTH_NORM: over every head at once, the
weight split with the heads and the mean square summed over the group; a mixture of experts, 4
experts, top 2), GLM's fused gate_up_proj (COLUMN_FUSED2: each half split on its own,
`partition_chunks=2` in checkpoints) and partial interleaved RoPE, GLM-4's norms after each
sub-block. Default run (~35 s): GLM-4 under tp2; `slow` (~4 min): SLOW_PAIRS (every
family under the layouts its switches touch, and GLM-4 under every sequence- and context-parallel
layout of issue 55, as Llama in test_pretrain.py), the same GLM-4 layouts in bf16 against a
one-process bf16 run (BF16_PAIRS), GLM-4's tp2 slices merged by merge_tp (the runs of two and of
four ranks share one torchrun each), and the kill-and-resume test.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from checkpoint_fixtures import chat_tokenizer, save_checkpoint
from pretrain_fixtures import (BF16_RTOL, kill_after_checkpoint, model_section, pretrain_section, torchrun,
                               torchrun_command)
from runs_in_one_world import start_world
from stages import import_base, prepare
from stages.checkpoint.hf import load_state_dict
from stages.checkpoint.store import StateReader, checkpoint_name, complete_checkpoints
from stages.merge_tp import merge

pytestmark = pytest.mark.multiproc

CLASSES = {"qwen3": "Qwen3ForCausalLM", "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM",
           "olmoe": "OlmoeForCausalLM"}
COMMON = dict(enabled=True, max_steps=8, warmup_steps=2, max_length=32, seed=7, learning_rate=3e-3)
REFERENCE = (1, dict(sharding="none", per_device_train_batch_size=2, gradient_accumulation_steps=4))
BF16_REFERENCE = (1, dict(REFERENCE[1], bf16=True))
LAYOUTS = {
    "tp2": (2, dict(sharding="none", tensor_parallel_degree=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=4)),
    "pp2_1f1b": (2, dict(sharding="none", pipeline_parallel_degree=2, per_device_train_batch_size=2,
                         gradient_accumulation_steps=4)),
    "sharding_stage3": (2, dict(sharding="stage3", per_device_train_batch_size=2, gradient_accumulation_steps=2)),
    "pp2_interleaved": (2, dict(sharding="none", pipeline_parallel_degree=2, virtual_pp_degree=2,
                                per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "tp2_vocab_parallel_loss_recompute": (2, dict(sharding="stage1", tensor_parallel_degree=2,
                                                  tensor_parallel_output=True, recompute=True,
                                                  per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "tp2_pp2_zero1": (4, dict(sharding="stage1", tensor_parallel_degree=2, pipeline_parallel_degree=2,
                              per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "tp2_sequence_parallel": (2, dict(sharding="stage1", tensor_parallel_degree=2, sequence_parallel=True,
                                      per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "cp2_sharding_stage3": (2, dict(sharding="stage3", context_parallel_degree=2, per_device_train_batch_size=2,
                                    gradient_accumulation_steps=4)),
    "cp2": (2, dict(sharding="none", context_parallel_degree=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=4)),
    "tp2_sequence_parallel_pp2": (4, dict(sharding="none", tensor_parallel_degree=2, sequence_parallel=True,
                                          pipeline_parallel_degree=2, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=4)),
    "cp2_tp2_sequence_parallel": (4, dict(sharding="stage1", context_parallel_degree=2, tensor_parallel_degree=2,
                                          sequence_parallel=True, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=4)),
}
# Issue 55's sequence- and context-parallel layouts, which GLM-4 (the second family after Llama, in
# test_pretrain.py) also runs in bf16 against its own one-process bf16 run (loss within BF16_RTOL)
SEQUENCE_LAYOUTS = ["tp2_sequence_parallel", "tp2_sequence_parallel_pp2", "cp2", "cp2_tp2_sequence_parallel",
                    "cp2_sharding_stage3"]
LAYOUTS.update({f"bf16_{name}": (LAYOUTS[name][0], dict(LAYOUTS[name][1], bf16=True)) for name in SEQUENCE_LAYOUTS})
# The written weights, element by element. test_pretrain.py's atol of 2e-5 is below Adam's noise
# floor here: an element whose gradient (nearly) cancels has its rounding, which differs with the
# order of the sums, turned into a step of up to lr. GLM's k_proj.bias has such elements by
# construction: where RoPE leaves a key dimension unturned, adding to it shifts every score of a query
# by the same amount, which softmax ignores, so its gradient is 0 in exact arithmetic (those 8 of 16
# dimensions per head reach |w| ~ 2e-5 from zero, from rounding alone). Measured, every layout and
# family: at most 2.9e-5 there and 2.6e-5 elsewhere (one element of 16384 in a gate_up_proj);
# a wrong slice or a missing gradient reduction moves weights by ~lr = 3e-3.
WEIGHTS_RTOL, WEIGHTS_ATOL = 1e-4, 5e-5
DEFAULT = ("glm4", "tp2")  # the one pair of the default run
# The slow run's pairs: what each family adds under the layouts it
# touches (Qwen3's head norms and GLM's fused gate_up under tensor parallelism; GLM-4's extra norms
# move with their layer under the pipeline, and run on each rank's tokens under sequence parallelism;
# its partial interleaved RoPE turns each rank's tokens by their places under context parallelism),
# and GLM-4 under each of SEQUENCE_LAYOUTS (measured 2026-12-01: loss within 2.1e-7, weights within
# 3.6e-5 of one process; in bf16, loss within 1.3e-4 of one bf16 process).
# The whole 3 x 6 product passed on 2026-11-26 (numbers in the commit's note); it takes ~10 min on 2
# cores, this selection ~3. Left out since 2026-11-30 for CI's time: Qwen3 under plain tp2 (its head
# norms are under tp2 in both Qwen3 pairs below) and GLM under ZeRO-3 (which splits no family's
# switch: GLM-4 runs it under cp2).
SLOW_PAIRS = [("qwen3", "tp2_vocab_parallel_loss_recompute"), ("glm", "pp2_interleaved"),
              ("glm4", "tp2_pp2_zero1"), ("qwen3", "tp2_sequence_parallel"),
              *(("glm4", name) for name in SEQUENCE_LAYOUTS),
              ("olmoe", "tp2_vocab_parallel_loss_recompute")]  # its q/k norms over every head, split by tp
BF16_PAIRS = [("glm4", f"bf16_{name}") for name in SEQUENCE_LAYOUTS]
# The slow tests' runs of two and of four ranks, each group one after another in one torchrun
# (tests/unit/runs_in_one_world.py): (family, layout, extra settings); the default pair keeps a torchrun of its own.
SLOW_WORLD_RUNS = [(family, layout, {}) for family, layout in SLOW_PAIRS + BF16_PAIRS] + \
    [("glm4", "tp2", {"unified_checkpoint": False, "save_steps": 3, "save_total_limit": 0})]
# 8 steps, saved every 3: checkpoints 3 and 6 (none at the last step)
RESUME = dict(COMMON, save_steps=3, save_total_limit=0, unified_checkpoint=False)
SHARDED = {"unified_checkpoint": False, "save_steps": 3, "save_total_limit": 0}  # RESUME's keys beyond COMMON


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_tokenizer_dir):
    """`runs(family, layout, **extra)`: (train_log, out dir) of a run (run on first use) from the
    family's imported checkpoint; `runs.base(family)` the imported checkpoint, `runs.data` the
    prepared data (one tokenizer: every family's data is the same)."""
    root = tmp_path_factory.mktemp("families")
    tokenizer = chat_tokenizer(tiny_tokenizer_dir)
    vocab = -(-(len(tokenizer) + 3) // 8) * 8  # padded rows, and divisible by the tensor-parallel degree

    @functools.cache
    def base(family: str):
        source = save_checkpoint(root / family / "published", tokenizer, family, seed=1, vocab_size=vocab)
        import_base.run(source, root / family / "base")
        return root / family / "base"

    @functools.cache
    def data():
        prepare.run(root / "data", dict(corpus=["builtin:sft_targets"], sft="builtin:attributes", vocab_size=512,
                                        validation_fraction=0.1, num_sft_train=50, num_sft_dev=4, seed=0),
                    tokenizer_dir=base("glm4"))
        return root / "data"

    def out_dir(family: str, layout: str, extra: dict) -> Path:
        return root / family / "_".join([layout, *(f"{k}-{v}" for k, v in sorted(extra.items()))])

    def checkpoint_dir(family: str, layout: str, extra: dict) -> Path:
        return out_dir(family, layout, extra).with_name(out_dir(family, layout, extra).name + "-checkpoints")

    @functools.cache
    def slow_world(world: int):
        entries = {}
        for family, layout, extra in SLOW_WORLD_RUNS:
            nproc, section = LAYOUTS[layout]
            if nproc != world:
                continue
            entries[str(out_dir(family, layout, extra))] = {
                "stage": "pretrain", "data": data(), "out": out_dir(family, layout, extra), "init": base(family),
                "checkpoints": checkpoint_dir(family, layout, extra) if "save_steps" in extra else None,
                "model": model_section({"model_name_or_path": str(base(family))}),
                "section": pretrain_section(world_size=nproc, **{**COMMON, **section, **extra})}
        return start_world(world, entries, root / f"slow_world{world}")

    @functools.cache
    def run(family: str, layout: str, **extra):
        nproc, section = {"reference": REFERENCE, "bf16_reference": BF16_REFERENCE}.get(layout) or LAYOUTS[layout]
        out = out_dir(family, layout, extra)
        if (family, layout, extra) in SLOW_WORLD_RUNS:
            slow_world(nproc).out(str(out))
        else:
            torchrun(nproc, data(), out, {"model_name_or_path": str(base(family))}, init=base(family),
                     world_size=nproc, **{**COMMON, **section, **extra})
        return pd.read_csv(out / "train_log.csv"), out

    run.base, run.data, run.checkpoints = base, data, checkpoint_dir
    return run


def check_hf_logits(model_dir, family: str) -> float:
    """transformers loads `model_dir` as the family's class, with our model's logits (fp32, 1e-5);
    returns the largest difference."""
    from transformers import AutoModelForCausalLM

    from stages.checkpoint.hf import load_pretrained

    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(theirs).__name__ == CLASSES[family]
    ours = load_pretrained(model_dir).eval()
    assert ours.config.model_type == family
    ids = torch.randint(3, theirs.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, got = theirs(input_ids=ids).logits, ours(ids)
    diff = float((got - want).abs().max())
    assert diff <= 1e-5, diff
    return diff


def check_layout(runs, family: str, layout: str, **extra) -> dict[str, float]:
    """The layout's degrees, loss curve, grad norms (test_pretrain.check_layout's tolerances) and
    written weights (WEIGHTS_*) against the single-process run's, and the written model in
    transformers; returns the largest differences seen."""
    ref_log, ref_dir = runs(family, "reference")
    log, out = runs(family, layout, **extra)
    nproc, section = LAYOUTS[layout]
    metrics = json.loads((out / "meta.json").read_text())["metrics"]
    assert (metrics["world_size"], metrics["tensor_parallel_degree"], metrics["pipeline_parallel_degree"]) == \
        (nproc, section.get("tensor_parallel_degree", 1), section.get("pipeline_parallel_degree", 1))
    np.testing.assert_allclose(log["loss"], ref_log["loss"], rtol=1e-5)
    np.testing.assert_allclose(log["grad_norm"], ref_log["grad_norm"], rtol=1e-4)
    assert ref_log["loss"].iloc[-1] < ref_log["loss"].iloc[0]  # it trained
    ref, got = load_state_dict(ref_dir), load_state_dict(out)
    assert sorted(got) == sorted(ref)
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=WEIGHTS_RTOL, atol=WEIGHTS_ATOL, msg=key)
    return {"loss_rel": float(np.max(np.abs(log["loss"] / ref_log["loss"] - 1))),
            "grad_norm_rel": float(np.max(np.abs(log["grad_norm"] / ref_log["grad_norm"] - 1))),
            "weights_abs": max(float((got[k] - ref[k]).abs().max()) for k in ref),
            "hf_logits": check_hf_logits(out, family)}


def _report(family: str, layout: str, diffs: dict[str, float]) -> None:
    print(f"{family} {layout}: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


def test_glm4_tp2_matches_one_process(runs):
    """The default run's pair: GLM-4 (fused gate_up, partial interleaved RoPE, sandwich norms) under tp2."""
    _report(*DEFAULT, check_layout(runs, *DEFAULT))
    ref_log, ref_dir = runs(DEFAULT[0], "reference")
    check_hf_logits(ref_dir, DEFAULT[0])
    meta = json.loads((ref_dir / "meta.json").read_text())
    assert meta["config"]["model"]["model_type"] == "glm4" and meta["parent"] == str(runs.base("glm4"))


@pytest.mark.slow
def test_merge_tp_of_a_sharded_glm4_run_is_the_single_device_model(runs, tmp_path):
    """tp2 written as slices (`unified_checkpoint: false`): each rank's [gate_r | up_r] of the fused
    gate_up_proj is recorded with partition_chunks=2, and merge_tp joins each half; the merged model
    equals the unified tp2 run's weights exactly and loads in transformers."""
    _, sharded = runs("glm4", "tp2", **SHARDED)
    _, unified = runs(*DEFAULT)
    index = json.loads((sharded / "checkpoint_index.json").read_text())
    assert index["format"] == "sharded"
    fused = index["tensors"]["model.layers.0.mlp.gate_up_proj.weight"]
    assert [p["tp_rank"] for p in fused] == [0, 1] and all(p["partition_chunks"] == 2 for p in fused)
    summary = merge(sharded, tmp_path / "merged")
    assert summary["merged_tensor_parallel"] > 0
    merged, want = load_state_dict(tmp_path / "merged"), load_state_dict(unified)
    assert sorted(merged) == sorted(want)
    for key in want:
        assert torch.equal(merged[key], want[key]), key
    check_hf_logits(tmp_path / "merged", "glm4")


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", SLOW_PAIRS)
def test_every_layout_matches_one_process(runs, family, layout):
    _report(family, layout, check_layout(runs, family, layout))


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", BF16_PAIRS)
def test_bf16_sequence_and_context_parallel_layouts_match_one_bf16_process(runs, family, layout):
    """bf16 (DeepSpeed's mixed precision: bf16 weights, fp32 masters) under issue 55's layouts follows the
    family's one-process bf16 run within BF16_RTOL, the tolerance test_pretrain.py gives Llama's."""
    ref_log, _ = runs(family, "bf16_reference")
    log, out = runs(family, layout)
    nproc, section = LAYOUTS[layout]
    metrics = json.loads((out / "meta.json").read_text())["metrics"]
    assert (metrics["world_size"], metrics["context_parallel_degree"]) == \
        (nproc, section.get("context_parallel_degree", 1))
    np.testing.assert_allclose(log["loss"], ref_log["loss"], rtol=BF16_RTOL)
    assert ref_log["loss"].iloc[-1] < ref_log["loss"].iloc[0]
    print(f"{family} {layout}: loss_rel {np.max(np.abs(log['loss'] / ref_log['loss'] - 1)):.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["glm4"])  # the fused slices; Qwen3's tp2 passed too (~70 s more)
def test_killed_tp2_run_resumes_bit_identically(runs, family, tmp_path):
    """A tp2 run with sharded checkpoints (`unified_checkpoint: false`: each rank writes its slices,
    gate_up_proj's [gate_r | up_r] with partition_chunks=2) SIGKILLed after its first checkpoint,
    then started again with the same command, finishes with the uninterrupted run's curve and
    weights bit for bit. The same sharded checkpoint resumes in one process on the single-process
    curve: the store joins each half of the fused slices, and the Adam moments with them."""
    nproc, layout = LAYOUTS["tp2"]
    section = dict(world_size=nproc, **{**RESUME, **layout})
    model, base = {"model_name_or_path": str(runs.base(family))}, runs.base(family)
    # the uninterrupted run: the merge test's sharded tp2 run, with RESUME's settings
    straight, straight_out = runs(family, "tp2", **SHARDED)
    straight_checkpoints = runs.checkpoints(family, "tp2", SHARDED)

    cmd, env = torchrun_command(nproc, runs.data(), tmp_path / "killed", model, tmp_path / "ckpt", base, **section)
    killed = kill_after_checkpoint(cmd, env, tmp_path / "ckpt", 3)
    assert not (tmp_path / "killed").exists()
    resumed = torchrun(nproc, runs.data(), tmp_path / "killed", model, checkpoints=tmp_path / "ckpt", init=base,
                       **section)
    meta = json.loads((tmp_path / "killed" / "meta.json").read_text())["metrics"]
    assert meta["resumed_from_step"] in (3, 6), (killed, meta["resumed_from_step"])
    assert (resumed["loss"] == straight["loss"]).all()
    assert (resumed["grad_norm"] == straight["grad_norm"]).all()
    a, b = StateReader(straight_out), StateReader(tmp_path / "killed")
    assert sorted(a.tensors) == sorted(b.tensors)
    for key in a.tensors:
        assert torch.equal(a.get(key), b.get(key)), key

    checkpoints = complete_checkpoints(next(straight_checkpoints.iterdir()))
    assert [c.name for c in checkpoints] == [checkpoint_name(3), checkpoint_name(6)]
    reader = StateReader(checkpoints[-1])
    assert reader.index["format"] == "sharded"
    fused = [parts for key, parts in reader.tensors.items() if "gate_up_proj" in key]
    assert len(fused) == (3 * 4 if family == "glm4" else 0)  # weight, exp_avg, exp_avg_sq of 4 layers
    assert all(len(parts) == 2 and parts[0]["partition_chunks"] == 2 for parts in fused)
    reader.close()
    reference, _ = runs(family, "reference")
    one_nproc, one = REFERENCE
    single = torchrun(one_nproc, runs.data(), tmp_path / "single", model, checkpoints=straight_checkpoints,
                      init=base, world_size=1, **{**RESUME, **one})
    assert json.loads((tmp_path / "single" / "meta.json").read_text())["metrics"]["resumed_from_step"] == 6
    np.testing.assert_allclose(single["loss"], reference["loss"], rtol=1e-5)
