"""The one thread that runs the model: requests wait in a bounded queue, greedy ones are batched.

HTTP handler threads `submit` a `Completion` and read its events; a single worker thread owns the
model and runs one batch at a time on the decode engine (`stages.inference.engine`: preallocated KV
cache, one forward per token; the model's own `generate` where the engine does not run it):
  - greedy requests that are waiting when a batch starts are run together (up to
    `max_batch_size`), left-padded as stages.predict pads, so concurrent greedy clients share each
    forward pass; a request that arrives while a batch runs waits for the next one;
  - a sampling request runs alone, from a generator seeded with its seed when it gives one (the
    draws `torch.manual_seed(seed)` would give), so the same seed gives the same answer whatever
    else the server is doing.
Each step, `RowProgress` (the engine's `on_token`, or a stopping criterion of `generate`: it sees
every new token before the next forward pass) feeds each row's token to its `TextStream`, sends
the safe delta to its client, and ends the row at eos, a stop string, its `max_tokens`, or when
its client went away.

`submit` refuses (`QueueFull`) when `max_queue` requests are already admitted (waiting or running):
the HTTP layer answers 503 instead of letting a queue grow without bound.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from stages.errors import InputError
from stages.inference.engine import DecodeEngine, unsupported
from stages.inference.engine import Sampling as EngineSampling
from stages.inference.generation import left_padded
from stages.serving.text_stream import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, TextStream

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests than `max_queue` are admitted; the client should retry later (HTTP 503)."""


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request; None in `Completion.sampling` means greedy."""

    temperature: float
    top_p: float
    seed: int | None  # seeds this request's generator (None: a random seed)


@dataclass
class Completion:
    """One request's generation: what to generate, and the events its HTTP handler reads.

    Events on `events`: with `streaming`, ("delta", text) any number of times; then exactly one of
    ("done", finish_reason) or ("error", message). Without `streaming` only the last one: the
    answer is `stream.text` (no thread wakes up per token while the model runs)."""

    prompt: list[int]
    max_tokens: int
    stream: TextStream
    sampling: Sampling | None = None
    streaming: bool = True
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finish_reason: str | None = None
    on_finish: Callable[["Completion"], None] | None = None  # the scheduler's: frees its place in the queue

    @property
    def completion_tokens(self) -> int:
        return len(self.stream.tokens)  # eos included, as stages.predict counts output_tokens

    def finish(self, reason: str) -> None:
        """End the answer (once): the held-back text, then ("done", reason)."""
        if self.finish_reason is None:
            if reason != FINISH_CANCELLED:
                rest = self.stream.flush()
                if rest and self.streaming:
                    self.events.put(("delta", rest))
            self._end(reason, ("done", reason))

    def fail(self, message: str) -> None:
        """End the answer (once) with ("error", message)."""
        if self.finish_reason is None:
            self._end("error", ("error", message))

    def _end(self, reason: str, event: tuple[str, str]) -> None:
        self.finish_reason = reason
        if self.on_finish is not None:
            self.on_finish(self)  # before the event: a client that sends its next request at once finds a place
        self.events.put(event)


class RowProgress(StoppingCriteria):
    """Feeds each step's new tokens to the rows' completions; a row is done at eos, a stop string,
    its max_tokens, or when its client went away. Returns the per-row done flags (B,)."""

    def __init__(self, rows: Sequence[Completion], eos_token_id: int | None):
        self.rows = rows
        self.eos_token_id = eos_token_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, -1].tolist()  # (B,) the token each row got this step
        done = []
        for row, token in zip(self.rows, new):
            if row.finish_reason is None:
                self._advance(row, token)
            done.append(row.finish_reason is not None)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def on_token(self, r: int, token: int) -> bool:
        """The engine's per-row callback: feed row r's new token; True once the row has ended."""
        row = self.rows[r]
        if row.finish_reason is None:
            self._advance(row, token)
        return row.finish_reason is not None

    def _advance(self, row: Completion, token: int) -> None:
        if row.cancelled.is_set():
            row.finish(FINISH_CANCELLED)
            return
        delta = row.stream.push(token)
        if delta and row.streaming:
            row.events.put(("delta", delta))
        if token == self.eos_token_id or row.stream.stopped:
            row.finish(FINISH_STOP)
        elif row.completion_tokens >= row.max_tokens:
            row.finish(FINISH_LENGTH)


class Scheduler:
    """Owns the model; `submit` from any thread, `close` to stop the worker."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int | None, pad_token_id: int,
                 max_batch_size: int = 8, max_queue: int = 16):
        if max_batch_size < 1 or max_queue < 1:
            raise InputError(f"--max-batch-size {max_batch_size} and --max-queue {max_queue} must both be >= 1")
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.device = next(model.parameters()).device
        reason = unsupported(model)
        if reason is not None:
            log.info("the scheduler generates with the model's own generate: %s", reason)
        self.engine = None if reason is not None else DecodeEngine(model, eos_token_id=eos_token_id,
                                                                    pad_token_id=pad_token_id)
        self._waiting: deque[Completion] = deque()
        self._admitted = 0  # submitted and not finished: waiting, or rows of the batch still generating
        self._closed = False
        self._cond = threading.Condition(threading.RLock())  # re-entrant: finish() frees places under it
        self.batches = 0  # generate calls so far
        self.current: list[Completion] = []  # the batch being generated
        self.finished: Counter[str] = Counter()  # requests ended, by finish reason (/health shows it)
        self._worker = threading.Thread(target=self._loop, name="generate", daemon=True)
        self._worker.start()

    # -- called by the HTTP handlers -------------------------------------------------------------
    def submit(self, completion: Completion) -> Completion:
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if self._admitted >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already queued or running (--max-queue); "
                                "retry later")
            completion.on_finish = self._release
            self._admitted += 1
            self._waiting.append(completion)
            self._cond.notify()
        return completion

    @property
    def admitted(self) -> int:
        """Requests waiting or still generating."""
        with self._cond:
            return self._admitted

    def _release(self, completion: Completion) -> None:
        with self._cond:
            self._admitted -= 1
            self.finished[completion.finish_reason] += 1

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join(timeout=30)

    # -- the worker thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    waiting, self._waiting = list(self._waiting), deque()
                else:
                    waiting, batch = [], self._take_batch()
                    self.current = batch
            if self._closed:
                for completion in waiting:
                    completion.fail("the server is shutting down")
                return
            if not batch:
                continue
            try:
                self._generate(batch)
            except Exception as e:  # a failed batch answers its requests; the server goes on
                log.exception("generate failed for a batch of %d", len(batch))
                for completion in batch:
                    completion.fail(f"generation failed: {type(e).__name__}: {e}")
            finally:
                self.current = []

    def _take_batch(self) -> list[Completion]:
        """The oldest waiting request, and with a greedy one every other waiting greedy request
        (oldest first, up to max_batch_size). Requests whose client already left are dropped."""
        live = [c for c in self._waiting if not c.cancelled.is_set()]
        dropped = [c for c in self._waiting if c.cancelled.is_set()]
        self._waiting = deque(live)
        for c in dropped:
            c.finish(FINISH_CANCELLED)  # its place is freed under this same (re-entrant) lock
        if not live:
            return []
        first = live[0]
        if first.sampling is not None:
            batch = [first]
        else:
            batch = [c for c in live if c.sampling is None][:self.max_batch_size]
        taken = {id(c) for c in batch}
        self._waiting = deque(c for c in live if id(c) not in taken)
        return batch

    def _generate(self, batch: list[Completion]) -> None:
        self.batches += 1
        if self.engine is None:
            self._generate_with_generate(batch)
        else:
            sampling = batch[0].sampling
            progress = RowProgress(batch, self.eos_token_id)
            self.engine.generate([c.prompt for c in batch], [c.max_tokens for c in batch], on_token=progress.on_token,
                                 sampling=None if sampling is None else EngineSampling(
                                     temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed))
        for c in batch:  # every row has ended by its max_tokens; RowProgress has finished it then
            c.finish(FINISH_LENGTH)

    @torch.no_grad()
    def _generate_with_generate(self, batch: list[Completion]) -> None:
        ids, mask = left_padded([c.prompt for c in batch], self.pad_token_id)  # (B, T) each, as predict pads
        sampling = batch[0].sampling
        if sampling is None:
            decode = dict(do_sample=False)
        else:
            decode = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=True,
                            max_new_tokens=max(c.max_tokens for c in batch), num_beams=1,
                            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                            stopping_criteria=StoppingCriteriaList([RowProgress(batch, self.eos_token_id)]),
                            **decode)
