"""The rope types `stages.model.rope` computes and the check of an HF scaling dict against them.
Torch-free: the config check (`stages.model.config`, run while Snakemake parses) reads it."""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Keys each rope type cannot do without (transformers raises KeyError without them as well).
REQUIRED_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",),
}


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The rope type of an HF scaling dict (`rope_type`, or the older `type`); `default` when None."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def depends_on_length(scaling: dict[str, Any] | None) -> bool:
    """Whether the rope type's frequencies are recomputed from the sequence's total length
    (`dynamic`): a position's angle then changes as the sequence grows, which the model follows per
    forward and a KV-cache graph (cached keys rotated once) cannot."""
    return rope_type(scaling) == "dynamic"


def check_rope_scaling(scaling: dict[str, Any] | None, key: str) -> None:
    """Raise ValueError, naming `key` (e.g. 'rope_parameters'), when the scaling dict asks for a
    rope type or parameter this module does not compute."""
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{key}.rope_type={kind!r} is not supported; supported rope types: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    missing = [k for k in REQUIRED_ROPE_KEYS[kind] if k not in (scaling or {})]
    if missing:
        raise ValueError(f"{key} with rope_type={kind!r} lacks {missing}; transformers needs them too")
    partial = (scaling or {}).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"{key}.partial_rotary_factor={partial!r} is not supported; only 1.0 (every "
                         "head dimension rotated) outside GLM's classes: transformers' Llama/Qwen2/Qwen3/Mistral "
                         "ignore it for the default rope type and fail for the others")
