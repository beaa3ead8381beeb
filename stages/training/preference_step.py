"""One optimizer step of preference training (DPO, IPO, SimPO, ORPO: `stages.model.preference_loss`)
in every layout: the step loss is the mean pair loss over the global batch of pairs (ORPO adds the
NLL of the chosen answers' tokens over the global batch; with data mixing, the mean NLL of the
general-text tokens over the global batch is added too), so every layout follows the
single-process run, as the token-mean SFT step does (`stages.training.step`).

A micro-batch is one forward of its chosen and rejected rows (`stages.training.preference_batches`):
(ids, labels, reference, mix_labels), where `labels` marks the answers' tokens and `mix_labels` the
general text mixed into the room after them (IGNORE_INDEX elsewhere; a 3-tuple has none). Each
row's log-probability is the sum over its answer tokens of -cross-entropy at the learned positions
only: our model projects just those positions (`logits_at`), and under tensor parallelism with
`tensor_parallel_output` the cross-entropy is the vocab-parallel one, so the log-probs of split
logits equal the whole ones'.

Under pipeline parallelism the pipeline schedule runs the micro-batches; its last stage computes
the same micro-batch loss from the logits of every position (`PipelineTarget` carries the labels,
the general-text labels and the reference log-probs to it as one tensor, the schedule's target),
and the statistics reach the other stages by a broadcast after the step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stages.model import LlamaForCausalLM
from stages.model.labels import IGNORE_INDEX
from stages.model.loss import counted_tokens, learned_positions, next_tokens, per_token_loss
from stages.model.preference_loss import PreferenceObjective, SequenceLogps
from stages.parallel.mappings import collective_device
from stages.parallel.pipeline import PipelineRunner
from stages.parallel.tensor import vocab_parallel_cross_entropy
from stages.training.deepspeed_engine import loss_scale

# train_log.csv columns of the preference statistics (means over the pairs since the last row), as TRL logs them
STATS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected")
MIX_STATS = ("mix_loss",)  # with data mixing: the mean NLL of the general-text tokens since the last row
_PAIRS, _MIX_NLL, _MIX_TOKENS = len(STATS), len(STATS) + 1, len(STATS) + 2  # the other entries of a stats vector
STATS_SIZE = len(STATS) + 3


@dataclass(frozen=True)
class GlobalCounts:
    """What the step's loss is a mean over, counted on the whole global batch: pairs, the chosen
    answers' tokens (ORPO's NLL) and the general-text tokens (data mixing)."""

    pairs: int
    chosen_tokens: int = 1
    mix_tokens: int = 0


@dataclass(frozen=True)
class RowTerms:
    """A micro-batch's forward, reduced: each row's answer log-prob (`logps`), and the summed NLL
    of its general-text tokens (`mix_nll`, 0-d) and their count (`mix_tokens`)."""

    logps: SequenceLogps
    mix_nll: torch.Tensor
    mix_tokens: int


def learned_logps(logits: torch.Tensor, where: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor,
                  per_token=None) -> RowTerms:
    """From the logits (N, V or V/tp) of the learned positions `where` (R, T) and their `targets`
    (N,): each row's summed log-prob of its answer tokens (marked by `labels` (R, T)) and the NLL
    of the other learned tokens, the general text."""
    nll = per_token_loss(logits, targets, per_token)  # (N,)
    answers = next_tokens(labels) != IGNORE_INDEX  # (R, T)
    answer = answers[where]  # (N,) which learned positions are the answers'
    rows = where.nonzero()[:, 0]  # the row of each learned position, in logits' row-major order
    answer_logps = -nll.masked_fill(~answer, 0)
    total = torch.zeros(len(labels), dtype=nll.dtype, device=nll.device).index_add(0, rows, answer_logps)
    return RowTerms(SequenceLogps(total=total, tokens=answers.sum(-1)), nll[~answer].sum(), int((~answer).sum()))


def learned_labels(labels: torch.Tensor, mix_labels: torch.Tensor | None) -> torch.Tensor:
    """The answers' labels with the general text's filled in: every token the step learns."""
    return labels if mix_labels is None else torch.where(labels != IGNORE_INDEX, labels, mix_labels)


def row_logps(model, ids: torch.Tensor, labels: torch.Tensor, tp_group=None,
              mix_labels: torch.Tensor | None = None) -> RowTerms:
    """Each row's summed log-probability of its answer tokens (labels shifted by one, as the SFT
    loss scores them), in fp32, and their count; and the summed NLL of the general-text tokens of
    `mix_labels` (0 without). `model` is our model, a transformers causal LM or a DeepSpeed engine
    holding either; `tp_group`: the logits are split over the vocabulary."""
    where, targets = learned_positions(learned_labels(labels, mix_labels))  # (R, T) bool, (N,)
    if isinstance(getattr(model, "module", model), LlamaForCausalLM):
        logits = model(input_ids=ids, logits_at=where)  # (N, V or V/tp)
    else:
        output = model(input_ids=ids)
        logits = (output if torch.is_tensor(output) else output.logits)[where]
    per_token = None if tp_group is None else functools.partial(vocab_parallel_cross_entropy, group=tp_group)
    return learned_logps(logits, where, targets, labels, per_token)


def split_rows(logps: SequenceLogps) -> tuple[SequenceLogps, SequenceLogps]:
    """(chosen, rejected): a micro-batch's first half of rows and its second half."""
    m = len(logps.total) // 2
    return (SequenceLogps(logps.total[:m], logps.tokens[:m]), SequenceLogps(logps.total[m:], logps.tokens[m:]))


