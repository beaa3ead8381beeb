"""The host's memory as Linux reports it in /proc (kB fields), torch-free: this process's resident
set size and the memory still available to new allocations. None where /proc cannot be read."""

from __future__ import annotations

from pathlib import Path


def proc_bytes(path: str, field: str) -> int | None:
    """The kB value of line `field:` of a /proc file, in bytes; None where it cannot be read."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    """This process's resident set size (/proc/self/status VmRSS)."""
    return proc_bytes("/proc/self/status", "VmRSS")


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo."""
    return proc_bytes("/proc/meminfo", "MemAvailable")
