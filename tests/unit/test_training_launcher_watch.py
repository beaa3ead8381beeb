"""stages/training/launcher_watch.py: a rank launched by torchrun (in a session of its own) dies
with its launcher instead of training on as an orphan."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from stages.training.launcher_watch import LAUNCHED_BY_TORCHRUN, exit_with_launcher

ROOT = Path(__file__).resolve().parents[2]
# The "rank": watches its parent, says so, then would sleep for a minute.
RANK = ("import sys, time; from stages.training.launcher_watch import exit_with_launcher; "
        "assert exit_with_launcher(interval_s=0.05) is not None; open(sys.argv[1], 'w').close(); time.sleep(60)")
# The "launcher": starts the rank in a new session (as torchrun does), prints its pid, waits until
# it watches, then dies.
LAUNCHER = ("import os, subprocess, sys, time; "
            f"p = subprocess.Popen([sys.executable, '-c', {RANK!r}, sys.argv[1]], start_new_session=True, "
            f"env=dict(os.environ, {LAUNCHED_BY_TORCHRUN}='test')); print(p.pid, flush=True); "
            "[time.sleep(0.05) for _ in range(1200) if not os.path.exists(sys.argv[1])]; os._exit(0)")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_rank_dies_with_its_launcher(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path / "watching")], env=env,
                              capture_output=True, text=True, timeout=120)
    assert launcher.returncode == 0, launcher.stderr
    rank = int(launcher.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(rank)
    if alive:
        psutil.Process(rank).kill()
    assert not alive, "the rank outlived its launcher"


def test_no_watch_outside_torchrun(monkeypatch):
    monkeypatch.delenv(LAUNCHED_BY_TORCHRUN, raising=False)
    assert exit_with_launcher() is None
