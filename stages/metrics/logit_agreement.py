"""How closely one model's logits follow another's: the one rule of every check of a model against
its source (the imported checkpoint against transformers, the merged adapter against the adapter,
the ONNX graph against torch, its int8 graph against the float one, a deployed file against the
pipeline's model).

    max_abs_diff   = max |got - want|            over every position and vocabulary entry
    logit_scale    = max |want|
    rel_err        = max_abs_diff / logit_scale  (0 when both are 0, inf when only the scale is 0)
    top1_agreement = share of positions whose argmax over the vocabulary is the same

`want` is the reference, `got` what is checked against it, both (..., vocab), torch tensors or
numpy arrays. Each is reduced in its own library and precision, so the numbers are those the
arrays give: a torch tensor's share is the float32 mean of its matches, a numpy array's the
float64 one; pass float64 `got` to difference float32 logits without rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LogitAgreement:
    """How closely one set of logits follows another (see the module docstring)."""

    max_abs_diff: float  # max |got - want| over every position and vocabulary entry
    logit_scale: float  # max |want|
    rel_err: float  # max_abs_diff / logit_scale
    top1_agreement: float  # share of positions whose argmax over the vocabulary agrees
    positions: int


def top1_matches(want: Any, got: Any) -> Any:
    """(...) booleans, same library as the inputs: where `got`'s argmax over the vocabulary is `want`'s."""
    return got.argmax(-1) == want.argmax(-1)


def share(flags: Any) -> float:
    """The share of True in a boolean array: numpy's float64 mean, or a torch tensor's float32 one."""
    if isinstance(flags, np.ndarray):
        return float(flags.mean())
    return flags.float().mean().item()


def top1_agreement(want: Any, got: Any, where: Any = None) -> float:
    """The share of positions (those `where` is True, if given) whose top-1 token agrees."""
    same = top1_matches(want, got)
    return share(same if where is None else same[where])


def logit_error(want: Any, got: Any) -> tuple[float, float, float]:
    """(max_abs_diff, logit_scale, rel_err) of `got` against `want`; nan in the difference makes
    max_abs_diff and rel_err nan, so a check `rel_err <= rtol` fails on it."""
    diff = float(abs(got - want).max())
    scale = float(abs(want).max())
    if scale > 0:
        return diff, scale, diff / scale
    return diff, scale, 0.0 if diff == 0 else math.inf


def logit_agreement(want: Any, got: Any) -> LogitAgreement:
    """Every number of the module docstring for two (..., vocab) logits of the same shape."""
    if tuple(want.shape) != tuple(got.shape):
        raise ValueError(f"logits of shape {tuple(got.shape)} against {tuple(want.shape)}")
    diff, scale, rel = logit_error(want, got)
    return LogitAgreement(diff, scale, rel, top1_agreement(want, got), math.prod(want.shape[:-1]))
