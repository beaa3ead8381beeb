"""import_base: a checkpoint saved by transformers arrives in results/<name>/base intact, with its
tokenizer, its config fields and the proof that our Llama computes what transformers computes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers import PreTrainedTokenizerFast

from checkpoint_fixtures import chat_tokenizer, save_checkpoint
from stages import import_base


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_tokenizer_dir):
    return save_checkpoint(tmp_path_factory.mktemp("src") / "llama", chat_tokenizer(tiny_tokenizer_dir))


def test_import_keeps_everything_and_checks_parity(llama, tmp_path):
    metrics = import_base.run(llama, tmp_path / "base")
    base = tmp_path / "base"
    # rope_theta=1e5 in transformers 5's rope_parameters: read right, our logits are transformers'.
    assert metrics["family"] == "Llama" and metrics["our_model"]
    assert metrics["max_rel_logit_diff"] <= 1e-5 and metrics["top1_agreement"] == 1.0
    assert json.loads((base / "config.json").read_text()) == json.loads((llama / "config.json").read_text())
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (base / name).read_bytes() == (llama / name).read_bytes(), name
    meta = json.loads((base / "meta.json").read_text())
    assert meta["stage"] == "import_base" and meta["parent"] == str(llama)
    assert meta["config"]["architecture"] == "LlamaForCausalLM" and metrics["weights_sha256"]["model.safetensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    assert model.config.rope_parameters["rope_theta"] == 100000.0
    assert metrics["num_parameters"] == sum(p.numel() for p in model.parameters())


def test_a_family_without_our_model_is_imported_without_parity(tmp_path, tiny_tokenizer_dir):
    gpt2 = save_checkpoint(tmp_path / "gpt2", PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), "gpt2")
    metrics = import_base.run(gpt2, tmp_path / "base")
    assert metrics["family"] == "GPT-2" and not metrics["our_model"] and "max_rel_logit_diff" not in metrics


def test_a_truncated_weight_file_is_named_and_nothing_is_written(llama, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ValueError, match=r"broken/model.safetensors: not a readable safetensors file"):
        import_base.run(broken, tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_a_config_our_model_reads_differently_fails_the_parity_check(llama, tmp_path, monkeypatch):
    """The guard itself: were our model to compute anything differently (simulated here by scaling
    one projection after loading), the stage stops with the figures instead of importing a model
    that trains as another."""
    from stages.checkpoint import hf

    real = hf.load_pretrained

    def scaled_q_proj(path, *args, **kwargs):
        model = real(path, *args, **kwargs)
        with torch.no_grad():
            model.model.layers["0"].self_attn.q_proj.weight.mul_(1.5)
        return model

    monkeypatch.setattr(hf, "load_pretrained", scaled_q_proj)
    with pytest.raises(ValueError, match=r"our Llama and transformers' LlamaForCausalLM disagree"):
        import_base.run(llama, tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_cli(llama, tmp_path):
    metrics = import_base.main(["--source", str(llama), "--out", str(tmp_path / "b"), "--no-parity-check"])
    assert "max_rel_logit_diff" not in metrics and (tmp_path / "b" / "model.safetensors").exists()


@pytest.mark.parametrize("adds_bos", [False, True])
def test_an_imported_tokenizer_keeps_its_own_special_tokens(tmp_path, tiny_tokenizer_dir, adds_bos):
    """The files of an imported checkpoint are carried as they are: a ChatML tokenizer without bos
    adds nothing, one whose post-processor adds bos keeps adding it (unlike ours, neither is given
    or stripped of a bos). Either way its users' ids are the predictor's: the chat template's prompt,
    or `[bos] src` in the plain format."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from stages.data.sft import SftRecord, encode_prompt
    from stages.data.tokenizer import load_model_tokenizer

    source = chat_tokenizer(tiny_tokenizer_dir, chat_template=not adds_bos)
    if adds_bos:  # a Llama-like tokenizer: bos `<s>`, added by its post-processor
        source.bos_token = "<s>"
        source.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", source.convert_tokens_to_ids("<s>"))])
    src = save_checkpoint(tmp_path / "src", source)
    import_base.run(src, tmp_path / "base", check_parity=False)
    theirs, users = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(tmp_path / "base")
    ours = load_model_tokenizer(tmp_path / "base")
    text = "colour: red; size: big"
    assert users(text).input_ids == theirs(text).input_ids
    record = SftRecord(src=[text], tgt=[""])
    if adds_bos:
        assert users(text).input_ids == encode_prompt(ours, record, 1 << 20) == [1] + users(
            text, add_special_tokens=False).input_ids
    else:
        prompt = users.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompt = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
        assert prompt == encode_prompt(ours, record, 1 << 20, chat=True)
        assert users(text).input_ids == users(text, add_special_tokens=False).input_ids
