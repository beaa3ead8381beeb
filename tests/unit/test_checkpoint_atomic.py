"""Atomic writes: a failure leaves the earlier result intact and no half-written file behind."""

import json
import os

import pytest

from stages.checkpoint.atomic import atomic_dir, atomic_file, write_json


def test_failed_directory_write_keeps_the_previous_result(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("killed mid-write")
    assert (target / "weights").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left over


def test_successful_directory_write_replaces_and_is_readable(tmp_path):
    target = tmp_path / "out"
    for version in ("v1", "v2"):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_text(version)
    assert (target / "weights").read_text() == "v2"
    assert oct(target.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_failed_file_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.json"
    write_json(path, {"a": 1})
    with pytest.raises(ValueError):
        with atomic_file(path) as f:
            f.write('{"a": ')
            raise ValueError("boom")
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["m.json"]
