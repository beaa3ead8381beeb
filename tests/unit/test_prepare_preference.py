"""prepare's preference pairs (stages/prepare.py, data.preference): the builtin task's pairs made of
the SFT records, a user's directory in TRL's or LLaMA-Factory's shapes normalised to ours, and the
errors (a bad line named by file:line, a missing directory named by its key) raised before any
byte is written."""

import json

import pytest

from stages import prepare
from stages.data import attributes
from stages.data.preference import PreferenceDataError, read_preference_file
from stages.data.sft import read_sft_file
from stages.data.validate import DataConfigError, check_data_section

TINY = dict(sft="builtin:attributes", vocab_size=300, validation_fraction=0.2, num_sft_train=24, num_sft_dev=6,
            seed=3, chat_template=False)


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "c.txt").write_text("A few words about nothing in particular, said twice. " * 20)
    return str(tmp_path / "c.txt")


def listing(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def test_builtin_pairs_are_the_sft_records_with_a_wrong_answer(tmp_path, corpus):
    out = tmp_path / "data"
    metrics = prepare.run(out, {**TINY, "corpus": [corpus]})
    assert (metrics["num_preference_train"], metrics["num_preference_dev"]) == (24, 6)
    for split in ("train", "dev"):
        sft = read_sft_file(out / "sft" / f"{split}.json")
        pairs = read_preference_file(out / "preference" / f"{split}.json")
        assert [p.src for p in pairs] == [r.src for r in sft]  # dev pairs are the held-out dev records
        assert [p.chosen for p in pairs] == [r.tgt[-1] for r in sft]
        assert all(p.rejected != p.chosen for p in pairs)
        # the rejected answer describes the same kind of thing, wrong in one respect
        assert all(len(p.rejected.split()) == len(p.chosen.split()) for p in pairs)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["preference"] is None and meta["metrics"]["num_preference_dev"] == 6


def test_builtin_pairs_are_deterministic_for_a_seed():
    train, dev = attributes.generate(40, 8, seed=5)
    first = prepare.load_preference(None, "builtin:attributes", train, dev, seed=5)
    again = prepare.load_preference("builtin:attributes", "builtin:attributes", train, dev, seed=5)
    other = prepare.load_preference(None, "builtin:attributes", train, dev, seed=6)
    assert first == again
    assert [p.rejected for p in first.train] != [p.rejected for p in other.train]
    assert [p.chosen for p in first.train] == [p.chosen for p in other.train]
    # dev pairs do not depend on how many train records there are
    fewer = prepare.load_preference(None, "builtin:attributes", train[:10], dev, seed=5)
    assert fewer.dev == first.dev


def test_no_pairs_beside_a_user_sft_dir(tmp_path, corpus):
    (tmp_path / "sft").mkdir()
    for split in ("train", "dev"):
        (tmp_path / "sft" / f"{split}.json").write_text('{"src": "hello", "tgt": "world"}\n')
    metrics = prepare.run(tmp_path / "out", {**TINY, "corpus": [corpus], "sft": "sft"}, base_dir=tmp_path)
    assert metrics["num_preference_train"] is None and metrics["num_preference_dev"] is None
    assert not (tmp_path / "out" / "preference").exists()
    with pytest.raises(DataConfigError, match=r"data.preference: builtin:attributes pairs are made of the builtin "
                                              r"task's records, but data.sft is 'sft'; give a directory"):
        prepare.run(tmp_path / "out2", {**TINY, "corpus": [corpus], "sft": "sft", "preference": "builtin:attributes"},
                    base_dir=tmp_path)


def _trl_dir(root):
    """A preference directory as TRL users have one: train.jsonl in the conversational shape
    (implicit prompt and explicit prompt), dev/ in the LLaMA-Factory alpaca shape."""
    def msg(role, text):
        return {"role": role, "content": text}

    train = [
        {"chosen": [msg("user", "count: 1; shape: star; size: big; color: red"), msg("assistant", "a big red star")],
         "rejected": [msg("user", "count: 1; shape: star; size: big; color: red"), msg("assistant", "a red big star")]},
        {"prompt": [msg("system", "Be brief."), msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "2 boxes?")],
         "chosen": [msg("assistant", "two boxes")], "rejected": [msg("assistant", "two box")]},
    ]
    (root / "dev").mkdir(parents=True)
    (root / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in train))
    say_no = {"instruction": "Say no", "chosen": "no", "rejected": "yes"}
    (root / "dev" / "b.json").write_text(json.dumps(say_no) + "\n")
    (root / "dev" / "a.jsonl").write_text(json.dumps({"instruction": "Name it", "input": "a cat",
                                                      "chosen": "cat", "rejected": "dog"}) + "\n")
    return root


