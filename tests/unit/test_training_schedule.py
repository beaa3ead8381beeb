"""Learning-rate schedules."""

import math

import pytest

from stages.training.schedule import lr_at


def test_warmup_then_cosine_to_the_floor():
    kw = dict(learning_rate=1.0, warmup_steps=4, max_steps=14, min_learning_rate=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, **kw) == pytest.approx(0.1)


def test_linear_and_constant():
    assert lr_at(5, learning_rate=2.0, warmup_steps=0, max_steps=10, lr_scheduler_type="linear") == pytest.approx(1.0)
    assert lr_at(7, learning_rate=2.0, warmup_steps=0, max_steps=10, lr_scheduler_type="constant") == 2.0
    with pytest.raises(ValueError, match="lr_scheduler_type='step'"):
        lr_at(7, learning_rate=2.0, warmup_steps=0, max_steps=10, lr_scheduler_type="step")
