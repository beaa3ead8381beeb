"""stages/checkpoint/weights.py: every way a weight file can be unusable is named with its path (and
tensor) and the fix; meta.json's records catch a flipped byte; pickle is never read; a directory
saved by the installed transformers loads unchanged. The last tests go through the real CLI."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from checkpoint_fixtures import save_checkpoint
from stages.checkpoint import weights
from stages.checkpoint.hf import save_state_dict
from stages.checkpoint.meta import write_meta
from stages.checkpoint.weights import WeightsError

REPO = Path(__file__).resolve().parents[2]


def _state(n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(8, 8, generator=g) for i in range(n)}


@pytest.fixture
def written(tmp_path):
    """An artifact as a stage writes it: model.safetensors, then meta.json recording it."""
    out = tmp_path / "sft"
    out.mkdir()
    save_state_dict(_state(), out)
    write_meta(out, stage="finetune-sft", config={}, parent=None, seed=0, metrics={})
    return out


@pytest.fixture
def plain(written):
    """The same weights with no meta.json: a user's own directory, nothing recorded."""
    (written / "meta.json").unlink()
    return written


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's data: the header stays valid
    path.write_bytes(bytes(data))


# -- files that load --------------------------------------------------------------------------------
def test_a_directory_saved_by_transformers_loads_exactly(tmp_path, tiny_tokenizer_dir):
    model_dir = save_checkpoint(tmp_path / "llama", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    got = weights.load_state_dict(model_dir)
    want = load_file(str(model_dir / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert weights.check_model_dir(model_dir) == [model_dir / "model.safetensors"]


def test_write_meta_records_every_weight_file(written):
    from stages.checkpoint.integrity import sha256_file

    files = json.loads((written / "meta.json").read_text())["files"]
    path = written / "model.safetensors"
    assert files == [{"name": "model.safetensors", "size": path.stat().st_size, "sha256": sha256_file(path)}]
    assert weights.verify_artifact(written) is True


def test_a_sharded_directory_loads_through_its_index(tmp_path):
    save_state_dict(_state(), tmp_path, max_shard_bytes=300)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 4
    got = weights.load_state_dict(tmp_path)
    assert all(torch.equal(got[k], v) for k, v in _state().items())


def test_an_unrecorded_directory_is_allowed(plain):
    assert weights.verify_artifact(plain) is False
    assert sorted(weights.load_state_dict(plain)) == sorted(_state())


# -- integrity: meta.json's records -----------------------------------------------------------------
def test_a_flipped_byte_is_found_by_sha256_with_the_stage_that_wrote_it(written):
    _flip_last_byte(written / "model.safetensors")
    with pytest.raises(WeightsError, match=r"sft/model.safetensors has sha256 \w{16}\.\.\., .*meta.json "
                                           r"\(written by stage 'finetune-sft'\) records \w{16}\.\.\. .*"
                                           r"delete .*sft and rerun snakemake"):
        weights.load_state_dict(written)


def test_a_truncated_recorded_file_names_both_sizes(written):
    path = written / "model.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightsError, match=rf"has {size - 10} bytes, .*meta.json \(written by stage "
                                           rf"'finetune-sft'\) records {size} \(truncated or replaced\)"):
        weights.check_model_dir(written)


def test_a_missing_recorded_file_is_named(written):
    (written / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"model.safetensors is missing \(.*meta.json .*'finetune-sft'"):
        weights.check_model_dir(written)


# -- format: unrecorded files ------------------------------------------------------------------------
@pytest.mark.parametrize("keep, reason", [
    (-10, r"truncated: the header describes \d+ bytes, the file has \d+"),
    (40, r"truncated: the header alone needs \d+ bytes, the file has 40"),
    (5, r"truncated: 5 bytes, fewer than the 8-byte header length"),
])
def test_a_truncated_file_is_named(plain, keep, reason):
    path = plain / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(WeightsError, match=rf"sft/model.safetensors: not a readable safetensors file \({reason}\); "
                                           r"re-create the directory"):
        weights.load_state_dict(plain)


def test_a_pickle_renamed_safetensors_is_refused_unread(plain, monkeypatch):
    import pickle

    torch.save(_state(), plain / "model.safetensors")
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(WeightsError, match=r"model.safetensors: not a safetensors file but a pickle .*never "
                                           r"unpickles.*Rename it to pytorch_model.bin.*safe_serialization=True"):
        weights.load_state_dict(plain)


@pytest.mark.parametrize("content, reason", [
    (b"this is not a weight file at all" * 4, r"header too large: .* not safetensors content"),
    (len(b"{not json").to_bytes(8, "little") + b"{not json", r"the header is not a JSON object"),
])
def test_garbage_is_named(plain, content, reason):
    (plain / "model.safetensors").write_bytes(content)
    with pytest.raises(WeightsError, match=rf"model.safetensors: not a readable safetensors file \({reason}"):
        weights.check_model_dir(plain)


def test_a_header_that_lies_about_a_tensor_names_the_tensor(plain):
    path = plain / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header["layer.2.weight"]["shape"] = [8, 9]
    raw = json.dumps(header).encode().ljust(length)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length:])
    with pytest.raises(WeightsError, match=r"tensor 'layer.2.weight' \(F32, shape \[8, 9\]\) spans 256 bytes, "
                                           r"its shape needs 288"):
        weights.load_state_dict(plain)


def test_a_shard_listed_in_the_index_but_missing_is_named(tmp_path):
    save_state_dict(_state(), tmp_path, max_shard_bytes=300)
    (tmp_path / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json lists shard model-00003-of-00004"
                                           r".safetensors \(tensors \['layer.2.weight'\], 1 in all\) but "
                                           r".*model-00003-of-00004.safetensors is missing"):
        weights.load_state_dict(tmp_path)


def test_an_index_pointing_at_the_wrong_shard_names_the_tensor(tmp_path):
    save_state_dict(_state(), tmp_path, max_shard_bytes=300)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["layer.0.weight"] = "model-00002-of-00004.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"puts tensor 'layer.0.weight' in .*model-00002-of-00004.safetensors, "
                                           r"which does not hold it"):
        weights.check_model_dir(tmp_path)


