"""Training checkpoints on disk: finalize/verify, skipping broken checkpoints, rotation, reading
sharded tensors whole, and merging tensor-parallel slices into the Hugging Face layout.

Every checkpoint here is built with the real writers (`write_tensors` + `finalize`) from a few
tiny tensors, so a test takes milliseconds.
"""

from __future__ import annotations

import json
import logging
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from stages import merge_tp
from stages.checkpoint.atomic import write_json
from stages.checkpoint.hf import load_state_dict
from stages.checkpoint.integrity import sha256_file, verify, write_tensors
from stages.checkpoint.store import (COMPLETE, HF_INDEX, INDEX, OPTIMIZER_KEYS, SHARDED, TRAINER_STATE, UNIFIED,
                                     StateReader, checkpoint_name, complete_checkpoints, finalize, newest_valid,
                                     optimizer_key, problems, prune, remove_partial)

MODEL_FILE, OPTIM_FILE, RNG_FILE = "model.safetensors", "optimizer.safetensors", "rng_state_0.safetensors"
STORE_LOGGER = "stages.checkpoint.store"


# -- builders ------------------------------------------------------------------------------------
def _model_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few tensors of the shapes and dtypes a checkpoint holds (fp32 masters, a bf16 extra)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(8, 6, generator=g),  # (vocab, hidden)
        "model.layers.0.self_attn.q_proj.weight": torch.randn(6, 6, generator=g),  # (out, in)
        "model.layers.0.mlp.down_proj.weight": torch.randn(6, 4, generator=g),  # (hidden, intermediate)
        "model.norm.weight": torch.randn(6, generator=g),
        "model.extra.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
    }


