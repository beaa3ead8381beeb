"""LoRA and prefix tuning in parallel layouts (LoRA tp2, dp2 x ZeRO-2 and cp2 on packed rows, prefix dp2 x ZeRO-1,
tp2 and cp2 x ZeRO-1, a prefix projection under dp2 x ZeRO-3) on the training engine (real torchrun, gloo; the
layouts one after another in one torchrun) follow the one-process run of the same engine: same
adapter init, same global batch of 8 examples per step, fp32, loss curve within 1e-5 relative; the
tp2 LoRA adapter is peft's whole-tensor adapter (equal to the one-process adapter within 1e-5) and,
merged, gives the unmerged model's logits. In bf16, one-process LoRA (ZeRO off) and dp2 x ZeRO-1,
and one-process prefix tuning, follow the fp32 curve within BF16_RTOL."""

from __future__ import annotations

import csv
import json

import peft
import pytest
import torch
from safetensors.torch import load_file
from pretrain_fixtures import BF16_RTOL
from runs_in_one_world import start_world
from sft_fixtures import finetune_section, train_losses, write_toy_data
from transformers import AutoModelForCausalLM

from stages import finetune, merge

pytestmark = pytest.mark.multiproc

RECIPE = {"lora": ("lora", dict(learning_rate=1e-2, lora_rank=4, target_modules="all-linear")),
          "lora_bf16": ("lora", dict(learning_rate=1e-2, lora_rank=4, target_modules="all-linear", bf16=True)),
          # packed rows, evaluated every 2 steps with greedy generation (the dev metrics compared too)
          "lora_packed": ("lora", dict(learning_rate=1e-2, lora_rank=4, target_modules="all-linear", packing=True,
                                       eval_steps=2, eval_with_do_generation=True)),
          "prefix": ("prefix", dict(learning_rate=1e-1, num_prefix_tokens=4)),
          "prefix_bf16": ("prefix", dict(learning_rate=1e-1, num_prefix_tokens=4, bf16=True)),
          "prefix_projection": ("prefix", dict(learning_rate=1e-2, num_prefix_tokens=4, prefix_projection=True,
                                               prefix_projection_hidden_size=16))}
LAYOUTS = {  # name -> (recipe, layout)
    "lora_tp2": ("lora", dict(world_size=2, tensor_parallel_degree=2, per_device_train_batch_size=4,
                              gradient_accumulation_steps=2)),
    "lora_dp2_zero2": ("lora", dict(world_size=2, sharding="stage2", per_device_train_batch_size=4)),
    "lora_bf16_dp2_zero1": ("lora_bf16", dict(world_size=2, sharding="stage1", per_device_train_batch_size=4)),
    "prefix_dp2": ("prefix", dict(world_size=2, sharding="stage1", per_device_train_batch_size=4)),
    "prefix_tp2": ("prefix", dict(world_size=2, tensor_parallel_degree=2, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2)),
    "prefix_projection_dp2_zero3": ("prefix_projection", dict(world_size=2, sharding="stage3",
                                                              per_device_train_batch_size=4)),
    # context parallelism: both ranks read the same 4 x 2 examples, each learns its half of their tokens
    "lora_packed_cp2": ("lora_packed", dict(world_size=2, context_parallel_degree=2, per_device_train_batch_size=4,
                                            gradient_accumulation_steps=2)),
    "prefix_cp2_zero1": ("prefix", dict(world_size=2, context_parallel_degree=2, sharding="stage1",
                                        per_device_train_batch_size=4, gradient_accumulation_steps=2)),
    "lora_packed_cp2_ulysses": ("lora_packed", dict(world_size=2, context_parallel_degree=2,
                                                    context_parallel_mode="ulysses", per_device_train_batch_size=4,
                                                    gradient_accumulation_steps=2)),
}


