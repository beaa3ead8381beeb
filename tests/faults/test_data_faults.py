"""Fault catalog, data inputs: each case breaks one corpus or SFT file (or path) of an otherwise
good experiment and runs what a user runs. Faults that the workflow's parse-time check
(`stages.data.validate`) catches go through `snakemake -n`, which must stop before any job with
the config key, the file and the line; faults in file contents that only `prepare` reads go
through `python -m stages.prepare`. Either way the message names the file (and line) and the
fix, and the earlier results in the working directory are byte-identical afterwards."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

GOOD_FILES = {
    "corpus/a.txt": b"The first document of the corpus.\nIt has two lines.\n",
    "corpus/b.jsonl": b'{"text": "fine"}\n{"text": "also fine", "id": 2}\n',
    "sft/train.json": (b'{"src": "count: 1; shape: box", "tgt": "one box"}\n'
                       b'{"src": "count: 2; shape: box", "tgt": "two boxes"}\n'),
    "sft/dev.json": b'{"src": "count: 3; shape: box", "tgt": "three boxes"}\n{"src": "q", "tgt": "a"}\n',
}
GOOD_DATA = {"corpus": ["corpus/*.txt", "corpus/b.jsonl"], "sft": "sft", "vocab_size": 300,
             "validation_fraction": 0.2, "num_sft_train": 4, "num_sft_dev": 2, "seed": 0, "chat_template": True}
EXPERIMENT = "x"
EARLIER = f"results/{EXPERIMENT}/data"  # an earlier prepare output that no failed run may touch


@dataclass(frozen=True)
class Case:
    """One bad input: `files` replace (or, None, remove) files of the good experiment, `data`
    overrides keys of its data section; `route` is the command; `expect` a regex on its output."""

    route: str  # "prepare" (python -m stages.prepare) or "dry-run" (snakemake -n)
    expect: str
    files: dict[str, bytes | None] = field(default_factory=dict)
    data: dict = field(default_factory=dict)


def slow(case: Case):
    """A case a unit test (tests/unit/test_data_*.py) covers too: run only with `-m slow`, which
    keeps the default catalog near a minute (each launch costs seconds of imports)."""
    return pytest.param(case, marks=pytest.mark.slow)


CASES = {
    # --- file contents: only prepare reads them --------------------------------------------------
    "jsonl_corpus_invalid_utf8": Case(
        "prepare", r"prepare: error: \S*corpus/b\.jsonl:2: not UTF-8 \(byte 0xe9 at byte 14 of the line, offset 30 "
                   r"of the file: invalid continuation byte\); convert the file to UTF-8",
        {"corpus/b.jsonl": b'{"text": "fine"}\n{"text": "caf\xe9"}\n'}),
    "txt_corpus_invalid_utf8": Case(
        "prepare", r"prepare: error: \S*corpus/a\.txt:2: not UTF-8 \(byte 0xff at byte 5 of the line",
        {"corpus/a.txt": b"line one\nline\xff two\n"}),
    "jsonl_corpus_broken_json": Case(
        "prepare", r"prepare: error: \S*corpus/b\.jsonl:3: malformed JSON \(.*\); each line must be one JSON object "
                   r"such as \{\"text\": \"...\"\}",
        {"corpus/b.jsonl": b'{"text": "fine"}\n\n{"text": "unterminated}\n'}),
    "jsonl_corpus_missing_field": Case(
        "prepare", r"prepare: error: \S*corpus/b\.jsonl:2: no 'text' field \(got keys \['body'\]\); each line must be "
                   r"an object with a string field \"text\"",
        {"corpus/b.jsonl": b'{"text": "fine"}\n{"body": "no text"}\n'}),
    "jsonl_corpus_line_not_an_object": Case(
        "prepare", r"prepare: error: \S*corpus/b\.jsonl:1: expected a JSON object, got an array",
        {"corpus/b.jsonl": b'["a", "list"]\n'}),
    "jsonl_corpus_text_not_a_string": slow(Case(
        "prepare", r"prepare: error: \S*corpus/b\.jsonl:1: 'text' is int, expected a string",
        {"corpus/b.jsonl": b'{"text": 5}\n'})),
    "jsonl_corpus_blank": Case(
        "prepare", r"prepare: error: \S*corpus/b\.jsonl: no JSON lines \(the file is empty or blank\)",
        {"corpus/b.jsonl": b"\n   \n"}),
    "parquet_corpus_unreadable": Case(
        "prepare", r"prepare: error: \S*corpus/c\.parquet: cannot read as parquet \(.*\); the file is not parquet or "
                   r"is truncated",
        {"corpus/c.parquet": b"PAR1 not really parquet"}, {"corpus": ["corpus/*.txt", "corpus/c.parquet"]}),
    "corpus_without_text": Case(
        "prepare", r"prepare: error: data\.corpus: the corpus .* holds no text",
        {"corpus/a.txt": b"   \n\n", "corpus/b.jsonl": b'{"text": "  "}\n'}),
    # --- paths and SFT files: the parse-time check stops Snakemake before any job ---------------
    "sft_invalid_utf8": Case(
        "dry-run", r"experiments\.x\.data\.sft: \S*sft/dev\.json:2: not UTF-8 \(byte 0xe9 at byte 13 of the line",
        {"sft/dev.json": b'{"src": "a", "tgt": "b"}\n{"src": "caf\xe9", "tgt": "b"}\n'}),
    "sft_broken_json": Case(
        "dry-run", r"experiments\.x\.data\.sft: \S*sft/dev\.json:2: malformed JSON \(.*\); each line must be one JSON "
                   r"object such as",
        {"sft/dev.json": b'{"src": "a", "tgt": "b"}\n{"src": "a", "tgt": \n'}),
    "sft_missing_field": Case(
        "dry-run", r"experiments\.x\.data\.sft: \S*sft/train\.json:1: record has no 'tgt' \(keys present: \['src'\]\)",
        {"sft/train.json": b'{"src": "only a prompt"}\n'}),
    "sft_empty_file": slow(Case(
        "dry-run", r"experiments\.x\.data\.sft: \S*sft/dev\.json is empty",
        {"sft/dev.json": b""})),
    "sft_wrong_extension": Case(
        "dry-run", r"experiments\.x\.data\.sft: \S*sft has no 'dev' split \(found dev\.jsonl: rename to \.json\)",
        {"sft/dev.json": None, "sft/dev.jsonl": GOOD_FILES["sft/dev.json"]}),
    "sft_dir_does_not_exist": slow(Case(
        "dry-run", r"experiments\.x\.data\.sft: 'nowhere' \(\S+\) does not exist; give a directory",
        data={"sft": "nowhere"})),
    "corpus_path_does_not_exist": Case(
        "dry-run", r"experiments\.x\.data\.corpus\[1\]: 'corpus/missing\.txt' \(resolved to \S+\) matches no file",
        data={"corpus": ["corpus/*.txt", "corpus/missing.txt"]}),
    "corpus_wrong_extension": Case(
        "dry-run", r"experiments\.x\.data\.corpus\[0\]: \S*corpus/notes\.md has unsupported extension '\.md'",
        {"corpus/notes.md": b"# notes\n"}, {"corpus": ["corpus/*.md"]}),
    "corpus_empty_file": slow(Case(
        "dry-run", r"experiments\.x\.data\.corpus\[0\]: \S*corpus/a\.txt is empty",
        {"corpus/a.txt": b""})),
    "corpus_directory_without_usable_files": Case(
        "dry-run", r"experiments\.x\.data\.corpus\[0\]: 'docs' is a directory .*holds no \.txt, \.jsonl, \.parquet "
                   r"file \(found: \.csv, \.md\)",
        {"docs/a.md": b"x", "docs/b.csv": b"x"}, {"corpus": ["docs"]}),
}


@pytest.fixture(scope="module")
def earlier_data(tmp_path_factory) -> Path:
    """A real prepare output of the good experiment, made once (in this process)."""
    from stages import prepare

    workdir = tmp_path_factory.mktemp("good")
    _write_files(workdir, GOOD_FILES)
    prepare.run(workdir / EARLIER, GOOD_DATA, base_dir=workdir)
    return workdir / EARLIER


def _write_files(root: Path, files: dict[str, bytes | None]) -> None:
    for rel, content in files.items():
        path = root / rel
        if content is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_data_input_is_named_and_earlier_results_are_kept(case, tmp_path, earlier_data, snapshot, run_stage,
                                                               run_snakemake):
    _write_files(tmp_path, GOOD_FILES)
    _write_files(tmp_path, case.files)
    shutil.copytree(earlier_data, tmp_path / EARLIER)
    data = {**GOOD_DATA, **case.data}
    before = snapshot(tmp_path)

    if case.route == "prepare":
        ran = run_stage("prepare", "--out", EARLIER, "--config", json.dumps(data), cwd=tmp_path)
    else:
        extra = tmp_path.parent / f"{tmp_path.name}.yaml"  # outside the snapshot
        extra.write_text(yaml.safe_dump({"experiments": {EXPERIMENT: {"model": {"flavour": "debug"}, "data": data}}}))
        ran = run_snakemake(tmp_path, "--configfile", str(extra), "-n", EARLIER)

    assert ran.returncode != 0, ran.describe()
    if case.route == "prepare":  # an input error: one line, status 2, no traceback (stages.errors)
        assert ran.returncode == 2 and "Traceback" not in ran.output, ran.describe()
    assert re.search(case.expect, ran.output), f"expected /{case.expect}/ in:\n{ran.describe()}"
    assert snapshot(tmp_path) == before, "the failed command changed the working directory"


@pytest.mark.slow
def test_bad_corpus_line_met_by_a_real_prepare_job(tmp_path, run_snakemake, snapshot):
    """The same fault as `jsonl_corpus_invalid_utf8`, met where a user meets it: the corpus of a
    built experiment is edited into invalid UTF-8 and `snakemake` reruns its prepare job, which
    fails. Snakemake prints the job's log (the default profile's show-failed-logs), which names
    the file, the line and the byte; no output is left to look complete, and the results of
    another experiment are untouched."""
    _write_files(tmp_path, GOOD_FILES)
    experiments = {name: {"model": {"flavour": "debug"}, "data": GOOD_DATA} for name in (EXPERIMENT, "other")}
    extra = tmp_path.parent / f"{tmp_path.name}.yaml"
    extra.write_text(yaml.safe_dump({"experiments": experiments}))
    ran = run_snakemake(tmp_path, "--configfile", str(extra), "--cores", "1", "results/other/data", EARLIER)
    assert ran.returncode == 0, ran.describe()
    before = snapshot(tmp_path / "results" / "other")

    _write_files(tmp_path, {"corpus/b.jsonl": b'{"text": "fine"}\n{"text": "caf\xe9"}\n'})
    ran = run_snakemake(tmp_path, "--configfile", str(extra), "--cores", "1", EARLIER)

    assert ran.returncode != 0, ran.describe()
    assert re.search(r"corpus/b\.jsonl:2: not UTF-8 \(byte 0xe9 at byte 14 of the line", ran.output), ran.describe()
    # Snakemake removes the output of a job that fails (and of one it reruns), so the earlier
    # results/x/data is gone, not kept as prepare alone keeps it (the "prepare" cases above):
    # what is promised here is that nothing half-built is left to look complete.
    assert not (tmp_path / EARLIER).exists()
    assert not list((tmp_path / "results" / EXPERIMENT).glob(".data.*"))  # no half-built directory either
    assert snapshot(tmp_path / "results" / "other") == before
