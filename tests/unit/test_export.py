"""stages/export.py: ONNX export of a debug model, checked against torch at two sequence lengths."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from stages import export
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.model import build_model, config_for_flavour

VOCAB = 256


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    with atomic_dir(root / "model") as tmp:
        save_pretrained(build_model(config_for_flavour("debug", vocab_size=VOCAB), seed=0), tmp)
        (tmp / "tokenizer_config.json").write_text("{}\n")
    metrics = export.run(root / "model", root / "onnx", opset_version=18, atol=1e-4)
    return root, metrics


def test_metrics_and_files(exported):
    root, m = exported
    assert m["exporter"] == "dynamo" and m["opset_version"] == 18
    assert m["max_abs_diff"] <= 1e-4 and m["ort_latency_ms"] > 0
    assert [s[1] for s in m["probe_shapes"]] == [7, 23]
    assert (root / "onnx" / "model.onnx").stat().st_size == m["onnx_size_bytes"] and not m["external_data"]
    assert (root / "onnx" / "tokenizer_config.json").exists()
    meta = json.loads((root / "onnx" / "meta.json").read_text())
    assert meta["stage"] == "export" and meta["metrics"] == m


@pytest.mark.parametrize("batch,seq", [(1, 4), (2, 11)])
def test_onnx_logits_match_torch_at_other_shapes(exported, batch, seq):
    root, _ = exported
    session = ort.InferenceSession(str(root / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids"]
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))
    got = session.run(["logits"], {"input_ids": ids.numpy()})[0]
    with torch.no_grad():
        want = load_pretrained(root / "model")(ids).numpy()
    assert got.shape == (batch, seq, VOCAB)
    assert np.abs(got - want).max() <= 1e-4


def test_mismatch_beyond_atol_raises_and_writes_nothing(exported, tmp_path, monkeypatch):
    root, _ = exported
    monkeypatch.setattr(export, "export_onnx", lambda *a, **k: "dynamo")  # skip the slow part
    monkeypatch.setattr(export, "check_onnx", lambda *a, **k: (0.5, 1.0))
    with pytest.raises(ValueError, match=r"differ from torch by 0\.5 > export\.atol=0\.0001"):
        export.run(root / "model", tmp_path / "out", opset_version=18, atol=1e-4)
    assert not (tmp_path / "out").exists()
