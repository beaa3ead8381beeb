"""Training checkpoints on disk: the directory layout, finding the newest complete one, reading
tensors by their single-device names whatever layout wrote them, and rotation.

A run directory holds `checkpoint-<step>` directories. Ranks write their files into
`checkpoint-<step>.partial`; once every rank has written, rank 0 writes the indexes and
`trainer_state.json`, renames the directory to `checkpoint-<step>` and finally writes the
completion marker. A directory without a valid marker, or whose files do not match the sizes
and sha256 recorded in its index, is reported with its path and skipped.

Two formats share one index (`checkpoint_index.json`: tensor key -> the files holding it):

- unified: every tensor whole, under the name of the single-device Hugging Face model;
  `model.safetensors.index.json` and `config.json` make the directory loadable by
  `AutoModelForCausalLM.from_pretrained`.
- sharded: every rank's tensor-parallel slice as it is in memory, with its `partition_dim`;
  `StateReader` (and so `merge_tp`) concatenates the slices.

Model weights are stored under their parameter names (fp32 master weights); Adam's moments as
`<name>.exp_avg` / `<name>.exp_avg_sq` in `optimizer-*.safetensors`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.atomic import write_json
from stages.checkpoint.integrity import sha256_file, verify
from stages.checkpoint.weights import open_safetensors, read_tensor
from stages.model.gpt2_layout import from_hf, hf_name
from stages.parallel.tensor import join_shards

log = logging.getLogger(__name__)

INDEX = "checkpoint_index.json"
TRAINER_STATE = "trainer_state.json"
COMPLETE = "checkpoint_complete.json"
HF_INDEX = "model.safetensors.index.json"
OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq")
UNIFIED, SHARDED = "unified", "sharded"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:07d}"


def optimizer_key(name: str, state_key: str) -> str:
    return f"{name}.{state_key}"


def write_hf_index(directory: Path, index: dict[str, Any]) -> None:
    """model.safetensors.index.json for the whole model tensors of a unified `index`, so that
    `from_pretrained` finds them (its weight map: tensor -> file; optimizer files are left out)."""
    weight_map = {key: parts[0]["file"] for key, parts in index["tensors"].items()
                  if parts[0]["file"].startswith("model")}
    total = sum(r["size"] for r in index["files"] if r["name"].startswith("model"))
    write_json(directory / HF_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})


def finalize(partial: Path, final: Path, *, index: dict[str, Any], trainer_state: dict[str, Any] | None,
             hf_index: bool) -> None:
    """Rank 0, after every rank's files are in `partial`: write the indexes (with `hf_index` also
    the Hugging Face one), rename to `final`, then the completion marker (holding the indexes' sha256)."""
    write_json(partial / INDEX, index)
    if trainer_state is not None:
        write_json(partial / TRAINER_STATE, trainer_state)
    if hf_index:
        write_hf_index(partial, index)
    if final.exists():  # a checkpoint of the same step from an earlier attempt
        shutil.rmtree(final)
    partial.rename(final)
    marker = {"step": index["step"], "format": index["format"], INDEX: sha256_file(final / INDEX)}
    if trainer_state is not None:
        marker[TRAINER_STATE] = sha256_file(final / TRAINER_STATE)
    write_json(final / COMPLETE, marker)


def problems(path: Path, hashes: bool = True) -> list[str]:
    """Why `path` is not a complete, intact checkpoint ([] when it is)."""
    marker = path / COMPLETE
    if not marker.is_file():
        return [f"{path} has no {COMPLETE} (the save did not finish)"]
    try:
        done = json.loads(marker.read_text())
        found = [f"{path / name} does not match the sha256 in {COMPLETE}"
                 for name in (INDEX, TRAINER_STATE) if name in done and (
                     not (path / name).is_file() or sha256_file(path / name) != done[name])]
        if found:
            return found
        index = json.loads((path / INDEX).read_text())
    except (OSError, ValueError) as exc:
        return [f"{path}: unreadable index or marker ({exc})"]
    return verify(path, index["files"], hashes=hashes)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories with a completion marker, oldest first (not verified)."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name)) and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def newest_valid(run_dir: Path) -> Path | None:
    """The newest checkpoint in `run_dir` that is complete and verifies. Every newer
    `checkpoint-<step>` directory is logged as `skipping checkpoint <path>: <reason>` (no completion
    marker: its save did not finish; or files that do not match its index), so that a resume from
    further back than expected says why."""
    if not run_dir.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name)) and p.is_dir())
    for _, path in reversed(found):
        reasons = problems(path) if (path / COMPLETE).is_file() else [f"no {COMPLETE} (the save did not finish)"]
        if not reasons:
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(reasons))
    return None


