"""The `meta.json` sidecar every artifact carries: where it came from, what it measured, and the
size and sha256 of its weight files (`files`), which every stage that loads the artifact checks
(`stages.checkpoint.weights.verify_artifact`): a byte flipped on disk fails the load, naming the
file and the stage to rerun, instead of evaluating a silently different model."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from stages.checkpoint.atomic import write_json
from stages.checkpoint.integrity import weight_records

META_NAME = "meta.json"
# The digest of the code that made the artifact, as the workflow computed it for the job
# (stages/provenance/code.py; workflow/rules/common.smk puts it in the job's environment).
CODE_ENV = "LLM_LIFECYCLE_CODE"
_PACKAGES = ("torch", "transformers", "peft", "deepspeed", "safetensors", "tokenizers", "snakemake", "sacrebleu",
             "rouge-score")


def git_commit() -> str | None:
    """HEAD of the repository this code runs from, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write_meta(
    out_dir: str | Path, *, stage: str, config: dict[str, Any], parent: str | Path | None,
    seed: int | None, metrics: dict[str, Any],
) -> dict[str, Any]:
    """Write `out_dir/meta.json` atomically and return its content. Call it last, once the weights
    are in `out_dir`: `files` records the weight files present now (name, size, sha256)."""
    meta = {
        "stage": stage,
        "config": config,
        "parent": str(parent) if parent is not None else None,
        "git_commit": git_commit(),
        "code": os.environ.get(CODE_ENV),  # None when the stage ran outside the workflow
        "packages": package_versions(),
        "seed": seed,
        "metrics": metrics,
        "files": weight_records(out_dir),
    }
    write_json(Path(out_dir) / META_NAME, meta)
    return meta


def read_meta(artifact_dir: str | Path) -> dict[str, Any]:
    path = Path(artifact_dir) / META_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {artifact_dir} was not written by a pipeline stage")
    return json.loads(path.read_text())
