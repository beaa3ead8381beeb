"""Preference data: a prompt, the answer to prefer and the answer to reject, read from JSON lines in
the shapes the tools people use write them.

One line is one pair. Accepted shapes (the first key that matches decides):

  ours (PaddleNLP's src/tgt)  {"src": str or [str], "chosen": str, "rejected": str}
                              with several rounds, "tgt": the earlier rounds' answers (one fewer
                              than "src"); "system": a system prompt
  TRL, explicit prompt        {"prompt": str, "chosen": str, "rejected": str}
  TRL, conversational         {"prompt": [messages], "chosen": [messages], "rejected": [messages]},
                              or without "prompt": "chosen" and "rejected" whole conversations
                              that share everything but the last assistant message (implicit prompt)
  LLaMA-Factory, alpaca       {"instruction": str, "input": str, "chosen": str, "rejected": str}
                              ("input" optional, appended to the instruction after a blank line;
                              "system" and "history" [[user, assistant], ...] optional)
  LLaMA-Factory, sharegpt     {"conversations": [{"from": "human"|"gpt"|"system", "value": str}],
                              "chosen": {"from": "gpt", "value": str}, "rejected": {...}}

A message is {"role": "system"|"user"|"assistant", "content": str}. Every pair becomes a
`PreferenceRecord`: the user turns, the earlier assistant answers, the two final answers. A bad
line raises PreferenceDataError naming `file:line`, the field and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.checkpoint.atomic import atomic_file
from stages.data.files import json_lines
from stages.data.sft import SftRecord
from stages.errors import InputError

EXAMPLE = '{"src": "count: 3; shape: box; size: big; color: red", "chosen": "three big red boxes", "rejected": "three big red box"}'
SHAPES = ("src/chosen/rejected", "prompt/chosen/rejected (TRL)", "instruction/chosen/rejected (LLaMA-Factory)",
          "conversations/chosen/rejected (LLaMA-Factory sharegpt)")


class PreferenceDataError(InputError):
    """A malformed preference file; the message names the file, the line, the field and the fix."""


@dataclass(frozen=True)
class PreferenceRecord:
    src: list[str]  # the user turns, one per round
    history: list[str]  # the assistant's answers to every round but the last
    chosen: str  # the preferred answer to the last round
    rejected: str  # the answer to reject
    system: str | None = None

    def conversation(self, answer: str) -> SftRecord:
        """The SFT record whose last answer is `answer` (`self.chosen` or `self.rejected`): what
        stages.data.sft encodes, so a pair is tokenized as fine-tuning tokenizes."""
        return SftRecord(src=list(self.src), tgt=[*self.history, answer], system=self.system)


def _text(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise PreferenceDataError(f"{where}: {key!r} must be a string, got "
                                  f"{'nothing' if value is None else type(value).__name__}")
    return value


def _answer(value: Any, key: str, where: str) -> str:
    """A final answer: a string, one assistant message, or a list holding one (TRL's conversational
    completions), or a sharegpt turn {"from": "gpt", "value": ...}."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        if value.get("role", "assistant") != "assistant" or value.get("from", "gpt") not in ("gpt", "assistant"):
            raise PreferenceDataError(f"{where}: {key!r} must be the assistant's answer, got a "
                                      f"{value.get('role') or value.get('from')!r} message")
        value = value.get("content", value.get("value"))
    if not isinstance(value, str):
        raise PreferenceDataError(f"{where}: {key!r} must be a string or one assistant message "
                                  '({"role": "assistant", "content": "..."})')
    if not value.strip():
        raise PreferenceDataError(f"{where}: {key!r} is empty; give both answers or remove the line")
    return value


def _messages(value: Any, key: str, where: str) -> list[tuple[str, str]]:
    """[(role, text)] of a list of {"role", "content"} (or sharegpt {"from", "value"}) messages."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    if not isinstance(value, list) or not value:
        raise PreferenceDataError(f"{where}: {key!r} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        role = roles.get(m.get("role", m.get("from"))) if isinstance(m, dict) else None
        text = m.get("content", m.get("value")) if isinstance(m, dict) else None
        if role is None or not isinstance(text, str):
            raise PreferenceDataError(f"{where}: {key}[{i}] must be a message such as "
                                      '{"role": "user", "content": "..."} (roles system, user, assistant)')
        out.append((role, text))
    return out


def _from_turns(turns: list[tuple[str, str]], chosen: str, rejected: str, where: str, key: str) -> PreferenceRecord:
    """A record from the prompt's turns (an optional system message, then user and assistant
    alternating, ending with a user turn) and the two answers."""
    system = None
    if turns and turns[0][0] == "system":
        system, turns = turns[0][1], turns[1:]
    users = [t for r, t in turns[0::2] if r == "user"]
    assistants = [t for r, t in turns[1::2] if r == "assistant"]
    if len(users) != len(turns[0::2]) or len(assistants) != len(turns[1::2]) or not turns or turns[-1][0] != "user":
        raise PreferenceDataError(f"{where}: {key!r} must alternate user and assistant turns (after an optional "
                                  "system message) and end with the user's turn that the answers reply to")
    return PreferenceRecord(src=users, history=assistants, chosen=chosen, rejected=rejected, system=system)


def _implicit_prompt(obj: dict, where: str) -> PreferenceRecord:
    """TRL's conversational pairs without "prompt": two conversations equal but for the last message."""
    chosen, rejected = _messages(obj["chosen"], "chosen", where), _messages(obj["rejected"], "rejected", where)
    if chosen[:-1] != rejected[:-1] or chosen[-1][0] != "assistant" or rejected[-1][0] != "assistant":
        raise PreferenceDataError(f"{where}: without 'prompt', 'chosen' and 'rejected' must be the same "
                                  "conversation up to their last message, an assistant answer each")
    return _from_turns(chosen[:-1], _answer(chosen[-1][1], "chosen", where),
                       _answer(rejected[-1][1], "rejected", where), where, "chosen")


