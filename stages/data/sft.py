"""Supervised fine-tuning data: reading src/tgt JSON lines and encoding them for training and
generation.

Line format (PaddleNLP's): `{"src": str or [str], "tgt": str or [str]}`; with lists, the i-th
src/tgt pair is the i-th round of a conversation and the lists have equal length.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from stages.checkpoint.atomic import atomic_file
from stages.data.files import json_lines
from stages.errors import InputError
from stages.model.labels import IGNORE_INDEX


@dataclass(frozen=True)
class SftRecord:
    src: list[str]  # one entry per round
    tgt: list[str]
    system: str | None = None  # a system prompt before the first round (the server's system messages)


class SftDataError(InputError):
    """A malformed SFT file; the message names the file, the line and the fix."""


def parse_record(obj: Any, where: str) -> SftRecord:
    """Check one decoded JSON line and normalise str -> [str]."""
    if not isinstance(obj, dict):
        raise SftDataError(f"{where}: expected a JSON object with 'src' and 'tgt', got {type(obj).__name__}")
    missing = [k for k in ("src", "tgt") if k not in obj]
    if missing:
        raise SftDataError(f"{where}: record has no {' and no '.join(repr(m) for m in missing)} "
                           f"(keys present: {sorted(obj)}); each line needs both 'src' and 'tgt'")
    fields = {}
    for key in ("src", "tgt"):
        value = obj[key]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise SftDataError(f"{where}: '{key}' must be a string or a non-empty list of strings")
        fields[key] = value
    empty = [i for i, t in enumerate(fields["tgt"]) if not t.strip()]
    if empty:
        raise SftDataError(f"{where}: 'tgt' is empty (round {empty[0] + 1}); an empty answer would teach the model "
                           "to stop at once: fill in the answer or remove the line")
    if len(fields["src"]) != len(fields["tgt"]):
        raise SftDataError(f"{where}: 'src' has {len(fields['src'])} rounds but 'tgt' has "
                           f"{len(fields['tgt'])}; multi-turn lists must have equal length")
    return SftRecord(src=fields["src"], tgt=fields["tgt"])


def read_sft_file(path: str | Path) -> list[SftRecord]:
    """Read a JSON-lines SFT file; a bad line (or an empty file) raises SftDataError naming
    `path:line` (`stages.data.files.json_lines`)."""
    path = Path(path)
    return [parse_record(obj, f"{path}:{lineno}")
            for lineno, obj in json_lines(path, SftDataError, '{"src": "...", "tgt": "..."}')]


def write_sft_file(path: str | Path, records: Sequence[SftRecord]) -> None:
    """Write records as JSON lines (single-round records as plain strings)."""

    with atomic_file(path) as f:
        for r in records:
            src = r.src[0] if len(r.src) == 1 else r.src
            tgt = r.tgt[0] if len(r.tgt) == 1 else r.tgt
            f.write(json.dumps({"src": src, "tgt": tgt}, ensure_ascii=False) + "\n")


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _bos(tokenizer) -> list[int]:
    """[bos] for tokenizers that have one (GPT-2-style ones may not)."""
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def uses_chat_template(tokenizer, chat_template: bool) -> bool:
    """Whether SFT records are rendered with the tokenizer's chat template: asked for
    (`data.chat_template`) and the tokenizer has one."""
    return bool(chat_template and getattr(tokenizer, "chat_template", None))


def chat_segments(tokenizer, record: SftRecord) -> list[tuple[str, bool]]:
    """The chat template's rendering of the conversation (user = src, assistant = tgt, round by
    round) cut into (text, learned) pieces: learned pieces are exactly the assistant turns, each
    with the template's end-of-turn marker (e.g. `three big red boxes<|im_end|>`); everything else
    (system prompt, role headers, the whitespace between turns) is context.

    The cut comes from rendering growing prefixes of the conversation, so it needs a template whose
    rendering of a prefix is a prefix of the whole; SftDataError otherwise (set data.chat_template:
    false to use the plain format)."""
    messages: list[dict[str, str]] = [] if record.system is None else [{"role": "system", "content": record.system}]
    segments: list[tuple[str, bool]] = []
    done = ""
    for src, tgt in zip(record.src, record.tgt):
        messages.append({"role": "user", "content": src})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        messages.append({"role": "assistant", "content": tgt})
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise SftDataError("the tokenizer's chat template renders a conversation prefix that is not a prefix "
                               "of the whole conversation, so the assistant turns cannot be located; set "
                               "data.chat_template: false")
        turn = full[len(prompt):]
        answer = turn.rstrip()  # the answer and its end-of-turn token; trailing newlines are glue
        segments += [(prompt[len(done):], False), (answer, True)]
        done = prompt + answer
    return segments


def encode_prompt(tokenizer, record: SftRecord, src_length: int, chat: bool = False) -> list[int]:
    """Ids the model generates from: all earlier rounds in full, then the last src (with `chat`,
    rendered by the chat template up to the assistant header); truncated from the left to
    `src_length` so the most recent context is kept. Plain format: [bos] first, then the system
    prompt's text when the record has one."""
    if chat:
        ids = [i for text, _ in chat_segments(tokenizer, record)[:-1] for i in _ids(tokenizer, text)]
        return ids[-src_length:]
    ids: list[int] = [] if record.system is None else _ids(tokenizer, record.system)
    for src, tgt in zip(record.src[:-1], record.tgt[:-1]):
        ids += _ids(tokenizer, src) + _ids(tokenizer, tgt) + [tokenizer.eos_token_id]
    ids += _ids(tokenizer, record.src[-1])
    bos = _bos(tokenizer)
    keep = src_length - len(bos)
    return bos + (ids[-keep:] if keep > 0 else [])


def encode_example(tokenizer, record: SftRecord, src_length: int, max_length: int,
                   chat: bool = False) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for training: every target round is learned, prompts are not.
    Plain format: [bos] src tgt [eos] per round, eos learned. With `chat`: the chat template's
    rendering (`chat_segments`), the assistant turns learned with their end-of-turn token.
    Each round's prompt is cut from the left to `src_length`, the whole example to `max_length`."""
    if chat:
        pieces = [(_ids(tokenizer, text), learned) for text, learned in chat_segments(tokenizer, record)]
    else:
        pieces = []
        for src, tgt in zip(record.src, record.tgt):
            pieces += [(_ids(tokenizer, src), False), (_ids(tokenizer, tgt) + [tokenizer.eos_token_id], True)]
    # Plain prompts keep src_length - 1 tokens of src, leaving room for the bos in front.
    limit = src_length if chat else src_length - 1
    input_ids: list[int] = [] if chat else _bos(tokenizer)
    labels: list[int] = [IGNORE_INDEX] * len(input_ids)
    for ids, learned in pieces:
        if not learned:
            ids = ids[-limit:] if limit > 0 else []
        input_ids += ids
        labels += ids if learned else [IGNORE_INDEX] * len(ids)
    return input_ids[:max_length], labels[:max_length]


def target_text(record: SftRecord) -> str:
    """The reference a generation is scored against: the last round's target."""
    return record.tgt[-1]
