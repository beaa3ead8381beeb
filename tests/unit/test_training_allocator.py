"""stages.training.allocator: after keep_freed_host_memory, a buffer freed and allocated again
reuses pages that are already mapped (no page faults), where glibc's defaults map fresh pages
every time. Each case runs in its own interpreter: the setting lasts for the whole process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Page faults of the 16th..20th fresh 64 MiB buffer: the first ones grow the heap (glibc 2.36 here:
# the first 7 or 8), until freed chunks merge into one that a 64-byte-aligned request fits.
FAULTS = """
import resource, sys, torch
from stages.training.allocator import keep_freed_host_memory
print(keep_freed_host_memory())
def faults_of_a_fresh_buffer():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.empty(2**24, dtype=torch.float32)
    buffer.fill_(1.0)
    del buffer
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(max([faults_of_a_fresh_buffer() for _ in range(20)][15:]))
"""
PAGES = 2**26 // 4096  # one fault per 4 KiB page of 64 MiB


def faults(opt_out: bool) -> tuple[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LLM_LIFECYCLE_KEEP_FREED_MEMORY", None)
    if opt_out:
        env["LLM_LIFECYCLE_KEEP_FREED_MEMORY"] = "0"
    proc = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    applied, worst = proc.stdout.split()
    return applied, int(worst)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt; elsewhere the call changes nothing")
def test_freed_buffers_stay_mapped():
    applied, worst = faults(opt_out=False)
    assert applied == "True"
    assert worst < PAGES // 20, f"{worst} page faults for a 64 MiB buffer allocated again ({PAGES} pages)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt; elsewhere the call changes nothing")
def test_opting_out_leaves_mallocs_defaults():
    """With LLM_LIFECYCLE_KEEP_FREED_MEMORY=0 nothing changes: glibc maps a buffer this large afresh
    (above its largest mmap threshold, 32 MiB) and unmaps it on free, so every page faults again."""
    applied, worst = faults(opt_out=True)
    assert applied == "False"
    assert worst >= PAGES * 9 // 10
