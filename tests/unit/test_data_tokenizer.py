"""Tests of stages/data/tokenizer.py: special ids, HF layout, round trips, determinism."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from stages.data.tokenizer import TokenizerError, load_tokenizer, save_tokenizer, train_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\n" * 3,
    "def square(x):\n    return x ** 2  # a comment\n",
    "Unicode: naïve café, 日本語, emoji 🙂, tabs\tand  double  spaces.",
    "three big red circles; an enormous blue box",
]
ROUND_TRIP = [
    "hello world",
    " leading space and trailing space ",
    "  two leading spaces",
    "x = 1 , y = 2 . z",  # spaces before punctuation survive (no clean-up)
    "line one\n\nline three\r\n\ttabbed",
    "naïve café 日本語 🙂 ünseen wörds ß",
    "",
]


@pytest.fixture(scope="module")
def trained():
    return train_tokenizer(TEXTS, 300)


def test_special_token_ids(trained):
    assert trained.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [0, 1, 2]
    assert (trained.pad_token_id, trained.bos_token_id, trained.eos_token_id) == (0, 1, 2)


def test_vocab_size_is_respected(trained):
    assert len(trained) <= 300
    assert len(train_tokenizer(TEXTS * 5, 260)) == 260


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(trained, text):
    ids = trained(text, add_special_tokens=False).input_ids
    assert trained.decode(ids) == text


def test_encoding_with_special_tokens_adds_the_bos_of_the_training_format(trained):
    text = "hello world"
    bare = trained(text, add_special_tokens=False).input_ids
    assert trained(text).input_ids == [1] + bare  # [bos] src, as stages.data.sft trains it
    assert trained(text, "and more").input_ids[:1] == [1] and trained(text, "and more").input_ids.count(1) == 1
    assert trained.decode(trained(text).input_ids + [2], skip_special_tokens=True) == text


def test_save_writes_hf_layout_and_autotokenizer_loads(trained, tmp_path):
    save_tokenizer(trained, tmp_path / "tok")
    names = sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    specials = json.loads((tmp_path / "tok" / "special_tokens_map.json").read_text())
    assert specials == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert len(loaded) == len(trained)
    for text in ROUND_TRIP:
        ids = loaded(text, add_special_tokens=False).input_ids
        assert ids == trained(text, add_special_tokens=False).input_ids
        assert loaded.decode(ids) == text
    assert load_tokenizer(tmp_path / "tok").eos_token_id == 2


def test_deterministic_in_process(tmp_path):
    for name in ("a", "b"):
        save_tokenizer(train_tokenizer(TEXTS, 300), tmp_path / name)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_deterministic_across_processes(tmp_path):
    """The Rust trainer's hash maps are seeded per process; the output must not depend on it."""
    save_tokenizer(train_tokenizer(TEXTS, 300), tmp_path / "here")
    code = ("import sys; from stages.data.tokenizer import train_tokenizer, save_tokenizer; "
            f"save_tokenizer(train_tokenizer({TEXTS!r}, 300), sys.argv[1])")
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, cwd=repo)
    assert (tmp_path / "here" / "tokenizer.json").read_bytes() == (tmp_path / "there" / "tokenizer.json").read_bytes()


def test_vocab_too_small_is_an_error():
    with pytest.raises(TokenizerError, match=r"vocab_size=100 is below 259.*data.vocab_size"):
        train_tokenizer(TEXTS, 100)


def test_load_missing_dir_names_the_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer.json is missing.*prepare"):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.parametrize("src", ["hello world", "colour: red; size: big", "def f(x):\n    return x"])
def test_the_saved_files_encode_prompt_text_as_the_predictor_does(trained, tmp_path, src):
    """A user of the shipped files (transformers' AutoTokenizer, called on the prompt text) gets the
    ids the project's predictor and evaluation feed the model: `[bos] src`, the plain format."""
    from stages.data.sft import SftRecord, encode_prompt

    save_tokenizer(trained, tmp_path / "tok")
    users = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = encode_prompt(load_tokenizer(tmp_path / "tok"), SftRecord(src=[src], tgt=[""]), src_length=1 << 20)
    assert users(src).input_ids == ours
    assert ours[0] == users.bos_token_id == 1
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
