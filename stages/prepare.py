"""prepare: corpus + SFT data -> tokenizer, token files and normalised SFT files.

    python -m stages.prepare --out results/llama/data --config '{"corpus": ["builtin:pydoc"], ...}'

Output directory (docs/artifacts.md), written whole through `atomic_dir`:
    tokenizer/                      byte-level BPE, HF fast tokenizer layout
    train.bin/.idx, validation.bin/.idx, index.json
    sft/train.json, sft/dev.json    JSON lines {"src", "tgt"}
    preference/train.json, preference/dev.json
                                    JSON lines {"src", "chosen", "rejected"} (stages.data.preference),
                                    when there are pairs (data.preference)
    meta.json                       stage "prepare", the data config, seed, metrics

Everything that can fail on bad input (paths, file contents, SFT records) is read and checked
before the first byte is written, so a failed run leaves no partial output behind.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from stages import settings
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.meta import write_meta
from stages.checkpoint.tokenizer_files import copy_tokenizer
from stages.data import attributes, records
from stages.data.corpus import (RECORDS, SFT_TARGETS, CorpusError, TokenFile, encode_documents, read_documents,
                                split_documents, unigram_entropy_bits, write_token_files)
from stages.data.preference import PreferenceRecord, write_preference_file
from stages.data.sft import SftRecord, uses_chat_template, write_sft_file
from stages.data.tokenizer import (TokenizerError, load_model_tokenizer, save_tokenizer,
                                   tokenizer_fingerprint, train_tokenizer)
from stages.data.validate import (preference_source, read_preference_dir, read_sft_dir, resolve_corpus,
                                  resolve_preference, resolve_sft)
from stages.errors import ConfigError, run_cli
from stages.sections import DataSettings
from stages.stage_logs import configure_logging, log_io

log = logging.getLogger(__name__)

STAGE = "prepare"


def load_sft(sft: str, num_sft_train: int, num_sft_dev: int, seed: int,
             base_dir: str | os.PathLike | None = None) -> tuple[list[SftRecord], list[SftRecord]]:
    """(train, dev) SFT records: the generated builtin task, or a user directory's files.

    `num_sft_train`/`num_sft_dev` size the builtin task only; a directory is used whole.
    """
    sft_dir = resolve_sft(sft, base_dir)
    if sft_dir is None:  # resolve_sft accepts only the builtins that exist
        return attributes.generate(num_sft_train, num_sft_dev, seed)
    return read_sft_dir(sft_dir, "train"), read_sft_dir(sft_dir, "dev")


def load_preference(preference: str | None, sft: str, sft_train: list[SftRecord], sft_dev: list[SftRecord],
                    seed: int, base_dir: str | os.PathLike | None = None) -> Preference | None:
    """(train, dev) preference pairs, or None when the section asks for none (`preference_source`):
    the builtin task's pairs, one per SFT record (dev pairs from the SFT dev records, which no
    training sees), or a user directory's pairs in any shape stages.data.preference reads."""
    source = preference_source(preference, sft)
    if source is None:
        return None
    preference_dir = resolve_preference(source, sft, base_dir)
    if preference_dir is None:  # resolve_preference accepts the builtin only beside the builtin task
        return Preference(attributes.preference_pairs(sft_train, seed, "train"),
                          attributes.preference_pairs(sft_dev, seed, "dev"))
    return Preference(read_preference_dir(preference_dir, "train"), read_preference_dir(preference_dir, "dev"))


def _sft_texts(records: list[SftRecord]) -> list[str]:
    return [text for r in records for text in (*r.src, *r.tgt)]


TARGETS_PER_DOCUMENT = 32


def target_documents(records: list[SftRecord]) -> list[str]:
    """`builtin:sft_targets`: the target side of the SFT train split as plain text, one target per
    line, TARGETS_PER_DOCUMENT lines a document. It gives pretraining the task's language (its
    words and grammar) without the prompt-to-answer mapping, as a real pretraining corpus covers
    the language of its downstream tasks; without it the task words are tokens pretraining never
    saw, whose output rows it pushes far down, and fine-tuning has to undo that first."""
    lines = [t for r in records for t in r.tgt]
    return ["\n".join(lines[i:i + TARGETS_PER_DOCUMENT]) + "\n"
            for i in range(0, len(lines), TARGETS_PER_DOCUMENT)]