def test_a_user_directory_is_normalised_to_our_shape(tmp_path, corpus):
    _trl_dir(tmp_path / "pairs")
    metrics = prepare.run(tmp_path / "out", {**TINY, "corpus": [corpus], "preference": "pairs"}, base_dir=tmp_path)
    assert (metrics["num_preference_train"], metrics["num_preference_dev"]) == (2, 2)
    assert (tmp_path / "out" / "preference" / "train.json").read_text() == (
        '{"src": "count: 1; shape: star; size: big; color: red", "chosen": "a big red star", '
        '"rejected": "a red big star"}\n'
        '{"src": ["Hi", "2 boxes?"], "tgt": ["Hello!"], "system": "Be brief.", "chosen": "two boxes", '
        '"rejected": "two box"}\n')
    # dev/*.json and dev/*.jsonl, in sorted order
    assert (tmp_path / "out" / "preference" / "dev.json").read_text() == (
        '{"src": "Name it\\n\\na cat", "chosen": "cat", "rejected": "dog"}\n'
        '{"src": "Say no", "chosen": "no", "rejected": "yes"}\n')


@pytest.mark.parametrize("preference, breakage, error, match", [
    ("pairs", "line", PreferenceDataError, r"^data.preference: \S*pairs/train.jsonl:2: no 'rejected'"),
    ("pairs", "same", PreferenceDataError, r"^data.preference: \S*pairs/train.jsonl: pair 2 has the same chosen"),
    ("nowhere", None, DataConfigError, r"^data.preference: 'nowhere' \(\S*nowhere\) does not exist; give a directory "
                                       r"holding train.json and dev.json .* or null for the builtin pairs"),
    ("pairs", "no_dev", DataConfigError, r"^data.preference: \S*pairs has no 'dev' split; expected \S*dev.json or"),
    ("builtin:hh", None, DataConfigError, r"^data.preference: unknown builtin pairs 'builtin:hh'"),
])
def test_bad_pairs_fail_before_writing(tmp_path, corpus, preference, breakage, error, match):
    pairs = _trl_dir(tmp_path / "pairs")
    train = (pairs / "train.jsonl").read_text().splitlines()
    if breakage == "line":
        train[1] = json.dumps({"prompt": "two boxes?", "chosen": "two boxes"})
    if breakage == "same":
        train[1] = json.dumps({"prompt": "two boxes?", "chosen": "two boxes", "rejected": "two boxes"})
    (pairs / "train.jsonl").write_text("\n".join(train) + "\n")
    if breakage == "no_dev":
        for f in (pairs / "dev").iterdir():
            f.unlink()
        (pairs / "dev").rmdir()
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        prepare.run(out, {**TINY, "corpus": [corpus], "preference": preference}, base_dir=tmp_path)
    assert not out.exists()
    # the workflow's parse-time check names the experiment's key the same way
    with pytest.raises(error, match=match.replace("^data", r"^experiments\.x\.data")):
        check_data_section({"corpus": [corpus], "sft": "builtin:attributes", "preference": preference}, "x", tmp_path)


def test_parse_time_check_accepts_good_pairs_and_the_default(tmp_path, corpus):
    _trl_dir(tmp_path / "pairs")
    check_data_section({"corpus": [corpus], "sft": "builtin:attributes", "preference": "pairs"}, "x", tmp_path)
    check_data_section({"corpus": [corpus], "sft": "builtin:attributes", "preference": None}, "x", tmp_path)
