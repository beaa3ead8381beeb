"""What two from-scratch runs of the same chain must write identically (tests/integration/
test_workflow.py runs the debug chain, every stage, twice): every artifact under results/,
checkpoints included, byte for byte, apart from the measurements of the machine's speed and memory
that `stages.metrics.measured` names (JSON keys, CSV and Markdown table columns; whole files: the
report's plots of speed and memory, TensorBoard's event files), which are removed before comparing
(and so a checkpoint's hash of its trainer_state.json, whose log rows carry step times). Snakemake's logs/ and benchmarks/ are timing records, not artifacts."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from stages.metrics.measured import is_measured, is_measured_file, without_measured

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
    """Every file under results/ but logs, benchmarks and the files that are records of the run
    (plots of speed and memory, TensorBoard event files named by host and time)."""
    return sorted(p.relative_to(results) for p in results.rglob("*")
                  if p.is_file() and not NOT_ARTIFACTS & set(p.relative_to(results).parts)
                  and not is_measured_file(p.name))


def differing_artifacts(first: Path, second: Path) -> list[str]:
    """Artifacts of two results trees (`results/` of two runs) that differ beyond measurements;
    a file in one tree only counts as differing too."""
    files, other = artifacts(first), artifacts(second)
    assert any(f.suffix == ".safetensors" for f in files) and any(f.name == "adapter_config.json" for f in files)
    return sorted({str(f) for f in set(files) ^ set(other)}
                  | {str(f) for f in set(files) & set(other) if comparable(first / f) != comparable(second / f)})
