"""One optimizer step of preference training (DPO, IPO, SimPO, ORPO: `stages.model.preference_loss`)
in any layout but pipeline parallelism: the step loss is the mean pair loss over the global batch
of pairs (ORPO adds the NLL of the chosen answers' tokens over the global batch), so every layout
follows the single-process run, as the token-mean SFT step does (`stages.training.step`).

A micro-batch is one forward of its chosen and rejected rows (`stages.training.preference_batches`).
Each row's log-probability is the sum over its learned tokens of -cross-entropy at the learned
positions only: our model projects just those positions (`logits_at`), and under tensor parallelism
with `tensor_parallel_output` the cross-entropy is the vocab-parallel one, so the log-probs of split
logits equal the whole ones'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from stages.model import LlamaForCausalLM
from stages.model.loss import counted_tokens, learned_positions, per_token_loss
from stages.model.preference_loss import PreferenceObjective, SequenceLogps
from stages.parallel.mappings import collective_device
from stages.parallel.tensor import vocab_parallel_cross_entropy
from stages.training.deepspeed_engine import loss_scale

# train_log.csv columns of the preference statistics (means over the pairs since the last row), as TRL logs them
STATS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected")


def row_logps(model, ids: torch.Tensor, labels: torch.Tensor, tp_group=None) -> SequenceLogps:
    """Each row's summed log-probability of its learned tokens (labels shifted by one, as the
    SFT loss scores them), in fp32, and their count. `model` is our model, a transformers causal
    LM or a DeepSpeed engine holding either; `tp_group`: the logits are split over the vocabulary."""
    where, targets = learned_positions(labels)  # (R, T) bool, (N,)
    if isinstance(getattr(model, "module", model), LlamaForCausalLM):
        logits = model(input_ids=ids, logits_at=where)  # (N, V or V/tp)
    else:
        output = model(input_ids=ids)
        logits = (output if torch.is_tensor(output) else output.logits)[where]
    per_token = None if tp_group is None else functools.partial(vocab_parallel_cross_entropy, group=tp_group)
    nll = per_token_loss(logits, targets, per_token)  # (N,)
    rows = where.nonzero()[:, 0]  # the row of each learned position, in logits' row-major order
    total = torch.zeros(len(ids), dtype=nll.dtype, device=nll.device).index_add(0, rows, -nll)
    return SequenceLogps(total=total, tokens=where.sum(-1))


def split_rows(logps: SequenceLogps) -> tuple[SequenceLogps, SequenceLogps]:
    """(chosen, rejected): a micro-batch's first half of rows and its second half."""
    m = len(logps.total) // 2
    return (SequenceLogps(logps.total[:m], logps.tokens[:m]), SequenceLogps(logps.total[m:], logps.tokens[m:]))


def chosen_tokens(batches: list[tuple[torch.Tensor, ...]], dp_group) -> int:
    """Learned tokens of the chosen rows of the global batch (ORPO's NLL is their mean)."""
    import torch.distributed as dist

    count = sum(int(counted_tokens(labels[:len(labels) // 2])) for _, labels, _ in batches)
    count = torch.tensor(count, device=collective_device(dp_group))
    dist.all_reduce(count, group=dp_group)
    return max(int(count), 1)


def preference_train_step(engine, objective: PreferenceObjective, batches: list[tuple[torch.Tensor, ...]],
                          num_pairs: int, num_chosen_tokens: int, dp: int,
                          clip: Callable[[torch.nn.Module], float] | None,
                          tp_group=None) -> tuple[torch.Tensor, float | None, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns (this rank's share of the step
    loss, grad norm or None, this rank's sums of `STATS` and its pair count (7,)). `num_pairs` and
    `num_chosen_tokens` count the whole global batch. DeepSpeed divides gradients by the
    accumulation steps and by dp, so each micro-batch's loss is scaled by accum x dp (see
    `stages.training.step.train_step`)."""
    share, grad_norm, accum = torch.zeros((), dtype=torch.float64), None, len(batches)
    stats = torch.zeros(len(STATS) + 1, dtype=torch.float64)
    for i, (ids, labels, reference) in enumerate(batches):
        logps = row_logps(engine, ids.to(engine.device), labels.to(engine.device), tp_group)
        chosen, rejected = split_rows(logps)
        ref_chosen = ref_rejected = None
        if objective.needs_reference:
            ref = reference.to(device=logps.total.device, dtype=logps.total.dtype)
            ref_chosen, ref_rejected = split_rows(SequenceLogps(ref, logps.tokens))
        terms = objective.pair_terms(chosen, rejected, ref_chosen, ref_rejected)
        loss = terms.loss.sum() / num_pairs
        if objective.method == "orpo":  # the supervised term: NLL of the chosen answers' tokens
            loss = loss - chosen.total.sum() / num_chosen_tokens
        engine.backward(loss * (accum * dp * loss_scale(engine)))
        if clip and i == accum - 1:
            grad_norm = clip(engine.module)
        engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        share += loss.detach().double().cpu()
        stats += torch.stack([terms.chosen_reward.sum(), terms.rejected_reward.sum(), terms.accuracy.sum(),
                              terms.margin.sum(), chosen.total.detach().sum(), rejected.total.detach().sum(),
                              torch.tensor(float(len(terms.loss)))]).double().cpu()
    return share.float(), grad_norm, stats


class PairStats:
    """The `STATS` sums of this rank's pairs stepped since the last logged row; `means` sums them
    over the data-parallel ranks, once per logged row rather than once per step."""

    def __init__(self, dp_group):
        self.dp_group = dp_group
        self.sums = torch.zeros(len(STATS) + 1, dtype=torch.float64)

    def add(self, stats: torch.Tensor) -> None:
        """Add this rank's sums of one step (local, no collective)."""
        self.sums += stats

    def means(self) -> dict[str, float]:
        """The means per pair since the last call, over every data-parallel rank (collective over
        the group: every rank calls it at the same steps), then reset."""
        import torch.distributed as dist

        sums = self.sums.to(collective_device(self.dp_group), copy=True)  # not an alias: reset below
        dist.all_reduce(sums, group=self.dp_group)
        sums = sums.cpu()
        count = max(float(sums[-1]), 1.0)
        self.sums.zero_()
        return {name: float(value) / count for name, value in zip(STATS, sums[:-1])}
