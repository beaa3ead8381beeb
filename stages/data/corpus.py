"""Pretraining corpus: reading documents, tokenizing them to flat token files, and reading those.

On-disk layout (docs/artifacts.md), per split `<split>` in ("train", "validation"):
- `<split>.bin`: token ids, documents concatenated, each followed by eos; little-endian
  `uint16` when vocab_size <= 65535, else `uint32` (the dtype is recorded in index.json);
- `<split>.idx`: little-endian int64 offsets, the start token of every document plus the end
  (num_documents + 1 values), so document i is tokens[offsets[i]:offsets[i + 1]];
- `index.json`: dtype, vocab_size, bos/eos/pad ids and per split the file names and counts.

Sources (the `data.corpus` list; path rules in `stages.data.validate`):
- `builtin:pydoc`: Python's `pydoc_data.topics.topics`, one document per topic, sorted by key;
- `builtin:records`: record/sentence pairs (`stages.data.records`), train split only (prepare);
- `.txt`: one document per file;  `.jsonl`: one document per line, field `text`;
- `.parquet`: one document per row of column `text`.
Documents with no non-whitespace text are skipped (and counted in the log).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from stages.checkpoint.atomic import atomic_file, write_json
from stages.data import records
from stages.data.files import json_lines, read_text
from stages.data.validate import resolve_corpus
from stages.errors import InputError
from stages.stage_logs import Progress

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"
SPLITS = ("train", "validation")


class CorpusError(InputError):
    """Unusable corpus content or token files; names the file (and line or row) and the fix."""


# --- reading documents -------------------------------------------------------------------------

def _pydoc_documents() -> Iterator[str]:
    from pydoc_data.topics import topics  # ships with every CPython install

    for key in sorted(topics):
        yield topics[key]


def _jsonl_documents(path: Path) -> Iterator[str]:
    for lineno, obj in json_lines(path, CorpusError, '{"text": "..."}'):
        if "text" not in obj:
            raise CorpusError(f"{path}:{lineno}: no 'text' field (got keys {sorted(obj)}); "
                              'each line must be an object with a string field "text"')
        if not isinstance(obj["text"], str):
            raise CorpusError(f"{path}:{lineno}: 'text' is {type(obj['text']).__name__}, expected a string; "
                              'each line must be an object with a string field "text"')
        yield obj["text"]


def _parquet_documents(path: Path) -> Iterator[str]:
    import pandas as pd  # only needed for parquet sources

    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise CorpusError(f"{path}: cannot read as parquet ({type(e).__name__}: {e}); the file is not parquet or "
                          "is truncated: write it again (e.g. pandas DataFrame.to_parquet) or remove it from "
                          "data.corpus") from None
    if "text" not in frame.columns:
        raise CorpusError(f"{path}: no 'text' column (columns: {list(frame.columns)}); "
                          "put the documents in a string column named 'text'")
    for row, value in enumerate(frame["text"].tolist()):
        if not isinstance(value, str):
            what = "missing (null)" if pd.api.types.is_scalar(value) and pd.isna(value) else type(value).__name__
            raise CorpusError(f"{path}: row {row} of column 'text' is {what}, expected a string; "
                              "drop or fill such rows")
        yield value


SFT_TARGETS = "builtin:sft_targets"
RECORDS = "builtin:records"


def iter_documents(sources: list[str], base_dir: str | os.PathLike | None = None,
                   key: str = "data.corpus") -> Iterator[str]:
    """Every document of the corpus, in source order (files of a glob sorted)."""
    for source, path in resolve_corpus(sources, base_dir, key):
        if source == SFT_TARGETS:
            continue  # made by prepare from the SFT train split (see stages.prepare.target_documents)
        if source == RECORDS:
            yield from records.documents()
        elif path is None:
            yield from _pydoc_documents()  # builtin:pydoc; resolve_corpus rejects unknown builtins
        elif path.suffix.lower() == ".txt":
            yield read_text(path, CorpusError)
        elif path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path)
        else:
            yield from _parquet_documents(path)


def read_documents(sources: list[str], base_dir: str | os.PathLike | None = None,
                   key: str = "data.corpus") -> list[str]:
    """All non-blank documents of the corpus; raises CorpusError if none has any text."""
    docs, blank = [], 0
    for doc in iter_documents(sources, base_dir, key):
        if doc.strip():
            docs.append(doc)
        else:
            blank += 1
    if blank:
        log.warning("skipped %d corpus documents with no text", blank)
    if not docs:
        raise CorpusError(f"{key}: the corpus {sources} holds no text (every document is empty or "
                          "whitespace); add text to the sources")
    log.info("read %d documents (%d characters) from %s", len(docs), sum(map(len, docs)), sources)
    return docs


def encode_documents(tokenizer, docs: list[str], batch_size: int = 1024) -> list[list[int]]:
    """Token ids of every document, without special tokens (eos is added when writing).

    Uses the Rust tokenizer's batch encoding (parallel across cores) in batches to bound memory.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
        return [tokenizer(doc, add_special_tokens=False)["input_ids"] for doc in docs]
    ids: list[list[int]] = []
    progress = Progress(log, "documents tokenized", len(docs))
    for start in range(0, len(docs), batch_size):
        batch = docs[start:start + batch_size]
        ids += [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]
        progress.advance(len(batch))
    return ids