def remove_partial(run_dir: Path) -> None:
    """Delete the leftovers of saves that were interrupted (no other writer may be running)."""
    if run_dir.is_dir():
        for path in sorted(run_dir.glob("checkpoint-*.partial")):
            log.warning("skipping checkpoint %s: the save was interrupted (removed)", path)
            shutil.rmtree(path, ignore_errors=True)


def prune(run_dir: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints (0 keeps all)."""
    if keep <= 0:
        return
    for path in complete_checkpoints(run_dir)[:-keep]:
        (path / COMPLETE).unlink()  # first, so a half-deleted directory is never taken as complete
        shutil.rmtree(path, ignore_errors=True)


class StateReader:
    """Tensors of a checkpoint (unified or sharded) by key, always whole (single-device shape);
    files are opened lazily with safetensors (through `stages.checkpoint.weights`, so a bad file is
    named), one tensor read at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = json.loads((self.path / INDEX).read_text())
        self.tensors: dict[str, list[dict[str, Any]]] = self.index["tensors"]
        self._handles: dict[str, Any] = {}

    @property
    def trainer_state(self) -> dict[str, Any]:
        return json.loads((self.path / TRAINER_STATE).read_text())

    def keys(self, kind: str = "model") -> list[str]:
        return [k for k, parts in self.tensors.items() if parts[0]["file"].startswith(kind)]

    def _read(self, file: str, key: str) -> torch.Tensor:
        if file not in self._handles:  # header checked once, then kept open (memory-mapped)
            self._handles[file] = open_safetensors(self.path / file)
        return read_tensor(self._handles[file], self.path / file, key)

    def get(self, key: str) -> torch.Tensor:
        if key not in self.tensors and self.index.get("hf_layout") == "gpt2":
            return self._get_gpt2(key)
        if key not in self.tensors:
            raise KeyError(f"{self.path / INDEX} has no tensor {key!r}; the checkpoint was written for "
                           "another model architecture")
        parts = sorted(self.tensors[key], key=lambda p: p["tp_rank"])
        if [p["tp_rank"] for p in parts] != list(range(parts[0]["tp_size"])):
            raise ValueError(f"{self.path / INDEX}: tensor {key!r} has slices of tensor-parallel ranks "
                             f"{[p['tp_rank'] for p in parts]} of {parts[0]['tp_size']}; the checkpoint is incomplete")
        if len(parts) == 1:
            return self._read(parts[0]["file"], key)
        return join_shards([self._read(p["file"], key) for p in parts], parts[0]["partition_dim"],
                           parts[0].get("partition_chunks", 1))

    def has(self, key: str) -> bool:
        """Whether `get(key)` finds the tensor (our model's name, in either layout)."""
        if key in self.tensors:
            return True

        try:
            return self.index.get("hf_layout") == "gpt2" and hf_name(key) in self.tensors
        except KeyError:
            return False

    def _get_gpt2(self, key: str) -> torch.Tensor:
        """Our model's tensor `key` from a unified checkpoint written in GPT-2's names and Conv1D
        layout (`stages.model.gpt2_layout`; its optimizer moments keep our names)."""

        try:
            theirs = hf_name(key)
        except KeyError:
            theirs = None
        if theirs is None or theirs not in self.tensors:
            raise KeyError(f"{self.path / INDEX} has no tensor {key!r} (GPT-2's {theirs!r}); the checkpoint "
                           "was written for another model architecture")
        return from_hf({theirs: self.get(theirs)})[key]

    def close(self) -> None:
        self._handles.clear()
