"""The causal-LM loss, written once: position t of the logits scores label t + 1, labels equal to
IGNORE_INDEX (prompt tokens, padding, the first token of a mixed window) are skipped, in fp32.

Every site that trains or measures a model calls `causal_lm_loss`: the model's own forward with
labels (the mean), the training loop and the dev loss (the sum, so gradient accumulation and
micro-batches weigh every counted token equally), the pipeline's last stage (the sum over one
micro-batch divided by the whole batch's count, `normalizer`), perplexity, and tensor parallelism
with the logits split over the vocabulary (`per_token`: `stages.parallel.tensor`'s
vocab-parallel cross-entropy, which this layer does not import). The training step of our model
asks for the logits of the learned positions only (`learned_positions`, then `token_loss`): the
same terms, without the vocabulary projection of the prompt and padding positions.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn.functional as F

from stages.model.labels import IGNORE_INDEX

# (logits (N, V or V/tp) fp32, targets (N,)) -> per-token losses (N,), 0 where target == IGNORE_INDEX
PerTokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shift(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (B, T, V), labels (B, T)) -> (B*T, V) fp32 logits and (B*T,) targets: position t
    predicts token t + 1, and the last position of each row has none (IGNORE_INDEX). The labels
    move, not the logits (as transformers' ForCausalLMLoss does): a slice of the logits would be
    copied once more before the fp32 copy and its gradient zero-filled, on every step."""
    vocab = logits.shape[-1]
    return logits.reshape(-1, vocab).float(), next_tokens(labels).reshape(-1)


def next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the label position t scores, t + 1's; IGNORE_INDEX at each row's end."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def learned_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels (B, T)) -> (where (B, T) bool, targets (N,)): the positions whose next token is
    learned and those tokens, in row-major order; `logits[where]` are the rows `shift` keeps."""
    targets = next_tokens(labels)
    where = targets != IGNORE_INDEX
    return where, targets[where]


def counted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many label tokens `causal_lm_loss` counts (a 0-d tensor): labels shifted by one, not ignored."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *,
                   reduction: Literal["mean", "sum"] = "mean", normalizer: float | None = None,
                   per_token: PerTokenLoss | None = None) -> torch.Tensor:
    """Next-token cross-entropy of `logits` (B, T, V) against `labels` (B, T).

    reduction: "mean" over the counted tokens, or "sum" (then divided by `normalizer` when given:
    one micro-batch's share of a larger batch's mean). per_token: the cross-entropy for logits that
    are not whole, e.g. split over the vocabulary under tensor parallelism; without it
    F.cross_entropy reduces directly (the same floats as every earlier copy of this loss).
    """
    loss = token_loss(*shift(logits, labels), reduction=reduction, per_token=per_token)
    return loss if normalizer is None else loss / normalizer


def per_token_loss(logits: torch.Tensor, targets: torch.Tensor,
                   per_token: PerTokenLoss | None = None) -> torch.Tensor:
    """(N,) fp32 cross-entropy of each row of `logits` (N, V or V/tp) against `targets` (N,), 0
    where the target is IGNORE_INDEX: what a sequence's log-probability sums (preference training)."""
    logits = logits.float()
    if per_token is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return per_token(logits, targets)


def token_loss(logits: torch.Tensor, targets: torch.Tensor, *, reduction: Literal["mean", "sum"] = "mean",
               per_token: PerTokenLoss | None = None) -> torch.Tensor:
    """Cross-entropy of `logits` (N, V or V/tp) against `targets` (N,), those equal to IGNORE_INDEX
    skipped: the mean over the counted ones, or the sum."""
    logits = logits.float()
    if per_token is None:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)
    losses = per_token(logits, targets)
    return losses.sum() if reduction == "sum" else losses.sum() / (targets != IGNORE_INDEX).sum()
