"""Fault catalog, weights: a broken weight file in an artifact stops the stage that reads it, through
its real CLI, with an error naming the file, and the stage changes nothing in that directory.

One row per fault: what is broken, how, which stage CLI reads it, and the regex its last stderr
line (the exception) must match. Self-contained: the artifacts are built here, as the stages write
them (weights, tokenizer, then meta.json recording the weights' sizes and sha256)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
STAGE_TIMEOUT_S = 300


# -- the artifacts -------------------------------------------------------------------------------------
def _tokenizer(out: Path) -> Path:
    """A ~150-token byte-level BPE with `<pad>`=0, `<s>`=1, `</s>`=2, saved in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the colour of the apple is red", "copy: alpha beta gamma"] * 8, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """`sft/` (a debug Llama in HF layout, stage finetune-sft), `sharded/` (the same weights in
    shards with an index, no meta.json: a user's checkpoint), `lora/` (a LoRA adapter of `sft`,
    stage finetune-lora) and `data/` (enough for evaluate to reach the model)."""
    import peft
    import transformers

    from stages.checkpoint.hf import copy_tokenizer, save_config, save_pretrained, save_state_dict
    from stages.checkpoint.meta import write_meta
    from stages.model import build_model, config_for_flavour

    root = tmp_path_factory.mktemp("weight_faults")
    tokenizer = _tokenizer(root / "tokenizer")
    vocab = len(transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer))
    model = build_model(config_for_flavour("debug", vocab_size=vocab, bos_token_id=1, eos_token_id=2,
                                           pad_token_id=0), seed=0)
    (root / "sft").mkdir()
    save_pretrained(model, root / "sft", tokenizer_dir=tokenizer)
    write_meta(root / "sft", stage="finetune-sft", config={}, parent=None, seed=0, metrics={})

    (root / "sharded").mkdir()
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_state_dict(state, root / "sharded", max_shard_bytes=sum(t.numel() * 4 for t in state.values()) // 3)
    save_config(model.config, root / "sharded")
    copy_tokenizer(tokenizer, root / "sharded")

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "sft", dtype=torch.float32)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))
    (root / "lora").mkdir()
    lora.save_pretrained(root / "lora")
    copy_tokenizer(tokenizer, root / "lora")
    write_meta(root / "lora", stage="finetune-lora", config={}, parent=root / "sft", seed=0, metrics={})

    (root / "data" / "sft").mkdir(parents=True)
    (root / "data" / "sft" / "dev.json").write_text('{"src": "copy: alpha", "tgt": "alpha"}\n')
    return root


# -- ways to break a directory ---------------------------------------------------------------------------
def flip_byte(name: str) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = bytearray((directory / name).read_bytes())
        data[-5] ^= 0x10  # in the last tensor's bytes: the header stays valid
        (directory / name).write_bytes(bytes(data))
    return apply


def truncate(name: str, keep: float = 0.5, drop_meta: bool = False) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[:int(len(data) * keep)])
        if drop_meta:  # as a user's own directory: no sizes or sha256 recorded
            (directory / "meta.json").unlink()
    return apply


def pickle_as(name: str, remove: str | None = None) -> Callable[[Path], None]:
    """torch.save the directory's tensors to `name` (a pickle), deleting `remove` and meta.json."""
    def apply(directory: Path) -> None:
        from safetensors.torch import load_file

        source = next(directory.glob("*.safetensors"))
        tensors = {k: v.clone() for k, v in load_file(str(source)).items()}  # not the mmap it overwrites
        for path in (directory / (remove or ""), directory / "meta.json"):
            if path.is_file():
                path.unlink()
        torch.save(tensors, directory / name)
    return apply


def overwrite(name: str, content: bytes) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        (directory / name).write_bytes(content)
        (directory / "meta.json").unlink()
    return apply


def delete(name: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).unlink()


# -- the stages that read them ---------------------------------------------------------------------------
def evaluate(model: Path, out: Path, root: Path) -> list[str]:
    return ["stages.evaluate", "--model", str(model), "--data", str(root / "data"), "--out", str(out / "eval.json"),
            "--variant", "x"]


