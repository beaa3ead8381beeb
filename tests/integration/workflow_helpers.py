"""Running Snakemake on this repository's workflow from a test, in a temporary working directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = ROOT / "tests" / "integration" / "debug.yaml"
TARGET = "results/ci/quant_eval.json"


def repo_copy(dest: Path) -> Path:
    """A copy of the workflow and its code (workflow/, stages/, config/, README.md, one test file) that a
    test may edit: `snakemake(..., root=dest)` runs it, its jobs importing `stages` from the copy."""
    for name in ("workflow", "stages", "config"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", dest / "README.md")
    (dest / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "unit" / "test_config.py", dest / "tests" / "test_config.py")
    return dest


def snakemake(workdir: Path, *args: str, check: bool = True, root: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "workflow" / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(root / "config" / "config.yaml"), *args]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    if check and proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((workdir / "results").glob("*/logs/*.log")))
        pytest.fail(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-6000:]}\n{logs}")
    return proc


def planned_jobs(stdout: str) -> dict[str, int]:
    """Rule -> job count from the 'Job stats' table of a dry run."""
    counts, in_table = {}, False
    for line in stdout.splitlines():
        if line.startswith("Job stats"):
            in_table = True
            continue
        if in_table:
            m = re.match(r"^(\S+)\s+(\d+)\s*$", line.strip())
            if m and m.group(1) != "total":
                counts[m.group(1)] = int(m.group(2))
            elif line.strip().startswith("total"):
                break
    return counts




def artifact_hashes(results: Path) -> dict[str, str]:
    """{path under results/: sha256} of every artifact (logs and benchmarks are records, not artifacts)."""
    import hashlib

    return {p.relative_to(results).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(results.rglob("*")) if p.is_file() and not {"logs", "benchmarks"} & set(p.parts)}


def weights_sha256(model_dir: Path) -> dict[str, str]:
    """{weight file name: sha256} of a model directory: equal dicts are bit-identical weights."""
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(model_dir.glob("model*.safetensors"))}


def logged_steps(workdir: Path, experiment: str) -> int:
    """Rows in the running pretrain job's live train_log.csv (moved into the output at the end)."""
    live = workdir / "results" / experiment / ".pretrain.log" / "train_log.csv"
    try:
        return max(0, len(live.read_text().splitlines()) - 1)
    except FileNotFoundError:
        return 0