# --- splitting and writing ---------------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits, else uint32 (the contract's rule)."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def split_documents(docs: list[list[int]], validation_fraction: float,
                    seed: int) -> dict[str, list[list[int]]]:
    """Split tokenized documents (without eos) into train and validation, deterministically.

    `validation_fraction` is a share of tokens, held out as whole documents. Several documents:
    walk them in an order drawn by numpy's Generator seeded with `seed`, and move a document to
    validation whenever that keeps validation within fraction * total tokens; if none fits, the
    smallest document is held out. So validation has at least one document, train keeps at least
    one, and document-size skew (pydoc topics range from 30 to 20,000 tokens) does not leave
    validation with a handful of tokens. Both splits keep the corpus order.
    One document: it is cut at token min(T - 1, max(1, round((1 - fraction) * T))), the head
    becoming the train document and the tail the validation document (T >= 2 needed).
    """
    if not 0 < validation_fraction < 1:
        raise CorpusError(f"validation_fraction={validation_fraction} must be in (0, 1)")
    if not docs:
        raise CorpusError("no documents to split; the corpus is empty")
    if len(docs) == 1:
        tokens = docs[0]
        if len(tokens) < 2:
            raise CorpusError(f"the corpus is one document of {len(tokens)} token(s); it cannot be split "
                              "into train and validation; add text")
        cut = min(len(tokens) - 1, max(1, round((1 - validation_fraction) * len(tokens))))
        log.warning("one corpus document: split at token %d of %d", cut, len(tokens))
        return {"train": [tokens[:cut]], "validation": [tokens[cut:]]}
    lengths = [len(d) for d in docs]
    target = validation_fraction * sum(lengths)
    val_ids: set[int] = set()
    held = 0
    for i in np.random.default_rng(seed).permutation(len(docs)).tolist():
        if held + lengths[i] <= target:
            val_ids.add(i)
            held += lengths[i]
    if not val_ids:
        val_ids = {min(range(len(docs)), key=lambda i: (lengths[i], i))}
    if len(val_ids) == len(docs):  # only when documents are empty; keep one for train
        val_ids.discard(max(val_ids))
    return {
        "train": [d for i, d in enumerate(docs) if i not in val_ids],
        "validation": [d for i, d in enumerate(docs) if i in val_ids],
    }


