"""stages/data/preference.py: pairs read in every shape it accepts (ours, TRL's explicit and
conversational ones, LLaMA-Factory's alpaca and sharegpt ones) become the same record; bad lines
name the file, the line, the field and the fix; and the builtin task's pairs
(stages.data.attributes.rejected_answer) are wrong in each way a model can be wrong."""

from __future__ import annotations

import json
import random

import pytest

from stages.data import attributes
from stages.data.preference import (
    PreferenceDataError,
    PreferenceRecord,
    read_preference_file,
    write_preference_file,
)

ONE_ROUND = PreferenceRecord(src=["count: 3; shape: box; size: big; color: red"], history=[],
                             chosen="three big red boxes", rejected="three big red box")
TWO_ROUNDS = PreferenceRecord(src=["Hi", "count: 1; shape: star; size: big; color: red"], history=["Hello!"],
                              chosen="a big red star", rejected="a red big star", system="Be brief.")
USER, ANSWER = ONE_ROUND.src[0], ONE_ROUND.chosen


def _write(tmp_path, lines) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _messages(*turns):
    return [{"role": role, "content": text} for role, text in turns]


@pytest.mark.parametrize("line, expected", [
    ({"src": USER, "chosen": ANSWER, "rejected": "three big red box"}, ONE_ROUND),
    ({"prompt": USER, "chosen": ANSWER, "rejected": "three big red box"}, ONE_ROUND),
    ({"prompt": _messages(("user", USER)), "chosen": _messages(("assistant", ANSWER)),
      "rejected": _messages(("assistant", "three big red box"))}, ONE_ROUND),
    ({"chosen": _messages(("user", USER), ("assistant", ANSWER)),  # TRL's implicit prompt
      "rejected": _messages(("user", USER), ("assistant", "three big red box"))}, ONE_ROUND),
    ({"instruction": USER, "chosen": ANSWER, "rejected": "three big red box"}, ONE_ROUND),
    ({"conversations": [{"from": "human", "value": USER}], "chosen": {"from": "gpt", "value": ANSWER},
      "rejected": {"from": "gpt", "value": "three big red box"}}, ONE_ROUND),
    ({"src": ["Hi", TWO_ROUNDS.src[1]], "tgt": ["Hello!"], "system": "Be brief.", "chosen": "a big red star",
      "rejected": "a red big star"}, TWO_ROUNDS),
    ({"prompt": _messages(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"),
                          ("user", TWO_ROUNDS.src[1])),
      "chosen": "a big red star", "rejected": "a red big star"}, TWO_ROUNDS),
    ({"instruction": TWO_ROUNDS.src[1], "history": [["Hi", "Hello!"]], "system": "Be brief.",
      "chosen": "a big red star", "rejected": "a red big star"}, TWO_ROUNDS),
    ({"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                                               {"from": "human", "value": TWO_ROUNDS.src[1]}],
      "chosen": {"from": "gpt", "value": "a big red star"}, "rejected": {"from": "gpt", "value": "a red big star"}},
     TWO_ROUNDS),
], ids=["ours", "trl", "trl-conversational", "trl-implicit-prompt", "alpaca", "sharegpt", "ours-multi-round",
        "trl-multi-round", "alpaca-history", "sharegpt-multi-round"])
def test_every_shape_reads_as_the_same_pair(tmp_path, line, expected):
    assert read_preference_file(_write(tmp_path, [line])) == [expected]


def test_alpaca_input_joins_the_instruction(tmp_path):
    line = {"instruction": "Describe:", "input": USER, "chosen": ANSWER, "rejected": "x"}
    assert read_preference_file(_write(tmp_path, [line]))[0].src == [f"Describe:\n\n{USER}"]


def test_written_pairs_read_back_and_encode_as_sft_records(tmp_path):
    write_preference_file(tmp_path / "out.jsonl", [ONE_ROUND, TWO_ROUNDS])
    assert read_preference_file(tmp_path / "out.jsonl") == [ONE_ROUND, TWO_ROUNDS]
    rejected = TWO_ROUNDS.conversation(TWO_ROUNDS.rejected)
    assert rejected.src == TWO_ROUNDS.src and rejected.tgt == ["Hello!", "a red big star"]
    assert rejected.system == "Be brief."


@pytest.mark.parametrize("line, message", [
    ({"src": USER, "chosen": ANSWER}, r"pairs.jsonl:2: no 'rejected' \(keys present: \['chosen', 'src'\]\)"),
    ({"src": USER, "chosen": ANSWER, "rejected": " "}, r"pairs.jsonl:2: 'rejected' is empty; give both answers"),
    ({"src": USER, "chosen": 3, "rejected": "x"}, r"pairs.jsonl:2: 'chosen' must be a string or one assistant"),
    ({"src": ["a", "b"], "chosen": "c", "rejected": "d"},
     r"pairs.jsonl:2: 'tgt' must hold the answers to the 1 earlier round\(s\) of 'src', got 0"),
    ({"prompt": _messages(("user", "a"), ("user", "b")), "chosen": "c", "rejected": "d"},
     r"pairs.jsonl:2: 'prompt' must alternate user and assistant turns"),
    ({"prompt": [{"who": "user"}], "chosen": "c", "rejected": "d"}, r"pairs.jsonl:2: prompt\[0\] must be a message"),
    ({"chosen": _messages(("user", "a"), ("assistant", "b")), "rejected": _messages(("user", "z"), ("assistant", "c"))},
     r"pairs.jsonl:2: without 'prompt', 'chosen' and 'rejected' must be the same conversation"),
    ({"question": USER, "chosen": ANSWER, "rejected": "x"},
     r"pairs.jsonl:2: no prompt: give 'src', 'prompt', 'instruction' or 'conversations'"),
    ({"src": USER, "chosen": ANSWER, "rejected": ANSWER}, r"pairs.jsonl: pair 2 has the same chosen and rejected"),
])
def test_a_bad_line_names_the_file_line_and_field(tmp_path, line, message):
    good = {"src": USER, "chosen": ANSWER, "rejected": "three big red box"}
    with pytest.raises(PreferenceDataError, match=message):
        read_preference_file(_write(tmp_path, [good, line]))


def test_the_builtin_tasks_rejected_answers_are_wrong_in_every_way():
    train, dev = attributes.generate(num_train=400, num_dev=32, seed=3)
    rng = random.Random(0)
    kinds = {m: 0 for m in attributes.MISTAKES}
    for record in train + dev:
        combo = attributes.parse_src(record.src[0])
        assert attributes.describe(*combo) == record.tgt[0]
        for mistake in attributes.MISTAKES:
            wrong = attributes.wrong_answer(combo, mistake, rng)
            assert wrong != record.tgt[0] and len(wrong.split()) == len(record.tgt[0].split()), (record, mistake)
            kinds[mistake] += 1
    assert attributes.wrong_answer(("big", "red", "box", 3), "order", rng) == "three red big boxes"
    assert attributes.wrong_answer(("big", "red", "box", 1), "plural", rng) == "a big red boxes"
    assert attributes.wrong_answer(("big", "red", "box", 3), "plural", rng) in ("three big red box",
                                                                                "three big red boxs")
    drawn = [attributes.rejected_answer(r, random.Random(7)) for r in train[:50]]
    assert drawn == [attributes.rejected_answer(r, random.Random(7)) for r in train[:50]]  # a function of the seed
