"""Continued pretraining (`pretrain.enabled: true` with a starting checkpoint): the pretrain stage
starts from the checkpoint's weights, on data tokenized by its own tokenizer, and writes a model
that keeps the source's config fields and records where it came from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from checkpoint_fixtures import chat_tokenizer, save_checkpoint
from stages import import_base, prepare
from stages.config import check_config
from stages.data.corpus import load_split
from stages.training.batches import WindowSampler
from stages.training.distributed import without_world

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])  # GPT-2: our model under GPT-2's names and layout
def test_continued_pretraining_starts_from_the_checkpoint(tmp_path, tiny_tokenizer_dir, model_type):
    # GPT2Config's dropouts default to 0.1 and are honoured in training: off, so step 1 is comparable
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if model_type == "gpt2" else {}
    source = save_checkpoint(tmp_path / "published", chat_tokenizer(tiny_tokenizer_dir), model_type, **no_dropout)
    import_base.run(source, tmp_path / "base")
    prepare.run(tmp_path / "data", dict(corpus=["builtin:sft_targets"], sft="builtin:attributes", vocab_size=512,
                validation_fraction=0.1, num_sft_train=200, num_sft_dev=4, seed=0), tokenizer_dir=tmp_path / "base")
    exp = check_config({"experiments": {"x": {"model": {"model_name_or_path": str(source)}, "pretrain": {
        "enabled": True, "world_size": 1, "sharding": "none", "max_steps": 3, "warmup_steps": 0,
        "max_length": 32, "per_device_train_batch_size": 2, "learning_rate": 1e-3}}}})["experiments"]["x"]
    cmd = [sys.executable, "-m", "stages.pretrain", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
           "--model-config", json.dumps(exp["model"]), "--config", json.dumps(exp["pretrain"]),
           "--init", str(tmp_path / "base")]
    env = without_world(os.environ)  # this session's world must not leak
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]

    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["parent"] == str(tmp_path / "base") and meta["config"]["model"]["model_type"] == model_type
    assert "flavour" not in meta["config"]["model"]
    # The first step's loss is the checkpoint's own loss on the first batch, as transformers computes it.
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    tokens, _ = load_split(tmp_path / "data", "train")
    (ids, labels), = WindowSampler(tokens, 32, exp["pretrain"]["seed"]).micro_batches(0, 2, 0, 1, 2)
    with torch.no_grad():
        want = base(input_ids=ids, labels=labels).loss.item()
    assert meta["metrics"]["first_loss"] == pytest.approx(want, rel=1e-5)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vocab_size"] == base.config.vocab_size
    assert config["rope_parameters"]["rope_theta"] == 100000.0 if model_type == "llama" else config["n_embd"] == 64
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(trained) is type(base)
    assert not torch.equal(trained.lm_head.weight, base.lm_head.weight)
