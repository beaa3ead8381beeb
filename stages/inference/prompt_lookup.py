"""Prompt-lookup drafts for speculative greedy decoding (Saxena's prompt lookup decoding, which
transformers runs as `generate(prompt_lookup_num_tokens=...)`).

Where a continuation copies from its context (a summary quoting its source, an edit of code, an
answer naming the question's words), the tokens that followed an earlier occurrence of the last few
tokens are a good guess of what comes next. `PromptLookup.draft(context)` finds the latest earlier
occurrence of the context's last n tokens (n from `max_ngram` down to 1) and proposes the up to
`num_draft_tokens` tokens that followed it. The decode engine (`stages.inference.engine`) checks a
draft in one forward of the model over the last token and the draft: the draft's tokens that equal
the model's greedy choice at their place are taken, plus the model's own token at the first place
they differ, so one forward yields from 1 to `num_draft_tokens` + 1 tokens and the tokens are the
greedy ones (up to the float rounding of a several-token forward against one-token steps: see the
engine).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLookup:
    """How drafts are found: the longest n-gram matched (down to 1) and the tokens proposed."""

    max_ngram: int = 3
    num_draft_tokens: int = 10

    def __post_init__(self):
        if self.max_ngram < 1 or self.num_draft_tokens < 1:
            raise ValueError(f"max_ngram={self.max_ngram} and num_draft_tokens={self.num_draft_tokens} must be >= 1")

    def draft(self, context: list[int], limit: int | None = None) -> list[int]:
        """Up to min(num_draft_tokens, limit) tokens that followed the latest earlier occurrence of
        the last n tokens of `context` (the longest n that occurs), or [] where none does."""
        count = self.num_draft_tokens if limit is None else min(self.num_draft_tokens, limit)
        if count < 1:
            return []
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest first; not the tail itself
                if context[start:start + n] == tail:
                    return context[start + n:start + n + count]
        return []