def _optimizer_state(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {optimizer_key(name, key): torch.randn(t.shape, generator=g)
            for name, t in state.items() for key in OPTIMIZER_KEYS}


def _entry(file: str, tp_rank: int = 0, tp_size: int = 1, partition_dim: int | None = None) -> dict[str, Any]:
    return {"file": file, "tp_rank": tp_rank, "tp_size": tp_size, "partition_dim": partition_dim}


def _save_unified(run_dir: Path, step: int, *, name: str | None = None, seed: int = 0) -> Path:
    """A finalized unified checkpoint `run_dir/<name>` (default `checkpoint_name(step)`)."""
    name = name or checkpoint_name(step)
    partial = run_dir / f"{name}.partial"
    partial.mkdir(parents=True)
    state = _model_state(seed)
    optim = _optimizer_state(state, seed + 1)
    records = [write_tensors(partial / MODEL_FILE, state),
               write_tensors(partial / OPTIM_FILE, optim),
               write_tensors(partial / RNG_FILE, {"torch_cpu": torch.get_rng_state()}, {"python": [3, [1, 2], None]})]
    tensors = {k: [_entry(MODEL_FILE)] for k in state} | {k: [_entry(OPTIM_FILE)] for k in optim}
    index = {"format": UNIFIED, "step": step, "optimizer_step": step, "tensors": tensors,
             "files": sorted((r.to_json() for r in records), key=lambda r: r["name"])}
    finalize(partial, run_dir / name, index=index, trainer_state={"global_step": step, "optimizer_step": step},
             hf_index=True)
    return run_dir / name


def _split(t: torch.Tensor, dim: int, tp: int = 2) -> list[torch.Tensor]:
    return [s.clone() for s in torch.chunk(t, tp, dim=dim)]


# Which dimension each model tensor is split along over tensor parallelism (None: replicated).
_PARTITION = {"model.embed_tokens.weight": 0, "model.layers.0.self_attn.q_proj.weight": 0,
              "model.layers.0.mlp.down_proj.weight": 1, "model.norm.weight": None, "model.extra.bf16": None}


def _write_sharded(directory: Path, state: dict[str, torch.Tensor], *, tp: int = 2) -> dict[str, Any]:
    """Each tp rank's model and optimizer slices in `directory`, as `snapshot(unified=False)` lays
    them out (replicated tensors once, by rank 0); returns the index. Entries are listed rank 1
    first so that readers must order them by `tp_rank`."""
    directory.mkdir(parents=True, exist_ok=True)
    optim = _optimizer_state(state)
    files: dict[str, dict[str, torch.Tensor]] = {}
    tensors: dict[str, list[dict[str, Any]]] = {}
    for source, prefix in ((state, "model"), (optim, "optimizer")):
        for key, full in source.items():
            dim = _PARTITION[key.removesuffix(".exp_avg_sq").removesuffix(".exp_avg")]
            for rank in reversed(range(tp)):
                if dim is None and rank != 0:
                    continue
                file = f"{prefix}-tp{rank:02d}-pp00-dp00.safetensors"
                piece = full if dim is None else _split(full, dim, tp)[rank]
                files.setdefault(file, {})[key] = piece
                tensors.setdefault(key, []).append(_entry(file, rank, tp if dim is not None else 1, dim))
    records = [write_tensors(directory / f, t).to_json() for f, t in files.items()]
    return {"format": SHARDED, "step": 4, "optimizer_step": 4, "tensors": tensors,
            "files": sorted(records, key=lambda r: r["name"])}


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype, key
        assert torch.equal(got[key], t), key


# -- integrity -----------------------------------------------------------------------------------
def test_write_tensors_record_matches_the_file_and_leaves_no_temporary(tmp_path):
    record = write_tensors(tmp_path / "w.safetensors", {"a": torch.arange(6.0)}, {"note": {"k": 1}})
    path = tmp_path / record.name
    assert (record.size, record.sha256) == (path.stat().st_size, sha256_file(path))
    assert verify(tmp_path, [record.to_json()]) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
    # safetensors layout: u64 little-endian header length, then a JSON header (never a pickle)
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    assert json.loads(header["__metadata__"]["note"]) == {"k": 1}


# -- finalize / problems / newest_valid ----------------------------------------------------------
def test_finalized_unified_checkpoint_verifies_loads_exactly_and_is_hf_loadable(tmp_path):
    path = _save_unified(tmp_path, 7)
    state, optim = _model_state(0), _optimizer_state(_model_state(0), 1)

    assert problems(path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(7)]  # no .partial, no temporary
    assert not any(p.name.endswith(".tmp") for p in path.iterdir())
    marker = json.loads((path / COMPLETE).read_text())
    assert marker == {"step": 7, "format": UNIFIED, INDEX: sha256_file(path / INDEX),
                      TRAINER_STATE: sha256_file(path / TRAINER_STATE)}

    reader = StateReader(path)
    assert sorted(reader.keys("model")) == sorted(state)
    assert sorted(reader.keys("optimizer")) == sorted(optim)
    _assert_same({k: reader.get(k) for k in reader.keys("model")}, state)
    _assert_same({k: reader.get(k) for k in reader.keys("optimizer")}, optim)
    assert reader.trainer_state == {"global_step": 7, "optimizer_step": 7}
    reader.close()

    hf_index = json.loads((path / HF_INDEX).read_text())
    assert set(hf_index["weight_map"].values()) == {MODEL_FILE}
    _assert_same(load_state_dict(path), state)  # via the index: model tensors only, no optimizer


def test_finalize_replaces_an_earlier_attempt_of_the_same_step(tmp_path):
    _save_unified(tmp_path, 3, seed=0)
    path = _save_unified(tmp_path, 3, seed=5)
    assert problems(path) == []
    _assert_same(load_state_dict(path), _model_state(5))


def _truncate(path: Path) -> Path:
    target = path / MODEL_FILE
    target.write_bytes(target.read_bytes()[:-7])
    return target


def _flip(path: Path) -> Path:
    _flip_last_byte(path / MODEL_FILE)
    return path / MODEL_FILE


def _delete(path: Path) -> Path:
    (path / OPTIM_FILE).unlink()
    return path / OPTIM_FILE


def _remove_marker(path: Path) -> Path:
    (path / COMPLETE).unlink()
    return path


def _edit_trainer_state(path: Path) -> Path:
    write_json(path / TRAINER_STATE, {"global_step": 999, "optimizer_step": 999})
    return path / TRAINER_STATE


def _edit_index(path: Path) -> Path:
    # an index rewritten to agree with a truncated file must still be caught, by the marker
    index = json.loads((path / INDEX).read_text())
    target = path / MODEL_FILE
    target.write_bytes(target.read_bytes()[:-4])
    for record in index["files"]:
        if record["name"] == MODEL_FILE:
            record["size"], record["sha256"] = target.stat().st_size, sha256_file(target)
    write_json(path / INDEX, index)
    return path / INDEX


@pytest.mark.parametrize("damage", [_truncate, _flip, _delete, _remove_marker, _edit_trainer_state, _edit_index],
                         ids=["truncated", "flipped-byte", "deleted-file", "no-marker", "edited-trainer-state",
                              "edited-index"])
def test_damaged_checkpoint_is_reported_and_skipped(tmp_path, caplog, damage):
    older = _save_unified(tmp_path, 9, name="checkpoint-9")
    newer = _save_unified(tmp_path, 10, name="checkpoint-10")
    assert problems(newer) == []
    if damage is _flip:
        assert (newer / MODEL_FILE).stat().st_size == json.loads((newer / INDEX).read_text())["files"][0]["size"]
    culprit = damage(newer)

    found = problems(newer)
    assert found, f"{damage.__name__} was not detected"
    assert any(str(culprit) in p for p in found), found
    assert problems(older) == []

    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert newest_valid(tmp_path) == older
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if damage is _remove_marker:  # an unfinished save is not a candidate at all, so nothing to warn about
        assert newer not in complete_checkpoints(tmp_path)
    else:
        assert any(str(newer) in w for w in warnings), warnings


def test_flipped_byte_is_missed_without_hashes_but_truncation_is_not(tmp_path):
    path = _save_unified(tmp_path, 1)
    _flip_last_byte(path / MODEL_FILE)
    assert problems(path, hashes=False) == []  # same size: only the sha256 can tell
    assert problems(path) != []
    (path / MODEL_FILE).write_bytes((path / MODEL_FILE).read_bytes()[:-1])
    assert problems(path, hashes=False) != []


def test_newest_valid_is_none_when_nothing_verifies(tmp_path, caplog):
    assert newest_valid(tmp_path / "missing") is None
    path = _save_unified(tmp_path, 1)
    (path / OPTIM_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        assert newest_valid(tmp_path) is None
    assert any(str(path) in r.getMessage() for r in caplog.records)


# -- rotation ------------------------------------------------------------------------------------
def test_remove_partial_removes_only_interrupted_saves(tmp_path):
    kept = _save_unified(tmp_path, 4)
    interrupted = tmp_path / f"{checkpoint_name(5)}.partial"
    write_tensors(interrupted / MODEL_FILE, {"a": torch.zeros(2)})
    unfinished = tmp_path / checkpoint_name(6)  # renamed but no marker yet: not a .partial
    unfinished.mkdir()
    other = tmp_path / "notes.partial"
    other.mkdir()

    remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, unfinished.name, other.name])
    assert problems(kept) == []
    remove_partial(tmp_path / "missing")  # no run directory yet: nothing to do


