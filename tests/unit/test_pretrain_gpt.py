"""GPT-2 blocks pretrained on our model (the `gpt-debug` flavour: learned positions, LayerNorm, GELU,
the fused qkv projection split per third by tensor parallelism) in every layout of the training
engine (real torchrun, gloo, fp32), against the one-process run from the same seed on the same
global batch of 8 windows per step; the output is a GPT-2 checkpoint transformers opens as
GPT2LMHeadModel, and a run stopped at a checkpoint resumes bit for bit.

Default run: one process, tp2 and the killed run's resume; `slow` adds pp2 (1F1B), ZeRO-3, tp2 x
pp2 with ZeRO-1 on four processes and merge_tp of sharded slices (pp2 x dp2 ZeRO-1 passed too,
2026-11-26; Llama's tests/unit/test_pretrain.py runs it)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from pretrain_fixtures import killed_and_resumed, make_data_dir, torchrun
from stages.checkpoint.hf import load_pretrained, load_state_dict

pytestmark = pytest.mark.multiproc

MODEL = {"flavour": "gpt-debug", "num_hidden_layers": 4}  # 4 layers: two pipeline stages of two
COMMON = dict(max_steps=8, warmup_steps=2, max_length=32, seed=7, learning_rate=3e-3)
LAYOUTS = {  # name -> (processes, section); micro-batch x accumulation x data parallel = 8
    "tp2": (2, dict(sharding="none", tensor_parallel_degree=2, per_device_train_batch_size=2,
                    gradient_accumulation_steps=4)),
    "pp2_1f1b": (2, dict(sharding="none", pipeline_parallel_degree=2, per_device_train_batch_size=2,
                         gradient_accumulation_steps=4)),
    "sharding_stage3": (2, dict(sharding="stage3", per_device_train_batch_size=2, gradient_accumulation_steps=2)),
    "tp2_pp2_zero1": (4, dict(sharding="stage1", tensor_parallel_degree=2, pipeline_parallel_degree=2,
                              per_device_train_batch_size=2, gradient_accumulation_steps=4)),
}
SLOW = ("pp2_1f1b", "sharding_stage3", "tp2_pp2_zero1")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return make_data_dir(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "out"
    log = torchrun(1, data_dir, out, MODEL, world_size=1, sharding="none", per_device_train_batch_size=2,
                   gradient_accumulation_steps=4, **COMMON)
    return log, out


def test_the_output_is_a_gpt2_checkpoint_transformers_opens(reference):
    log, out = reference
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 64 and config["n_layer"] == 4
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs) is transformers.GPT2LMHeadModel
    ours = load_pretrained(out, families="all").eval()
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
    assert log["loss"].iloc[-1] < log["loss"].iloc[0] - 0.5  # it learns the repeated phrase


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_matches_the_single_process_run(name, data_dir, reference, tmp_path):
    nproc, section = LAYOUTS[name]
    log = torchrun(nproc, data_dir, tmp_path / name, MODEL, world_size=nproc, **section, **COMMON)
    ref_log, ref_dir = reference
    # fp32: only the order of reductions differs (measured ~1e-7 relative)
    np.testing.assert_allclose(log["loss"], ref_log["loss"], rtol=1e-5)
    np.testing.assert_allclose(log["grad_norm"], ref_log["grad_norm"], rtol=1e-4)
    ref, got = load_state_dict(ref_dir), load_state_dict(tmp_path / name)  # GPT-2's names, whatever the layout
    assert sorted(got) == sorted(ref) and "transformer.h.3.attn.c_attn.weight" in got
    # Adam magnifies reduction-order noise where a gradient is near zero (its update m / sqrt(v) is
    # lr-sized whatever the gradient's size): weights differ by a small fraction of one lr step (3e-3)
    # where the loss agrees to 1e-7. Measured max |diff| 3.2e-5 (tp2, block 2's mlp.c_proj, weights
    # ~0.08) on a Xeon with AMX, under 2e-5 on an AMD EPYC; a wrong slice or a missing all-reduce
    # moves them by orders of magnitude more.
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-4, msg=key)


def test_a_killed_tp2_run_resumes_bit_identically(data_dir, tmp_path):
    """tp2, a checkpoint every 4 steps: the run SIGKILLed once checkpoint-4 is complete, started
    again with the same command, ends with the uninterrupted run's losses and weights bit for bit."""
    nproc, section = LAYOUTS["tp2"]
    layout = dict(world_size=nproc, **section, save_steps=4, save_total_limit=0, **COMMON)
    full, resumed, full_dir, resumed_dir = killed_and_resumed(nproc, data_dir, tmp_path, MODEL, **layout)
    assert (resumed["loss"] == full["loss"]).all()
    a, b = load_state_dict(full_dir), load_state_dict(resumed_dir)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoint it resumed from is a plain GPT-2 directory too (its reader translates back)
    (checkpoint,) = [p for p in (tmp_path / "ckpt").glob("*/checkpoint-*") if p.is_dir()]
    assert type(transformers.AutoModelForCausalLM.from_pretrained(checkpoint)) is transformers.GPT2LMHeadModel


@pytest.mark.slow
def test_merge_tp_of_sharded_slices_writes_the_gpt2_checkpoint(data_dir, reference, tmp_path):
    """tp2 with unified_checkpoint: false writes each rank's slices under our names; merge_tp joins
    them (the fused qkv per third) and writes GPT-2's names and Conv1D layout, as the unified run does."""
    from stages.merge_tp import merge

    nproc, section = LAYOUTS["tp2"]
    torchrun(nproc, data_dir, tmp_path / "sharded", MODEL, world_size=nproc, unified_checkpoint=False, **section,
             **COMMON)
    merge(tmp_path / "sharded", tmp_path / "merged")
    ref, got = load_state_dict(reference[1]), load_state_dict(tmp_path / "merged")
    assert sorted(got) == sorted(ref)
    # Adam magnifies reduction-order noise where a gradient is near zero (its update m / sqrt(v) is
    # lr-sized whatever the gradient's size): weights differ by a small fraction of one lr step (3e-3)
    # where the loss agrees to 1e-7. Measured max |diff| 3.2e-5 (tp2, block 2's mlp.c_proj, weights
    # ~0.08) on a Xeon with AMX, under 2e-5 on an AMD EPYC; a wrong slice or a missing all-reduce
    # moves them by orders of magnitude more.
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-4, msg=key)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")) is transformers.GPT2LMHeadModel
