"""The one gate every weight file passes before a stage reads it.

Every stage that loads a model or an adapter (our loader, transformers' `from_pretrained`, peft's)
first calls `check_model_dir` / `check_adapter_dir`, and tensors are read only through
`load_state_dict` / `open_safetensors`. The checks, in order:

1. integrity: when the directory's `meta.json` records its weight files (`files`: name, size,
   sha256, written by `stages.checkpoint.meta.write_meta`), each must be there with that size and
   hash; a mismatch names the file, what differs and the stage that wrote it (rerun it). A
   directory without records (a user's own checkpoint) is allowed, with the checks below only.
2. no pickle: weights only in `.bin` / `.pt` / `.pth` / `.ckpt` files are refused with the
   one-line conversion to safetensors (unpickling can run code; transformers is also called with
   `use_safetensors=True`, so it never falls back to them).
3. format: every safetensors file's header is parsed here (8-byte length, JSON, every tensor's
   byte range against the file size), so a truncated file, a pickle renamed `.safetensors` or
   garbage is named with its path instead of surfacing as safetensors' bare "incomplete metadata"
   or "header too large"; a sharded index must list only shards that exist and hold its tensors.

Any failure raises `WeightsError` (a ValueError) whose message names the file, the tensor where
one is at fault, and the fix. Hashing reads every weight byte once per load (about a second for a
500 MB model); header checks read a few kilobytes. The stages that take float weights only
(export, merge, quantize) also `refuse_quantized` a model whose config.json has a
`quantization_config`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.integrity import verify
from stages.checkpoint.meta import META_NAME
from stages.checkpoint.source import PICKLE_SUFFIXES, pickle_conversion_hint
from stages.errors import InputError

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors refuses longer headers ("header too large")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class WeightsError(InputError):
    """A weight file a stage cannot use; the message names the file (and tensor) and the fix."""


# -- integrity: meta.json's records ------------------------------------------------------------------
def _writer(directory: Path) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(stage, weight records) of `directory`'s meta.json; (None, None) when it has none."""
    path = directory / META_NAME
    if not path.is_file():
        return None, None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path} is unreadable ({e}); delete {directory} and rerun snakemake to write "
                           "it again") from None
    return meta.get("stage"), meta.get("files")


def _fix(directory: Path, stage: str | None) -> str:
    """The remedy an error about a file in `directory` ends with: rerun the stage that wrote it, when
    meta.json names one."""
    if stage is not None:
        return f"delete {directory} and rerun snakemake so that stage {stage!r} writes it again"
    if (directory / "checkpoint_index.json").is_file():
        return f"delete {directory} (a training checkpoint: the run resumes from an earlier one, or from the start)"
    return ("re-create the directory (model.save_pretrained(dir, safe_serialization=True)) or copy it "
            "again from its source")


def verify_artifact(directory: str | Path) -> bool:
    """Check `directory`'s weight files against the sizes and sha256 its meta.json records.
    Returns whether there were records (False: a directory no stage wrote; nothing to compare)."""
    directory = Path(directory)
    stage, records = _writer(directory)
    if records is None:
        log.info("%s records no weight sizes or sha256 (not written by a stage): checking the file "
                 "formats only", directory)
        return False
    problems = verify(directory, records, source=f"{directory / META_NAME} (written by stage {stage!r})")
    if problems:
        raise WeightsError("; ".join(problems) + f": the weights changed after the stage wrote them; "
                           f"{_fix(directory, stage)}")
    return True


# -- format: safetensors headers -----------------------------------------------------------------------
def _looks_like_pickle(start: bytes) -> bool:
    """torch.save's zip archive, or a bare pickle of protocol 2 to 5 (legacy torch.save)."""
    return start.startswith(b"PK\x03\x04") or (start[:1] == b"\x80" and start[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))


