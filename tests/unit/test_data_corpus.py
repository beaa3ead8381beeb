"""Tests of stages/data/corpus.py: reading sources, the split rule, token files and their reader."""

import json

import numpy as np
import pandas as pd
import pytest
from pydoc_data.topics import topics

from stages.data.corpus import (CorpusError, TokenFile, load_split, read_documents, split_documents,
                                token_dtype, unigram_entropy_bits, write_token_files)
from stages.data.validate import DataConfigError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- reading ----------------------------------------------------------------------------------

def test_builtin_pydoc_is_sorted_by_topic():
    docs = read_documents(["builtin:pydoc"])
    assert docs == [topics[k] for k in sorted(topics)]


def test_each_format_and_glob_order(tmp_path):
    write(tmp_path / "b.txt", "second file\n")
    write(tmp_path / "a.txt", "first file\n")
    write(tmp_path / "lines.jsonl", '{"text": "line one"}\n\n{"text": "line two", "id": 7}\n')
    pd.DataFrame({"text": ["row zero", "row one"], "n": [0, 1]}).to_parquet(tmp_path / "t.parquet")
    docs = read_documents(["*.txt", "lines.jsonl", str(tmp_path / "t.parquet")], base_dir=tmp_path)
    assert docs == ["first file\n", "second file\n", "line one", "line two", "row zero", "row one"]


def test_blank_documents_are_skipped(tmp_path):
    write(tmp_path / "x.jsonl", '{"text": "   "}\n{"text": "kept"}\n')
    assert read_documents([str(tmp_path / "x.jsonl")]) == ["kept"]


def test_corpus_without_text_is_an_error(tmp_path):
    write(tmp_path / "x.jsonl", '{"text": "   "}\n{"text": "\\n"}\n')
    with pytest.raises(CorpusError, match=r"data.corpus.*holds no text"):
        read_documents([str(tmp_path / "x.jsonl")])


