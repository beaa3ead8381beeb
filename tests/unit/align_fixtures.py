"""Helpers for the alignment tests: toy preference pairs and filled align sections.

Not a conftest: test modules import these functions directly (pytest puts tests/unit on sys.path).
"""

from __future__ import annotations

from pathlib import Path

from sft_fixtures import toy_records

from stages.config import check_config
from stages.data.preference import PreferenceRecord, write_preference_file
from stages.sections import AlignSettings


def toy_pairs() -> list[PreferenceRecord]:
    """56 pairs of the toy SFT task (tests/unit/sft_fixtures.py): the right colour chosen, the next
    object's colour rejected."""
    records = toy_records()
    colours = sorted({r.tgt[0] for r in records})
    return [PreferenceRecord(src=list(r.src), history=[], chosen=r.tgt[0],
                             rejected=colours[(colours.index(r.tgt[0]) + 1) % len(colours)]) for r in records]


def write_preference_data(data_dir: Path) -> Path:
    """prepare's preference layout: data_dir/preference/train.json (48 pairs) and dev.json (8)."""
    pairs = toy_pairs()
    write_preference_file(data_dir / "preference" / "train.json", pairs[:48])
    write_preference_file(data_dir / "preference" / "dev.json", pairs[48:])
    return data_dir


def write_preference_and_general_text(data_dir: Path) -> Path:
    """`write_preference_data` plus data_dir/general.txt: general text for data mixing, in the debug
    model's tokenizer (Python's pydoc topics, as test_finetune_mixing mixes in)."""
    from pydoc_data.topics import topics  # stdlib text, imported only by the mixing tests

    write_preference_data(data_dir)
    (data_dir / "general.txt").write_text("\n\n".join(topics[k] for k in sorted(topics)[:12]))
    return data_dir


def align_section(**overrides) -> AlignSettings:
    """The align section (typed) with schema defaults, small-run settings and `overrides`."""
    small = dict(enabled=True, max_steps=5, warmup_steps=1, per_device_train_batch_size=8, src_length=16,
                 max_length=24, seed=0, learning_rate=1e-3)
    small.update(overrides)
    config = check_config({"experiments": {"t": {"align": small}}})
    return AlignSettings.of(config["experiments"]["t"]["align"])