def read_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header (name -> dtype, shape, data_offsets),
    after checking that the file is whole: WeightsError naming the file (and the tensor) otherwise.

    Layout: u64 little-endian header length N, N bytes of JSON, then the tensors' bytes, whose
    ranges (relative to the end of the header) must tile the rest of the file exactly."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path} is missing; {_fix(path.parent, _writer(path.parent)[0])}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(8)
        length = struct.unpack("<Q", start)[0] if len(start) == 8 else None
        raw = f.read(length) if length is not None and length <= min(size, MAX_HEADER_BYTES) else b""

    def fail(reason: str) -> WeightsError:
        if _looks_like_pickle(start):  # checked only on failure: a header length can begin with 0x80
            return WeightsError(f"{path}: not a safetensors file but a pickle (torch.save output) with a "
                                f"{path.suffix} name; this pipeline never unpickles (it can run code). Rename it "
                                f"to pytorch_model.bin, then {pickle_conversion_hint(path.parent)}")
        return WeightsError(f"{path}: not a readable safetensors file ({reason}); "
                            f"{_fix(path.parent, _writer(path.parent)[0])}")

    if length is None:
        raise fail(f"truncated: {size} bytes, fewer than the 8-byte header length")
    if length > MAX_HEADER_BYTES:
        raise fail(f"header too large: the first 8 bytes give a {length}-byte header, safetensors allows "
                   f"{MAX_HEADER_BYTES}: not safetensors content")
    if 8 + length > size:
        raise fail(f"truncated: the header alone needs {8 + length} bytes, the file has {size}")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise fail("the header is not a JSON object: not safetensors content, or corrupted")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = entry["dtype"], entry["shape"], entry["data_offsets"]
            nbytes = math.prod(shape) * _DTYPE_BYTES.get(dtype, 0)
        except (KeyError, TypeError, ValueError):
            raise fail(f"tensor {name!r} has a malformed header entry {entry!r}") from None
        if dtype in _DTYPE_BYTES and stop - begin != nbytes:
            raise fail(f"tensor {name!r} ({dtype}, shape {shape}) spans {stop - begin} bytes, its shape needs {nbytes}")
        end = max(end, stop)
    if 8 + length + end > size:
        raise fail(f"truncated: the header describes {8 + length + end} bytes, the file has {size}")
    if 8 + length + end < size:
        raise fail(f"{size - 8 - length - end} bytes beyond the tensors its header describes")
    return header


def open_safetensors(path: str | Path) -> Any:
    """`safetensors.safe_open(path, framework="pt")` after `read_header` (use it in a `with`, or keep
    it open); any error safetensors still raises on opening names the file."""
    from safetensors import safe_open

    path = Path(path)
    read_header(path)
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises SafetensorError, OSError, ...
        raise WeightsError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e}); "
                           f"{_fix(path.parent, _writer(path.parent)[0])}") from None


def read_tensor(handle: Any, path: Path, key: str) -> torch.Tensor:
    """One tensor of an `open_safetensors` handle; an error names the file and the tensor."""
    try:
        return handle.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - any failure of the reader is reported with where it was
        raise WeightsError(f"{path}: cannot read tensor {key!r} ({type(e).__name__}: {e}); "
                           f"{_fix(path.parent, _writer(path.parent)[0])}") from None


