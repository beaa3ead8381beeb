"""Tests of stages/data/attributes.py: the builtin SFT task's fixed rules and its generation."""

import pytest

from stages.data.attributes import (ATTRIBUTE_NAMES, COLORS, COUNTS, SHAPES, SIZES, AttributesTaskError,
                                    all_combos, describe, generate, plural)
from stages.data.sft import SftRecord


def parse_src(src: str) -> dict[str, str]:
    pairs = [p.split(": ") for p in src.split("; ")]
    return {k: v for k, v in pairs}


def combo_of(record: SftRecord) -> tuple:
    a = parse_src(record.src[0])
    return a["size"], a["color"], a["shape"], int(a["count"])


@pytest.mark.parametrize("args, expected", [
    (("big", "red", "circle", 1), "a big red circle"),
    (("enormous", "red", "circle", 1), "an enormous red circle"),
    (("big", "red", "circle", 3), "three big red circles"),
    (("tiny", "white", "box", 2), "two tiny white boxes"),
    (("huge", "green", "cross", 8), "eight huge green crosses"),
    (("small", "orange", "star", 1), "a small orange star"),
])
def test_describe_rules(args, expected):
    assert describe(*args) == expected


def test_plural():
    assert [plural(s) for s in ("box", "cross", "cube", "star")] == ["boxes", "crosses", "cubes", "stars"]


def test_vocabulary_sizes_are_small():
    assert 5 <= len(SIZES) <= 8 and 5 <= len(COLORS) <= 8 and 5 <= len(SHAPES) <= 8 and 5 <= len(COUNTS) <= 8
    assert any(s[0] in "aeiou" for s in SIZES)  # the "an" rule is exercised


@pytest.fixture(scope="module")
def task():
    return generate(2000, 64, seed=42)


def test_counts_and_types(task):
    train, dev = task
    assert len(train) == 2000 and len(dev) == 64
    assert all(isinstance(r, SftRecord) and len(r.src) == len(r.tgt) == 1 for r in train + dev)


def test_target_is_the_rule_applied_to_the_source(task):
    for r in task[0] + task[1]:
        assert r.tgt[0] == describe(*combo_of(r))
        assert len(r.tgt[0].split()) < 12
        assert sorted(parse_src(r.src[0])) == sorted(ATTRIBUTE_NAMES)  # each attribute exactly once


def test_attribute_order_is_shuffled(task):
    orders = {tuple(parse_src(r.src[0])) for r in task[0]}
    assert len(orders) > 12  # of 24 possible


def test_no_duplicates_and_dev_combinations_unseen(task):
    train, dev = task
    train_src = [r.src[0] for r in train]
    assert len(set(train_src)) == len(train_src)
    assert len({r.src[0] for r in dev}) == len(dev)
    assert not {combo_of(r) for r in dev} & {combo_of(r) for r in train}


def test_deterministic_and_seeded():
    assert generate(100, 10, seed=1) == generate(100, 10, seed=1)
    assert generate(100, 10, seed=1) != generate(100, 10, seed=2)


def test_more_train_records_than_combinations_reuse_combinations_in_new_orders():
    n_combos = len(all_combos())
    train, _ = generate(n_combos, 10, seed=0)
    assert len({r.src[0] for r in train}) == n_combos


@pytest.mark.parametrize("num_train, num_dev, match", [
    (10**7, 10, r"at most \d+ distinct train records.*num_sft_train"),
    (10, 10**6, r"num_sft_dev=1000000 leaves no combination"),
    (0, 10, r"must both be >= 1"),
])
def test_impossible_requests(num_train, num_dev, match):
    with pytest.raises(AttributesTaskError, match=match):
        generate(num_train, num_dev, seed=0)
