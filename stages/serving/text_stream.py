"""One answer's text as it grows token by token: the deltas a streaming client receives, cut at the
first stop string, without ever sending text that a stop string later takes back.

The text is always `tokenizer.decode(tokens, skip_special_tokens=True)` of every token so far
(stages.predict's decode), so the deltas of a stream join to exactly the text of the same request
without streaming. Two things are held back until they are settled:
  - a trailing U+FFFD: a byte-level BPE token may end inside a multi-byte character that the next
    token completes;
  - the longest tail of the text that is the start of a stop string: if the next tokens complete
    the stop string, the client must never have seen its beginning (OpenAI's semantics: the
    returned text does not contain the stop sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

FINISH_STOP = "stop"  # eos or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context window reached
FINISH_CANCELLED = "cancelled"  # the client went away; nothing is sent any more


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that may still become (part of) a stop string or a
    multi-byte character: the longest suffix that is a proper prefix of some stop string, at
    least 1 when the text ends in U+FFFD."""
    hold = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold


@dataclass
class TextStream:
    """The text of one answer; `push(token)` returns the delta that may be sent now."""

    tokenizer: object
    stops: Sequence[str] = ()
    eos_token_id: int | None = None
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters of `text` already returned as deltas
    text: str = ""  # the answer so far, cut before a stop string once one appeared
    stopped: bool = False  # a stop string appeared: the answer is final

    def push(self, token: int) -> str:
        """Add one generated token; return the text that became safe to send."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        if token == self.eos_token_id:
            return ""  # eos is kept in the token count, never in the text (skip_special_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops if s) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text))
        self.text = text
        return self._take(len(text) - held_back(text, self.stops))

    def flush(self) -> str:
        """The rest of the text once generation has ended (what was held back is final now)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return delta
