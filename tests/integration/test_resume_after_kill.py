"""Exact resume through Snakemake: the pretrain job is SIGKILLed at random steps, three times, and
after each kill the same `snakemake` command is simply run again. The last run finishes from the
newest complete checkpoint, and the final weights are bit-identical (sha256) to those of an
uninterrupted run of the same recipe (fp32, CPU, 2 ranks with ZeRO-1, asynchronous saving)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import yaml

from workflow_helpers import ROOT, logged_steps, snakemake, weights_sha256

# Slow (about 70 s each): CI runs them beside the SLURM tests, where the machine has time to spare;
# `make test-all` runs them here.
pytestmark = pytest.mark.slow

PRETRAIN = {"seed": 11, "max_steps": 40, "warmup_steps": 3, "max_length": 32, "per_device_train_batch_size": 2,
            "world_size": 2, "sharding": "stage1", "save_steps": 5, "save_total_limit": 2, "async_save": True}
EXPERIMENT = {"model": {"flavour": "debug"}, "data": {"vocab_size": 512, "num_sft_train": 50}, "pretrain": PRETRAIN}




def _run_and_kill_at(workdir: Path, extra: Path, step: int) -> int:
    """Start the pretrain job, SIGKILL its processes once `step` steps are logged; returns the step
    it was killed at. Snakemake itself sees a failed job and exits normally."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "workflow" / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(ROOT / "config" / "config.yaml"), str(extra), "--cores", "2", "results/kill/pretrain"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while logged_steps(workdir, "kill") < step:
        assert proc.poll() is None, f"the job ended before step {step}:\n{proc.stdout.read()[-4000:]}"
        assert time.monotonic() < deadline, "the job did not reach the step in time"
        time.sleep(0.02)
    killed = logged_steps(workdir, "kill")
    for child in psutil.Process(proc.pid).children(recursive=True):
        if "stages.pretrain" in " ".join(child.cmdline()):
            child.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out[-3000:]
    return killed


def test_pretrain_resumes_bit_identically_after_sigkill(tmp_path):
    extra = tmp_path / "kill.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"kill": EXPERIMENT, "straight": EXPERIMENT}}))
    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", "results/straight/pretrain")

    rng = random.Random(2026)
    targets = [rng.randint(2, 12), rng.randint(16, 24), rng.randint(28, 37)]
    killed = [_run_and_kill_at(tmp_path, extra, step) for step in targets]
    assert not (tmp_path / "results" / "kill" / "pretrain").exists()  # no output from a killed job
    checkpoints = tmp_path / "results" / "kill" / "checkpoints" / "pretrain"
    assert any(checkpoints.glob("*/checkpoint-*/checkpoint_complete.json"))

    snakemake(tmp_path, "--configfile", str(extra), "--cores", "2", "results/kill/pretrain")  # the same command
    done, reference = tmp_path / "results" / "kill" / "pretrain", tmp_path / "results" / "straight" / "pretrain"
    meta = json.loads((done / "meta.json").read_text())["metrics"]
    # from a checkpoint the last killed attempt wrote (a save still in flight at the kill is skipped)
    assert meta["resumed_from_step"] % 5 == 0 and meta["resumed_from_step"] > killed[-2], (killed, meta)
    assert weights_sha256(done) == weights_sha256(reference) != {}
    log, ref_log = pd.read_csv(done / "train_log.csv"), pd.read_csv(reference / "train_log.csv")
    assert list(log["step"]) == list(range(1, 41))
    assert (log["loss"] == ref_log["loss"]).all()  # the printed curve too, every step
    # each killed attempt resumed where the one before it had last saved
    run_log = (tmp_path / "results" / "kill" / "logs" / "pretrain.log").read_text()
    assert "resumed at step" in run_log
