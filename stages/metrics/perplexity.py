"""Perplexity of a causal LM on the validation token stream, and the unigram baseline it must beat.

The validation split is one stream of token ids (documents concatenated, each ending in eos; see
docs/artifacts.md). It is cut into non-overlapping windows of `max_length` tokens; a window may
span a document boundary, as during pretraining. Inside a window the model predicts tokens
1..L-1 from their prefixes (token 0 has no context and is not scored), so

    ppl = exp( sum_windows sum_{t=1..L-1} -log p(x_t | x_<t) / #scored tokens )

i.e. the exponential of the token-weighted mean negative log-likelihood. The unigram baseline is
scored on exactly the same target tokens, so the two numbers are directly comparable.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from stages.model.labels import IGNORE_INDEX
from stages.model.loss import causal_lm_loss, counted_tokens
from stages.stage_logs import Progress

log = logging.getLogger(__name__)

_COUNT_CHUNK = 1 << 24  # tokens counted per bincount call


def window_starts(num_tokens: int, max_length: int, max_windows: int) -> list[int]:
    """Start offsets of the windows scored: at most `max_windows` of the `num_tokens // max_length`
    full non-overlapping windows, evenly spread over the stream (deterministic, no RNG) so a long
    file is sampled from end to end rather than only from its beginning."""
    if max_length < 2 or max_windows < 1:
        raise ValueError(f"ppl_max_length={max_length} must be >= 2 and ppl_max_windows={max_windows} >= 1")
    full = num_tokens // max_length
    if full == 0:
        return []
    count = min(full, max_windows)
    # With count <= full the spacing is >= 1, so rounding never yields a duplicate index.
    picks = np.linspace(0, full - 1, count).round().astype(np.int64)
    return [int(i) * max_length for i in picks]


def validation_windows(tokens: np.ndarray, max_length: int, max_windows: int) -> np.ndarray:
    """The windows to score as an int64 array (num_windows, window_length).

    A stream shorter than `max_length` becomes one window holding all of it (it must still hold
    at least two tokens so that one is predicted)."""
    tokens = np.asarray(tokens)
    starts = window_starts(len(tokens), max_length, max_windows)
    if not starts:
        if len(tokens) < 2:
            raise ValueError(f"the validation split holds {len(tokens)} token(s); perplexity needs at "
                             "least 2 (re-run prepare with more validation text)")
        return tokens.astype(np.int64)[None, :]
    return np.stack([tokens[s:s + max_length].astype(np.int64) for s in starts])


@torch.no_grad()
def model_perplexity(model: torch.nn.Module, windows: np.ndarray, batch_size: int = 4) -> tuple[float, int]:
    """(perplexity, number of scored tokens) of `model` on `windows` (num_windows, L).

    `model(input_ids=...)` must return an object with `.logits` (batch, L, vocab), as every
    transformers / peft causal LM does. The NLL is accumulated in float64 over all windows before
    the exponential, so the result is token-weighted, not a mean of per-window perplexities.
    """
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    progress = Progress(log, "perplexity windows", len(windows))
    for i in range(0, len(windows), batch_size):
        batch = torch.as_tensor(windows[i:i + batch_size], device=device)  # (B, L)
        logits = model(input_ids=batch).logits.float()  # (B, L, V)
        vocab = logits.shape[-1]
        if int(batch.max()) >= vocab:
            raise ValueError(f"validation token id {int(batch.max())} is outside the model's vocabulary "
                             f"of {vocab}; the data dir and the model were built with different tokenizers")
        nll = causal_lm_loss(logits, batch, reduction="sum")  # position t predicts token t + 1
        total_nll += float(nll)
        total_tokens += batch[:, 1:].numel()
        progress.advance(len(batch))
    mean_nll = total_nll / total_tokens
    log.info("perplexity %.3f over %d tokens in %d windows", math.exp(mean_nll), total_tokens, len(windows))
    return math.exp(mean_nll), total_tokens


@torch.no_grad()
def target_perplexity(model: torch.nn.Module, examples: list[tuple[list[int], list[int]]],
                      pad_token_id: int, batch_size: int = 8) -> tuple[float, int]:
    """(perplexity, scored tokens) of the answer tokens of SFT examples given their prompts.

    `examples` are (input_ids, labels) pairs as `stages.data.sft.encode_example` makes them
    (labels -100 on the prompt); right-padded batches; position t scores labels[t + 1]. This is
    the perplexity a fine-tuned model is trained to lower, so it is the one that shows what
    quantization costs the deployed model (the corpus perplexity of a fine-tuned model mostly
    measures forgetting).
    """
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    progress = Progress(log, "dev answer perplexity examples", len(examples))
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, (x, y) in enumerate(chunk):
            ids[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()  # (B, T, V)
        labels = labels.to(device)
        total_nll += float(causal_lm_loss(logits, labels, reduction="sum"))
        total_tokens += int(counted_tokens(labels))
        progress.advance(len(chunk))
    if total_tokens == 0:
        raise ValueError("no answer tokens to score: every SFT example was cut to its prompt")
    return math.exp(total_nll / total_tokens), total_tokens


def unigram_perplexity(train_tokens: np.ndarray, targets: np.ndarray, vocab_size: int) -> float:
    """Perplexity of the add-one smoothed unigram model of the training split on `targets`.

        p(v) = (count_train(v) + 1) / (N_train + vocab_size)
        ppl  = exp( -mean_t log p(targets_t) )

    The number a language model has to beat: it knows token frequencies and nothing else.
    """
    targets = np.asarray(targets).ravel()
    if targets.size == 0:
        raise ValueError("no target tokens to score the unigram baseline on")
    if int(targets.max()) >= vocab_size:
        raise ValueError(f"token id {int(targets.max())} is outside vocab_size={vocab_size} "
                         "(data/index.json); the token files and index.json disagree: re-run prepare")
    counts = np.zeros(vocab_size, dtype=np.float64)
    # Chunked so a memory-mapped multi-GB train.bin is never widened to int64 all at once.
    for i in range(0, len(train_tokens), _COUNT_CHUNK):
        chunk = np.asarray(train_tokens[i:i + _COUNT_CHUNK], dtype=np.int64)
        if chunk.size and int(chunk.max()) >= vocab_size:
            raise ValueError(f"train token id {int(chunk.max())} is outside vocab_size={vocab_size} "
                             "(data/index.json); the token files and index.json disagree: re-run prepare")
        counts += np.bincount(chunk, minlength=vocab_size)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)
    return math.exp(-float(log_p[targets.astype(np.int64)].mean()))
