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


def test_sorted_metadata_makes_the_bytes_independent_of_insertion_order_and_still_loads(tmp_path):
    import torch
    from safetensors.torch import load_file

    from stages.checkpoint.integrity import write_tensors

    tensors = {"b": torch.arange(5.0), "a": torch.ones(3, dtype=torch.int64)}
    one = write_tensors(tmp_path / "one.safetensors", tensors, {"python": [1, 2], "numpy": "x", "c": 3})
    two = write_tensors(tmp_path / "two.safetensors", tensors, {"c": 3, "numpy": "x", "python": [1, 2]})
    assert one.sha256 == two.sha256
    loaded = load_file(tmp_path / "one.safetensors")
    assert torch.equal(loaded["a"], tensors["a"]) and torch.equal(loaded["b"], tensors["b"])


def test_a_full_disk_names_the_path_and_the_space(tmp_path):
    import errno

    from stages.errors import DiskFullError

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = tmp_path / "out"
    message = r"no space left writing .*out.*: more than 0\.0 MB needed, [\d,.]+ MB free"
    with pytest.raises(DiskFullError, match=message):
        with atomic_dir(target) as tmp:
            (tmp / "part").write_bytes(b"x" * 10)
            no_space()
    assert not target.exists() and not list(tmp_path.iterdir())  # nothing half-written left
