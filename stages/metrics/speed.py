"""Inference speed and memory of a loaded model, measured the same way for every variant.

    prefill_tokens_per_s   batch * tokens / seconds of one forward over `batch` random sequences
                           of `tokens` ids (no cache): the prompt-processing rate
    decode_tokens_per_s    tokens per second of greedy generation with the KV cache after a
                           prompt, batch 1, the prompt's forward not counted: the generation rate,
                           which reads every weight once per token and so shows what low-bit
                           kernels save
    model_bytes            bytes of the model's parameters and buffers as loaded (each storage
                           once): packed low-bit weights count as their packed bytes
    rss_bytes              the process's resident set size after loading (VmRSS): the model plus
                           the interpreter, torch and transformers

Timings are the median of `repeats` runs after one warm-up run, on the threads torch uses in this
process; they compare variants measured on the same machine in the same conditions (the report
says which) and are not a benchmark (`bench/quant.py` is). The ids are drawn from a fixed seed, so
every variant sees the same inputs.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch

from stages.stage_logs import Progress

log = logging.getLogger(__name__)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations, kernel selection, weight repacking caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ids(batch: int, tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, tokens), generator=generator)  # (B, T)


@torch.no_grad()
def prefill_tokens_per_s(model: torch.nn.Module, vocab_size: int, batch: int, tokens: int, repeats: int = 3) -> float:
    """Tokens per second of one cache-free forward over (batch, tokens) ids."""
    device = next(model.parameters()).device
    ids = _ids(batch, tokens, vocab_size).to(device)
    seconds = _median_seconds(lambda: model(input_ids=ids, use_cache=False), repeats)
    return batch * tokens / seconds


@torch.no_grad()
def decode_tokens_per_s(model: torch.nn.Module, vocab_size: int, prompt_tokens: int, new_tokens: int,
                        repeats: int = 3) -> float:
    """Tokens per second of greedy generation with the KV cache (batch 1) after a prompt of
    `prompt_tokens` ids: (new_tokens - 1) single-token steps over the time of `generate` less that of
    the prompt's forward (which yields the first new token). `generate` rather than a hand-written
    loop, so that peft adapters (prefix tuning's virtual cache included) decode as they generate."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens}: decoding speed needs at least 2 new tokens")
    device = next(model.parameters()).device
    prompt = _ids(1, prompt_tokens, vocab_size).to(device)
    mask = torch.ones_like(prompt)
    prefill = _median_seconds(lambda: model(input_ids=prompt, attention_mask=mask, use_cache=True), repeats)
    generate = _median_seconds(lambda: model.generate(
        input_ids=prompt, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, num_beams=1, pad_token_id=0), repeats)
    return (new_tokens - 1) / max(generate - prefill, 1e-9)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers of `model`, each storage counted once (tied weights)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest input the model's position embeddings take (GPT-2's n_positions, OPT's
    max_position_embeddings, ...) less a peft prompt-learning adapter's virtual tokens (prefix
    tuning's key/values take positions too); None when the config does not say."""
    config = getattr(model, "config", None)
    limit = next((v for key in ("max_position_embeddings", "n_positions")
                  if isinstance(v := getattr(config, key, None), int) and v > 0), None)
    if limit is None:
        return None
    peft_configs = getattr(model, "peft_config", None)
    virtual = max((getattr(c, "num_virtual_tokens", None) or 0 for c in peft_configs.values()), default=0) \
        if isinstance(peft_configs, dict) else 0
    return max(2, limit - virtual)


def speed_metrics(model: torch.nn.Module, vocab_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """prefill_tokens_per_s_b<B> for each of settings['speed_batch_sizes'] at
    settings['speed_prefill_tokens'] tokens, decode_tokens_per_s_b1 over settings['speed_decode_tokens']
    steps after a 16-token prompt, `speed_tokens` (the prefill and decode lengths used: both are cut
    to the model's position limit) and the threads used."""
    repeats = settings["speed_repeats"]
    limit = max_positions(model) or 1 << 30
    prefill = min(settings["speed_prefill_tokens"], limit)
    prompt = min(16, max(1, limit // 4))
    new_tokens = max(2, min(settings["speed_decode_tokens"], limit - prompt))
    metrics: dict[str, Any] = {}
    steps = len(settings["speed_batch_sizes"]) + 1  # a prefill per batch size, then the decode
    progress = Progress(log, "speed measurements", steps, lines=steps, min_interval_s=0, eta=False)
    for batch in settings["speed_batch_sizes"]:
        rate = prefill_tokens_per_s(model, vocab_size, batch, prefill, repeats)
        metrics[f"prefill_tokens_per_s_b{batch}"] = rate
        progress.advance(detail=f"prefill, batch {batch} x {prefill} tokens: {rate:.0f} tokens/s")
    rate = decode_tokens_per_s(model, vocab_size, prompt_tokens=prompt, new_tokens=new_tokens, repeats=repeats)
    metrics["decode_tokens_per_s_b1"] = rate
    progress.advance(detail=f"decode, batch 1, {new_tokens} new tokens: {rate:.0f} tokens/s")
    metrics["speed_tokens"] = {"prefill": prefill, "decode_prompt": prompt, "decode_new": new_tokens}
    metrics["torch_threads"] = torch.get_num_threads()
    return metrics
