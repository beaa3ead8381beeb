"""Learning-rate schedules: linear warmup, then cosine or linear decay to a floor, or constant."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from stages.sections import training_section


def lr_at(step: int, *, learning_rate: float, warmup_steps: int, max_steps: int,
          lr_scheduler_type: str = "cosine", min_learning_rate: float = 0.0) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup ramps from lr/warmup to lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    if lr_scheduler_type == "constant":
        return learning_rate
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if lr_scheduler_type == "cosine":
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif lr_scheduler_type == "linear":
        coeff = 1.0 - progress
    else:
        raise ValueError(f"lr_scheduler_type={lr_scheduler_type!r}: expected cosine, linear or constant")
    return min_learning_rate + coeff * (learning_rate - min_learning_rate)


def lr_lambda(section: Mapping[str, Any]) -> "callable":
    """A `torch.optim.lr_scheduler.LambdaLR` multiplier for a training section (typed, or a mapping
    completed by `stages.sections.training_section`)."""
    section = training_section(section)
    peak = section.learning_rate

    def multiplier(step: int) -> float:
        return lr_at(step, learning_rate=peak, warmup_steps=section.warmup_steps, max_steps=section.max_steps,
                     lr_scheduler_type=section.lr_scheduler_type, min_learning_rate=section.min_learning_rate) / peak

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, section: Mapping[str, Any]) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(section))
