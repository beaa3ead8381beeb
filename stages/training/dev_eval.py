"""Evaluation while training (`eval_steps`): the dev loss and, with `eval_with_do_generation`,
exact match / BLEU-4 / ROUGE-L of greedy generations, computed on the training engine's module in
any layout but pipeline parallelism.

Every rank evaluates the whole dev set (it is small): the forwards are collective under tensor
parallelism and ZeRO-3, so all ranks run the same ones, and nothing needs reducing afterwards.
Generation runs forwards of the whole batch, without a KV cache, prompts left-padded, until every
row has produced eos or `max_new_tokens` are made; the ranks agree on the stop through an all-reduce
(every rank runs the same collectives). The tokens after a row's eos are cut, so stopping there
changes no result. Our model is told where the padding ends through its position ids (the pad tokens
form a packed example of their own, which the prompt does not attend to); a transformers model gets
the attention mask. Under context parallelism the dev loss is split like the training batches (each
rank's share summed over the group) and generation runs whole sequences on every rank
(`whole_sequences`): the weights are the same on each.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from stages.data.sft import encode_prompt, target_text
from stages.model.labels import IGNORE_INDEX
from stages.model.loss import counted_tokens
from stages.metrics.text import corpus_bleu, exact_match, rouge_l
from stages.model import LlamaForCausalLM
from stages.parallel.context import whole_sequences
from stages.training.step import token_sum_loss

Example = tuple[list[int], list[int]]


def _last_logits(module, ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor) -> torch.Tensor:
    """The logits (B, V) of each row's last position: our model projects that position only."""
    if isinstance(_unwrap(module), LlamaForCausalLM):
        last = torch.zeros_like(ids, dtype=torch.bool)
        last[:, -1] = True
        return module(input_ids=ids, position_ids=position_ids, logits_at=last)
    out = module(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids)
    return (out if torch.is_tensor(out) else out.logits)[:, -1]


def _unwrap(module):
    return getattr(module, "module", module)  # a DeepSpeed engine holds the model as .module


class DevEvaluator:
    """`evaluator(engine, tp_group) -> {"eval_loss": ..., ["eval_exact_match", "eval_bleu4",
    "eval_rouge_l"]}`; `tp_group` is the tensor-parallel group when the logits stay split over the
    vocabulary (tensor_parallel_output), else None."""

    def __init__(self, examples: Sequence[Example], batch_size: int, pad_token_id: int, *,
                 generation: dict[str, Any] | None = None):
        """`examples`: encoded dev examples; `generation`: {tokenizer, records, src_length,
        max_new_tokens, chat} to also score greedy generations."""
        self.examples, self.batch_size, self.pad = list(examples), batch_size, pad_token_id
        self.generation, self.tp_group = generation, None

    def __call__(self, engine, tp_group=None) -> dict[str, float]:
        self.tp_group = tp_group
        metrics = {"eval_loss": self.loss(engine)}
        if self.generation is not None:
            metrics.update(self.generate_and_score(engine))
        return metrics

    def loss(self, engine) -> float:
        total, count = 0.0, 0
        for start in range(0, len(self.examples), self.batch_size):
            chunk = self.examples[start:start + self.batch_size]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), self.pad, dtype=torch.long)
            labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
            for row, (i, lab) in enumerate(chunk):
                ids[row, :len(i)], labels[row, :len(lab)] = torch.tensor(i), torch.tensor(lab)
            device = next(_unwrap(engine).parameters()).device
            total += float(token_sum_loss(engine, ids.to(device), labels.to(device), self.tp_group))
            count += int(counted_tokens(labels))
        context = getattr(_unwrap(engine), "context_parallel", None)
        if context is not None:  # each rank summed the terms of its own tokens
            summed = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(summed, group=context.group)
            total = float(summed)
        return total / max(count, 1)

    def generate_and_score(self, engine) -> dict[str, float]:
        g = self.generation
        tokenizer, records = g["tokenizer"], g["records"]
        prompts = [encode_prompt(tokenizer, r, g["src_length"], g["chat"]) for r in records]
        eos = tokenizer.eos_token_id
        outputs: list[list[int]] = []
        with whole_sequences(_unwrap(engine)):
            for start in range(0, len(prompts), self.batch_size):
                outputs += self.greedy(engine, prompts[start:start + self.batch_size], g["max_new_tokens"], eos)
        predictions = [tokenizer.decode(o, skip_special_tokens=True) for o in outputs]
        references = [target_text(r) for r in records]
        return {"eval_exact_match": exact_match(predictions, references),
                "eval_bleu4": corpus_bleu(predictions, references, smooth=True),
                "eval_rouge_l": rouge_l(predictions, references)}

    def greedy(self, engine, prompts: list[list[int]], max_new_tokens: int, eos: int) -> list[list[int]]:
        """New tokens of each prompt, cut after the first eos (kept)."""
        device = next(_unwrap(engine).parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
        finished = torch.zeros(len(prompts), dtype=torch.bool)
        for _ in range(max_new_tokens):
            # pads count 0, 1, ... and the real tokens start again at 0: two examples of a packed row
            pads = (mask == 0).long()
            position_ids = torch.where(mask.bool(), mask.cumsum(-1) - 1, pads.cumsum(-1) - 1)
            logits = _last_logits(engine, ids.to(device), position_ids.to(device), mask.to(device)).float()
            if self.tp_group is not None:  # vocab-split logits: gather the last position's
                parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(self.tp_group))]
                dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
                logits = torch.cat(parts, dim=-1)
            token = logits.argmax(-1).cpu()
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(token)[:, None]], dim=1)
            if eos is not None:
                finished |= token == eos
            if _everyone_finished(finished):
                break
        results = []
        for row in ids[:, width:].tolist():
            results.append(row[:row.index(eos) + 1] if eos in row else row)
        return results


def _everyone_finished(finished: torch.Tensor) -> bool:
    """Whether every row of every rank has produced eos: the ranks compute the same tokens, and the
    all-reduce makes sure they also stop at the same forward (a rank that stopped alone would leave
    the others waiting in the next forward's collectives)."""
    unfinished = torch.tensor([int((~finished).sum())])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(unfinished, op=dist.ReduceOp.MAX)
    return int(unfinished) == 0
