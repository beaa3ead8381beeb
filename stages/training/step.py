"""One optimizer step of any layout: the summed next-token loss of a micro-batch, the learned
tokens of the global batch, and the step whose loss is their mean (so every layout follows the
single-process curve)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from stages.model import LlamaForCausalLM, causal_lm_loss, counted_tokens
from stages.model.labels import IGNORE_INDEX
from stages.model.loss import learned_positions, token_loss
from stages.parallel.mappings import collective_device
from stages.parallel.pipeline import PipelineRunner
from stages.parallel.tensor import vocab_parallel_cross_entropy
from stages.training.deepspeed_engine import loss_scale
from stages.training.router_stats import RouterStats


def token_sum_loss(engine, ids: torch.Tensor, labels: torch.Tensor, tp_group,
                   position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Summed next-token cross-entropy over labels != IGNORE_INDEX (logits split over the vocabulary when
    `tp_group` is given, i.e. tensor_parallel_output). Our model computes the logits of the learned
    positions only (a prompt's and padding positions are not: 35% of the default SFT run's positions,
    63% of LoRA's; bench/learned_logits.py); a transformers model returns a ModelOutput holding all
    of them. Right padding needs no attention mask under causal attention. `position_ids` marks
    packed rows (our model only). Under context parallelism the rows are split first and the sum is
    this rank's share: of the learned tokens it holds (`ContextSplit.split_batch`)."""
    per_token = None if tp_group is None else functools.partial(vocab_parallel_cross_entropy, group=tp_group)
    model = getattr(engine, "module", engine)  # a DeepSpeed engine holds it as .module
    context = getattr(model, "context_parallel", None)
    if context is not None:  # this rank's tokens, their targets shifted over the whole row
        ids, shifted, position_ids = context.split_batch(ids, labels, position_ids)
        where = shifted != IGNORE_INDEX
        targets = shifted[where]
    elif isinstance(model, LlamaForCausalLM):
        where, targets = learned_positions(labels)
    inputs = {"input_ids": ids} if position_ids is None else {"input_ids": ids, "position_ids": position_ids}
    if isinstance(model, LlamaForCausalLM):
        return token_loss(engine(**inputs, logits_at=where), targets, reduction="sum", per_token=per_token)
    output = engine(**inputs)
    logits = output if torch.is_tensor(output) else output.logits  # (B, T, V) or (B, T, V/tp)
    return causal_lm_loss(logits, labels, reduction="sum", per_token=per_token)


def shifted_token_loss(logits: torch.Tensor, targets: torch.Tensor, normalizer: float) -> torch.Tensor:
    """Summed cross-entropy of logits (B, T, V) against targets (B, T) already shifted (position t's
    own next token; IGNORE_INDEX skipped), divided by `normalizer`: a pipeline micro-batch's share
    under context parallelism."""
    return token_loss(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / normalizer


def train_step(engine, runner: PipelineRunner | None, batches: list[tuple[torch.Tensor, ...]],
               num_tokens: int, dp: int, clip: Callable[[torch.nn.Module], float] | None,
               tp_group=None, router: RouterStats | None = None) -> tuple[torch.Tensor, float | None]:
    """One optimizer step over this rank's micro-batches; returns (this rank's share of the step
    loss, grad norm or None). `num_tokens` counts the learned tokens of the whole global batch:
    the step loss is their mean, and the shares of the data-parallel ranks add up to it.

    DeepSpeed divides gradients by gradient_accumulation_steps (engine.backward) and by dp (its
    data-parallel average), so each micro-batch's summed loss is scaled by accum x dp / num_tokens
    (and by fp16's loss scale without ZeRO, which DeepSpeed's backward leaves to its caller:
    `stages.training.deepspeed_engine.loss_scale`).
    With a pipeline the schedule runs the micro-batches (normalised by num_tokens / dp) and
    DeepSpeed's reduction and step are called explicitly. `clip`, when given, clips and measures
    the gradients just before the update (ZeRO off).

    A mixture of experts (`router`) adds each micro-batch's router loss (load balancing, z-loss:
    `RouterStats.step_loss`) unscaled: DeepSpeed's division by accumulation and data parallelism
    makes the step's router term the mean over the global batch's micro-batches. The returned loss
    is the next-token loss alone (the router loss is logged in its own column).
    """
    if runner is not None:
        if any(len(b) > 2 for b in batches):
            raise ValueError("packed micro-batches (with position_ids) under pipeline parallelism: the stages pass "
                             "hidden states only; set packing: false or pipeline_parallel_degree: 1")
        ids = torch.cat([b[0] for b in batches]).to(engine.device)
        labels = torch.cat([b[1] for b in batches]).to(engine.device)
        engine.zero_grad()
        if runner.context_parallel is None:
            share = runner.train_step(ids, labels, normalizer=num_tokens / dp).cpu() / dp
        else:  # this rank's tokens of each row, their targets already shifted over the whole row
            ids, targets, _ = runner.context_parallel.split_batch(ids, labels)
            loss = functools.partial(shifted_token_loss, normalizer=num_tokens / dp)
            share = runner.train_step(ids, targets, loss=loss).cpu() / dp
        engine.allreduce_gradients()  # the schedule ran backward, not engine.backward
        grad_norm = clip(engine.module) if clip else None
        engine.step()
        return share, grad_norm
    share, grad_norm, accum = torch.zeros(()), None, len(batches)
    for i, (ids, labels, *packed) in enumerate(batches):
        position_ids = packed[0].to(engine.device) if packed else None  # a packed micro-batch
        loss_sum = token_sum_loss(engine, ids.to(engine.device), labels.to(engine.device), tp_group, position_ids)
        objective = loss_sum * (accum * dp / num_tokens)
        if router is not None:
            objective = objective + router.step_loss(getattr(engine, "module", engine))
        engine.backward(objective * loss_scale(engine))
        if clip and i == accum - 1:
            grad_norm = clip(engine.module)
        engine.step()  # DeepSpeed applies the optimizer only at the accumulation boundary
        share += loss_sum.detach().float().cpu() / num_tokens
    return share, grad_norm


def learned_tokens(batches: list[tuple[torch.Tensor, ...]], dp_group, copies: int = 1) -> int:
    """Learned (next-token) positions in the global batch: this rank's count summed over dp, where
    `copies` ranks hold each batch (the context-parallel ranks, each learning its share of it)."""
    import torch.distributed as dist

    count = torch.tensor(sum(int(counted_tokens(b[1])) for b in batches),
                         device=collective_device(dp_group))
    dist.all_reduce(count, group=dp_group)
    return max(int(count) // copies, 1)
