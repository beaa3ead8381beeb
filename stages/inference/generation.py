"""Batched generation with transformers' `generate` (KV cache) on left-padded prompts: the decoding
loops of evaluate (`generate_greedy`) and predict (`generate_batched`), and the padding the server's
scheduler shares (`left_padded`).

Prompts are lists of token ids (`stages.data.sft.encode_prompt`). They are grouped by length
(longest first, fewer pad tokens) into batches and left-padded, so every row's last real token sits
at the end, where generation continues; the attention mask hides the pads, and results come back
in the input order. A row's new tokens are cut after its first eos (eos kept, `cut_at_eos`).
Greedy outputs do not depend on the batch size.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from stages.stage_logs import Progress

if TYPE_CHECKING:  # a type only: stages.serving imports this package, not the other way round
    from stages.serving.generation_settings import PredictSettings

log = logging.getLogger(__name__)


def pad_or_eos(tokenizer) -> int | None:
    """The id that fills left padding: the tokenizer's pad, else its eos (the mask hides it)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_padded(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, T) with T the longest prompt: each prompt at the right end
    of its row, where generation continues; the mask hides the pads."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


def cut_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """`tokens` up to and including the first eos (all of them without one)."""
    return tokens[:tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens


def _longest_first(prompts: Sequence[list[int]]) -> list[int]:
    """Prompt indices by decreasing length (a stable sort: equal lengths keep the input order)."""
    return sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))


# -- evaluate's: greedy, one budget -------------------------------------------------------------
@torch.no_grad()
def generate_greedy(model: torch.nn.Module, prompts: Sequence[list[int]], *, max_new_tokens: int,
                    eos_token_id: int, pad_token_id: int, batch_size: int) -> list[list[int]]:
    """Greedy continuations of `prompts` (new tokens only, cut after the first eos, eos kept), in
    the input order, `batch_size` prompts per generate call."""
    device = next(model.parameters()).device
    order = _longest_first(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    progress = Progress(log, "generation on dev examples", len(prompts))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        ids, mask = left_padded([prompts[i] for i in rows], pad_token_id)  # (B, T) each
        width = ids.shape[1]
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             eos_token_id=eos_token_id, pad_token_id=pad_token_id)  # (B, T + new)
        for r, i in enumerate(rows):
            outputs[i] = cut_at_eos(out[r, width:].tolist(), eos_token_id)
        progress.advance(len(rows))
    return outputs


# -- predict's: per-record budgets, greedy or seeded sampling ------------------------------------
@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # new tokens, cut after the first eos (eos kept)
    batch: int  # index of the batch (in generation order)
    batch_seconds: float  # wall seconds of that batch's generate call


def token_budgets(prompts: Sequence[list[int]], max_length: int, max_new_tokens: int | None) -> list[int]:
    """New tokens each prompt may get: max_length - len(prompt), capped by max_new_tokens."""
    cap = max_new_tokens if max_new_tokens is not None else max_length
    return [max(0, min(cap, max_length - len(p))) for p in prompts]


class RowLimits(StoppingCriteria):
    """Ends row r once it holds `width + budgets[r]` tokens: per row, so that a short prompt's
    budget does not depend on the longest prompt of its batch."""

    def __init__(self, width: int, budgets: Sequence[int]):
        self.limits = torch.tensor([width + b for b in budgets])  # (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return input_ids.shape[1] >= self.limits.to(input_ids.device)  # (B,)


def _decoding(settings: PredictSettings) -> dict:
    """generate's decoding arguments; sampling seeds torch once, here, before the first batch."""
    if settings.decode_strategy == "sampling":
        torch.manual_seed(settings.seed)
        return dict(do_sample=True, top_k=settings.top_k, top_p=settings.top_p, temperature=settings.temperature)
    return dict(do_sample=False)


@torch.no_grad()
def generate_batched(model: torch.nn.Module, prompts: Sequence[list[int]], settings: PredictSettings, *,
                     eos_token_id: int, pad_token_id: int) -> list[Generation]:
    """Continuations of `prompts` in input order, `settings.batch_size` at a time: each record
    gets at most max_length - len(prompt) new tokens (and max_new_tokens; `token_budgets`).
    Sampling is seeded once, before the first batch."""
    device = next(model.parameters()).device
    budgets = token_budgets(prompts, settings.max_length, settings.max_new_tokens)
    decode = _decoding(settings)
    order = _longest_first(prompts)
    results: list[Generation | None] = [None] * len(prompts)
    progress = Progress(log, "predicted records", len(prompts))
    num_batches = -(-len(prompts) // settings.batch_size)
    for batch, start in enumerate(range(0, len(order), settings.batch_size)):
        rows = order[start:start + settings.batch_size]
        ids, mask = left_padded([prompts[i] for i in rows], pad_token_id)  # (B, T) each
        width = ids.shape[1]
        row_budgets = [budgets[i] for i in rows]
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True,
                             max_new_tokens=max(row_budgets), num_beams=1, eos_token_id=eos_token_id,
                             pad_token_id=pad_token_id, stopping_criteria=StoppingCriteriaList(
                                 [RowLimits(width, row_budgets)]), **decode)  # (B, T + new)
        seconds = time.perf_counter() - t0
        for r, i in enumerate(rows):
            new = cut_at_eos(out[r, width:width + budgets[i]].tolist(), eos_token_id)
            results[i] = Generation(tokens=new, batch=batch, batch_seconds=seconds)
        progress.advance(len(rows), detail=f"{batch + 1} of {num_batches} batches")
    return results  # type: ignore[return-value]
