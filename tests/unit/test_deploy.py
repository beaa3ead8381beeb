"""stages/deploy.py: an artifact is written, checked with the runtime users deploy with (here
transformers' GGUF loader, for a mixture of experts transformers on our reading of the file, and
transformers with compressed-tensors) on validation text, and only then published; a failed check
publishes nothing and leaves the previous artifact; the manifest lists what was published with its
check. The writers themselves: test_gguf_writer.py,
test_compressed_tensors.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from checkpoint_fixtures import save_checkpoint, sharpen_and_perturb
from stages import deploy
from stages.config import ConfigError
from stages.data.corpus import write_token_files
from stages.deployment import checks
from stages.metrics.measured import without_measured


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, debug_model_dir):
    """A prepared data dir whose validation split is random tokens of the debug model's vocabulary."""
    vocab = json.loads((debug_model_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    splits = {split: [rng.integers(3, vocab, 300).tolist() for _ in range(2)] for split in ("train", "validation")}
    root = tmp_path_factory.mktemp("deploy_data")
    write_token_files(root, splits, vocab_size=vocab, bos_id=1, eos_id=2, pad_id=0)
    return root


def test_a_gguf_file_is_checked_by_transformers_and_listed_in_the_manifest(debug_model_dir, data_dir, tmp_path):
    out = tmp_path / "exp" / "deploy" / "gguf-f32"
    metrics = deploy.gguf(debug_model_dir, "f32", data_dir, out)
    check = metrics["check"]
    assert check["top1_agreement"] == 1.0 and check["rel_err"] <= deploy.GGUF_MAX_REL_ERR
    assert check["positions"] == checks.PROBE_WINDOWS * checks.PROBE_LENGTH and check["tokenizer_mismatches"] == 0
    assert "GGUF loader" in check["runtime"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stage"] == "deploy" and meta["metrics"]["check"] == check
    assert (out / "model-f32.gguf").is_file() and sorted(p.name for p in out.iterdir()) == ["meta.json",
                                                                                           "model-f32.gguf"]

    again = deploy.gguf(debug_model_dir, "f32", data_dir, tmp_path / "again")  # a rerun writes the same bytes
    assert (tmp_path / "again" / "model-f32.gguf").read_bytes() == (out / "model-f32.gguf").read_bytes()
    assert without_measured(again) == without_measured(metrics)

    listed = deploy.manifest(tmp_path / "exp", tmp_path / "exp" / "deploy" / "manifest.json")["artifacts"]
    assert list(listed) == ["gguf-f32"]  # no export/ in this experiment
    assert listed["gguf-f32"]["path"] == str(out / "model-f32.gguf") and listed["gguf-f32"]["check"] == check


def test_a_failed_check_publishes_nothing_and_keeps_the_previous_artifact(debug_model_dir, data_dir, tmp_path):
    out = tmp_path / "gguf"
    deploy.gguf(debug_model_dir, "f32", data_dir, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # q4_0 of a random-init model flips near-ties: a top-1 of 1.0 cannot be kept
    with pytest.raises(ValueError, match=r"top-1 agreement 0\.\d+ .* below deploy\.min_top1_agreement\.q4_0=1\.0"):
        deploy.gguf(debug_model_dir, "q4_0", data_dir, out, {"min_top1_agreement": {"q4_0": 1.0}})
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["gguf"]  # no temporary directory left beside it


ROUTERS = {"mixtral": "block_sparse_moe.gate.weight", "qwen2_moe": "mlp.gate.weight", "qwen3_moe": "mlp.gate.weight",
           "olmoe": "mlp.gate.weight"}


def _mixture(root, tokenizer_dir, model_type: str):
    """transformers-saved random mixture with clear-cut routing and non-trivial biases and norms (Qwen2-MoE tied)."""
    extra = {"tie_word_embeddings": True} if model_type == "qwen2_moe" else {}
    out = save_checkpoint(root / model_type, PreTrainedTokenizerFast.from_pretrained(tokenizer_dir),
                          model_type=model_type, **extra)
    return sharpen_and_perturb(out, ROUTERS[model_type])


@pytest.mark.parametrize("model_type", list(ROUTERS))
def test_a_mixtures_gguf_file_is_checked_through_our_reading_of_it(model_type, tiny_tokenizer_dir, data_dir,
                                                                   tmp_path):
    """transformers' GGUF loader reads no Mixtral or OLMoE experts (and Qwen2-/Qwen3-MoE at default widths only):
    the check loads the float model stages.checkpoint.gguf_mixture reads from the file, and leaves no scratch."""
    src = _mixture(tmp_path / "src", tiny_tokenizer_dir, model_type)
    check = deploy.gguf(src, "f32", data_dir, tmp_path / "deploy" / "gguf-f32")["check"]
    assert check["top1_agreement"] == 1.0 and check["rel_err"] <= deploy.GGUF_MAX_REL_ERR, check
    assert "stages.checkpoint.gguf_mixture" in check["runtime"] and check["tokenizer_mismatches"] == 0
    assert sorted(p.name for p in (tmp_path / "deploy").iterdir()) == ["gguf-f32"]
    assert sorted(p.name for p in (tmp_path / "deploy" / "gguf-f32").iterdir()) == ["meta.json", "model-f32.gguf"]


def test_a_mixtures_file_with_its_routers_written_wrong_is_refused(tiny_tokenizer_dir, data_dir, tmp_path,
                                                                   monkeypatch):
    """The check is not blind to the experts: a writer that negated every router (other experts chosen)
    publishes nothing."""
    from stages.deployment import gguf_writer

    src = _mixture(tmp_path / "src", tiny_tokenizer_dir, "mixtral")
    written = gguf_writer.gguf_tensors

    def negated_routers(state, config, arch):
        return {name: -t if name.endswith("ffn_gate_inp.weight") else t
                for name, t in written(state, config, arch).items()}

    monkeypatch.setattr(gguf_writer, "gguf_tensors", negated_routers)
    with pytest.raises(ValueError, match=r"gguf_mixture .* below deploy\.min_top1_agreement\.f32"):
        deploy.gguf(src, "f32", data_dir, tmp_path / "deploy" / "gguf-f32")
    assert not (tmp_path / "deploy" / "gguf-f32").exists()
    assert [p.name for p in (tmp_path / "deploy").iterdir()] == []


def test_settings_are_checked_against_the_schema(debug_model_dir, data_dir, tmp_path):
    with pytest.raises(ConfigError, match="min_top1_agreement"):
        deploy.gguf(debug_model_dir, "f32", data_dir, tmp_path / "x", {"min_top1_agreement": {"q9": 0.5}})
    with pytest.raises(ConfigError, match="--config is not valid JSON"):
        deploy.main(["gguf", "--model", str(debug_model_dir), "--type", "f32", "--data", str(data_dir),
                     "--out", str(tmp_path / "x"), "--config", "{"])
    assert not (tmp_path / "x").exists()


def test_agreement_and_require_name_the_numbers_and_the_setting():
    want = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    found = checks.agreement(want, torch.tensor([[[1.0, 0.5], [0.9, 0.8]]]))
    assert (found.top1_agreement, found.positions) == (0.5, 2) and found.rel_err == pytest.approx(0.9)
    assert (found.strict_top1_agreement, found.near_ties) == (0.5, 0)
    with pytest.raises(ValueError, match=r"a\.gguf: top-1 agreement 0\.5000 .* 2 validation positions "
                                         r"\(0 near-ties forgiven\) .* x=0\.9"):
        checks.require(found, 0.9, "a.gguf", "x")
    with pytest.raises(ValueError, match="differ from the source's by 9.00e-01"):
        checks.require(found, 0.5, "a.gguf", "x", max_rel_err=1e-5)
    with pytest.raises(ValueError, match="vocabulary"):
        checks.agreement(want, want[..., :1])


def test_a_flip_on_a_near_tie_of_the_source_is_not_a_disagreement():
    """The source leads by 0.05 of a logit scale of 10 (0.5% <= TIE_RTOL): a flip there is rounding on
    a tie; a flip where it leads by 0.5 (5%) stays a disagreement."""
    want = torch.tensor([[[10.0, 9.95, 0.0], [10.0, 9.5, 0.0], [0.0, 1.0, 10.0]]])
    got = torch.tensor([[[9.96, 9.98, 0.0], [9.6, 9.9, 0.0], [0.0, 1.0, 10.0]]])
    found = checks.agreement(want, got)
    assert found.near_ties == 1 and found.strict_top1_agreement == pytest.approx(1 / 3)
    assert found.top1_agreement == pytest.approx(2 / 3)
    assert checks.agreement(want, got, tie_rtol=0.0).top1_agreement == pytest.approx(1 / 3)


def test_the_cli_takes_the_sections_settings_as_options(debug_model_dir, data_dir, tmp_path, capsys):
    metrics = deploy.main(["gguf", "--model", str(debug_model_dir), "--type", "f32", "--data", str(data_dir),
                           "--out", str(tmp_path / "g"), "--min-top1-agreement", '{"f32": 1.0}'])
    assert metrics["check"]["min_top1_agreement"] == 1.0
    with pytest.raises(SystemExit):
        deploy.main(["compressed-tensors", "--help"])
    assert "--min-top1-agreement" in capsys.readouterr().out


@pytest.mark.parametrize("variants, deployed, message", [
    (["wint8", "a8w8"], ["a8w8-smooth"], r"'a8w8-smooth' is not one of experiments\.x\.quantize\.variants"),
    (["wint8"], ["wint8"], r"'wint8' is a rtn variant; the compressed-tensors export takes A8W8 variants"),
    (["a8w8-smooth-shift"], ["a8w8-smooth-shift"],
     r"'a8w8-smooth-shift' has shift: true, which the compressed-tensors format cannot express"),
])
def test_a_deploy_section_the_formats_cannot_serve_is_refused_when_the_config_is_read(variants, deployed, message):
    from stages.config import check_config

    exp = {"model": {"flavour": "debug"}, "quantize": {"variants": variants},
           "deploy": {"compressed_tensors": deployed}}
    with pytest.raises(ConfigError, match=f"experiments\\.x\\.deploy\\.compressed_tensors: {message}"):
        check_config({"experiments": {"x": exp}})


def test_the_gguf_check_starts_from_prompt_text(debug_model_dir, data_dir, tmp_path, caplog):
    """The check encodes prompt text as the GGUF's users get it (transformers' GGUF tokenizer, special
    tokens as the file says) against the predictor's prompt ids: the prepared tokenizer's file adds
    the bos (no mismatch); a tokenizer that adds nothing under the plain format loses it on every
    prompt, which the metrics and a warning say."""
    import shutil

    from checkpoint_fixtures import save_prepared_tokenizer

    prepared = tmp_path / "prepared"
    shutil.copytree(debug_model_dir, prepared)
    save_prepared_tokenizer(prepared)  # the same vocabulary, adding bos as prepare's tokenizer does
    check = deploy.gguf(prepared, "f32", data_dir, tmp_path / "a")["check"]
    assert check["prompt_texts"] == len(checks.TOKENIZER_PROBES) and check["prompt_text_mismatches"] == 0
    with caplog.at_level("WARNING"):
        check = deploy.gguf(debug_model_dir, "f32", data_dir, tmp_path / "b")["check"]
    assert check["prompt_text_mismatches"] == len(checks.TOKENIZER_PROBES)
    assert check["first_prompt_text_mismatch"] == checks.TOKENIZER_PROBES[0]
    assert "must add the special tokens the model was trained with" in caplog.text


def test_the_prompt_text_check_under_a_chat_template(tiny_tokenizer_dir):
    """Chat format: the users' prompt is the chat template's rendering (equal here); an artifact
    whose tokenizer lost the template mismatches on every prompt instead of failing to render."""
    from checkpoint_fixtures import chat_tokenizer

    tokenizer = chat_tokenizer(tiny_tokenizer_dir)
    assert checks.prompt_text_mismatches(tokenizer, tokenizer, chat=True) == []
    bare = chat_tokenizer(tiny_tokenizer_dir, chat_template=False)
    assert checks.prompt_text_mismatches(tokenizer, bare, chat=True) == list(checks.TOKENIZER_PROBES)
