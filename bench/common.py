"""What every bench script shares: the machine a run measured on, and how a run ends (its table
printed, its JSON written atomically so that a killed run leaves the previous file)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file from anywhere: `stages` is the repo's package
    sys.path.insert(0, str(ROOT))

from stages.checkpoint.atomic import write_json  # noqa: E402


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (the processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def load_average() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info(*packages: str, **extra: Any) -> dict[str, Any]:
    """The machine and software a run measured on: CPU, cores, torch's threads, Python, platform,
    the installed version of torch and each of `packages` (None when absent), the load average at
    the start, and `extra` fields."""
    import torch

    versions = {}
    for name in ("torch", *packages):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(), **versions,
            "loadavg_at_start": load_average(), **extra}


def csv_list(value: str) -> list[str]:
    """A comma-separated command-line value as a list (empty items dropped)."""
    return [v.strip() for v in value.split(",") if v.strip()]


def finish(out: Path, result: dict[str, Any], report: Callable[[dict[str, Any]], str],
           started: float | None = None) -> int:
    """The end of a bench run: `total_seconds` since `started` (a perf_counter), the table, the JSON."""
    if started is not None:
        result["total_seconds"] = time.perf_counter() - started
    print(report(result))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, result)
    took = f"total {result['total_seconds']:.0f} s; " if started is not None else ""
    print(f"\n{took}wrote {out}")
    return 0
