"""What this machine's device can run, asked where the config is checked (before any job starts).

DeepSpeed's CPU accelerator accepts `fp16` only where oneDNN has fp16 kernels (Intel CPUs with
AVX512-FP16/AMX-FP16); elsewhere, e.g. on AMD EPYC, `deepspeed.initialize` raises
"Type fp16 is not supported on your device" from inside the training job. These helpers give the
same verdict up front, with the reason, so `stages.config` can refuse the config at parse time and
the tests that need fp16 can skip with that reason.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def fp16_unsupported_reason() -> str | None:
    """None when fp16 training runs here; else why not (one sentence, ends with the fix)."""
    import torch

    if torch.cuda.is_available():
        return None
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        supported = False
    if supported:
        return None
    return ("this machine has no GPU and its CPU lacks oneDNN fp16 kernels (AVX512-FP16/AMX-FP16), so "
            "DeepSpeed refuses fp16 here; use bf16: true (or fp32) on this machine")


@functools.lru_cache(maxsize=None)
def bf16_unsupported_reason() -> str | None:
    """None when bf16 training runs here (any GPU with bf16, or any CPU: torch emulates it)."""
    import torch

    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support; use fp16: true (or fp32)"
    return None
