"""What a run measures of the machine instead of computing from its inputs: wall times, speeds,
memory, model FLOP utilisation. Two runs of the same inputs and seed on the same machine write
every other byte identically (sorted lists, no timestamps or host names outside meta.json's
provenance); these fields are the only ones that differ, and they are named here once, for the
rerun test (tests/integration/test_workflow.py with rerun_identity.py) and for anyone diffing two
results trees.
"""

from __future__ import annotations

from typing import Any

# Snakemake's benchmark columns (results/<name>/benchmarks/*.tsv, and the report's table of them)
SNAKEMAKE_BENCHMARK = frozenset({"s", "h:m:s", "max_rss", "max_vms", "max_uss", "max_pss", "io_in", "io_out",
                                 "mean_load", "cpu_time"})
MEASURED_NAMES = frozenset({"mfu", "peak_flops", "rss_bytes", "peak_rss_mb", "seconds_per_decoder_layer",
                            "max_seconds_per_decoder_layer"}) | SNAKEMAKE_BENCHMARK
MEASURED_SUFFIXES = ("_seconds", "_s", "_ms")  # gen_seconds, elapsed_s, checkpoint_save_stall_s, ort_latency_ms
MEASURED_PARTS = ("_per_s",)  # tokens_per_s, prefill_tokens_per_s_b8, decode_tokens_per_s_b1
# report.md's column headers (stages/reporting/tables.py): "decode b1 (tokens/s)", "peak RSS (MB)", ...
MEASURED_WORDS = ("tokens/s", "peak RSS", "wall time", "CPU time")
# the report's plots of speed and memory (results/<name>/report/, stages/reporting/plots.py)
MEASURED_FILES = frozenset({"quantization.png", "stages.png"})
# TensorBoard event files beside train_log.csv: their names carry the host and the time, their
# records wall times; their values are train_log.csv's (stages/training/log.py)
EVENT_FILE_PREFIX = "events.out.tfevents."


def is_measured(name: str) -> bool:
    """Whether a JSON key or CSV column holds a measurement of this machine's speed or memory (a
    report's "Δ <name>" column of the change in one too)."""
    name = name.removeprefix("Δ ")
    return (name in MEASURED_NAMES or name.endswith(MEASURED_SUFFIXES)
            or any(part in name for part in (*MEASURED_PARTS, *MEASURED_WORDS)))


def is_measured_file(name: str) -> bool:
    """Whether a whole file (by its name) is a record of this machine's run rather than a result."""
    return name in MEASURED_FILES or name.startswith(EVENT_FILE_PREFIX)


def without_measured(value: Any) -> Any:
    """`value` (parsed JSON) with every measured key removed, at any depth."""
    if isinstance(value, dict):
        return {k: without_measured(v) for k, v in value.items() if not is_measured(str(k))}
    if isinstance(value, list):
        return [without_measured(v) for v in value]
    return value
