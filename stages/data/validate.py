"""Parse-time checks of an experiment's `data:` section, and the path rules `prepare` shares.

Snakemake's common.smk calls `check_data_section` for every experiment while it parses the
workflow, so that a typo in a corpus path fails in a second instead of after an hour of jobs.
It must stay light: stdlib, `stages.data.sft`, `stages.data.preference` and `stages.data.files`
only (no numpy, torch, tokenizers, transformers). It checks what can be checked cheaply: every
corpus source resolves to files with a supported extension that are not empty, and the SFT
directory (and data.preference's directory) holds readable train and dev records. Reading corpus
contents (malformed JSON lines in a .jsonl corpus, a parquet file
without a `text` column) is left to `stages.data.corpus`, which reports the same way.

Path rules (one place, used by both this module and `prepare`):
- a source starting with `builtin:` names data the project makes (BUILTIN_CORPORA, BUILTIN_SFT);
- a relative path or glob resolves against `base_dir` (the repo root, Snakemake's workdir);
- a glob expands to its matches in sorted order, `**` included, so the corpus order, and with it
  the tokenizer and the split, does not depend on the file system's listing order.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from stages.data.preference import EXAMPLE as PREFERENCE_EXAMPLE
from stages.data.preference import PreferenceDataError, PreferenceRecord, read_preference_file
from stages.data.sft import SftDataError, SftRecord, read_sft_file
from stages.errors import InputError

SUPPORTED_EXTENSIONS = (".txt", ".jsonl", ".parquet")
BUILTIN_CORPORA = ("builtin:pydoc", "builtin:records", "builtin:sft_targets")
BUILTIN_SFT = ("builtin:attributes",)
BUILTIN_PREFERENCE = ("builtin:attributes",)  # pairs made of the builtin SFT task's records
PREFERENCE_SUFFIXES = (".json", ".jsonl")  # TRL and LLaMA-Factory pair files are often .jsonl
SFT_SPLITS = ("train", "dev")
_GLOB_CHARS = set("*?[")


class DataConfigError(InputError):
    """A `data:` setting that points at missing or unusable data; names the key, file and fix."""


def _resolve(path: str, base_dir: str | os.PathLike | None) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute():
        p = Path(base_dir if base_dir is not None else os.getcwd()) / p
    return p


def resolve_corpus_source(source: str, base_dir: str | os.PathLike | None, key: str) -> list[Path]:
    """The files one `corpus` entry stands for (empty list for a builtin).

    Raises DataConfigError naming `key` when the entry is an unknown builtin, matches nothing,
    is a directory, has an unsupported extension or is an empty file.
    """
    if source.startswith("builtin:"):
        if source not in BUILTIN_CORPORA:
            raise DataConfigError(f"{key}: unknown builtin corpus {source!r}; "
                                  f"the builtin corpora are: {', '.join(BUILTIN_CORPORA)}")
        return []
    full = _resolve(source, base_dir)
    if _GLOB_CHARS & set(source):
        paths = [Path(p) for p in sorted(glob.glob(str(full), recursive=True))]
        paths = [p for p in paths if p.is_file()]  # a `**` glob also matches directories
    else:
        paths = [full] if full.exists() else []
    if not paths:
        raise DataConfigError(f"{key}: {source!r} (resolved to {full}) matches no file; "
                              "fix the path or glob, relative paths resolve against the workflow directory")
    for p in paths:
        if p.is_dir():
            raise DataConfigError(f"{key}: {source!r} is a directory ({p}); {_directory_hint(p, source)}")
        if p.suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise DataConfigError(f"{key}: {p} has unsupported extension {p.suffix or '(none)'!r}; "
                                  f"supported corpus files are {', '.join(SUPPORTED_EXTENSIONS)} "
                                  f"(or a builtin: {', '.join(BUILTIN_CORPORA)})")
        if p.stat().st_size == 0:
            raise DataConfigError(f"{key}: {p} is empty; remove it from the corpus or give it text")
    return paths


def _directory_hint(directory: Path, source: str) -> str:
    """How to name the corpus files of a directory given as a source: a glob per supported
    extension it holds, or, when it holds none, what it does hold."""
    suffixes = {f.suffix.lower() or "(no extension)" for f in directory.rglob("*") if f.is_file()}
    usable = [x for x in SUPPORTED_EXTENSIONS if x in suffixes]
    if usable:
        globs = ", ".join(repr(str(Path(source) / ("*" + x))) for x in usable)
        return f"name its files with a glob such as {globs}"
    found = ", ".join(sorted(suffixes)) or "nothing"
    return (f"it holds no {', '.join(SUPPORTED_EXTENSIONS)} file (found: {found}); "
            "convert the documents to one of those formats")


def resolve_corpus(sources: list[str], base_dir: str | os.PathLike | None,
                   key: str = "data.corpus") -> list[tuple[str, Path | None]]:
    """Every corpus entry expanded, in order: (source, file) pairs; file is None for a builtin."""
    if isinstance(sources, str) or not isinstance(sources, list):
        raise DataConfigError(f"{key}: expected a list of paths, globs or builtins, got {sources!r}; "
                              f"write it as a YAML list, e.g. [{sources!r}]")
    if not sources:
        raise DataConfigError(f"{key}: the corpus list is empty; give at least one source, "
                              f"e.g. {BUILTIN_CORPORA[0]}")
    resolved: list[tuple[str, Path | None]] = []
    for i, source in enumerate(sources):
        if not isinstance(source, str):
            raise DataConfigError(f"{key}[{i}]: expected a string, got {source!r}")
        files = resolve_corpus_source(source, base_dir, f"{key}[{i}]")
        resolved += [(source, f) for f in files] if files else [(source, None)]
    return resolved


def split_files(data_dir: str | os.PathLike, split: str, key: str, suffixes: Sequence[str] = (".json",),
                line: str = '{"src": ..., "tgt": ...}') -> list[Path]:
    """The files of one split of a data directory: `<dir>/<split><suffix>`, or `<dir>/<split>/*<suffix>`
    sorted, for the accepted `suffixes`; `line` shows a good line in the error."""
    data_dir = Path(data_dir)
    singles = [data_dir / f"{split}{x}" for x in suffixes if (data_dir / f"{split}{x}").is_file()]
    folder = data_dir / split
    parts = sorted(p for x in suffixes for p in folder.glob(f"*{x}")) if folder.is_dir() else []
    names = " or ".join(f"{split}{x}" for x in suffixes)
    if len(singles) > 1 or (singles and parts):
        found = [p.name for p in singles]
        found += [f"{folder.name}/*{x}" for x in suffixes if any(p.suffix == x for p in parts)]
        raise DataConfigError(f"{key}: {data_dir} has both {' and '.join(found)} for the {split!r} split; "
                              "keep one of them")
    if singles:
        return singles
    if parts:
        return parts
    # Name what is there instead (train.jsonl, train/part-0.jsonl): the fix is then a rename.
    near = sorted(p.name for p in data_dir.glob(f"{split}.*") if p.is_file())
    near += sorted(f"{folder.name}/{p.name}" for p in folder.iterdir()) if folder.is_dir() else []
    rename = f"rename to {' or '.join(suffixes)}"
    found = f" (found {', '.join(near[:5])}{', ...' if len(near) > 5 else ''}: {rename})" if near else ""
    patterns = " or ".join(f"{folder}/*{x}" for x in suffixes)
    raise DataConfigError(f"{key}: {data_dir} has no {split!r} split{found}; expected {data_dir}/{names} or "
                          f"{patterns} (JSON lines, one {line} per line)")


def sft_split_files(sft_dir: str | os.PathLike, split: str, key: str = "data.sft") -> list[Path]:
    """The files of one SFT split: `<dir>/<split>.json`, or `<dir>/<split>/*.json` sorted."""
    return split_files(sft_dir, split, key)


def read_sft_dir(sft_dir: str | os.PathLike, split: str, key: str = "data.sft") -> list[SftRecord]:
    """All records of one split, files concatenated in sorted order; errors name `key` and file:line."""
    records: list[SftRecord] = []
    for path in sft_split_files(sft_dir, split, key):
        if path.stat().st_size == 0:
            raise DataConfigError(f"{key}: {path} is empty; expected one {{\"src\": ..., \"tgt\": ...}} "
                                  "JSON object per line")
        try:
            records += read_sft_file(path)
        except SftDataError as e:
            raise DataConfigError(f"{key}: {e}") from None
    return records


def resolve_sft(sft: str, base_dir: str | os.PathLike | None, key: str = "data.sft") -> Path | None:
    """The SFT directory (None for a builtin task); raises DataConfigError if it is not one."""
    if not isinstance(sft, str):
        raise DataConfigError(f"{key}: expected a directory or one of {', '.join(BUILTIN_SFT)}, got {sft!r}")
    if sft.startswith("builtin:"):
        if sft not in BUILTIN_SFT:
            raise DataConfigError(f"{key}: unknown builtin task {sft!r}; the builtin tasks are: "
                                  f"{', '.join(BUILTIN_SFT)}")
        return None
    path = _resolve(sft, base_dir)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise DataConfigError(f"{key}: {sft!r} ({path}) {what}; give a directory holding train.json and "
                              f"dev.json (or train/*.json, dev/*.json), or {BUILTIN_SFT[0]}")
    return path


def preference_source(preference: str | None, sft: str) -> str | None:
    """The preference pairs a `data:` section asks for: `preference` when set; when null, the
    builtin task's pairs if `sft` is the builtin task, else None (no pairs: align needs a directory)."""
    if preference is None:
        return BUILTIN_PREFERENCE[0] if sft in BUILTIN_SFT else None
    return preference