def test_prune_keeps_the_newest_by_step_not_by_name(tmp_path):
    paths = {step: _save_unified(tmp_path, step, name=f"checkpoint-{step}") for step in (9, 10, 100)}
    assert complete_checkpoints(tmp_path) == [paths[9], paths[10], paths[100]]

    prune(tmp_path, keep=0)
    assert complete_checkpoints(tmp_path) == [paths[9], paths[10], paths[100]]
    prune(tmp_path, keep=5)
    assert complete_checkpoints(tmp_path) == [paths[9], paths[10], paths[100]]

    prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-10", "checkpoint-100"]
    assert all(problems(p) == [] for p in (paths[10], paths[100]))
    assert newest_valid(tmp_path) == paths[100]


# -- StateReader on sharded checkpoints ----------------------------------------------------------
def test_state_reader_joins_tensor_parallel_slices(tmp_path):
    state = _model_state(3)
    index = _write_sharded(tmp_path, state)
    write_json(tmp_path / INDEX, index)
    reader = StateReader(tmp_path)

    down = index["tensors"]["model.layers.0.mlp.down_proj.weight"]
    assert [p["partition_dim"] for p in down] == [1, 1] and [p["tp_rank"] for p in down] == [1, 0]
    assert len(index["tensors"]["model.norm.weight"]) == 1
    _assert_same({k: reader.get(k) for k in reader.keys("model")}, state)
    assert reader.get("model.layers.0.mlp.down_proj.weight").shape == (6, 4)  # joined along dim 1
    assert reader.get("model.embed_tokens.weight").shape == (8, 6)  # joined along dim 0
    _assert_same({k: reader.get(k) for k in reader.keys("optimizer")}, _optimizer_state(state))

    with pytest.raises(KeyError) as excinfo:
        reader.get("model.layers.1.mlp.up_proj.weight")
    assert str(tmp_path / INDEX) in excinfo.value.args[0]
    assert "model.layers.1.mlp.up_proj.weight" in excinfo.value.args[0]