def model_tokenizer(model_dir: str | os.PathLike):
    """(tokenizer, vocabulary size) of a starting checkpoint: the vocabulary is the embedding's row
    count from config.json (it may exceed the tokenizer's length: padding rows); a tokenizer with
    ids beyond the embedding is refused."""
    tokenizer = load_model_tokenizer(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    rows = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if rows is None:
        raise TokenizerError(f"{model_dir}/config.json has no vocab_size")
    if len(tokenizer) > rows:
        raise TokenizerError(f"{model_dir}: the tokenizer has {len(tokenizer)} tokens but the embedding only "
                             f"{rows} rows (config.json vocab_size); ids past {rows - 1} would index nothing")
    return tokenizer, rows


def run(out_dir: str | os.PathLike, data: Mapping[str, Any] | None = None, *,
        base_dir: str | os.PathLike | None = None, tokenizer_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Build the data artifact in `out_dir` (replaced atomically when complete) from the experiment's
    `data` section `data` (typed `DataSettings` or a mapping; what it lacks takes the schema's
    default) and return its metrics.

    The section's keys: `corpus` (paths, globs or builtins such as `builtin:pydoc`), `sft` (a
    directory with train.json/dev.json, or train/*.json, dev/*.json, or `builtin:attributes`),
    `vocab_size` (asked for; the tokenizer may end smaller on tiny corpora, index.json records the
    real size), `validation_fraction` (share of corpus tokens held out as whole documents,
    `stages.data.corpus.split_documents`), `num_sft_train`/`num_sft_dev` (records of the builtin
    task), `seed` (the document split and the builtin task), `chat_template` (render SFT records
    with the tokenizer's chat template when it has one, recorded as index.json's `sft_format`,
    which fine-tuning and evaluation follow).

    base_dir: what relative paths resolve against (default: the current directory).
    tokenizer_dir: a starting checkpoint's directory: its tokenizer is used as is (copied into
        tokenizer/) and the vocabulary is its embedding's; `vocab_size` is then ignored.

    Returns metrics: vocab_size (real), num_documents_<split>, num_tokens_<split> (eos included),
    num_sft_train, num_sft_dev, num_preference_train, num_preference_dev (null without pairs),
    train_unigram_entropy_bits, chars_per_token.

    `preference` (null: the builtin task's pairs when `sft` is builtin:attributes, none otherwise;
    builtin:attributes; or a directory of train/dev pair files) gives preference/train.json and
    preference/dev.json, normalised to our shape; the pairs do not join the tokenizer's text, so
    every other output is what it would be without them.
    """
    t0 = time.perf_counter()
    data = DataSettings.of(data)
    config = {**data.as_dict(), "tokenizer": str(tokenizer_dir) if tokenizer_dir else None}
    log_io(STAGE, reads={"corpus": data.corpus, "SFT records": data.sft, "tokenizer": tokenizer_dir},
           writes={"tokenizer, train/validation tokens, sft/train.json, sft/dev.json, preference/*.json": out_dir},
           logger=log)
    inputs = read_inputs(data, base_dir)  # every input checked before anything is written
    if tokenizer_dir is None:
        # The SFT train texts join the tokenizer's training text so that task words become tokens;
        # dev texts stay out so that evaluation sees only what training saw.
        tokenizer = train_tokenizer(inputs.docs + inputs.train_only + _sft_texts(inputs.sft_train), data.vocab_size)
        vocab_size = len(tokenizer)
    else:  # a starting checkpoint: its own tokenizer, its embedding's vocabulary
        tokenizer, vocab_size = model_tokenizer(tokenizer_dir)
    splits = split_documents(encode_documents(tokenizer, inputs.docs), data.validation_fraction, data.seed)
    splits["train"] += encode_documents(tokenizer, inputs.train_only)
    with atomic_dir(out_dir) as tmp:
        if tokenizer_dir is None:
            save_tokenizer(tokenizer, tmp / "tokenizer")
        else:
            copy_tokenizer(tokenizer_dir, tmp / "tokenizer")
        identity = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                    "tokenizer_source": str(tokenizer_dir) if tokenizer_dir else "trained by prepare",
                    "sft_format": "chat_template" if uses_chat_template(tokenizer, data.chat_template) else "plain"}
        metrics = write_data(tmp, tokenizer, vocab_size, splits, inputs, identity)
        write_meta(tmp, stage=STAGE, config=config, parent=None, seed=data.seed, metrics=metrics)
    log.info("prepare wrote %s in %.1f s: %s", out_dir, time.perf_counter() - t0, metrics)
    return metrics


@dataclass
class Preference:
    """Preference pairs of the train and dev splits."""

    train: list[PreferenceRecord]
    dev: list[PreferenceRecord]


@dataclass
class Inputs:
    """What prepare reads: the SFT records, the corpus documents (`train_only`: training text
    that stays out of the validation split, builtin:records) and the preference pairs (None: none)."""

    sft_train: list[SftRecord]
    sft_dev: list[SftRecord]
    docs: list[str]
    train_only: list[str]
    preference: Preference | None = None


def read_inputs(data: DataSettings, base_dir: str | os.PathLike | None) -> Inputs:
    """Every input of the data section, read and checked. Paths are resolved before any file is read
    so that a typo fails at once, not after a long corpus read."""
    corpus = data.corpus
    resolve_corpus(corpus, base_dir)
    resolve_sft(data.sft, base_dir)
    preference_pairs = preference_source(data.preference, data.sft)
    if preference_pairs is not None:
        resolve_preference(preference_pairs, data.sft, base_dir)
    sft_train, sft_dev = load_sft(data.sft, data.num_sft_train, data.num_sft_dev, data.seed, base_dir)
    preference = load_preference(data.preference, data.sft, sft_train, sft_dev, data.seed, base_dir)
    files_and_pydoc = [c for c in corpus if c not in (SFT_TARGETS, RECORDS)]
    docs = read_documents(files_and_pydoc, base_dir) if files_and_pydoc else []
    if SFT_TARGETS in corpus:
        docs += target_documents(sft_train)
    # builtin:records is training text only, after the split: validation measures general text
    train_only = records.documents() if RECORDS in corpus else []
    if train_only and not docs:
        raise CorpusError(f"data.corpus: {corpus} has only builtin:records, which is training text only; "
                          "add general text (files or builtin:pydoc) for the validation split")
    return Inputs(sft_train, sft_dev, docs, train_only, preference)


def write_data(out: Path, tokenizer, vocab_size: int, splits: dict[str, list], inputs: Inputs,
               identity: dict[str, Any]) -> dict[str, Any]:
    """The token files, index.json and the SFT files in `out`; returns the data's metrics."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    index = write_token_files(out, splits, vocab_size=vocab_size, bos_id=tokenizer.bos_token_id,
                              eos_id=tokenizer.eos_token_id, pad_id=pad, extra=identity)
    write_sft_file(out / "sft" / "train.json", inputs.sft_train)
    write_sft_file(out / "sft" / "dev.json", inputs.sft_dev)
    if inputs.preference is not None:
        write_preference_file(out / "preference" / "train.json", inputs.preference.train)
        write_preference_file(out / "preference" / "dev.json", inputs.preference.dev)
        log.info("preference pairs: %d train, %d dev -> %s", len(inputs.preference.train),
                 len(inputs.preference.dev), out / "preference")
    else:
        log.info("no preference pairs (data.preference is null and data.sft is not builtin:attributes)")
    train_tokens = TokenFile.open(out, "train").tokens  # re-read: also checks what was written
    all_docs = splits["train"] + splits["validation"]
    metrics = {
        "vocab_size": vocab_size,
        **{f"num_documents_{s}": index["splits"][s]["num_documents"] for s in ("train", "validation")},
        **{f"num_tokens_{s}": index["splits"][s]["num_tokens"] for s in ("train", "validation")},
        "num_sft_train": len(inputs.sft_train),
        "num_sft_dev": len(inputs.sft_dev),
        "num_preference_train": None if inputs.preference is None else len(inputs.preference.train),
        "num_preference_dev": None if inputs.preference is None else len(inputs.preference.dev),
        "train_unigram_entropy_bits": round(unigram_entropy_bits(train_tokens, vocab_size), 6),
        "chars_per_token": round(sum(map(len, inputs.docs + inputs.train_only)) / sum(map(len, all_docs)), 4),
    }
    del train_tokens  # release the memmap before the directory is renamed
    return metrics


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.prepare", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path,
                        help="output data directory (e.g. results/llama/data); replaced atomically")
    parser.add_argument("--config", metavar="JSON", help="the experiment's `data` section as one JSON object")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="MODEL_DIR",
                        help="use this checkpoint's tokenizer (and its embedding's vocabulary) instead of "
                             "training one: the imported model.model_name_or_path (results/<name>/base)")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="directory that relative corpus/sft paths resolve against "
                             "(default: the current directory, Snakemake's workdir)")
    settings.add_arguments(parser, "data")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        config = settings.from_arguments(args, "data", args.config)
    except ConfigError as e:
        parser.error(str(e))  # usage + message, exit status 2
    return run(args.out, config, base_dir=args.base_dir, tokenizer_dir=args.tokenizer)


if __name__ == "__main__":
    run_cli(main, "prepare")