# -- no pickle ------------------------------------------------------------------------------------------
def test_a_bin_only_directory_is_refused_with_the_conversion(tmp_path):
    torch.save(_state(), tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match=r"pytorch_model.bin: the weights of .* are pickle files .*never loads.*"
                                           r"python -c \"from transformers import AutoModelForCausalLM as M; "
                                           r"dir = '.*'; M.from_pretrained\(dir\).save_pretrained\(dir, "
                                           r"safe_serialization=True\)\""):
        weights.load_state_dict(tmp_path)


def test_a_bin_only_adapter_is_refused_with_the_peft_conversion(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "results/x/base"}))
    torch.save(_state(1), tmp_path / "adapter_model.bin")
    with pytest.raises(WeightsError, match=r"adapter_model.bin: the adapter weights are a pickle file.*"
                                           r"from_pretrained\('results/x/base'\); peft.PeftModel.from_pretrained"
                                           r"\(base, '.*'\).save_pretrained\('.*', safe_serialization=True\)"):
        weights.check_adapter_dir(tmp_path)


def test_no_torch_load_without_weights_only_in_the_stages():
    found = subprocess.run(["grep", "-rn", "torch.load", "stages", "bench"], cwd=REPO, capture_output=True, text=True)
    assert [line for line in found.stdout.splitlines() if "weights_only=True" not in line] == []


# -- through the real CLI ----------------------------------------------------------------------------
def _evaluate(model_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    data = tmp_path / "data"
    (data / "sft").mkdir(parents=True, exist_ok=True)
    (data / "sft" / "dev.json").write_text('{"src": "a", "tgt": "b"}\n')  # the model fails before the data is read
    return subprocess.run([sys.executable, "-m", "stages.evaluate", "--model", str(model_dir), "--data", str(data),
                           "--out", str(tmp_path / "eval.json"), "--variant", "x"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def _stage_written(tmp_path, tiny_tokenizer_dir) -> Path:
    model_dir = save_checkpoint(tmp_path / "sft", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    write_meta(model_dir, stage="finetune-sft", config={}, parent=None, seed=0, metrics={})
    return model_dir


def test_evaluate_cli_stops_on_a_flipped_byte(tmp_path, tiny_tokenizer_dir):
    model_dir = _stage_written(tmp_path, tiny_tokenizer_dir)
    _flip_last_byte(model_dir / "model.safetensors")
    done = _evaluate(model_dir, tmp_path)
    assert done.returncode == 2 and not (tmp_path / "eval.json").exists()
    last = done.stderr.strip().splitlines()[-1]  # one line, no traceback (stages.errors.run_cli)
    assert last.startswith("evaluate: error: ") and f"{model_dir}/model.safetensors" in last
    assert "Traceback" not in done.stderr
    assert "stage 'finetune-sft'" in last and "rerun snakemake" in last


def test_evaluate_cli_refuses_a_pytorch_model_bin(tmp_path, tiny_tokenizer_dir):
    model_dir = save_checkpoint(tmp_path / "user", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    torch.save(load_file(str(model_dir / "model.safetensors")), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    done = _evaluate(model_dir, tmp_path)
    assert done.returncode != 0 and not (tmp_path / "eval.json").exists()
    last = done.stderr.strip().splitlines()[-1]
    assert f"{model_dir}/pytorch_model.bin" in last and "save_pretrained(dir, safe_serialization=True)" in last


def test_evaluate_cli_refuses_a_pickle_adapter(tmp_path, tiny_tokenizer_dir):
    base = save_checkpoint(tmp_path / "base", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(base)}))
    torch.save({}, adapter / "adapter_model.bin")
    shutil.copy2(base / "tokenizer.json", adapter / "tokenizer.json")
    done = _evaluate(adapter, tmp_path)
    assert done.returncode != 0
    assert f"{adapter}/adapter_model.bin: the adapter weights are a pickle file" in done.stderr.strip().splitlines()[-1]
