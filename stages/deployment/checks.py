"""Checks of a deployable artifact against its source, run before the artifact is published.

Each check compares what a runtime users deploy with computes from the artifact (transformers'
GGUF loader, transformers with compressed-tensors) with what the pipeline computes from the source,
on the experiment's own validation text, so the top-1 agreement measures quantization error at
positions where the model has a real preference, not near-ties of random tokens:

    top1_agreement = share of probe positions whose argmax token is the same, a near-tie counted as
                     agreeing: a position where the source itself prefers its token over the
                     artifact's by at most TIE_RTOL of the logit scale (such a flip is rounding on a
                     tie, not quantization error; strict_top1_agreement and near_ties report both)
    rel_err        = max |got - want| / max |want|  over every logit of the probe (stages.metrics.logit_agreement)

Tokenizers are compared on strings that break careless conversions (numerals, runs of spaces,
newlines and tabs, accents, CJK, emoji): the same ids or the check fails naming the string. The
same strings as prompts (`prompt_text_mismatches`): the artifact's tokenizer called on the text as
its users call it (`tokenizer(text)`, or the chat template with the generation prompt) against the
ids the predictor feeds (`stages.data.sft.encode_prompt`); the logit checks start from ids, so only
this one sees a prompt that loses the bos the model was trained with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from stages.data.corpus import load_split
from stages.metrics.logit_agreement import logit_agreement, share, top1_matches
from stages.metrics.perplexity import validation_windows
from stages.data.sft import SftRecord, encode_prompt

# Strings on which byte-level BPE conversions go wrong: digits split one by one or in groups of
# three, runs of spaces kept or merged, newlines and tabs, non-ASCII letters, CJK and emoji bytes.
TOKENIZER_PROBES = (
    "The year 2024 had 365 days; pi is 3.14159 and 1000000 is a million.",
    "a  b   c    d     e      (runs of spaces)",
    "line one\nline two\n\n\ttabbed line\r\nend",
    "naïve café, Größe, señor, déjà vu",
    "東京 and 北京 are cities 🙂👍",
    "x=3;y = -42;print(x+y)",
)
PROBE_LENGTH = 64  # tokens per probe window
PROBE_WINDOWS = 8
# A near-tie: the source's lead of its own top-1 over the artifact's pick is at most this share of
# the logit scale. Measured on the default run's merged model (logit scale 12.8): its q8_0 file
# flipped 6 of 512 positions, where the source led by 0.0005-0.015 (<= 0.12% of the scale) while
# q8_0 moved logits by up to 0.087 (a q4_0 file of it, read with the source's config.json beside
# it, flipped 37 positions at leads of up to 0.52, 4% of the scale).
TIE_RTOL = 1e-2


@dataclasses.dataclass(frozen=True)
class Agreement:
    top1_agreement: float
    rel_err: float
    max_abs_diff: float
    positions: int
    strict_top1_agreement: float
    near_ties: int  # positions whose argmax differs only on a near-tie of the source

    def as_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def probe_windows(data_dir: str | Path, length: int = PROBE_LENGTH, count: int = PROBE_WINDOWS) -> torch.Tensor:
    """(count, length) int64 windows of the validation split of a prepared data directory."""
    tokens, _ = load_split(data_dir, "validation")
    return torch.as_tensor(validation_windows(np.asarray(tokens), length, count))


@torch.no_grad()
def logits_of(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 4) -> torch.Tensor:
    """(windows, length, vocab) float32 logits of a causal LM called as model(input_ids=...)."""
    model.eval()
    return torch.cat([model(input_ids=windows[i:i + batch_size]).logits.float()
                      for i in range(0, len(windows), batch_size)])


def agreement(want: torch.Tensor, got: torch.Tensor, tie_rtol: float = TIE_RTOL) -> Agreement:
    """How far `got` logits are from `want` (same shape, (..., vocab)); see the module docstring."""
    if want.shape != got.shape:
        raise ValueError(f"logits of shape {tuple(got.shape)} against {tuple(want.shape)}: the artifact's "
                         "vocabulary or sequence handling differs from the source's")
    found = logit_agreement(want, got)
    want_top, got_top = want.argmax(-1), got.argmax(-1)
    same = top1_matches(want, got)
    lead = (want.gather(-1, want_top[..., None]) - want.gather(-1, got_top[..., None]))[..., 0]  # >= 0
    ties = ~same & (lead <= tie_rtol * found.logit_scale)
    return Agreement(top1_agreement=share(same | ties), rel_err=found.rel_err, max_abs_diff=found.max_abs_diff,
                     positions=found.positions, strict_top1_agreement=found.top1_agreement,
                     near_ties=int(ties.sum()))


def tokenizer_mismatches(want, got, texts: tuple[str, ...] = TOKENIZER_PROBES) -> list[str]:
    """The probe strings two tokenizers encode differently (ids without special tokens)."""
    return [text for text in texts
            if want.encode(text, add_special_tokens=False) != got.encode(text, add_special_tokens=False)]


def users_prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """The ids a runtime's user gets for the prompt `text`: `tokenizer(text)` (special tokens as the
    tokenizer adds them), or with `chat` the chat template of one user turn and the generation prompt."""
    if not chat:
        return list(tokenizer(text)["input_ids"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_text_mismatches(project_tokenizer, users_tokenizer, chat: bool,
                           texts: tuple[str, ...] = TOKENIZER_PROBES) -> list[str]:
    """The prompt texts for which `users_tokenizer` (the artifact's, as its runtime reads it) gives
    other ids than the predictor feeds the model (`encode_prompt` with `project_tokenizer`)."""
    if chat and not getattr(users_tokenizer, "chat_template", None):
        return list(texts)  # the artifact lost the chat template: its users cannot render the prompt
    return [text for text in texts if users_prompt_ids(users_tokenizer, text, chat)
            != encode_prompt(project_tokenizer, SftRecord(src=[text], tgt=[""]), 1 << 30, chat)]


def report_prompt_text(mismatches: list[str], what: str) -> dict[str, int | str | None]:
    """Metrics of `prompt_text_mismatches`, with a warning when a prompt text loses its training
    format (an imported tokenizer that adds no bos under the plain format does: its users must add it)."""
    import logging

    if mismatches:
        logging.getLogger(__name__).warning(
            "%s: %d of %d prompt texts encode differently from the predictor's prompts (first %r): its users "
            "must add the special tokens the model was trained with themselves", what, len(mismatches),
            len(TOKENIZER_PROBES), mismatches[0])
    return {"prompt_texts": len(TOKENIZER_PROBES), "prompt_text_mismatches": len(mismatches),
            "first_prompt_text_mismatch": mismatches[0] if mismatches else None}


def require(agreement_: Agreement, min_top1: float, what: str, setting: str, max_rel_err: float | None = None) -> None:
    """ValueError naming the artifact, the numbers and the setting when the agreement is too low."""
    if agreement_.top1_agreement < min_top1:
        raise ValueError(f"{what}: top-1 agreement {agreement_.top1_agreement:.4f} with the source over "
                         f"{agreement_.positions} validation positions ({agreement_.near_ties} near-ties "
                         f"forgiven) is below {setting}={min_top1}; the "
                         "artifact is not published (lower the setting only if this loss is acceptable)")
    if max_rel_err is not None and agreement_.rel_err > max_rel_err:
        raise ValueError(f"{what}: logits differ from the source's by {agreement_.rel_err:.2e} of their scale "
                         f"(limit {max_rel_err:g}): the file does not hold the source's weights")
