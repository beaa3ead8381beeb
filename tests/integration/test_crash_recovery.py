"""Recovery from a crash of Snakemake itself, as the README promises: the whole process group of
`snakemake` is SIGKILLed during pretraining (what a node failure or the OOM killer taking the
group does), after at least one checkpoint is complete. Then `snakemake --unlock` and the same
command (the default profile supplies `rerun-incomplete`) resume training from the newest complete
checkpoint and end with weights bit-identical (sha256) to an uninterrupted run of the same config in
another working directory (fp32, CPU, 2 ranks with ZeRO-1, asynchronous saving).

torchrun starts its workers in a session of their own, so killing Snakemake's process group does
not reach them by itself: they must notice that their launcher is gone and stop (see
`stages.training.parent_watch`), or they would go on training beside the resumed run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from workflow_helpers import ROOT, snakemake, weights_sha256

pytestmark = pytest.mark.slow

SAVE_STEPS = 4
PRETRAIN = {"seed": 5, "max_steps": 40, "warmup_steps": 2, "max_length": 32, "per_device_train_batch_size": 2,
            "world_size": 2, "sharding": "stage1", "save_steps": SAVE_STEPS, "save_total_limit": 2,
            "async_save": True}
# A small corpus of our own: prepare trains its tokenizer in a second instead of on all of pydoc.
EXPERIMENT = {"model": {"flavour": "debug"},
              "data": {"corpus": ["corpus/*.txt", "builtin:sft_targets"], "vocab_size": 384, "num_sft_train": 60,
                       "num_sft_dev": 8},
              "pretrain": PRETRAIN}
TARGET = "results/crash/pretrain"


def _setup(workdir: Path) -> Path:
    """Write the corpus and the experiment file into `workdir`; returns the experiment file."""
    (workdir / "corpus").mkdir(parents=True)
    from pydoc_data.topics import topics

    for key in sorted(topics)[:12]:
        (workdir / "corpus" / f"{key}.txt").write_text(topics[key], encoding="utf-8")
    extra = workdir / "crash.yaml"
    extra.write_text(yaml.safe_dump({"experiments": {"crash": EXPERIMENT}}))
    return extra


def _command(workdir: Path, extra: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "-s", str(ROOT / "workflow" / "Snakefile"), "--directory", str(workdir),
            "--configfile", str(ROOT / "config" / "config.yaml"), str(extra), *args]


def _complete_checkpoints(workdir: Path) -> list[Path]:
    run_dirs = workdir / "results" / "crash" / "checkpoints" / "pretrain"
    return sorted(run_dirs.glob("*/checkpoint-*/checkpoint_complete.json"))


def _processes_in(workdir: Path) -> list[psutil.Process]:
    """Live processes whose working directory is `workdir` (Snakemake's jobs run there)."""
    found = []
    for p in psutil.process_iter(["cwd"]):
        try:
            if p.info["cwd"] and Path(p.info["cwd"]) == workdir and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found



def _env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT))


def _kill_group_after_first_checkpoint(workdir: Path, extra: Path) -> float:
    """Run `snakemake --cores 2 TARGET` in a session of its own and SIGKILL the whole process group
    as soon as a checkpoint is complete; returns the seconds it ran."""
    log = (workdir / "killed_snakemake.out").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen(_command(workdir, extra, "--cores", "2", TARGET), cwd=ROOT, env=_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not _complete_checkpoints(workdir):
            assert proc.poll() is None, (f"snakemake ended ({proc.returncode}) before a checkpoint was complete:\n"
                                         f"{(workdir / 'killed_snakemake.out').read_text()[-4000:]}")
            assert time.monotonic() - t0 < 600, "no complete checkpoint within 10 minutes"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the session leader's pid is the group id
        proc.wait()
        log.close()
    return time.monotonic() - t0


def test_snakemake_process_group_sigkill_resumes_bit_identically(tmp_path):
    crashed, straight = tmp_path / "crashed", tmp_path / "straight"
    extra_crashed, extra_straight = _setup(crashed), _setup(straight)

    t0 = time.monotonic()
    # The uninterrupted reference runs meanwhile, in its own working directory.
    reference_run = subprocess.Popen(_command(straight, extra_straight, "--cores", "2", TARGET), cwd=ROOT, env=_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ran = _kill_group_after_first_checkpoint(crashed, extra_crashed)
    # The training ranks (own session, under torchrun) must follow their launcher within a second
    # or so; left alive they would finish the run (40 steps take seconds) and write its output.
    deadline = time.monotonic() + 15
    while (left := _processes_in(crashed)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the killed run still alive: {[p.cmdline() for p in left]}"
    assert not (crashed / TARGET).exists(), "the killed run's ranks went on and finished it"
    saved = [int(p.parent.name.split("-")[1]) for p in _complete_checkpoints(crashed)]
    assert saved and max(saved) < PRETRAIN["max_steps"]
    assert any((crashed / ".snakemake" / "locks").iterdir())  # what --unlock is for

    # What the README tells the user to do: unlock, then the same command.
    snakemake(crashed, "--configfile", str(extra_crashed), "--unlock")
    t_resume = time.monotonic()
    snakemake(crashed, "--configfile", str(extra_crashed), "--cores", "2", TARGET)
    t_resumed = time.monotonic()
    out, _ = reference_run.communicate(timeout=900)
    assert reference_run.returncode == 0, out[-4000:]
    print(f"killed after {ran:.1f} s (complete checkpoints {saved}); resumed run {t_resumed - t_resume:.1f} s; "
          f"total {time.monotonic() - t0:.1f} s")

    done, reference = crashed / TARGET, straight / TARGET
    resumed = json.loads((done / "meta.json").read_text())["metrics"]["resumed_from_step"]
    assert resumed == max(saved), (resumed, saved)
    run_log = (crashed / "results" / "crash" / "logs" / "pretrain.log").read_text()
    assert f"pretrain: resumed at step {resumed} of {PRETRAIN['max_steps']}" in run_log
    assert weights_sha256(done) == weights_sha256(reference) != {}
    logs = [[row.split(",")[:2] for row in (d / "train_log.csv").read_text().splitlines()[1:]]
            for d in (done, reference)]
    assert [int(step) for step, _ in logs[0]] == list(range(1, PRETRAIN["max_steps"] + 1))
    assert logs[0] == logs[1]  # the printed loss curve too, every step
