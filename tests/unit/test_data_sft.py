"""SFT data (stages/data/sft.py): reading the JSON-lines files (every malformed line named by file
and line), the plain format and the chat-template format, whose loss covers exactly the assistant
turns."""

from __future__ import annotations

import pytest

from checkpoint_fixtures import chat_tokenizer
from stages.data.sft import (IGNORE_INDEX, SftDataError, SftRecord, chat_segments, encode_example, encode_prompt,
                             read_sft_file, uses_chat_template)

RECORD = SftRecord(src=["count: 3; shape: box", "and two?"], tgt=["three boxes", "two boxes"])


@pytest.fixture(scope="module")
def chat(tiny_tokenizer_dir):
    return chat_tokenizer(tiny_tokenizer_dir)


def learned(tokenizer, ids, labels):
    """The learned spans as text, one string per maximal run of labels != -100."""
    spans, run = [], []
    for i, label in zip(ids, labels):
        if label == IGNORE_INDEX:
            if run:
                spans.append(tokenizer.decode(run))
            run = []
        else:
            assert label == i
            run.append(i)
    return spans + ([tokenizer.decode(run)] if run else [])


def test_chat_loss_covers_exactly_the_assistant_turns(chat):
    ids, labels = encode_example(chat, RECORD, src_length=64, max_length=256, chat=True)
    assert learned(chat, ids, labels) == ["three boxes<|im_end|>", "two boxes<|im_end|>"]
    rendered = chat.apply_chat_template(
        [{"role": r, "content": c} for s, t in zip(RECORD.src, RECORD.tgt) for r, c in (("user", s), ("assistant", t))],
        tokenize=False)
    assert chat.decode(ids) == rendered.rstrip()  # the template's text, token for token
    # Generation starts where training's last assistant turn starts: same ids, same position.
    prompt = encode_prompt(chat, RECORD, src_length=256, chat=True)
    assert ids[:len(prompt)] == prompt and chat.decode(prompt).endswith("<|im_start|>assistant\n")


def test_plain_format_learns_targets_and_eos(chat, tiny_tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    plain = PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir)
    ids, labels = encode_example(plain, RECORD, src_length=64, max_length=256)
    assert ids[0] == plain.bos_token_id
    assert learned(plain, ids, labels) == ["three boxes</s>", "two boxes</s>"]
    # A tokenizer without bos (GPT-2 style) gets no bos rather than a None id.
    ids, _ = encode_example(chat, RECORD, src_length=64, max_length=256, chat=False)
    assert None not in ids and ids[0] != chat.bos_token_id


def test_chat_template_is_used_only_when_asked_and_present(chat, tiny_tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    assert uses_chat_template(chat, True) and not uses_chat_template(chat, False)
    assert not uses_chat_template(PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir), True)


def test_prompt_truncation_keeps_the_latest_context(chat):
    ids, labels = encode_example(chat, RECORD, src_length=5, max_length=256, chat=True)
    assert learned(chat, ids, labels) == ["three boxes<|im_end|>", "two boxes<|im_end|>"]
    prompt = encode_prompt(chat, RECORD, src_length=5, chat=True)
    assert len(prompt) == 5 and chat.decode(prompt).endswith("stant\n")  # the last 5 tokens


def test_a_template_that_rewrites_history_is_refused(tiny_tokenizer_dir):
    weird = chat_tokenizer(tiny_tokenizer_dir)
    # Renders only the last message: a prefix of the conversation is not a prefix of its rendering.
    weird.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(SftDataError, match="set data.chat_template: false"):
        chat_segments(weird, RECORD)


# --- reading SFT files (stages.data.files.json_lines underneath) -------------------------------

@pytest.mark.parametrize("content, match", [
    (b'{"src": "a", "tgt": "b"}\n{"src": "caf\xe9", "tgt": "b"}\n',
     r"train.json:2: not UTF-8 \(byte 0xe9 at byte 13 of the line, offset 37 of the file.*convert the file to UTF-8"),
    (b'{"src": "a", "tgt": "b"}\n\n{"src": "a", "tgt": \n',
     r"train.json:3: malformed JSON \(.*\); each line must be one JSON object such as "
     r"\{\"src\": \"...\", \"tgt\": \"...\"\}"),
    (b'[1, 2]\n', r"train.json:1: expected a JSON object, got an array"),
    (b'{"src": "a", "tgt": "b"}\n{"src": "a"}\n', r"train.json:2: record has no 'tgt' \(keys present: \['src'\]\); "
                                                  r"each line needs both 'src' and 'tgt'"),
    (b'{"src": 3, "tgt": "b"}\n', r"train.json:1: 'src' must be a string or a non-empty list of strings"),
    (b'', r"train.json: no JSON lines \(the file is empty or blank\)"),
    (b'\n \n', r"train.json: no JSON lines"),
])
def test_bad_sft_file_names_file_line_and_fix(tmp_path, content, match):
    (tmp_path / "train.json").write_bytes(content)
    with pytest.raises(SftDataError, match=match):
        read_sft_file(tmp_path / "train.json")


def test_sft_file_that_is_a_directory_or_missing(tmp_path):
    (tmp_path / "train.json").mkdir()
    with pytest.raises(SftDataError, match=r"train.json is a directory, not a file"):
        read_sft_file(tmp_path / "train.json")
    with pytest.raises(SftDataError, match=r"gone.json cannot be read \(No such file or directory\)"):
        read_sft_file(tmp_path / "gone.json")


def test_sft_file_with_bom_and_crlf(tmp_path):
    (tmp_path / "train.json").write_bytes(b'\xef\xbb\xbf{"src": "a", "tgt": "b"}\r\n{"src": ["c"], "tgt": ["d"]}\r\n')
    assert read_sft_file(tmp_path / "train.json") == [SftRecord(["a"], ["b"]), SftRecord(["c"], ["d"])]
