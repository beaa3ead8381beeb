"""Host memory for training steps: glibc's malloc told to keep the memory a step frees.

A CPU training step allocates and frees the same large buffers every step (the logits and their
fp32 copy, the loss's gradient, activations). glibc serves each allocation above its mmap
threshold (128 KiB, rising to at most 32 MiB) with a fresh mmap and unmaps it on free, so every
step page-faults on every 4 KiB page of each such buffer again. Served from the heap and kept
there, the pages stay mapped after the first steps. The floats do not change (the same kernels on
the same values). Measured on a 2-core AMD EPYC (2026-11-27, bf16, 1 thread per rank):
- the default pretraining (tiny, 2 ranks, ZeRO-1, 8 x 256 tokens): 0.599 / 0.603 -> 0.543 /
  0.545 s per step, page faults 4.9 M -> 0.43 M over 80 steps, peak RSS 821-885 -> 827 MB, the
  same final loss;
- SmolLM2-135M's shape (one process, 4 x 256 tokens, 2 threads, the bench's stage step): 4.48 ->
  3.49 s per step, peak RSS 4,316 -> 4,515 MB (+4.6%);
- fine-tuning in fp32 (the default SFT and LoRA): no change beyond the noise.
The cost: memory freed after the peak stays with the process until it exits (as with PyTorch's
CUDA caching allocator), and the heap can hold several freed copies of a buffer before they merge
into one that a new request fits (a lone 64 MiB buffer allocated over and over: 7 copies). This
per-step page-fault cost is what Intel's PyTorch tuning guides preload jemalloc or tcmalloc
against; here glibc's own setting, with no library or launcher change (not compared with them).
Every training job applies it (`stages.training.engine.setup`); LLM_LIFECYCLE_KEEP_FREED_MEMORY=0
in the environment leaves malloc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NO_TRIM = 2**31 - 1  # mallopt takes an int: free memory at the heap's top is kept up to 2 GiB
OPT_OUT = "LLM_LIFECYCLE_KEEP_FREED_MEMORY"


def keep_freed_host_memory() -> bool:
    """From now on this process's large allocations come from malloc's heap (no mmap) and freed
    memory stays there for the next step (no trim). True where it took effect (Linux with glibc);
    False elsewhere (another libc or OS) and with LLM_LIFECYCLE_KEEP_FREED_MEMORY=0, where nothing
    changes."""
    if os.environ.get(OPT_OUT, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1
    if not applied:
        log.warning("mallopt refused M_MMAP_MAX / M_TRIM_THRESHOLD; host memory stays with malloc's defaults")
    return applied
