"""stages/export.py: ONNX export (with a KV cache) of a debug model, checked against torch at two
sequence lengths with the scale-free check (relative error and top-1 agreement) and by generation,
which a wrong graph fails. The cache itself: tests/unit/test_onnx_decoder.py."""

import json

import numpy as np
import pytest
import torch

from stages import export
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import load_pretrained, save_pretrained
from stages.deployment.onnx_generate import OnnxDecoder
from stages.model import build_model, config_for_flavour

VOCAB = 256


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    with atomic_dir(root / "model") as tmp:
        save_pretrained(build_model(config_for_flavour("debug", vocab_size=VOCAB), seed=0), tmp)
        (tmp / "tokenizer_config.json").write_text("{}\n")
    metrics = export.run(root / "model", root / "onnx", {"int8": False})  # int8: tests/unit/test_onnx_decoder.py
    return root, metrics


def test_metrics_and_files(exported):
    root, m = exported
    assert m["torch_model"] == "project" and m["exporter"] == "dynamo" and m["opset_version"] == 18
    assert m["kv_cache"] and m["generation_tokens_compared"] == 48 and m["generation_near_ties"] == 0
    assert not m["genai_config"]  # the fixture's config and tokenizer name no eos: nothing to stop at
    assert m["rel_err"] <= 1e-5 and m["top1_agreement"] == 1.0 and m["ort_latency_ms"] > 0
    assert m["rel_err"] == pytest.approx(m["max_abs_diff"] / m["logit_scale"])
    assert (m["rtol"], m["min_top1_agreement"]) == (1e-3, 0.99)  # the schema's defaults
    assert [s[1] for s in m["probe_shapes"]] == [7, 37]
    assert (root / "onnx" / "model.onnx").stat().st_size == m["onnx_size_bytes"] and not m["external_data"]
    assert (root / "onnx" / "tokenizer_config.json").exists()
    meta = json.loads((root / "onnx" / "meta.json").read_text())
    assert meta["stage"] == "export" and meta["metrics"] == m


@pytest.mark.parametrize("batch,seq", [(1, 4), (2, 11)])
def test_onnx_logits_match_torch_at_other_shapes(exported, batch, seq):
    root, _ = exported
    decoder = OnnxDecoder(root / "onnx" / "model.onnx")
    assert [i.name for i in decoder.session.get_inputs()][:3] == ["input_ids", "attention_mask", "position_ids"]
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seq))
    got = decoder.logits(ids.numpy())
    with torch.no_grad():
        want = load_pretrained(root / "model")(ids).numpy()
    assert got.shape == (batch, seq, VOCAB)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_wrong_graph_fails_the_check_and_writes_nothing(exported, tmp_path, monkeypatch):
    """One weight of the torch model changed after export: the graph no longer computes the model."""
    root, _ = exported
    real_export = export.export_onnx

    def export_then_perturb(model, *args, **kwargs):
        exporter = real_export(model, *args, **kwargs)
        with torch.no_grad():
            model.model.model.layers["0"].mlp.down_proj.weight[0, 0] += 1.0
        return exporter

    monkeypatch.setattr(export, "export_onnx", export_then_perturb)
    with pytest.raises(ValueError, match=r"of the logit scale .* > export\.rtol=0\.001"):
        export.run(root / "model", tmp_path / "out", {"opset_version": 18, "int8": False})
    assert not (tmp_path / "out").exists()


def _logits(seed: int, shape=(2, 50, 40)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_relative_error_scales_with_the_logits():
    want = _logits(0) * 30.0  # a trained model's logit range
    got = want + 3e-3  # what a correct 135M fp32 graph shows, and more than the old atol 1e-4
    a = export.compare_logits([got], [want])
    assert a.max_abs_diff == pytest.approx(3e-3, rel=1e-3) and a.rel_err < 1e-4 and a.top1_agreement == 1.0
    export.check_agreement(a, rtol=1e-3, min_top1_agreement=0.99)
    bad = export.compare_logits([want * 1.01], [want])  # 1% drift: beyond rtol
    with pytest.raises(ValueError, match=r"> export\.rtol=0\.001"):
        export.check_agreement(bad, rtol=1e-3, min_top1_agreement=0.99)


def test_top1_disagreement_fails_even_within_rtol():
    """Logits whose top two are within rtol of each other everywhere: a graph that swaps them is
    within the relative error yet means something else; the top-1 condition catches it."""
    want = _logits(1)
    top = want.argmax(-1)
    second = np.where(np.arange(want.shape[-1]) == top[..., None], -np.inf, want).argmax(-1)
    got = want.copy()
    rows = np.indices(top.shape)
    got[(*rows, second)] = want[(*rows, top)] + 1e-4  # every second-best becomes the best, barely
    a = export.compare_logits([got], [want])
    assert a.top1_agreement == 0.0 and a.positions == 100
    expected = r"top-1 token agrees at 0\.0000 of 100 positions < export\.min_top1_agreement=0\.99"
    with pytest.raises(ValueError, match=expected):
        export.check_agreement(a, rtol=1.0, min_top1_agreement=0.99)
    export.check_agreement(export.compare_logits([want], [want]), rtol=0.0, min_top1_agreement=1.0)


def test_nan_fails_the_check():
    want = _logits(2)
    got = want.copy()
    got[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="export.rtol"):
        export.check_agreement(export.compare_logits([want, got], [want, want]), rtol=1e-3, min_top1_agreement=0.0)


def test_a_wrong_cache_fails_the_generation_check(exported, tmp_path, monkeypatch):
    """A graph whose logits are right without a past but whose cache is wrong (the present keys
    scaled) passes the logit probes and fails the generation check."""
    root, _ = exported
    from stages.deployment import onnx_decoder

    real_attention = onnx_decoder._cached_attention

    def wrong_present(*args):
        y, k, v = real_attention(*args)
        return y, k * 1.5, v

    monkeypatch.setattr(onnx_decoder, "_cached_attention", wrong_present)
    with pytest.raises(ValueError, match="greedy generation with the KV cache differs from torch"):
        export.run(root / "model", tmp_path / "out", {"opset_version": 18, "int8": False})
    assert not (tmp_path / "out").exists()


def test_a_family_without_our_model_keeps_the_cache_free_graph(tmp_path, tiny_tokenizer_dir):
    """GPT-2 (transformers' model): input_ids -> logits as before, no genai_config, no int8."""
    from checkpoint_fixtures import save_checkpoint
    from transformers import PreTrainedTokenizerFast

    save_checkpoint(tmp_path / "gpt2", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), "gpt2")
    m = export.run(tmp_path / "gpt2", tmp_path / "onnx")
    assert m["torch_model"] == "transformers" and not m["kv_cache"] and not m["genai_config"]
    assert m["generation_rows"] is None and m["rel_err"] <= 1e-5
    assert not (tmp_path / "onnx" / "genai_config.json").exists()
    decoder = OnnxDecoder(tmp_path / "onnx" / "model.onnx")
    assert not decoder.has_cache and decoder.logits(np.ones((1, 3), np.int64)).shape[:2] == (1, 3)
    # export.int8 (on by default) quantizes the cache graph only: nothing here, a warning in the log
    assert not (tmp_path / "onnx" / "int8").exists() and "int8_top1_agreement" not in m


def test_cli_names_an_unknown_setting(exported, tmp_path):
    root, _ = exported
    with pytest.raises(ValueError, match=r"'export.atol' is unknown; did you mean 'rtol'"):
        export.main(["--model", str(root / "model"), "--out", str(tmp_path / "o"),
                     "--config", json.dumps({"opset_version": 18, "atol": 1e-4})])
