"""Helpers for the finetune / merge / adapter tests: toy SFT data and filled config sections.

Not a conftest: test modules import these functions directly (pytest puts tests/unit on sys.path).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from runs_in_one_world import torchrun_env

from stages.config import check_config
from stages.data.sft import SftRecord, write_sft_file
from stages.sections import FINETUNE, SftSettings

# A trivially learnable mapping: the target is a fixed function of one word of the prompt.
_COLOURS = {"apple": "red", "sky": "blue", "grass": "green", "banana": "yellow", "plum": "purple",
            "snow": "white", "coal": "black", "orange": "orange"}
_TEMPLATES = ["what colour is the {}?", "the colour of the {} is", "question: {} colour",
              "colour of {}", "{} is what colour?", "the {}, what colour is it?", "{}: colour"]


def toy_records() -> list[SftRecord]:
    """56 single-round records (8 objects x 7 prompt templates)."""
    return [SftRecord(src=[t.format(obj)], tgt=[colour]) for t in _TEMPLATES for obj, colour in _COLOURS.items()]


def write_toy_data(data_dir: Path) -> Path:
    """prepare's SFT layout: data_dir/sft/train.json (48 records) and dev.json (8 records)."""
    records = toy_records()
    write_sft_file(data_dir / "sft" / "train.json", records[:48])
    write_sft_file(data_dir / "sft" / "dev.json", records[48:])
    return data_dir


def finetune_section(method: str, **overrides) -> SftSettings:
    """The `finetune.<method>` section (typed) with schema defaults, small-run settings and `overrides`."""
    small = dict(max_steps=30, warmup_steps=2, per_device_train_batch_size=8, src_length=16,
                 max_length=24, seed=0)
    if method == "lora":
        small.update(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    if method == "prefix":
        small.update(num_prefix_tokens=4)
    small.update(overrides)
    config = check_config({"experiments": {"t": {"finetune": {method: small}}}})
    return FINETUNE[method].of(config["experiments"]["t"]["finetune"][method])


ROOT = Path(__file__).resolve().parents[2]


def train_losses(out_dir: Path) -> list[float]:
    """The loss column of a training stage's train_log.csv."""
    with open(Path(out_dir) / "train_log.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def torchrun_finetune_sft(nproc: int, model_dir: Path, data_dir: Path, out: Path, config: dict,
                          checkpoints: Path | None = None, method: str = "sft") -> list[float]:
    """`python -m stages.finetune --method <method>` on `nproc` gloo ranks (real torchrun); returns
    the losses of its train_log.csv."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
           "-m", "stages.finetune", "--method", method, "--model", str(model_dir), "--data", str(data_dir),
           "--out", str(out), "--config", json.dumps(dict(config))]
    if checkpoints is not None:
        cmd += ["--checkpoints", str(checkpoints)]
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return train_losses(out)


def signal_after(rows: int, train_log: Path, signum: int) -> threading.Thread:
    """A thread that sends `signum` to this process once `train_log` has `rows` steps logged."""
    def wait_and_send():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if len(train_log.read_text().splitlines()) - 1 >= rows:
                    os.kill(os.getpid(), signum)
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.002)

    thread = threading.Thread(target=wait_and_send, daemon=True)
    thread.start()
    return thread