@pytest.mark.parametrize("content, where, match", [
    ('{"text": "ok"}\n\n{"text": broken\n', ":3:", "malformed JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', ":2:", r"no 'text' field \(got keys \['body'\]\)"),
    ('["a list"]\n', ":1:", r"expected a JSON object, got an array; each line must be one JSON object"),
    ('{"text": 5}\n', ":1:", "'text' is int, expected a string"),
    ('{"text": "ok"}\n{"text": "caf\udce9"}\n', ":2:",
     r"not UTF-8 \(byte 0xe9 at byte 14 of the line, offset 28 of the file: invalid continuation byte\); convert"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, content, where, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))  # \udce9: the raw byte 0xe9
    with pytest.raises(CorpusError, match=match) as e:
        read_documents([str(path)])
    assert f"{path}{where}" in str(e.value)


def test_parquet_without_text_column(tmp_path):
    pd.DataFrame({"body": ["x"]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(CorpusError, match=r"p.parquet: no 'text' column \(columns: \['body'\]\)"):
        read_documents([str(tmp_path / "p.parquet")])


def test_parquet_with_missing_or_wrong_values_names_the_row(tmp_path):
    pd.DataFrame({"text": ["x", None]}).to_parquet(tmp_path / "p.parquet")
    with pytest.raises(CorpusError, match=r"p.parquet: row 1 of column 'text' is missing \(null\)"):
        read_documents([str(tmp_path / "p.parquet")])
    pd.DataFrame({"text": [1, 2]}).to_parquet(tmp_path / "q.parquet")
    with pytest.raises(CorpusError, match=r"q.parquet: row 0 of column 'text' is int"):
        read_documents([str(tmp_path / "q.parquet")])


def test_not_utf8_text(tmp_path):
    (tmp_path / "latin.txt").write_bytes("first line\ncaf\xe9".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin.txt:2: not UTF-8 \(byte 0xe9 at byte 4 of the line, offset 14 "
                                          r"of the file.*convert the file to UTF-8"):
        read_documents([str(tmp_path / "latin.txt")])


def test_text_newlines_are_normalised_and_jsonl_may_start_with_a_bom(tmp_path):
    (tmp_path / "dos.txt").write_bytes(b"one\r\ntwo\rthree\n")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "after the mark"}\r\n')
    assert read_documents(["dos.txt", "bom.jsonl"], base_dir=tmp_path) == ["one\ntwo\nthree\n", "after the mark"]


def test_blank_jsonl_file_is_an_error(tmp_path):
    write(tmp_path / "blank.jsonl", "\n  \n")
    with pytest.raises(CorpusError, match=r"blank.jsonl: no JSON lines \(the file is empty or blank\); expected one"):
        read_documents([str(tmp_path / "blank.jsonl")])


def test_unreadable_parquet_names_the_file_and_the_fix(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(CorpusError, match=r"broken.parquet: cannot read as parquet \(.*\); .*write it again"):
        read_documents([str(tmp_path / "broken.parquet")])


@pytest.mark.parametrize("source, match", [
    ("missing.txt", r"data.corpus\[0\]: 'missing.txt' .* matches no file"),
    ("*.nothing", r"data.corpus\[0\]: '\*.nothing' .* matches no file"),
    ("builtin:wiki", r"data.corpus\[0\]: unknown builtin corpus 'builtin:wiki'.*builtin:pydoc"),
    ("doc.md", r"doc.md has unsupported extension '.md'.*\.txt, \.jsonl, \.parquet"),
    ("empty.txt", r"empty.txt is empty"),
    ("sub", r"'sub' is a directory.*glob such as 'sub/\*.txt', 'sub/\*.jsonl'$"),
    ("notes", r"'notes' is a directory .*holds no .txt, .jsonl, .parquet file \(found: .csv, .md\); convert"),
    ("only_dirs/**", r"'only_dirs/\*\*' .* matches no file"),
])
def test_bad_sources(tmp_path, source, match):
    write(tmp_path / "doc.md", "markdown")
    write(tmp_path / "empty.txt", "")
    write(tmp_path / "sub" / "a.txt", "x")
    write(tmp_path / "sub" / "b.jsonl", '{"text": "x"}')
    write(tmp_path / "sub" / "deeper" / "c.jsonl", '{"text": "x"}')
    write(tmp_path / "notes" / "a.md", "x")
    write(tmp_path / "notes" / "b.csv", "x")
    (tmp_path / "only_dirs" / "empty").mkdir(parents=True)
    with pytest.raises(DataConfigError, match=match):
        read_documents([source], base_dir=tmp_path)


# --- splitting --------------------------------------------------------------------------------

def make_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 50, size=int(rng.integers(1, 200))).tolist() for _ in range(n)]


def test_split_is_deterministic_and_a_partition():
    docs = make_docs(100)
    a, b = split_documents(docs, 0.1, seed=3), split_documents(docs, 0.1, seed=3)
    assert a == b
    assert split_documents(docs, 0.1, seed=4) != a
    assert sorted(map(tuple, a["train"] + a["validation"])) == sorted(map(tuple, docs))
    # corpus order is kept inside each split
    positions = [docs.index(d) for d in a["validation"]]
    assert positions == sorted(positions)


def test_split_holds_out_about_the_fraction_of_tokens():
    docs = make_docs(200)
    total = sum(map(len, docs))
    held = sum(map(len, split_documents(docs, 0.1, seed=0)["validation"]))
    assert 0.08 * total <= held <= 0.1 * total


def test_split_keeps_one_document_each_side():
    docs = [[5] * 1000, [6] * 1000]  # each alone is more than the target
    s = split_documents(docs, 0.05, seed=0)
    assert len(s["train"]) == 1 and len(s["validation"]) == 1


def test_single_document_is_cut_at_token_level():
    s = split_documents([list(range(3, 103))], 0.1, seed=0)
    assert s == {"train": [list(range(3, 93))], "validation": [list(range(93, 103))]}
    tiny = split_documents([[7, 8]], 0.01, seed=0)
    assert tiny == {"train": [[7]], "validation": [[8]]}


def test_single_token_document_cannot_be_split():
    with pytest.raises(CorpusError, match="one document of 1 token"):
        split_documents([[7]], 0.1, seed=0)


# --- token files ------------------------------------------------------------------------------

def test_token_dtype_rule():
    assert token_dtype(65535) == np.dtype("<u2") and token_dtype(65536) == np.dtype("<u4")


@pytest.mark.parametrize("vocab_size, dtype", [(300, "uint16"), (70000, "uint32")])
def test_write_and_load_round_trip(tmp_path, vocab_size, dtype):
    splits = {"train": [[5, 6, 7], [vocab_size - 1]], "validation": [[9, 10]]}
    index = write_token_files(tmp_path, splits, vocab_size=vocab_size, bos_id=1, eos_id=2, pad_id=0)
    on_disk = json.loads((tmp_path / "index.json").read_text())
    assert on_disk == index
    assert on_disk["dtype"] == dtype and on_disk["vocab_size"] == vocab_size
    assert (on_disk["bos_token_id"], on_disk["eos_token_id"], on_disk["pad_token_id"]) == (1, 2, 0)
    assert on_disk["splits"]["train"] == {"tokens": "train.bin", "offsets": "train.idx",
                                          "num_tokens": 6, "num_documents": 2}
    tokens, offsets = load_split(tmp_path, "train")
    assert tokens.tolist() == [5, 6, 7, 2, vocab_size - 1, 2]
    assert offsets.dtype == np.dtype("<i8") and offsets.tolist() == [0, 4, 6]
    # raw layout: little-endian ids and int64 offsets, nothing else in the files
    assert np.fromfile(tmp_path / "train.bin", dtype=np.dtype(dtype).newbyteorder("<")).tolist() == tokens.tolist()
    assert (tmp_path / "validation.idx").read_bytes() == np.array([0, 3], dtype="<i8").tobytes()
    val = TokenFile.open(tmp_path, "validation")
    assert (val.num_documents, val.num_tokens) == (1, 3)
    assert val.document(0).tolist() == [9, 10, 2]


def test_reader_errors(tmp_path):
    with pytest.raises(CorpusError, match=r"index.json is missing.*run the prepare stage"):
        load_split(tmp_path, "train")
    write_token_files(tmp_path, {"train": [[5, 6]], "validation": [[7]]}, vocab_size=300, bos_id=1, eos_id=2, pad_id=0)
    with pytest.raises(CorpusError, match=r"no split 'test'"):
        load_split(tmp_path, "test")
    with open(tmp_path / "train.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(CorpusError, match=r"train.bin: expected 6 bytes .* found 8.*rerun prepare"):
        load_split(tmp_path, "train")


def test_unigram_entropy():
    assert unigram_entropy_bits(np.array([0, 1, 2, 3] * 5), 10) == pytest.approx(2.0)
    assert unigram_entropy_bits(np.array([4] * 9), 10) == pytest.approx(0.0)