def resolve_preference(preference: str, sft: str, base_dir: str | os.PathLike | None,
                       key: str = "data.preference") -> Path | None:
    """The preference directory (None for the builtin pairs); raises DataConfigError naming `key`
    if it is not one, or if the builtin pairs are asked for without the builtin task (they are made
    of its records)."""
    if not isinstance(preference, str):
        raise DataConfigError(f"{key}: expected a directory, {BUILTIN_PREFERENCE[0]} or null, got {preference!r}")
    if preference.startswith("builtin:"):
        if preference not in BUILTIN_PREFERENCE:
            raise DataConfigError(f"{key}: unknown builtin pairs {preference!r}; the builtin pairs are: "
                                  f"{', '.join(BUILTIN_PREFERENCE)} (or null)")
        if sft not in BUILTIN_SFT:
            raise DataConfigError(f"{key}: {preference} pairs are made of the builtin task's records, but "
                                  f"data.sft is {sft!r}; give a directory of pairs, or null for no pairs")
        return None
    path = _resolve(preference, base_dir)
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise DataConfigError(f"{key}: {preference!r} ({path}) {what}; give a directory holding train.json and "
                              "dev.json (or .jsonl, or train/*.json(l), dev/*.json(l)) with one pair per line, or "
                              f"null for the builtin pairs (with data.sft: {BUILTIN_SFT[0]})")
    return path