def section(recipe: str, **layout) -> dict:
    method, settings = RECIPE[recipe]
    return finetune_section(method, max_steps=5, warmup_steps=1, **settings, **layout)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return write_toy_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def references(tmp_path_factory, debug_model_dir, data_dir):
    """recipe -> output dir of the one-process run (in this process, on the same engine)."""
    root = tmp_path_factory.mktemp("reference")
    for recipe, (method, _) in RECIPE.items():
        finetune.run(method, debug_model_dir, data_dir, root / recipe,
                     section(recipe, per_device_train_batch_size=4, gradient_accumulation_steps=2))
    return {recipe: root / recipe for recipe in RECIPE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, debug_model_dir, data_dir):
    """layout -> output dir of its run: every layout has two ranks, so all run one after another in
    one torchrun (tests/unit/runs_in_one_world.py)."""
    root = tmp_path_factory.mktemp("layouts")
    assert {layout["world_size"] for _, layout in LAYOUTS.values()} == {2}
    world = start_world(2, {name: {"stage": "finetune", "method": RECIPE[recipe][0], "model": debug_model_dir,
                                   "data": data_dir, "out": root / name, "section": dict(section(recipe, **layout))}
                            for name, (recipe, layout) in LAYOUTS.items()}, root / "world")
    return {name: world.out(name) for name in LAYOUTS}


@pytest.mark.parametrize("name", [name for name, (recipe, _) in LAYOUTS.items() if not recipe.endswith("bf16")])
def test_layout_follows_the_one_process_curve(name, runs, references):
    recipe = LAYOUTS[name][0]
    curve, reference = train_losses(runs[name]), train_losses(references[recipe])
    assert len(curve) == len(reference) == 5 and reference[-1] < reference[0]
    assert curve == pytest.approx(reference, rel=1e-5)
    ours, theirs = load_file(runs[name] / "adapter_model.safetensors"), load_file(references[recipe] / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys()
    for key in ours:  # whole tensors under peft's names, whatever the layout
        assert ours[key].shape == theirs[key].shape
        assert torch.allclose(ours[key], theirs[key], atol=1e-5, rtol=1e-4), key


@pytest.mark.parametrize("name", ["lora_packed_cp2", "lora_packed_cp2_ulysses"])
def test_context_parallel_dev_metrics_equal_the_one_process_run(runs, references, name):
    """The dev loss (each rank's share of the tokens, summed over the group) and the greedy answers
    (whole sequences on every rank) of a cp2 run are the one-process run's."""
    ours = json.loads((runs[name] / "meta.json").read_text())["metrics"]
    theirs = json.loads((references["lora_packed"] / "meta.json").read_text())["metrics"]
    assert ours["dev_loss"] == pytest.approx(theirs["dev_loss"], rel=1e-5)
    assert ours["dev_exact_match"] == theirs["dev_exact_match"] and ours["dev_rouge_l"] == theirs["dev_rouge_l"]
    def evaluations(out):
        return [float(row["eval_loss"]) for row in csv.DictReader((out / "train_log.csv").open()) if row["eval_loss"]]

    logged, reference = evaluations(runs[name]), evaluations(references["lora_packed"])
    assert len(logged) == len(reference) >= 2
    assert logged == pytest.approx(reference, rel=1e-5)


def test_bf16_lora_keeps_fp32_masters_in_one_process_and_under_zero(runs, references):
    """A one-rank bf16 LoRA job (ZeRO off) and a two-rank ZeRO-1 one run one recipe: fp32 masters
    and Adam moments, gradients summed in fp32; both follow the fp32 curve within BF16_RTOL."""
    fp32, one = train_losses(references["lora"]), train_losses(references["lora_bf16"])
    assert one == pytest.approx(fp32, rel=BF16_RTOL)
    assert train_losses(runs["lora_bf16_dp2_zero1"]) == pytest.approx(one, rel=BF16_RTOL)


def test_bf16_prefix_tuning_in_one_process_follows_its_fp32_curve(references):
    assert train_losses(references["prefix_bf16"]) == pytest.approx(train_losses(references["prefix"]), rel=BF16_RTOL)


def test_tp2_adapter_merges_to_the_unmerged_logits(runs, debug_model_dir, tmp_path):
    adapter = runs["lora_tp2"]
    merge.run(adapter, tmp_path / "merged", base_dir=debug_model_dir)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(debug_model_dir, dtype=torch.float32)
    with torch.no_grad():
        unmerged = peft.PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)(input_ids=ids).logits
    assert torch.allclose(merged, unmerged, atol=1e-5, rtol=1e-5)