def parse_preference(obj: Any, where: str) -> PreferenceRecord:
    """Check one decoded JSON line (any accepted shape) and normalise it."""
    if not isinstance(obj, dict):
        raise PreferenceDataError(f"{where}: expected a JSON object such as {EXAMPLE}")
    missing = [k for k in ("chosen", "rejected") if k not in obj]
    if missing:
        raise PreferenceDataError(f"{where}: no {' and no '.join(repr(m) for m in missing)} (keys present: "
                                  f"{sorted(obj)}); each line needs a prompt and both answers, in one of the "
                                  f"shapes {', '.join(SHAPES)}")
    if "src" in obj:
        src = [obj["src"]] if isinstance(obj["src"], str) else obj["src"]
        history = obj.get("tgt", [])
        history = [history] if isinstance(history, str) else history
        if not isinstance(src, list) or not src or not all(isinstance(s, str) for s in src):
            raise PreferenceDataError(f"{where}: 'src' must be a string or a non-empty list of strings")
        if not isinstance(history, list) or not all(isinstance(t, str) for t in history) \
                or len(history) != len(src) - 1:
            raise PreferenceDataError(f"{where}: 'tgt' must hold the answers to the {len(src) - 1} earlier "
                                      f"round(s) of 'src', got {len(history) if isinstance(history, list) else history!r}")
        system = obj.get("system")
        if system is not None and not isinstance(system, str):
            raise PreferenceDataError(f"{where}: 'system' must be a string")
        return PreferenceRecord(src, history, _answer(obj["chosen"], "chosen", where),
                                _answer(obj["rejected"], "rejected", where), system)
    if "prompt" in obj:
        chosen, rejected = _answer(obj["chosen"], "chosen", where), _answer(obj["rejected"], "rejected", where)
        if isinstance(obj["prompt"], str):
            return PreferenceRecord([obj["prompt"]], [], chosen, rejected)
        return _from_turns(_messages(obj["prompt"], "prompt", where), chosen, rejected, where, "prompt")
    if "instruction" in obj:
        instruction = _text(obj, "instruction", where)
        extra = obj.get("input") or ""
        if not isinstance(extra, str):
            raise PreferenceDataError(f"{where}: 'input' must be a string")
        history = obj.get("history") or []
        if not isinstance(history, list) or not all(isinstance(h, list) and len(h) == 2
                                                    and all(isinstance(t, str) for t in h) for h in history):
            raise PreferenceDataError(f"{where}: 'history' must be a list of [user, assistant] string pairs")
        system = obj.get("system")
        if system is not None and not isinstance(system, str):
            raise PreferenceDataError(f"{where}: 'system' must be a string")
        last = f"{instruction}\n\n{extra}" if extra else instruction
        return PreferenceRecord([*(h[0] for h in history), last], [h[1] for h in history],
                                _answer(obj["chosen"], "chosen", where), _answer(obj["rejected"], "rejected", where),
                                system or None)
    if "conversations" in obj:
        turns = _messages(obj["conversations"], "conversations", where)
        if obj.get("system"):
            turns = [("system", _text(obj, "system", where)), *turns]
        return _from_turns(turns, _answer(obj["chosen"], "chosen", where),
                           _answer(obj["rejected"], "rejected", where), where, "conversations")
    if isinstance(obj["chosen"], list) and isinstance(obj["rejected"], list):
        return _implicit_prompt(obj, where)
    raise PreferenceDataError(f"{where}: no prompt: give 'src', 'prompt', 'instruction' or 'conversations' "
                              f"beside 'chosen' and 'rejected' (keys present: {sorted(obj)})")


def read_preference_file(path: str | Path) -> list[PreferenceRecord]:
    """Every pair of a JSON-lines file; a bad line (or an empty file) raises PreferenceDataError
    naming `path:line`."""
    path = Path(path)
    records = [parse_preference(obj, f"{path}:{lineno}") for lineno, obj in json_lines(path, PreferenceDataError,
                                                                                         EXAMPLE)]
    same = next((i for i, r in enumerate(records) if r.chosen == r.rejected), None)
    if same is not None:
        raise PreferenceDataError(f"{path}: pair {same + 1} has the same chosen and rejected answer "
                                  f"({records[same].chosen!r}); it teaches nothing: fix or remove it")
    return records


def write_preference_file(path: str | Path, records: Sequence[PreferenceRecord]) -> None:
    """Write records in our shape (a single round's src as a plain string), atomically."""
    with atomic_file(path) as f:
        for r in records:
            line: dict[str, Any] = {"src": r.src[0] if len(r.src) == 1 else r.src}
            if r.history:
                line["tgt"] = r.history
            if r.system is not None:
                line["system"] = r.system
            line.update(chosen=r.chosen, rejected=r.rejected)
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