def quantize(model: Path, out: Path, root: Path) -> list[str]:
    return ["stages.quantize", "--source", str(model), "--out", str(out), "--variant", "wint8",
            "--config", json.dumps({"group_size": -1})]


def export(model: Path, out: Path, root: Path) -> list[str]:
    return ["stages.export", "--model", str(model), "--out", str(out),
            "--config", json.dumps({"opset_version": 18, "rtol": 1e-3, "min_top1_agreement": 0.99})]


def merge(adapter: Path, out: Path, root: Path) -> list[str]:
    return ["stages.merge", "--adapter", str(adapter), "--out", str(out)]


def import_base(model: Path, out: Path, root: Path) -> list[str]:
    return ["stages.import_base", "--source", str(model), "--out", str(out), "--no-parity-check"]


@dataclass(frozen=True)
class Fault:
    description: str
    artifact: str  # the directory of `artifacts` that is broken (a copy of it)
    breaks: Callable[[Path], None]
    stage: Callable[[Path, Path, Path], list[str]]  # (artifact, out, artifacts root) -> python -m argv
    error: str  # regex the exception line must match ({dir}: the broken directory)


FAULTS = [
    Fault("a flipped byte in a fine-tuned model", "sft", flip_byte("model.safetensors"), evaluate,
          r"error: {dir}/model.safetensors has sha256 \w+\.\.\., {dir}/meta.json \(written by stage "
          r"'finetune-sft'\) records \w+\.\.\. \(corrupted or changed\).*delete {dir} and rerun snakemake"),
    Fault("a truncated, recorded model.safetensors", "sft", truncate("model.safetensors"), quantize,
          r"error: {dir}/model.safetensors has \d+ bytes, .* records \d+ \(truncated or replaced\)"),
    Fault("a truncated model.safetensors, nothing recorded", "sft",
          truncate("model.safetensors", drop_meta=True), evaluate,
          r"error: {dir}/model.safetensors: not a readable safetensors file \(truncated: the header "
          r"describes \d+ bytes, the file has \d+\)"),
    Fault("a pickle renamed model.safetensors", "sft", pickle_as("model.safetensors"), export,
          r"error: {dir}/model.safetensors: not a safetensors file but a pickle"),
    Fault("garbage in model.safetensors", "sft", overwrite("model.safetensors", b"\x00garbage" * 64), quantize,
          r"error: {dir}/model.safetensors: not a readable safetensors file \(header too large"),
    Fault("pytorch_model.bin instead of model.safetensors", "sft",
          pickle_as("pytorch_model.bin", remove="model.safetensors"), evaluate,
          r"error: {dir}/pytorch_model.bin: the weights of {dir} are pickle files .*"
          r"save_pretrained\(dir, safe_serialization=True\)"),
    Fault("a shard the index lists is missing", "sharded", delete("model-00002-of-00004.safetensors"), import_base,
          r"error: {dir}/model.safetensors.index.json lists shard model-00002-of-00004.safetensors .* "
          r"is missing"),
    Fault("a flipped byte in a LoRA adapter", "lora", flip_byte("adapter_model.safetensors"), merge,
          r"error: {dir}/adapter_model.safetensors has sha256 .*'finetune-lora'"),
    Fault("adapter_model.bin instead of adapter_model.safetensors", "lora",
          pickle_as("adapter_model.bin", remove="adapter_model.safetensors"), evaluate,
          r"error: {dir}/adapter_model.bin: the adapter weights are a pickle file.*"
          r"save_pretrained\('{dir}', safe_serialization=True\)"),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.description for f in FAULTS])
def test_a_broken_weight_file_stops_the_stage_naming_it(fault, artifacts, tmp_path, snapshot):
    broken = tmp_path / fault.artifact
    shutil.copytree(artifacts / fault.artifact, broken)
    fault.breaks(broken)
    before = snapshot(broken)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", *fault.stage(broken, out, artifacts)], cwd=REPO,
                          capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-2000:]  # an input error (stages.errors), not a crash
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert re.search(fault.error.format(dir=broken), last), last
    assert snapshot(broken) == before  # the stage read, and changed nothing
    assert not out.exists() or not any(out.iterdir())
