"""Preference accuracy: how often a model gives the chosen answer of a pair a higher log-probability
than the rejected one, and by how much.

Each side of a pair is the conversation that ends in that answer (`PreferenceRecord.conversation`),
encoded exactly as fine-tuning encodes it (`stages.data.sft.encode_example`: the prompt is context,
the answers are scored, eos or the chat template's end-of-turn marker included), then cut to
`max_length` tokens. A side's log-probability is the sum over its scored tokens of
log p(token | what precedes it) (`stages.model.preference_loss.sequence_logps`, fp32). For a
conversation of several rounds the earlier answers are scored too, as fine-tuning scores them; they
are the same tokens after the same prefix on both sides, so they add the same amount to both and
cancel in the margin and the accuracy.

    preference_accuracy   share of pairs with logp(chosen) > logp(rejected) (a tie counts as wrong)
    preference_margin     mean of logp(chosen) - logp(rejected), in nats summed over the answer tokens
    preference_pairs      pairs scored: a pair whose two sides are the same tokens after the cut to
                          max_length (the answers cut off where they still agree) carries no
                          preference and is left out, with a warning

The model is anything evaluate loads: `model(input_ids=..., attention_mask=...).logits` (B, T, V)
and `model.parameters()` for the device (transformers and peft models, stages.quant's quantized
ones, stages.deployment.onnx_model.OnnxCausalLM).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from stages.data.preference import PreferenceRecord
from stages.data.sft import encode_example
from stages.model.labels import IGNORE_INDEX
from stages.model.preference_loss import sequence_logps
from stages.stage_logs import Progress

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # (input_ids, labels)


def encode_pair(tokenizer, record: PreferenceRecord, src_length: int, max_length: int,
                chat: bool) -> tuple[Example, Example]:
    """(chosen, rejected) as fine-tuning encodes each conversation, each cut to `max_length`."""
    return tuple(encode_example(tokenizer, record.conversation(answer), src_length, max_length, chat)
                 for answer in (record.chosen, record.rejected))


@torch.no_grad()
def row_logps(model, examples: Sequence[Example], pad_token_id: int, batch_size: int = 8) -> torch.Tensor:
    """(N,) float64: each example's summed log-prob of its labelled tokens, in right-padded
    batches of `batch_size` rows (no gradients, the model in eval mode)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    progress = Progress(log, "preference rows", len(examples))
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)  # (B, T)
        for row, (x, y) in enumerate(chunk):
            ids[row, :len(x)], labels[row, :len(y)], mask[row, :len(x)] = torch.tensor(x), torch.tensor(y), 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits  # (B, T, V)
        out.append(sequence_logps(logits, labels.to(logits.device)).total.double().cpu())
        progress.advance(len(chunk))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def pair_logps(model, tokenizer, records: Sequence[PreferenceRecord], src_length: int, max_length: int,
               chat: bool, pad_token_id: int, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen (N,), rejected (N,)) summed answer log-probs of the pairs that carry a preference
    after the cut to `max_length` (see the module docstring)."""
    pairs = [encode_pair(tokenizer, r, src_length, max_length, chat) for r in records]
    kept = [(c, r) for c, r in pairs if c != r]
    if len(kept) < len(pairs):
        log.warning("preference: %d of %d pairs are the same tokens on both sides within max_length=%d "
                    "(their answers are cut off where they still agree); left out", len(pairs) - len(kept),
                    len(pairs), max_length)
    # chosen rows then rejected rows: one pass over all of them, batched across pairs
    totals = row_logps(model, [c for c, _ in kept] + [r for _, r in kept], pad_token_id, batch_size)
    return totals[:len(kept)], totals[len(kept):]


def preference_metrics(model, tokenizer, records: Sequence[PreferenceRecord], src_length: int, max_length: int,
                       chat: bool, pad_token_id: int, batch_size: int = 8) -> dict[str, float | int | None]:
    """{preference_accuracy, preference_margin, preference_pairs} of `model` on `records` (the
    module docstring); accuracy and margin are None when no pair is scored."""
    chosen, rejected = pair_logps(model, tokenizer, records, src_length, max_length, chat, pad_token_id, batch_size)
    n = len(chosen)
    if n == 0:
        return {"preference_accuracy": None, "preference_margin": None, "preference_pairs": 0}
    margin = chosen - rejected  # (N,)
    metrics = {"preference_accuracy": float((margin > 0).double().mean()), "preference_margin": float(margin.mean()),
               "preference_pairs": n}
    log.info("preference: accuracy %.3f, margin %.3f nats over %d pairs", metrics["preference_accuracy"],
             metrics["preference_margin"], n)
    return metrics
