"""bench/train_throughput.py runs end to end on the smallest settings and writes its JSON.

Checks the shape of the report only: timings on a shared CPU are noise, never asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "train_throughput.py"
SMALLEST = ["--flavour", "debug", "--steps", "2", "--warmup-steps", "1", "--batch-size", "2", "--seq-len", "32",
            "--vocab-size", "512", "--no-compile"]


def run_bench(out: Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALLEST, "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "ratio ours/hf" in proc.stdout
    return json.loads(out.read_text())


def test_throughput_report_has_its_keys(tmp_path):
    result = run_bench(tmp_path / "bench.json", "--skip-memory")
    for key in ("machine", "settings", "flops_per_token", "mfu_formula", "peak_flops", "runs", "ours", "hf",
                "ratio", "ratios", "memory"):
        assert key in result, key
    assert {"cpu", "cores", "torch"} <= result["machine"].keys()
    assert {"ours (eager)", "hf trainer (eager)"} <= result["runs"].keys()
    for run in result["runs"].values():
        assert len(run["step_times_s"]) == 2
        assert {"tokens_per_s", "mfu", "median_step_s", "first_step_s"} <= run.keys()
    assert result["peak_flops"] > 0 and result["ratio"] > 0
    assert result["memory"] == []


@pytest.mark.multiproc
def test_memory_report_has_its_keys(tmp_path):
    result = run_bench(tmp_path / "bench.json", "--memory-flavour", "debug", "--shardings", "none", "stage3")
    assert [(r["sharding"], r["rank"]) for r in result["memory"]] == [("none", 0), ("none", 1), ("stage3", 0), ("stage3", 1)]
    for row in result["memory"]:
        assert row["peak_rss_bytes"] > 0
        assert {"params", "grads", "master_params", "optimizer_state", "buffers", "total"} <= row["held"].keys()
