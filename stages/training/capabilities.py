"""What this machine's device can run, asked where the config is checked (before any job starts),
and what `bf16: auto` becomes: on this machine (in the training job, `resolved_bf16`), and where the
machine is not known (the memory plan, `bf16_choices`).

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


@functools.lru_cache(maxsize=None)
def native_bf16() -> str | None:
    """What multiplies bf16 natively here (a GPU with bf16, or a CPU with AVX512-BF16 or AMX-BF16),
    named; None where bf16 would be emulated, slower than fp32 (e.g. AVX2-only or AVX-512 without
    BF16 CPUs)."""
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} has bf16" if torch.cuda.is_bf16_supported() else None
    if torch.cpu._is_amx_tile_supported():
        return "this CPU has AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "this CPU has AVX512-BF16"
    return None


def bf16_choices(bf16: bool | str) -> tuple[bool, ...]:
    """What a section's `bf16` may train with: itself, or for `auto` either value, which only the
    training job decides, on its own machine (`resolved_bf16`). The memory planner runs where the
    workflow is parsed, which need not be that machine: it plans each choice and keeps the larger
    peak (neither is always larger: bf16 halves the activations but adds fp32 master weights and,
    without ZeRO, the fp32 copies of the gradients its optimizer wrapper makes), fp32's where the two
    peak alike (it comes first)."""
    return (False, True) if bf16 == "auto" else (bool(bf16),)


def resolved_bf16(section):
    """`section` with `bf16: auto` decided for this machine: true where `native_bf16()`, else
    false (a bool is returned unchanged, so deciding twice is deciding once). The training engine
    decides it once, where a run is set up (`stages.training.engine.setup`): the run's fingerprint
    and engine see the decision, and meta.json's metrics record it as `bf16`. `section` is a typed
    section or a mapping."""
    if section["bf16"] != "auto":
        return section
    decided = native_bf16() is not None
    return section.replace(bf16=decided) if hasattr(section, "replace") else {**section, "bf16": decided}