def read_preference_dir(preference_dir: str | os.PathLike, split: str,
                        key: str = "data.preference") -> list[PreferenceRecord]:
    """All pairs of one split, files concatenated in sorted order, in any shape
    stages.data.preference reads; a bad line raises PreferenceDataError naming `key` and file:line."""
    records: list[PreferenceRecord] = []
    for path in split_files(preference_dir, split, key, PREFERENCE_SUFFIXES, PREFERENCE_EXAMPLE):
        try:
            records += read_preference_file(path)
        except PreferenceDataError as e:
            raise PreferenceDataError(f"{key}: {e}") from None
    return records


def check_data_section(data: Mapping[str, Any], experiment: str, base_dir: str | os.PathLike | None) -> None:
    """Check one experiment's (schema-validated) `data:` section before any job starts.

    Raises DataConfigError (PreferenceDataError for a bad pair) whose message begins with the config
    key (`experiments.<experiment>.data.corpus[i]`, `.data.sft` or `.data.preference`) and names the
    file, the line where there is one, and the fix. Returns None when the data can be read.
    """
    prefix = f"experiments.{experiment}.data"
    if "corpus" in data:
        resolve_corpus(data["corpus"], base_dir, f"{prefix}.corpus")
    if "sft" in data:
        sft_dir = resolve_sft(data["sft"], base_dir, f"{prefix}.sft")
        if sft_dir is not None:
            for split in SFT_SPLITS:
                read_sft_dir(sft_dir, split, f"{prefix}.sft")
    sft = data.get("sft", BUILTIN_SFT[0])
    preference = preference_source(data.get("preference"), sft)
    if preference is not None:
        preference_dir = resolve_preference(preference, sft, base_dir, f"{prefix}.preference")
        if preference_dir is not None:
            for split in SFT_SPLITS:
                read_preference_dir(preference_dir, split, f"{prefix}.preference")


MIX_CORPUS = "corpus"  # the mix_datasets entry naming the experiment's own pretraining split


def _mix_entries(section: Mapping[str, Any]) -> list[str]:
    """The mix_datasets entries read from files (not `corpus`, prepare's own split), when mixing is on."""
    if not section.get("mix_ratio"):
        return []
    return [name for name in section.get("mix_datasets", []) if name != MIX_CORPUS]


def mixing_sections(exp: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The sections of a complete experiment that mix general text in, by their key below it: every
    `finetune.<method>`, and `align` when it runs."""
    sections = {f"finetune.{method}": section for method, section in exp["finetune"].items()}
    if exp["align"]["enabled"]:
        sections["align"] = exp["align"]
    return sections


def check_mix_datasets(exp: Mapping[str, Any], experiment: str, base_dir: str | os.PathLike | None) -> None:
    """The mix_datasets entries of every section of the complete experiment `exp` that mixes
    (`mixing_sections`) resolve to readable corpus files (the rules of data.corpus), or
    DataConfigError naming `experiments.<name>.<section>.mix_datasets`."""
    for where, section in mixing_sections(exp).items():
        key = f"experiments.{experiment}.{where}.mix_datasets"
        for i, name in enumerate(_mix_entries(section)):
            resolve_corpus_source(name, base_dir, f"{key}[{i}]")


def mix_files(section: Mapping[str, Any], base_dir: str | os.PathLike | None) -> list[str]:
    """The files a fine-tuning or align section mixes in (its rule's inputs)."""
    return [str(p) for name in _mix_entries(section) for p in resolve_corpus_source(name, base_dir, "mix_datasets")]
