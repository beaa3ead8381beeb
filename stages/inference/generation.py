"""Batched generation on left-padded prompts: the decoding loops of evaluate (`generate_greedy`)
and predict (`generate_batched`). A torch model runs on the decode engine
(`stages.inference.engine`: preallocated KV cache, its own prefill and decode steps), whose tokens
are `generate`'s; what the engine does not run (an onnxruntime model) keeps the model's own
`generate`. `left_padded` (the engine's) is the padding the server's scheduler shares.

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

# left_padded is the engine's; the scheduler and the tests import it from here
from stages.inference.engine import DecodeEngine, Sampling, left_padded, unsupported
from stages.inference.prompt_lookup import PromptLookup
from stages.stage_logs import Progress

if TYPE_CHECKING:  # a type only: stages.serving imports this package, not the other way round
    from stages.serving.generation_settings import PredictSettings

log = logging.getLogger(__name__)


def pad_or_eos(tokenizer) -> int | None:
    """The id that fills left padding: the tokenizer's pad, else its eos (the mask hides it)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def cut_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """`tokens` up to and including the first eos (all of them without one)."""
    return tokens[:tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens


def _longest_first(prompts: Sequence[list[int]]) -> list[int]:
    """Prompt indices by decreasing length (a stable sort: equal lengths keep the input order)."""
    return sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))


def _engine(model, eos_token_id: int | None, pad_token_id: int, compile: bool = False,
            prompt_lookup: PromptLookup | None = None) -> DecodeEngine | None:
    """The decode engine of `model` (`compile`: its compiled decode step; `prompt_lookup`: its
    speculative greedy decoding of lone prompts), or None (logged) where `generate` keeps it."""
    reason = unsupported(model)
    if reason is not None:
        log.info("generating with the model's own generate%s: %s",
                 " (not compiled)" if compile else " (without prompt lookup)" if prompt_lookup else "", reason)
        return None
    return DecodeEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id, compile=compile,
                        prompt_lookup=prompt_lookup)


def _batch_tokens(model, engine: DecodeEngine | None, batch: list[list[int]], budgets: list[int], *,
                  eos_token_id: int | None, pad_token_id: int, sampling: Sampling | None = None,
                  generator: torch.Generator | None = None, stop_strings: Sequence[str] = (),
                  tokenizer=None) -> list[list[int]]:
    """New tokens of each prompt of one left-padded batch, row r cut at budgets[r] and after its
    first eos (eos kept): on the engine, else with the model's generate (sampling then draws from
    torch's global generator, `_decoding` seeded it). `stop_strings` (with the `tokenizer` that
    decodes them) end a row early on the engine; `generate` runs on to eos or the budget, and the
    caller cuts the text."""
    if engine is not None:
        return [d.tokens for d in engine.generate(batch, budgets, sampling=sampling, generator=generator,
                                                  stop_strings=stop_strings, tokenizer=tokenizer)]
    device = next(model.parameters()).device
    ids, mask = left_padded(batch, pad_token_id)  # (B, T) each
    width = ids.shape[1]
    decode = {"do_sample": False} if sampling is None else {
        "do_sample": True, "top_k": sampling.top_k, "top_p": sampling.top_p, "temperature": sampling.temperature}
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True,
                         max_new_tokens=max(budgets), num_beams=1, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, stopping_criteria=StoppingCriteriaList(
                             [RowLimits(width, budgets)]), **decode)  # (B, T + new)
    return [cut_at_eos(out[r, width:width + b].tolist(), eos_token_id) for r, b in enumerate(budgets)]


# -- evaluate's: greedy, one budget -------------------------------------------------------------
@torch.no_grad()
def generate_greedy(model: torch.nn.Module, prompts: Sequence[list[int]], *, max_new_tokens: int,
                    eos_token_id: int, pad_token_id: int, batch_size: int, stop_strings: Sequence[str] = (),
                    tokenizer=None) -> list[list[int]]:
    """Greedy continuations of `prompts` (new tokens only, cut after the first eos, eos kept), in
    the input order, `batch_size` prompts per batch. `stop_strings` end a row early where the
    decode engine runs (see `_batch_tokens`); the tokens before the stop are the same either way."""
    engine = _engine(model, eos_token_id, pad_token_id)
    order = _longest_first(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    progress = Progress(log, "generation on dev examples", len(prompts))
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        tokens = _batch_tokens(model, engine, [prompts[i] for i in rows], [max_new_tokens] * len(rows),
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings,
                               tokenizer=tokenizer)
        for i, t in zip(rows, tokens):
            outputs[i] = t
        progress.advance(len(rows))
    return outputs


# -- predict's: per-record budgets, greedy or seeded sampling ------------------------------------
@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # new tokens, cut after the first eos (eos kept)
    batch: int  # index of the batch (in generation order)
    batch_seconds: float  # wall seconds of that batch's generation


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


def _sampling(settings: PredictSettings, engine: DecodeEngine | None, device: torch.device
              ) -> tuple[Sampling | None, torch.Generator | None]:
    """(sampling, its generator), seeded once, here, before the first batch: a torch.Generator on
    the engine (seeded as torch.manual_seed would seed the global one: the same draws), torch's
    global generator for `generate`. (None, None) for greedy_search."""
    if settings.decode_strategy != "sampling":
        return None, None
    sampling = Sampling(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    if engine is None:
        torch.manual_seed(settings.seed)
        return sampling, None
    return sampling, torch.Generator(device).manual_seed(settings.seed)


@torch.no_grad()
def generate_batched(model: torch.nn.Module, prompts: Sequence[list[int]], settings: PredictSettings, *,
                     eos_token_id: int, pad_token_id: int) -> list[Generation]:
    """Continuations of `prompts` in input order, `settings.batch_size` at a time: each record
    gets at most max_length - len(prompt) new tokens (and max_new_tokens; `token_budgets`).
    Sampling is seeded once, before the first batch."""
    budgets = token_budgets(prompts, settings.max_length, settings.max_new_tokens)
    lookup = PromptLookup(num_draft_tokens=settings.prompt_lookup_num_tokens) if settings.prompt_lookup_num_tokens \
        else None
    engine = _engine(model, eos_token_id, pad_token_id, compile=settings.compile, prompt_lookup=lookup)
    sampling, generator = _sampling(settings, engine, next(model.parameters()).device)
    order = _longest_first(prompts)
    results: list[Generation | None] = [None] * len(prompts)
    progress = Progress(log, "predicted records", len(prompts))
    num_batches = -(-len(prompts) // settings.batch_size)
    for batch, start in enumerate(range(0, len(order), settings.batch_size)):
        rows = order[start:start + settings.batch_size]
        t0 = time.perf_counter()
        tokens = _batch_tokens(model, engine, [prompts[i] for i in rows], [budgets[i] for i in rows],
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id, sampling=sampling,
                               generator=generator)
        seconds = time.perf_counter() - t0
        for i, t in zip(rows, tokens):
            results[i] = Generation(tokens=t, batch=batch, batch_seconds=seconds)
        progress.advance(len(rows), detail=f"{batch + 1} of {num_batches} batches")
    if engine is not None and lookup is not None:
        log.info("prompt lookup: %d of %d draft tokens taken, %d forwards", engine.accepted_tokens,
                 engine.drafted_tokens, engine.forward_calls)
    return results  # type: ignore[return-value]
