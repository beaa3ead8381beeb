"""Checked tensor files: written atomically with their size and sha256, verified before use.

A training checkpoint is several safetensors files written by several ranks. Each file is
serialised in memory, hashed, written to a temporary name, fsynced and renamed; the writer returns
a `FileRecord` (name, size, sha256) that goes into the checkpoint's index, so a truncated, missing
or altered file is found by `verify` before anything is loaded from it. Nothing here uses pickle.

Artifact directories (a stage's output) carry the same records for their weight files in
`meta.json`'s `files` (`weight_records`, called by `stages.checkpoint.meta.write_meta`), which
`stages.checkpoint.weights` verifies whenever a stage loads the artifact.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from stages.checkpoint.atomic import atomic_file

_CHUNK = 16 * 1024 * 1024
# The files of an artifact that hold weights (or say where they are): recorded in meta.json.
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.onnx", "*.onnx.data")


@dataclass(frozen=True)
class FileRecord:
    name: str  # relative to the checkpoint directory
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def write_bytes(path: Path, data: bytes) -> FileRecord:
    """Atomically write `data` to `path` (temporary name, fsync, rename) and describe it."""
    with atomic_file(path, "wb") as f:
        f.write(data)
    return FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> FileRecord:
    """Write `tensors` as one safetensors file; `metadata` values are stored as JSON strings."""
    meta = {"format": "pt", **{k: json.dumps(v) for k, v in (metadata or {}).items()}}
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    data = save(tensors, metadata=meta)
    return write_bytes(path, sorted_metadata(data) if len(meta) > 1 else data)


def sorted_metadata(data: bytes) -> bytes:
    """A serialised safetensors file with its `__metadata__` keys in sorted order. The library
    writes them from a hash map, in an order that changes between processes, so two runs of the
    same inputs would write different bytes. The header is JSON after its 8-byte little-endian
    length and the data offsets count from the header's end, so only the header is rewritten
    (padded with spaces to a multiple of 8, as the library pads it)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + size:]


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path) -> FileRecord:
    """The record of a file already on disk (hashed in chunks: weights may be gigabytes)."""
    return FileRecord(path.name, path.stat().st_size, sha256_file(path))


def weight_records(directory: str | Path) -> list[dict[str, Any]]:
    """Records of the weight files directly in `directory` (`WEIGHT_PATTERNS`), sorted by name."""
    paths = {p for pattern in WEIGHT_PATTERNS for p in Path(directory).glob(pattern) if p.is_file()}
    return [file_record(p).to_json() for p in sorted(paths)]


def verify(directory: Path, records: list[dict[str, Any]], hashes: bool = True,
           source: str = "the index") -> list[str]:
    """Problems with the files `records` describe (missing, wrong size, wrong sha256); [] when whole.
    `source` names where the records come from, in the messages."""
    problems = []
    for record in records:
        path = directory / record["name"]
        if not path.is_file():
            problems.append(f"{path} is missing ({source} lists it)")
        elif path.stat().st_size != record["size"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, {source} records {record['size']} "
                            "(truncated or replaced)")
        elif hashes and (digest := sha256_file(path)) != record["sha256"]:
            problems.append(f"{path} has sha256 {digest[:16]}..., {source} records {record['sha256'][:16]}... "
                            "(corrupted or changed)")
    return problems

