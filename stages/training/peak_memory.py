"""The peak memory a training rank reached, logged beside what the memory plan predicted.

On a GPU the peak is torch's `max_memory_allocated` (tensor bytes, what the plan models); on CPU
the process's peak resident set (VmHWM), which also holds the Python runtime, torch and DeepSpeed
(stages.cluster.resources.RUNTIME_ALLOWANCE_BYTES), so the two are logged separately rather than
compared as one number (bench/memory_plan.py compares training memory on CPU properly).
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path

import torch

log = logging.getLogger(__name__)
GB = 1e9


def peak_bytes() -> tuple[int, str]:
    """(bytes, what was measured) of this process so far."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated(), "GPU max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "CPU peak resident set"


def log_memory_against_plan(plan_path: str | Path, job: str) -> dict[str, float] | None:
    """Log (and return) this rank's planned per-device GB (results/<name>/plan/<job>.json, or the
    `job` entry of a whole plan.json) and its measured peak. A plan without the job is reported,
    not fatal."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = json.loads(Path(plan_path).read_text())
    entry = plan if plan.get("job") == job else plan.get("jobs", {}).get(job)  # one job's file, or the whole plan
    measured, what = peak_bytes()
    if entry is None:
        log.warning("rank %d: %s has no entry for %s; measured %s %.2f GB", rank, plan_path, job, what,
                    measured / GB)
        return None
    planned = entry["per_device_total_gb"]
    log.info("rank %d: memory planned %.3f GB per device (%s), measured %s %.3f GB", rank, planned,
             plan_path, what, measured / GB)
    return {"planned_gb": planned, "measured_gb": measured / GB}