def write_split(out_dir: str | os.PathLike, split: str, docs: list[list[int]], eos_id: int,
                dtype: np.dtype) -> dict[str, object]:
    """Write `<split>.bin` (each document followed by eos) and `<split>.idx`; returns the split's
    index.json entry."""
    out_dir = Path(out_dir)
    lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)  # +1: the eos
    offsets = np.zeros(len(docs) + 1, dtype="<i8")
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=dtype)
    for doc, start, end in zip(docs, offsets[:-1], offsets[1:]):
        tokens[start:end - 1] = doc
        tokens[end - 1] = eos_id
    with atomic_file(out_dir / f"{split}.bin", "wb") as f:
        tokens.tofile(f)
    with atomic_file(out_dir / f"{split}.idx", "wb") as f:
        offsets.tofile(f)
    return {"tokens": f"{split}.bin", "offsets": f"{split}.idx",
            "num_tokens": int(offsets[-1]), "num_documents": len(docs)}


def write_token_files(out_dir: str | os.PathLike, splits: dict[str, list[list[int]]], *, vocab_size: int,
                      bos_id: int | None, eos_id: int, pad_id: int, extra: dict | None = None) -> dict[str, object]:
    """Write every split and `index.json` (with the `extra` fields, e.g. the tokenizer's
    fingerprint); returns the index."""
    dtype = token_dtype(vocab_size)
    index = {
        "dtype": dtype.name,  # "uint16" / "uint32"; the files are little-endian
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        **(extra or {}),
        "splits": {name: write_split(out_dir, name, splits[name], eos_id, dtype) for name in SPLITS},
    }
    write_json(Path(out_dir) / INDEX_NAME, index)
    return index


def unigram_entropy_bits(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (bits/token) of the token frequencies: the loss floor of a context-free model."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


# --- reading token files -----------------------------------------------------------------------

def read_index(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / INDEX_NAME
    if not path.is_file():
        raise CorpusError(f"{path} is missing; {data_dir} is not a prepared data directory "
                          "(run the prepare stage)")
    return json.loads(path.read_text())


@dataclass(frozen=True)
class TokenFile:
    """One split: `tokens` is a read-only memmap of every token, `offsets` the document bounds."""

    tokens: np.ndarray  # (num_tokens,) uint16/uint32 memmap
    offsets: np.ndarray  # (num_documents + 1,) int64

    @classmethod
    def open(cls, data_dir: str | os.PathLike, split: str) -> "TokenFile":
        """Open `split` of a prepared data directory, checking the files against index.json."""
        data_dir = Path(data_dir)
        index = read_index(data_dir)
        if split not in index["splits"]:
            raise CorpusError(f"{data_dir / INDEX_NAME}: no split {split!r} (have {sorted(index['splits'])})")
        entry = index["splits"][split]
        dtype = np.dtype(index["dtype"]).newbyteorder("<")
        tok_path, idx_path = data_dir / entry["tokens"], data_dir / entry["offsets"]
        expected = {tok_path: entry["num_tokens"] * dtype.itemsize, idx_path: (entry["num_documents"] + 1) * 8}
        for p, nbytes in expected.items():
            size = p.stat().st_size if p.is_file() else None
            if size != nbytes:
                raise CorpusError(f"{p}: expected {nbytes} bytes from {INDEX_NAME}, found "
                                  f"{'no file' if size is None else size}; the data directory is "
                                  "incomplete or mixed, rerun prepare")
        tokens = np.memmap(tok_path, dtype=dtype, mode="r", shape=(entry["num_tokens"],))
        offsets = np.fromfile(idx_path, dtype="<i8")
        if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) <= 0):
            raise CorpusError(f"{idx_path}: offsets are not increasing from 0 to {len(tokens)}; rerun prepare")
        return cls(tokens=tokens, offsets=offsets)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def document(self, i: int) -> np.ndarray:
        """Tokens of document i, its trailing eos included."""
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def load_split(data_dir: str | os.PathLike, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens memmap, int64 offsets) of one split of a prepared data directory."""
    f = TokenFile.open(data_dir, split)
    return f.tokens, f.offsets
