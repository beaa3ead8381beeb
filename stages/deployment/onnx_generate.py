"""Greedy generation and logits with onnxruntime on the decoder of `stages.deployment.onnx_decoder`.

`OnnxDecoder(path)` is one onnxruntime session of a cache graph; `greedy_generate` runs a
left-padded batch as transformers' `generate` does: one prefill over the prompts, then one token
per step with the cache, position ids from the mask (cumsum - 1, pads at 1, as HF), finished rows
(eos, or their own token budget) continued with pad, the loop ending when every row is done.
`logits` is the cache-free forward (past of length 0) that perplexity needs.

Everything is numpy; torch only appears in `stages.deployment.onnx_model`, the adapter that lets
the torch-facing stages (predict, evaluate) call this as they call a transformers model.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")


def position_ids(attention_mask: np.ndarray) -> np.ndarray:
    """(B, S) int64 positions of a (B, S) mask: cumsum - 1 on real tokens, 1 on pads (HF's
    `prepare_inputs_for_generation`); left padding thus numbers each row's tokens from 0."""
    pos = np.cumsum(attention_mask, axis=-1, dtype=np.int64) - 1
    return np.where(attention_mask == 0, 1, pos)


class OnnxDecoder:
    """An onnxruntime session of a decoder graph; a graph without `past_key_values.*` inputs (the
    cache-free export of families our model does not implement) runs as `logits` only."""

    def __init__(self, path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",),
                 intra_op_num_threads: int = 0, allow_spinning: bool = False):
        import onnxruntime as ort  # imported here: only ONNX consumers need it

        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_num_threads  # 0: onnxruntime's default (one per core)
        # onnxruntime's idle worker threads spin after each run by default; beside torch in the same
        # process (the export checks, evaluate's torch metrics) they starve torch's threads (a debug
        # model's linear layer went from 0.5 ms to 30 ms on 2 cores)
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), options, providers=list(providers))
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.input_names = set(inputs)
        layers = sorted({int(m.group(1)) for name in inputs if (m := _PAST.fullmatch(name))})
        self.num_layers = len(layers)
        if self.num_layers:
            _, heads, _, head_dim = inputs["past_key_values.0.key"].shape
            self.kv_shape = (int(heads), int(head_dim))  # (K, hd): static axes of the cache
        self.vocab_size = self.session.get_outputs()[0].shape[-1]

    @property
    def has_cache(self) -> bool:
        return self.num_layers > 0

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """[key_0, value_0, ...] of past length 0: the first (prefill) step."""
        return [np.zeros((batch, self.kv_shape[0], 0, self.kv_shape[1]), np.float32)
                for _ in range(2 * self.num_layers)]

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, past: list[np.ndarray]
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(logits (B, T, V), present) for `input_ids` (B, T) after `past`; `attention_mask` covers
        past and new tokens (B, P + T)."""
        if not self.has_cache:
            raise ValueError(f"{self.path} is a graph without a KV cache (input_ids -> logits); it "
                             "cannot run step by step, only `logits`")
        feed = {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask.astype(np.int64),
                "position_ids": position_ids(attention_mask)[:, -input_ids.shape[1]:]}
        feed.update({name: tensor for name, tensor in
                     zip((f"past_key_values.{i}.{kv}" for i in range(self.num_layers) for kv in ("key", "value")),
                         past)})
        logits, *present = self.session.run(None, feed)
        return logits, present

    def logits(self, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
        """(B, T, V) logits of whole sequences, no cache (for perplexity)."""
        if attention_mask is None:
            attention_mask = np.ones_like(input_ids)
        if not self.has_cache:
            if not np.all(attention_mask):
                raise ValueError(f"{self.path} has no attention_mask input; it cannot score padded batches")
            return self.session.run(["logits"], {"input_ids": input_ids.astype(np.int64)})[0]
        return self.step(input_ids, attention_mask, self.empty_past(len(input_ids)))[0]


def greedy_generate(decoder: OnnxDecoder, input_ids: np.ndarray, attention_mask: np.ndarray,
                    max_new_tokens: int | Sequence[int], eos_token_id: int | Sequence[int] | None,
                    pad_token_id: int, min_new_tokens: int = 0,
                    stop: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """(B, T + new) ids: the left-padded prompts `input_ids` (B, T) and their greedy continuation.

    A row ends at an eos (kept), after its own `max_new_tokens` (an int for every row, or one per
    row), or when `stop(sequences, logits)` (the ids so far, the last step's (B, V) logits) marks
    it; once ended it gets `pad_token_id`, as transformers pads finished rows. eos is suppressed
    for the first `min_new_tokens` steps. The loop stops when every row has ended."""
    batch = len(input_ids)
    budgets = np.broadcast_to(np.asarray(max_new_tokens, dtype=np.int64), (batch,))
    eos = np.asarray([] if eos_token_id is None else np.atleast_1d(eos_token_id), dtype=np.int64)
    sequences = input_ids.astype(np.int64)
    mask = attention_mask.astype(np.int64)
    done = budgets <= 0
    past = decoder.empty_past(batch)
    step_ids = sequences
    for step in range(int(budgets.max(initial=0))):
        if done.all():
            break
        logits, past = decoder.step(step_ids, mask, past)
        scores = logits[:, -1].astype(np.float32)  # (B, V)
        if step < min_new_tokens and eos.size:
            scores[:, eos] = -np.inf
        token = np.where(done, pad_token_id, scores.argmax(-1))  # (B,)
        sequences = np.concatenate([sequences, token[:, None]], axis=1)
        done = done | np.isin(token, eos) | (step + 1 >= budgets)
        if stop is not None:
            done = done | np.asarray(stop(sequences, scores), dtype=bool)
        step_ids = token[:, None]
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return sequences
