"""Two from-scratch runs of the debug chain (every stage: data, pretrain with ZeRO-1 on 2 ranks,
SFT, LoRA, prefix, merges, quantization, export, evaluation, report) write the same bytes: every
artifact under results/, checkpoints included, is byte-identical, apart from the measurements of
the machine's speed and memory that `stages.metrics.measured` names (JSON keys, CSV and Markdown
table columns), which are removed before comparing (and so a checkpoint's hash of its
trainer_state.json, whose log rows carry step times). Snakemake's logs/ and benchmarks/ are timing
records, not artifacts."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from stages.metrics.measured import is_measured, without_measured
from workflow_helpers import DEBUG_CONFIG, TARGET, snakemake

pytestmark = pytest.mark.slow  # two runs of the whole debug DAG

NOT_ARTIFACTS = {"logs", "benchmarks"}


def _csv_without_measured(text: str) -> list[list[str]]:
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return rows
    keep = [i for i, name in enumerate(rows[0]) if not is_measured(name)]
    return [[row[i] for i in keep if i < len(row)] for row in rows]


def _markdown_without_measured(text: str) -> list[str]:
    """Lines of a Markdown file, table cells under a measured column header dropped."""
    out, keep = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            out.append(line)
            keep = None
            continue
        cells = line.strip("|").split("|")
        if keep is None:  # a table's header row
            keep = [i for i, name in enumerate(cells) if not is_measured(name.strip())]
        out.append("|".join(cells[i] for i in keep if i < len(cells)))
    return out


def comparable(path: Path):
    """What of `path` must be equal between the two runs."""
    data = path.read_bytes()
    if path.name == "checkpoint_complete.json":  # the sha256 of trainer_state.json, whose log rows
        return {k: v for k, v in json.loads(data).items() if k != "trainer_state.json"}  # carry times
    if path.suffix in (".json", ".jsonl"):
        try:
            return without_measured(json.loads(data))
        except json.JSONDecodeError:  # JSON lines (data/sft/*.json, as PaddleNLP names them)
            return [without_measured(json.loads(line)) for line in data.decode().splitlines() if line.strip()]
    if path.suffix == ".csv":
        return _csv_without_measured(data.decode())
    if path.suffix == ".md":
        return _markdown_without_measured(data.decode())
    return data


def artifacts(results: Path) -> list[Path]:
    return sorted(p.relative_to(results) for p in results.rglob("*")
                  if p.is_file() and not NOT_ARTIFACTS & set(p.relative_to(results).parts))


def test_two_runs_of_the_debug_chain_write_identical_artifacts(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for workdir in (first, second):
        workdir.mkdir()
        snakemake(workdir, "--configfile", str(DEBUG_CONFIG), "--cores", "2", TARGET)
    files = artifacts(first / "results")
    assert artifacts(second / "results") == files
    assert any(f.suffix == ".safetensors" for f in files) and any(f.name == "adapter_config.json" for f in files)
    differ = [str(f) for f in files if comparable(first / "results" / f) != comparable(second / "results" / f)]
    assert not differ, f"differ between two runs of the same inputs and seed: {differ}"