def test_reading_never_unpickles(tmp_path, monkeypatch):
    unified = _save_unified(tmp_path / "run", 2)
    sharded = tmp_path / "shards"
    write_json(sharded / INDEX, _write_sharded(sharded, _model_state(0)))

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was read with pickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    for path in (unified, sharded):
        reader = StateReader(path)
        _assert_same({k: reader.get(k) for k in reader.keys("model")}, _model_state(0))
        reader.close()
    _assert_same(load_state_dict(unified), _model_state(0))
    merge_tp.merge(sharded, tmp_path / "merged")
    _assert_same(load_file(str(tmp_path / "merged" / "model.safetensors")), _model_state(0))


# -- merge_tp ------------------------------------------------------------------------------------
_EXTRAS = {"config.json": '{"model_type": "llama"}\n', "tokenizer.json": '{"version": "1.0"}\n',
           "tokenizer_config.json": '{"bos_token": "<s>"}\n', "special_tokens_map.json": '{"eos_token": "</s>"}\n',
           "train_log.csv": "step,loss\n1,2.5\n2,2.25\n",
           "events.out.tfevents.1700000000.host.1.0": "TensorBoard records\n"}  # any name TensorBoard gives


def _sharded_dir(directory: Path, state: dict[str, torch.Tensor], *, as_checkpoint: bool) -> Path:
    """A sharded stage output (index swapped in whole) or a finalized sharded training checkpoint."""
    if as_checkpoint:
        partial = directory.with_name(directory.name + ".partial")
        index = _write_sharded(partial, state)
        target = partial
    else:
        index = _write_sharded(directory, state)
        target = directory
    for name, text in _EXTRAS.items():
        (target / name).write_text(text)
    write_json(target / "meta.json", {"stage": "pretrain", "seed": 0})
    if as_checkpoint:
        finalize(partial, directory, index=index, trainer_state={"global_step": 4}, hf_index=False)
    else:
        write_json(directory / INDEX, index)
    return directory


@pytest.mark.parametrize("as_checkpoint", [False, True], ids=["stage-output", "training-checkpoint"])
def test_merge_writes_the_unsharded_model_and_carries_the_extras(tmp_path, as_checkpoint):
    state = _model_state(2)
    shards = _sharded_dir(tmp_path / "shards", state, as_checkpoint=as_checkpoint)
    out = tmp_path / "merged"

    summary = merge_tp.merge(shards, out)
    assert summary["format"] == SHARDED
    assert summary["tensors"] == len(state)
    assert summary["merged_tensor_parallel"] == 3  # embed, q_proj, down_proj

    _assert_same(load_file(str(out / "model.safetensors")), state)  # no optimizer tensors
    _assert_same(load_state_dict(out), state)
    for name, text in _EXTRAS.items():
        assert (out / name).read_text() == text, name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "pretrain" and meta["seed"] == 0
    assert meta["merged_from"]["path"] == str(shards)
    assert meta["merged_from"]["format"] == SHARDED
    assert not (out / INDEX).exists() and not (out / COMPLETE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "shards"]  # no temporary left over


@pytest.mark.parametrize("as_checkpoint", [False, True], ids=["stage-output", "training-checkpoint"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_merge_refuses_a_corrupted_shard_and_writes_nothing(tmp_path, as_checkpoint, damage):
    shards = _sharded_dir(tmp_path / "shards", _model_state(2), as_checkpoint=as_checkpoint)
    bad = shards / "model-tp01-pp00-dp00.safetensors"
    if damage == "flip":
        _flip_last_byte(bad)
    else:
        bad.write_bytes(bad.read_bytes()[:-3])
    out = tmp_path / "merged"

    with pytest.raises(ValueError, match=r"model-tp01-pp00-dp00\.safetensors"):
        merge_tp.merge(shards, out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shards"]


def test_merge_explains_a_directory_without_an_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="unified_checkpoint: false"):
        merge_tp.merge(tmp_path, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


def test_state_reader_refuses_a_tensor_with_missing_slices(tmp_path):
    """An index that lists one of two tensor-parallel slices must not pass for the whole tensor."""
    full = torch.arange(12.0).reshape(4, 3)
    record = write_tensors(tmp_path / "model-tp00.safetensors", {"w": full[:2].clone()})
    write_json(tmp_path / INDEX, {"format": SHARDED, "step": 1, "files": [record.to_json()],
                                  "tensors": {"w": [{"file": "model-tp00.safetensors", "tp_rank": 0, "tp_size": 2,
                                                     "partition_dim": 0}]}})
    with pytest.raises(ValueError, match=r"ranks \[0\] of 2"):
        StateReader(tmp_path).get("w")
