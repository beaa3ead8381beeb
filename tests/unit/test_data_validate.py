"""Tests of stages/data/validate.py: the parse-time checks of a `data:` section."""


import pytest
from light_imports import loaded_by_import

from stages.data.validate import DataConfigError, check_data_section, read_sft_dir, sft_split_files

GOOD = '{"src": "a", "tgt": "b"}\n{"src": ["c", "d"], "tgt": ["e", "f"]}\n'


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def repo(tmp_path):
    """A workdir with a usable corpus and SFT dir; tests break one piece each."""
    write(tmp_path / "corpus" / "a.txt", "some text")
    write(tmp_path / "corpus" / "b.jsonl", '{"text": "more"}\n')
    write(tmp_path / "sft" / "train.json", GOOD)
    write(tmp_path / "sft" / "dev.json", GOOD)
    return tmp_path


def data(**overrides):
    return {"corpus": ["corpus/*.txt", "corpus/b.jsonl"], "sft": "sft", **overrides}


def check(repo, **overrides):
    check_data_section(data(**overrides), "exp", repo)


def test_good_section_passes(repo):
    check(repo)
    check(repo, corpus=["builtin:pydoc"], sft="builtin:attributes")
    check(repo, corpus=[str(repo / "corpus" / "**" / "*.txt")])  # absolute, recursive glob


def test_paths_resolve_against_base_dir_not_cwd(repo, monkeypatch, tmp_path_factory):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    check(repo)


@pytest.mark.parametrize("corpus, match", [
    (["corpus/*.csv"], r"experiments.exp.data.corpus\[0\]: 'corpus/\*.csv' .* matches no file.*fix the path"),
    (["builtin:pydoc", "nope.txt"], r"experiments.exp.data.corpus\[1\]: 'nope.txt'"),
    (["builtin:wikipedia"], r"experiments.exp.data.corpus\[0\]: unknown builtin corpus.*builtin:pydoc"),
    (["corpus/notes.md"], r"notes.md has unsupported extension '.md'; supported corpus files are .txt, .jsonl, .parquet"),
    (["corpus/empty.jsonl"], r"empty.jsonl is empty"),
    (["corpus"], r"'corpus' is a directory.*corpus/\*.txt"),
    ([], r"experiments.exp.data.corpus: the corpus list is empty"),
    ("corpus/a.txt", r"experiments.exp.data.corpus: expected a list"),
])
def test_bad_corpus(repo, corpus, match):
    write(repo / "corpus" / "notes.md", "x")
    write(repo / "corpus" / "empty.jsonl", "")
    with pytest.raises(DataConfigError, match=match):
        check(repo, corpus=corpus)


def test_missing_sft_dir(repo):
    with pytest.raises(DataConfigError, match=r"experiments.exp.data.sft: 'gone' .* does not exist.*train.json"):
        check(repo, sft="gone")
    with pytest.raises(DataConfigError, match=r"is a file, not a directory"):
        check(repo, sft="sft/train.json")
    with pytest.raises(DataConfigError, match=r"unknown builtin task 'builtin:chat'.*builtin:attributes"):
        check(repo, sft="builtin:chat")


def test_missing_dev_split(repo):
    (repo / "sft" / "dev.json").unlink()
    with pytest.raises(DataConfigError, match=r"experiments.exp.data.sft: .* has no 'dev' split; expected .*dev.json"):
        check(repo)


def test_split_folders_are_accepted_and_sorted(repo):
    (repo / "sft" / "train.json").unlink()
    write(repo / "sft" / "train" / "b.json", '{"src": "2", "tgt": "2"}\n')
    write(repo / "sft" / "train" / "a.json", '{"src": "1", "tgt": "1"}\n')
    check(repo)
    assert [p.name for p in sft_split_files(repo / "sft", "train")] == ["a.json", "b.json"]
    assert [r.src for r in read_sft_dir(repo / "sft", "train")] == [["1"], ["2"]]


@pytest.mark.parametrize("layout, match", [
    (["dev.jsonl"], r"has no 'dev' split \(found dev.jsonl: rename to .json\); expected .*dev.json"),
    (["dev/part-0.jsonl", "dev/part-1.txt"], r"has no 'dev' split \(found dev/part-0.jsonl, dev/part-1.txt: rename"),
    (["dev/"], r"has no 'dev' split; expected .*dev.json or .*dev/\*.json"),
])
def test_split_in_the_wrong_format_names_what_is_there(repo, layout, match):
    (repo / "sft" / "dev.json").unlink()
    for name in layout:
        if name.endswith("/"):
            (repo / "sft" / name).mkdir()
        else:
            write(repo / "sft" / name, GOOD)
    with pytest.raises(DataConfigError, match=match):
        check(repo)


def test_file_and_folder_for_one_split_is_ambiguous(repo):
    write(repo / "sft" / "dev" / "x.json", GOOD)
    with pytest.raises(DataConfigError, match=r"both dev.json and dev/\*.json.*keep one"):
        check(repo)


@pytest.mark.parametrize("content, match", [
    ('{"src": "a", "tgt": "b"}\n{"src": "a", "tgt": \n', r"dev.json:2: malformed JSON"),
    ('{"src": "a", "tgt": "b"}\n\n{"src": "a"}\n', r"dev.json:3: record has no 'tgt'"),
    ('{"src": ["a", "b"], "tgt": ["c"]}\n', r"dev.json:1: 'src' has 2 rounds but 'tgt' has 1"),
    ("", r"dev.json is empty"),
    ("\n\n", r"dev.json: no JSON lines \(the file is empty or blank\)"),
    ('"a string"\n', r"dev.json:1: expected a JSON object, got a string"),
    ('{"src": "a", "tgt": "b"}\n{"src": "caf\udce9", "tgt": "b"}\n', r"dev.json:2: not UTF-8 \(byte 0xe9 at byte 13"),
])
def test_bad_sft_file_names_key_file_and_line(repo, content, match):
    path = repo / "sft" / "dev.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))  # \udce9: the raw byte 0xe9
    with pytest.raises(DataConfigError, match=match) as e:
        check(repo)
    assert str(e.value).startswith("experiments.exp.data.sft: ")
    assert str(path) in str(e.value)


def test_validate_stays_light():
    """common.smk imports this while Snakemake parses: no numpy, torch, tokenizers, transformers."""
    assert loaded_by_import("stages.data.validate", ("torch", "numpy", "tokenizers", "transformers", "pandas")) == []
