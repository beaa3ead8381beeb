"""Full SFT of a transformers-saved GPT-2 checkpoint runs on our model (GPT-2's switches), so it
takes every layout: tp2 (the fused qkv split per third) and pp2 follow the one-process curve, and
the output is a GPT-2 checkpoint transformers opens. LoRA and prefix tuning of GPT-2 keep transformers' model (peft's GPT-2 names);
tests/unit/test_families.py covers them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from sft_fixtures import finetune_section, torchrun_finetune_sft, train_losses, write_toy_data

from checkpoint_fixtures import save_checkpoint
from stages import finetune
from stages.training.families import load_causal_lm

pytestmark = pytest.mark.multiproc

# global batch 8 in every layout; GPT-2's dropouts off so the layouts can agree step by step
SECTION = dict(max_steps=5, warmup_steps=1, learning_rate=1e-3, per_device_train_batch_size=4,
               gradient_accumulation_steps=2)
LAYOUTS = {"tp2": dict(world_size=2, tensor_parallel_degree=2),
           "pp2": dict(world_size=2, pipeline_parallel_degree=2, per_device_train_batch_size=2,
                       gradient_accumulation_steps=4)}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, tiny_tokenizer_dir):
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)
    # untied (pipeline parallelism keeps the embedding and the head on two stages), an even vocabulary
    return save_checkpoint(tmp_path_factory.mktemp("gpt2"), tokenizer, "gpt2", vocab_size=324, n_layer=4,
                           tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, gpt2_dir):
    data = write_toy_data(tmp_path_factory.mktemp("data"))
    out = tmp_path_factory.mktemp("one") / "sft"
    metrics = finetune.run("sft", gpt2_dir, data, out, finetune_section("sft", **SECTION))
    return data, out, metrics


def test_full_sft_of_gpt2_runs_our_model_and_writes_gpt2(gpt2_dir, reference):
    data, out, metrics = reference
    assert type(load_causal_lm(gpt2_dir, families="all")).__name__ == "LlamaForCausalLM"
    assert type(load_causal_lm(gpt2_dir)) is transformers.GPT2LMHeadModel  # adapters' (and the default) model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(theirs) is transformers.GPT2LMHeadModel
    assert json.loads((out / "config.json").read_text())["n_layer"] == 4
    base = transformers.AutoModelForCausalLM.from_pretrained(gpt2_dir)
    assert not torch.equal(theirs.transformer.h[0].attn.c_attn.weight, base.transformer.h[0].attn.c_attn.weight)
    assert metrics["final_loss"] < metrics["first_loss"]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "pp2" else n for n in LAYOUTS])
def test_layout_follows_the_one_process_curve(name, gpt2_dir, reference, tmp_path):
    data, out, _ = reference
    section = finetune_section("sft", **{**SECTION, **LAYOUTS[name]})
    losses = torchrun_finetune_sft(section.world_size, gpt2_dir, data, tmp_path / name, section)
    np.testing.assert_allclose(losses, train_losses(out), rtol=1e-5)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name)) is transformers.GPT2LMHeadModel
