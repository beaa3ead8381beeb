"""Running Snakemake on this repository's workflow from a test, in a temporary working directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEBUG_CONFIG = ROOT / "tests" / "integration" / "debug.yaml"
TARGET = "results/ci/quant_eval.json"
# DPO after SFT on two ranks (ZeRO-2), from the reference log-probs of rule score_pairs: test_workflow's
# DAG adds it to debug.yaml's (the other integration tests run the chain without it). The debug model's
# loss moves ~0.03 in 20 steps of 16 pairs at 1e-3; at 1e-4 it stayed within batch noise.
DEBUG_ALIGN = {"enabled": True, "max_steps": 20, "warmup_steps": 2, "per_device_train_batch_size": 8,
               "world_size": 2, "sharding": "stage2", "learning_rate": 1.0e-3, "save_steps": 10}


def debug_config_with_align(directory: Path) -> Path:
    """debug.yaml with DEBUG_ALIGN as experiment ci's align section, written into `directory`."""
    config = yaml.safe_load(DEBUG_CONFIG.read_text())
    config["experiments"]["ci"]["align"] = dict(DEBUG_ALIGN)
    path = Path(directory) / "debug_align.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


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
