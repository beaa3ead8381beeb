"""stages/data/sft_format.py: the one chat-template decision. Readers of prepared data follow
index.json's sft_format after the tokenizer check; prompts outside it follow --chat-template, then
the tokenizer's template."""

import logging

import pytest

from checkpoint_fixtures import chat_tokenizer
from stages.checkpoint.atomic import write_json
from stages.data.sft_format import data_chat_format, format_name, prompt_format, recorded_chat_format
from stages.errors import InputError


def test_the_recorded_format_and_its_name():
    assert recorded_chat_format({"sft_format": "chat_template"}) is True
    assert recorded_chat_format({"sft_format": "plain"}) is False
    assert recorded_chat_format({}) is False  # an index written before sft_format was recorded
    assert (format_name(True), format_name(False)) == ("chat_template", "plain")


def test_prepared_data_decides_after_the_tokenizer_check(tiny_tokenizer_dir, tmp_path, caplog):
    chat = chat_tokenizer(tiny_tokenizer_dir)
    assert data_chat_format(chat, "m", None) is False  # no data dir: plain (finetune, calibration)
    with caplog.at_level(logging.WARNING):
        assert data_chat_format(chat, "m", tmp_path) is False  # not written by prepare: plain, with a warning
    assert "has no index.json" in caplog.text
    for fmt, want in (("plain", False), ("chat_template", True)):
        write_json(tmp_path / "index.json", {"vocab_size": len(chat), "sft_format": fmt})
        assert data_chat_format(chat, "m", tmp_path) is want
    write_json(tmp_path / "index.json", {"vocab_size": len(chat) + 1, "sft_format": "chat_template"})
    with pytest.raises(InputError, match="tokenizer mismatch"):
        data_chat_format(chat, "m", tmp_path)


def test_prompts_follow_the_choice_then_the_data_then_the_tokenizer(tiny_tokenizer_dir, tmp_path):
    chat, plain = chat_tokenizer(tiny_tokenizer_dir), chat_tokenizer(tiny_tokenizer_dir, chat_template=False)
    assert prompt_format("auto", chat, "m", None) is True
    assert prompt_format("auto", plain, "m", None) is False
    assert prompt_format("false", chat, "m", None) is False
    with pytest.raises(InputError, match="has no chat template"):
        prompt_format("true", plain, "m", None)
    write_json(tmp_path / "index.json", {"vocab_size": len(chat), "sft_format": "plain"})
    assert prompt_format("auto", chat, "m", tmp_path) is False  # the data's record wins over the template
    assert prompt_format("true", chat, "m", tmp_path) is True  # as asked