def read_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (checked first)."""
    path = Path(path)
    with open_safetensors(path) as f:
        return {key: read_tensor(f, path, key) for key in f.keys()}


# -- directories ----------------------------------------------------------------------------------
def _pickles(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)


def model_weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory: the shards its index lists, else
    model.safetensors. WeightsError when a listed shard is missing, when the weights are pickle
    files only (with the conversion), or when there are none."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); "
                               f"{_fix(model_dir, _writer(model_dir)[0])}") from None
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            keys = [k for k, s in weight_map.items() if s == missing[0]]
            raise WeightsError(f"{index} lists shard {missing[0]} (tensors {keys[:2]}, {len(keys)} in all) but "
                               f"{model_dir / missing[0]} is missing" + (f", as are {missing[1:]}" if missing[1:] else "")
                               + f"; {_fix(model_dir, _writer(model_dir)[0])}")
        return [model_dir / s for s in shards]
    if (model_dir / WEIGHTS_NAME).is_file():
        return [model_dir / WEIGHTS_NAME]
    pickles = _pickles(model_dir) if model_dir.is_dir() else []
    if pickles:
        raise WeightsError(f"{model_dir / pickles[0]}: the weights of {model_dir} are pickle files ({', '.join(pickles[:3])}), "
                           "which this pipeline never loads (unpickling can run code); "
                           f"{pickle_conversion_hint(model_dir)}")
    raise WeightsError(f"{model_dir} has neither {WEIGHTS_NAME} nor {INDEX_NAME}; expected a Hugging Face "
                       "model directory written with safetensors")


def check_model_dir(model_dir: str | Path) -> list[Path]:
    """Run every check of the module docstring on an HF model directory before anything loads it;
    returns its safetensors files. With a sharded index, each listed tensor must be in its shard."""
    model_dir = Path(model_dir)
    verify_artifact(model_dir)
    files = model_weight_files(model_dir)
    headers = {p.name: read_header(p) for p in files}
    index = model_dir / INDEX_NAME
    if index.is_file():
        for key, shard in json.loads(index.read_text())["weight_map"].items():
            if key not in headers[shard]:
                raise WeightsError(f"{index} puts tensor {key!r} in {model_dir / shard}, which does not hold it; "
                                   f"{_fix(model_dir, _writer(model_dir)[0])}")
    return files


def refuse_quantized(model_dir: str | Path, refusal: Callable[[str], str]) -> None:
    """Raise InputError(`refusal(quant_method)`) when `model_dir`'s config.json has a
    `quantization_config` (null is a float model's, as `stages.model.config` reads it): the stage
    takes float weights, and its sentence names the flag or key to fix and what to give instead. A
    directory without config.json passes; what loads it names what is missing."""
    config_path = Path(model_dir) / "config.json"
    quantization = json.loads(config_path.read_text()).get("quantization_config") if config_path.is_file() else None
    if quantization is not None:
        raise InputError(refusal(quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"))


def _adapter_hint(adapter_dir: Path) -> str:
    base = "BASE_MODEL_DIR"
    with contextlib.suppress(OSError, ValueError):
        base = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path") or base
    return ("convert it once with peft, in an environment you trust: python -c \"import peft, transformers; "
            f"base = transformers.AutoModelForCausalLM.from_pretrained('{base}'); "
            f"peft.PeftModel.from_pretrained(base, '{adapter_dir}').save_pretrained('{adapter_dir}', "
            "safe_serialization=True)\"")


def check_adapter_dir(adapter_dir: str | Path) -> Path:
    """The checks for a peft adapter directory (adapter_model.safetensors), before peft reads it:
    records, no pickle-only adapter (`adapter_model.bin` is refused with the conversion), format."""
    adapter_dir = Path(adapter_dir)
    verify_artifact(adapter_dir)
    path = adapter_dir / ADAPTER_WEIGHTS_NAME
    if not path.is_file():
        pickles = _pickles(adapter_dir)
        if pickles:
            raise WeightsError(f"{adapter_dir / pickles[0]}: the adapter weights are a pickle file, which this "
                               f"pipeline never loads (unpickling can run code); {_adapter_hint(adapter_dir)}")
        raise WeightsError(f"{path} is missing; a peft adapter directory holds adapter_config.json and "
                           f"{ADAPTER_WEIGHTS_NAME} (PeftModel.save_pretrained(dir, safe_serialization=True))")
    read_header(path)
    return path


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF model directory (single file or sharded), after `check_model_dir`."""
    state: dict[str, torch.Tensor] = {}
    for path in check_model_dir(model_dir):
        state.update(read_file(path))
    return state
