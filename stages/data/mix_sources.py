"""The general text that fine-tuning and preference alignment mix in (`mix_datasets`), as flat
token arrays.

- `corpus`: the experiment's pretraining train split as prepare tokenized it (`train.bin`), which
  is already in the model's tokenizer: prepare checks that before fine-tuning starts;
- anything else: a corpus entry as `data.corpus` takes them (.txt, .jsonl field `text`, .parquet
  column `text`, globs, builtin:pydoc), tokenized here with the model's tokenizer, each document
  followed by eos as in `train.bin`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from stages.data.corpus import TokenFile, encode_documents, read_documents
from stages.data.validate import MIX_CORPUS
from stages.errors import InputError

log = logging.getLogger(__name__)


def load_mix_sources(names: Sequence[str], data_dir: str | Path, tokenizer, key: str) -> list[np.ndarray]:
    """One token array per entry of `names` (`key` names the config entry in errors)."""
    arrays = []
    for i, name in enumerate(names):
        if name == MIX_CORPUS:
            tokens = np.asarray(TokenFile.open(data_dir, "train").tokens)
        else:
            tokens = _tokenize(name, tokenizer, f"{key}[{i}]")
        log.info("%s[%d] %s: %d tokens of general text", key, i, name, len(tokens))
        arrays.append(tokens)
    return arrays


def _tokenize(source: str, tokenizer, key: str) -> np.ndarray:
    if tokenizer.eos_token_id is None:
        raise InputError(f"{key}: the model's tokenizer has no eos token to separate the documents of {source!r}")
    docs = encode_documents(tokenizer, read_documents([source], Path.cwd(), key))
    return np.fromiter((t for doc in docs for t in (*doc, tokenizer.eos_token_id)), dtype=np.int64)


def section_mix_sources(section: Mapping[str, Any], data_dir: str | Path, tokenizer, key: str) -> list[np.ndarray]:
    """The general text a training section mixes in (its `mix_datasets` as token arrays, errors
    naming `<key>.mix_datasets[i]`); none without `mix_ratio`."""
    if not section["mix_ratio"]:
        return []
    return load_mix_sources(section["mix_datasets"], data_dir, tokenizer, f"{key}.mix_datasets")


def mix_digests(arrays: Sequence[np.ndarray]) -> list[str]:
    """The sha256 of each token array: part of a run's identity (other general text is another run,
    never resumed from this one's checkpoints)."""
    return [hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest() for tokens in arrays]