def global_counts(batches: list[tuple[torch.Tensor, ...]], objective: PreferenceObjective, global_batch: int,
                  dp_group) -> GlobalCounts:
    """The global batch's pairs, chosen answer tokens (ORPO) and general-text tokens: this rank's
    counts of its micro-batches summed over the data-parallel group (one all_reduce)."""
    import torch.distributed as dist

    chosen = sum(int(counted_tokens(b[1][:len(b[1]) // 2])) for b in batches) if objective.method == "orpo" else 0
    mix = sum(int(counted_tokens(b[3])) for b in batches if len(b) > 3)
    counts = torch.tensor([chosen, mix], device=collective_device(dp_group))
    dist.all_reduce(counts, group=dp_group)
    return GlobalCounts(pairs=global_batch, chosen_tokens=max(int(counts[0]), 1), mix_tokens=int(counts[1]))


def micro_batch_loss(objective: PreferenceObjective, rows: RowTerms, reference: torch.Tensor,
                     counts: GlobalCounts) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's share of the step loss, its statistics: the `STATS` sums, its pair count,
    its general-text NLL sum and token count (STATS_SIZE,) float64)."""
    logps = rows.logps
    chosen, rejected = split_rows(logps)
    ref_chosen = ref_rejected = None
    if objective.needs_reference:
        ref = reference.to(device=logps.total.device, dtype=logps.total.dtype)
        ref_chosen, ref_rejected = split_rows(SequenceLogps(ref, logps.tokens))
    terms = objective.pair_terms(chosen, rejected, ref_chosen, ref_rejected)
    loss = terms.loss.sum() / counts.pairs
    if objective.method == "orpo":  # the supervised term: NLL of the chosen answers' tokens
        loss = loss - chosen.total.sum() / counts.chosen_tokens
    if counts.mix_tokens:  # data mixing: the general text's mean NLL over the global batch
        loss = loss + rows.mix_nll / counts.mix_tokens
    sums = torch.stack([terms.chosen_reward.sum(), terms.rejected_reward.sum(), terms.accuracy.sum(),
                        terms.margin.sum(), chosen.total.sum(), rejected.total.sum()]).detach().double().cpu()
    counted = torch.tensor([len(terms.loss), float(rows.mix_nll), rows.mix_tokens], dtype=torch.float64)
    return loss, torch.cat([sums, counted])


def preference_train_step(engine, objective: PreferenceObjective, batches: list[tuple[torch.Tensor, ...]],
                          counts: GlobalCounts, dp: int, clip: Callable[[torch.nn.Module], float] | None,
                          tp_group=None, runner: PipelineRunner | None = None
                          ) -> tuple[torch.Tensor, float | None, torch.Tensor]:
    """One optimizer step over this rank's micro-batches; returns (this rank's share of the step
    loss, grad norm or None, this rank's statistics (STATS_SIZE,)). `counts` counts the whole global
    batch. DeepSpeed divides gradients by the accumulation steps and by dp, so each micro-batch's
    loss is scaled by accum x dp (see `stages.training.step.train_step`)."""
    if runner is not None:
        return _pipeline_step(engine, runner, objective, batches, counts, dp, clip, tp_group)
    share, grad_norm, accum = torch.zeros((), dtype=torch.float64), None, len(batches)
    stats = torch.zeros(STATS_SIZE, dtype=torch.float64)
    for i, (ids, labels, reference, *mix) in enumerate(batches):
        mix_labels = mix[0].to(engine.device) if mix else None
        rows = row_logps(engine, ids.to(engine.device), labels.to(engine.device), tp_group, mix_labels)
        loss, micro_stats = micro_batch_loss(objective, rows, reference, counts)
        engine.backward(loss * (accum * dp * loss_scale(engine)))
        if clip and i == accum - 1:
            grad_norm = clip(engine.module)
        engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        share += loss.detach().double().cpu()
        stats += micro_stats
    return share.float(), grad_norm, stats


class PairStats:
    """The statistics of this rank's pairs stepped since the last logged row; `means` sums them over
    the data-parallel ranks, once per logged row rather than once per step. `mixing`: the run mixes
    general text in, and `means` adds its mean NLL (`MIX_STATS`)."""

    def __init__(self, dp_group, mixing: bool = False):
        self.dp_group, self.mixing = dp_group, mixing
        self.sums = torch.zeros(STATS_SIZE, dtype=torch.float64)

    @property
    def columns(self) -> tuple[str, ...]:
        """The train_log.csv columns `means` fills."""
        return STATS + MIX_STATS if self.mixing else STATS

    def add(self, stats: torch.Tensor) -> None:
        """Add this rank's sums of one step (local, no collective)."""
        self.sums += stats

    def means(self) -> dict[str, float]:
        """The means per pair (and per general-text token) since the last call, over every
        data-parallel rank (collective over the group: every rank calls it at the same steps), then reset."""
        import torch.distributed as dist

        sums = self.sums.to(collective_device(self.dp_group), copy=True)  # not an alias: reset below
        dist.all_reduce(sums, group=self.dp_group)
        sums = sums.cpu()
        self.sums.zero_()
        count = max(float(sums[_PAIRS]), 1.0)
        means = {name: float(value) / count for name, value in zip(STATS, sums[:len(STATS)])}
        if self.mixing:
            means["mix_loss"] = float(sums[_MIX_NLL]) / max(float(sums[_MIX_TOKENS]), 1.0)
        return means


def pipeline_target(batches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The micro-batches' labels, general-text labels and reference log-probs as one float64 tensor
    (R, 2T + 1), the pipeline schedule's target: it splits the target into micro-batches along the
    rows, as it splits the ids. Token ids and IGNORE_INDEX are exact in float64."""
    parts = []
    for ids, labels, reference, *mix in batches:
        mix_labels = mix[0] if mix else torch.full_like(labels, IGNORE_INDEX)
        parts.append(torch.cat([labels.double(), mix_labels.double(), reference.double()[:, None]], dim=1))
    return torch.cat(parts)


def _pipeline_step(engine, runner: PipelineRunner, objective: PreferenceObjective,
                   batches: list[tuple[torch.Tensor, ...]], counts: GlobalCounts, dp: int,
                   clip: Callable[[torch.nn.Module], float] | None, tp_group) -> tuple[torch.Tensor, float | None,
                                                                                    torch.Tensor]:
    """`preference_train_step` under pipeline parallelism: the schedule runs this rank's
    micro-batches (one per accumulation step, as `runner.n_microbatches` says) and the last stage
    computes each one's loss from the logits of every position; DeepSpeed's gradient reduction and
    step are called explicitly, as `stages.training.step.train_step` does for SFT."""
    import torch.distributed as dist

    ids = torch.cat([b[0] for b in batches])  # (R, T): every micro-batch is padded to the same width
    width = ids.shape[1]
    per_token = None if tp_group is None else functools.partial(vocab_parallel_cross_entropy, group=tp_group)
    calls: list[torch.Tensor] = []  # each call's statistics (the last stage's)

    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # the last stage, per micro-batch
        labels, mix_labels = target[:, :width].long(), target[:, width:2 * width].long()
        where, targets = learned_positions(learned_labels(labels, mix_labels))
        rows = learned_logps(logits[where], where, targets, labels, per_token)
        micro, micro_stats = micro_batch_loss(objective, rows, target[:, 2 * width], counts)
        calls.append(micro_stats)
        return micro * dp  # DeepSpeed's reduction averages the gradients over dp

    engine.zero_grad()
    share = runner.train_step(ids.to(engine.device), pipeline_target(batches).to(engine.device), loss=loss).cpu() / dp
    engine.allreduce_gradients()  # the schedule ran backward, not engine.backward
    grad_norm = clip(engine.module) if clip else None
    engine.step()
    # The schedule's first step also calls the loss once, before the micro-batches, to infer the
    # gradients' shapes (torch.distributed.pipelining's _prepare_backward_infra), on outputs the
    # step does not use: the last len(batches) calls are the step's micro-batches.
    mine = calls[-len(batches):]
    stats = torch.stack(mine).sum(0) if mine else torch.zeros(STATS_SIZE, dtype=torch.float64)
    stats = stats.to(collective_device(runner.group))  # the last stage's statistics, to every stage
    dist.broadcast(stats, group=runner.group, group_src=runner.last_rank)
    return share.float(), grad_norm, stats.cpu()
