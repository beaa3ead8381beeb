"""Shared by the pretraining tests: a small prepared-data directory, a validated pretrain
section, and a real `torchrun` of the pretrain stage."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from stages.checkpoint.store import COMPLETE, checkpoint_name
from stages.config import check_config
from stages.data.corpus import write_token_files

ROOT = Path(__file__).resolve().parents[2]


def _fp16_reason() -> str | None:
    from stages.training.capabilities import fp16_unsupported_reason

    return fp16_unsupported_reason()


# fp16 needs a GPU or a CPU with oneDNN fp16 kernels (not AMD EPYC): skipped elsewhere, with the reason.
requires_fp16 = pytest.mark.skipif(_fp16_reason() is not None, reason=f"fp16: {_fp16_reason()}")


# bf16 training keeps fp32 master weights and Adam moments and sums gradients over data parallel in
# fp32 in every layout (stages.training.deepspeed_engine). The fp32 layouts agree to ~1e-7 (reduction
# order); in bf16 the order of the bf16 roundings differs by layout (TP's partial sums, the
# data-parallel split of a micro-batch), so loss curves spread by about bf16's unit roundoff
# (2^-9 = 2e-3): test_pretrain's 10 steps measured at most 1.4e-3 between layouts (tp2, tp2_pp2) and
# 9.7e-4 between one process in bf16 and in fp32 (2-core Intel Xeon with AMX, 2026-11-28). 2^-8 = 3.9e-3 keeps
# a 2.8x margin over that and catches the 1.6% lag the layouts without ZeRO had while DeepSpeed's
# FP16_UnfusedOptimizer counted a step on zero gradients at start-up (issue 50).
BF16_RTOL = 2.0 ** -8


def pretrain_section(model: dict | None = None, **overrides):
    """A validated `pretrain` section (checked against the `model` section's flavour, when given)."""
    cfg = check_config({"experiments": {"t": {"pretrain": overrides, **({"model": model} if model else {})}}})
    return cfg["experiments"]["t"]["pretrain"]


def model_section(model: dict | None = None) -> dict:
    """A validated `model` section (the `debug` flavour unless `model` says otherwise)."""
    return check_config({"experiments": {"t": {"model": model or {"flavour": "debug"}}}})["experiments"]["t"]["model"]


def make_data_dir(out: Path) -> Path:
    """A prepared data directory whose text is a repeated random phrase: quickly learnable."""
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, 300, size=37).tolist()
    docs = [phrase * 20 for _ in range(8)]
    write_token_files(out, {"train": docs, "validation": docs[:1]}, vocab_size=320, bos_id=1, eos_id=2, pad_id=0)
    return out


def torchrun_command(nproc: int, data_dir: Path, out: Path, model: dict | None = None,
                     checkpoints: Path | None = None, init: Path | None = None,
                     **section) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `torchrun` (below), for a caller that starts it itself."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
           "-m", "stages.pretrain", "--data", str(data_dir), "--out", str(out),
           "--model-config", json.dumps(model_section(model)),
           "--config", json.dumps(pretrain_section(model, **section))]
    if checkpoints is not None:
        cmd += ["--checkpoints", str(checkpoints)]
    if init is not None:  # continued pretraining from this imported checkpoint
        cmd += ["--init", str(init)]
    return cmd, dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def torchrun(nproc: int, data_dir: Path, out: Path, model: dict | None = None, checkpoints: Path | None = None,
             init: Path | None = None, **section) -> pd.DataFrame:
    """Run the pretrain stage on `nproc` gloo ranks (from the imported checkpoint `init`, or the
    `model` section's random-init flavour); returns its train_log.csv."""
    cmd, env = torchrun_command(nproc, data_dir, out, model, checkpoints, init, **section)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return pd.read_csv(out / "train_log.csv")


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid:
            found.append(int(stat.parent.name))
    return found


def kill_after_checkpoint(cmd: list[str], env: dict[str, str], ckpt, step: int) -> bool:
    """Start the run and SIGKILL it, torchrun and its ranks, once checkpoint-`step` is complete; returns
    whether it was still running then. The ranks are killed themselves: torchrun starts them in
    sessions of their own, and left to stages/training/launcher_watch.py they would train on for up
    to half a second (a few of moe-debug's steps, another checkpoint). A run that outran the poll is
    left as a kill right after that checkpoint would have left it: no output, no later checkpoint."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(ckpt.glob(f"*/{checkpoint_name(step)}/{COMPLETE}")):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {checkpoint_name(step)}:\n"
                                 f"{proc.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, f"no {checkpoint_name(step)} in time"
        time.sleep(0.01)
    killed = proc.poll() is None
    if killed:
        for rank in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(rank, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's own group: this test started it
    proc.communicate(timeout=60)
    if not killed:
        out = Path(cmd[cmd.index("--out") + 1])
        shutil.rmtree(out)
        for later in ckpt.glob("*/checkpoint-*"):
            if later.name > checkpoint_name(step):
                shutil.rmtree(later)
    return killed


def killed_and_resumed(nproc: int, data_dir: Path, tmp_path: Path, model: dict, **layout) -> tuple:
    """The uninterrupted run and the same command SIGKILLed once checkpoint-4 is complete, then started
    again (it must resume there): their train_logs and output dirs, (full, resumed, full_dir, resumed_dir)."""
    full = torchrun(nproc, data_dir, tmp_path / "full", model, checkpoints=tmp_path / "ckpt_full", **layout)
    cmd, env = torchrun_command(nproc, data_dir, tmp_path / "killed", model, tmp_path / "ckpt", **layout)
    kill_after_checkpoint(cmd, env, tmp_path / "ckpt", 4)
    assert not (tmp_path / "killed").exists()
    resumed = torchrun(nproc, data_dir, tmp_path / "killed", model, checkpoints=tmp_path / "ckpt", **layout)
    assert json.loads((tmp_path / "killed" / "meta.json").read_text())["metrics"]["resumed_from_step"] == 4
    return full, resumed, tmp_path / "full", tmp_path / "killed"
