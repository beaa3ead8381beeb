"""The fault catalog: what a user can get wrong, and what the pipeline answers.

One case = one bad input or one fault (a malformed data file, a missing path, a corrupt
checkpoint, a config typo, a killed process), run the way a user runs the pipeline (a stage CLI,
`python -m stages.<verb>`, or `snakemake`, in a subprocess), and two promises checked:
- the command fails with a message that names the culprit (the file and line, or the config key)
  and the fix: a regex on its output;
- earlier results are unchanged: a snapshot (`snapshot`: every file's sha256, every directory)
  of the working directory's results taken before the command equals the one taken after, so a
  failed run leaves neither a half-written output nor a damaged earlier one.

Files, one per area, each self-contained apart from these fixtures:
- test_data_faults.py: corpus and SFT files (encoding, JSON, fields, empty, extensions, paths);
- test_weight_faults.py: checkpoints and weights;
- test_config_faults.py: the experiment config.

Every launch costs seconds of imports (torch, transformers, Snakemake), so a case goes through
the cheapest command that meets the fault as a user would: `snakemake -n` for what is checked
when the workflow is parsed, the stage CLI for what only the stage reads; real Snakemake runs
are marked slow.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]


def snapshot_tree(root: str | os.PathLike, skip: tuple[str, ...] = (".snakemake",)) -> dict[str, str]:
    """{path relative to `root`: sha256 of the file, or "<dir>"} for everything under `root`,
    hidden names included (a leftover `.data.x1y2.tmp` counts); top-level names in `skip` (the
    bookkeeping Snakemake writes even for a dry run) are left out."""
    root = Path(root)
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if here == root:
            dirnames[:] = [d for d in dirnames if d not in skip]
            filenames = [f for f in filenames if f not in skip]
        for d in dirnames:
            found[str((here / d).relative_to(root))] = "<dir>"
        for f in filenames:
            found[str((here / f).relative_to(root))] = hashlib.sha256((here / f).read_bytes()).hexdigest()
    return found


@dataclass(frozen=True)
class Ran:
    """A finished command: its exit status and what it printed."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def traceback(self) -> bool:
        """Whether it printed a Python traceback (or a frame of one, as Snakemake prints them)."""
        return ("Traceback (most recent call last)" in self.output
                or re.search(r'^\s*File "', self.output, re.M) is not None)

    def describe(self) -> str:
        """The command and the tail of its output, for an assertion message."""
        return f"$ {' '.join(self.args)}\n(exit {self.returncode})\n{self.output[-4000:]}"


def _env() -> dict[str, str]:
    """The environment a user of the virtualenv has: its bin/ first on PATH (Snakemake's jobs call
    `python`, `torchrun`) and the repository importable."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def run_command(args: list[str], cwd: str | os.PathLike, timeout: float = 600) -> Ran:
    proc = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return Ran(args, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def snapshot() -> Callable[..., dict[str, str]]:
    """`snapshot(dir)` -> {relative path: sha256 or "<dir>"} (see `snapshot_tree`)."""
    return snapshot_tree


@pytest.fixture
def run_stage() -> Callable[..., Ran]:
    """`run_stage(verb, *args, cwd=dir)`: `python -m stages.<verb> *args` run in `cwd`."""

    def run(verb: str, *args: str, cwd: str | os.PathLike, timeout: float = 600) -> Ran:
        return run_command([sys.executable, "-m", f"stages.{verb}", *args], cwd, timeout)

    return run


@pytest.fixture
def run_snakemake() -> Callable[..., Ran]:
    """`run_snakemake(workdir, *args)`: this repository's workflow with `workdir` as its working
    directory and config/config.yaml first (pass `--configfile extra.yaml` for an experiment of
    your own), as `snakemake` is run from the repository root."""

    def run(workdir: str | os.PathLike, *args: str, timeout: float = 1800) -> Ran:
        cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "workflow" / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(ROOT / "config" / "config.yaml"), *args]
        return run_command(cmd, ROOT, timeout)

    return run


@pytest.fixture
def run_workflow() -> Callable[..., Ran]:
    """`run_workflow(cwd, *args)`: `snakemake -s <repository>/workflow/Snakefile *args` run in `cwd`,
    as a user runs the workflow from a directory of their own: relative --configfile paths and
    targets resolve there, and nothing else is added to the command line."""

    def run(cwd: str | os.PathLike, *args: str, timeout: float = 300) -> Ran:
        return run_command([sys.executable, "-m", "snakemake", "-s", str(ROOT / "workflow" / "Snakefile"), *args],
                           cwd, timeout)

    return run
