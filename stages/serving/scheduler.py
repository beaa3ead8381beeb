"""The one thread that runs the model: requests wait in a bounded queue and join a running batch.

HTTP handler threads `submit` a `Completion` and read its events; a single worker thread owns the
model. On a model the decode engine runs, it batches continuously
(`stages.inference.running_batch.RunningBatch`: one KV cache for the rows generating together):
  - at every step boundary, rows whose client went away leave, then waiting requests join (oldest
    first, up to `max_batch_size` rows): the joiners are prefilled together, each gets its first
    token, and the batch's next step decodes them with the others. A request that arrives while
    others generate starts at the next step, not after the whole batch;
  - each step is one forward for every row; a row leaves the step it ends (eos, a stop string,
    its `max_tokens`, its client gone) and its place is free for the next waiting request;
  - greedy and sampling rows share steps; a sampling row draws from its own generator, seeded
    with its seed when it gives one (the draws `torch.manual_seed(seed)` would give), so the same
    seed gives the same answer whatever else the server is doing.
Models the running batch does not run (`running_batch.unsupported`: an onnxruntime model, a
prompt-learning adapter other than prefix tuning, a sliding window shorter than the context) are
batched statically, as before continuous batching: the greedy requests waiting when a batch
starts run together on `DecodeEngine.generate` (or the model's own `generate`), a request
arriving meanwhile waits for the next batch, a sampling request runs alone.
`compile=True` (`--compile`) runs the running batch's decode steps compiled (RunningBatch's
`compile`), after compiling them on dummy rows before the worker starts.
Either way `feed` gives each row's new token to its `TextStream`, sends the safe delta to its
client and ends the row at eos, a stop string, its `max_tokens`, or when its client went away.

`submit` refuses (`QueueFull`) when `max_queue` requests are already admitted (waiting or running):
the HTTP layer answers 503 instead of letting a queue grow without bound. A failed step (or
prefill) answers its rows with an error; the server goes on. `close` refuses new requests, fails
the waiting ones and lets the running rows finish.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from stages.errors import InputError
from stages.inference.engine import DecodeEngine, unsupported
from stages.inference.engine import Sampling as EngineSampling
from stages.inference.generation import left_padded
from stages.inference.running_batch import Row, RunningBatch
from stages.inference.running_batch import unsupported as batch_unsupported
from stages.serving.text_stream import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    TextStream,
)

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
    on_finish: Callable[[Completion], None] | None = None  # the scheduler's: frees its place in the queue

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


def feed(completion: Completion, token: int, eos_token_id: int | None) -> bool:
    """Give `completion` its next token: the safe delta to its client, then the end at eos, a stop
    string, its max_tokens, or when its client went away. True once it has ended."""
    if completion.finish_reason is None:
        if completion.cancelled.is_set():
            completion.finish(FINISH_CANCELLED)
        else:
            delta = completion.stream.push(token)
            if delta and completion.streaming:
                completion.events.put(("delta", delta))
            if token == eos_token_id or completion.stream.stopped:
                completion.finish(FINISH_STOP)
            elif completion.completion_tokens >= completion.max_tokens:
                completion.finish(FINISH_LENGTH)
    return completion.finish_reason is not None


class RowProgress(StoppingCriteria):
    """`feed` for a static batch: as the engine's `on_token(r, token)`, or as a stopping
    criterion of `generate` (per-row done flags (B,))."""

    def __init__(self, rows: Sequence[Completion], eos_token_id: int | None):
        self.rows = rows
        self.eos_token_id = eos_token_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        new = input_ids[:, -1].tolist()  # (B,) the token each row got this step
        done = [feed(row, token, self.eos_token_id) for row, token in zip(self.rows, new)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    def on_token(self, r: int, token: int) -> bool:
        """The engine's per-row callback: feed row r's new token; True once the row has ended."""
        return feed(self.rows[r], token, self.eos_token_id)


class Scheduler:
    """Owns the model; `submit` from any thread, `close` to stop the worker.

    `current`: the requests generating now (the running batch's rows and those joining it; the
    static batch). `batches`: prefills so far, each a group of requests that started together
    (a join of the running batch, or a static batch)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int | None, pad_token_id: int,
                 max_batch_size: int = 8, max_queue: int = 16, compile: bool = False):
        if max_batch_size < 1 or max_queue < 1:
            raise InputError(f"--max-batch-size {max_batch_size} and --max-queue {max_queue} must both be >= 1")
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.device = next(model.parameters()).device
        self.engine: DecodeEngine | None = None  # the static path's, where the engine runs the model
        self.running_batch: RunningBatch | None = None
        reason = batch_unsupported(model)
        if reason is None:
            self.running_batch = RunningBatch(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                              compile=compile)
        else:
            if compile:
                log.info("--compile is for continuous batching; this model's batches stay eager")
            log.info("the scheduler batches statically (no continuous batching): %s", reason)
            if unsupported(model) is None:
                self.engine = DecodeEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
            else:
                log.info("the scheduler generates with the model's own generate: %s", unsupported(model))
        self._waiting: deque[Completion] = deque()
        self._admitted = 0  # submitted and not finished: waiting, or rows still generating
        self._closed = False
        self._cond = threading.Condition(threading.RLock())  # re-entrant: finish() frees places under it
        self._rows: list[tuple[Row, Completion]] = []  # the running batch's rows, in no particular order
        self.batches = 0  # prefills so far (see the class docstring)
        self.current: list[Completion] = []  # the requests generating now
        self.finished: Counter[str] = Counter()  # requests ended, by finish reason (/health shows it)
        loop = self._run_continuously if self.running_batch is not None else self._run_statically
        warmed: queue.Queue[BaseException | None] = queue.Queue()
        self._worker = threading.Thread(target=self._warm_up_then, args=(loop, warmed), name="generate", daemon=True)
        self._worker.start()
        error = warmed.get()  # the compiled steps are ready (at once without compile)
        if error is not None:
            self._worker.join()
            raise error

    def _warm_up_then(self, loop: Callable[[], None], warmed: queue.Queue) -> None:
        """The worker thread: the running batch's warm-up (compile=True), then `loop`. The warm-up
        runs here, not in the caller's thread, so that this thread is the only one whose OpenMP
        threads run the model: with a second thread's team idle beside it (the caller's), libgomp
        counts more threads than cores and its threads stop spinning between parallel regions,
        which made the compiled steps 1.7x slower (SmolLM2-135M, 2 cores). With compile,
        stages.serve loads the models in a thread that ends for the same reason."""
        try:
            if self.running_batch is not None and self.running_batch.compiled:
                log.info("compiling the decode steps (a lone row, a batch of rows) before serving...")
                log.info("decode steps compiled in %.1f s", self.running_batch.warm_up())
        except BaseException as e:  # the caller raises it
            warmed.put(e)
            return
        warmed.put(None)
        loop()

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
        """Refuse new requests, fail the waiting ones, let the running ones end; wait for the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._worker.join(timeout=30)

    def _live_waiting(self) -> list[Completion]:
        """The waiting requests whose client is still there (the others end as cancelled), oldest first."""
        live = [c for c in self._waiting if not c.cancelled.is_set()]
        dropped = [c for c in self._waiting if c.cancelled.is_set()]
        self._waiting = deque(live)
        for c in dropped:
            c.finish(FINISH_CANCELLED)  # its place is freed under this same (re-entrant) lock
        return live

    def _refuse_waiting(self) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for completion in waiting:
            completion.fail("the server is shutting down")

    # -- the worker thread: continuous batching ---------------------------------------------------
    def _run_continuously(self) -> None:
        """Each round, at a step boundary: rows whose client left go, waiting requests join while
        there is room, then one decode step of the running batch."""
        while True:
            self._drop_cancelled()
            with self._cond:
                while not self._waiting and not self._rows and not self._closed:
                    self._cond.wait()
                room = max(0, self.max_batch_size - len(self._rows))
                joining = [] if self._closed else self._live_waiting()[:room]
                taken = {id(c) for c in joining}
                self._waiting = deque(c for c in self._waiting if id(c) not in taken)
                self.current = [c for _, c in self._rows] + joining
            if self._closed:
                self._refuse_waiting()
                if not self._rows:
                    return
            if joining:
                self._join(joining)
            if self._rows:
                self._step()
            self.current = [c for _, c in self._rows]

    def _join(self, joining: list[Completion]) -> None:
        """Prefill `joining` into the running batch; each gets its first token."""
        self.batches += 1
        eos = self.eos_token_id
        pairs = [(Row(c.prompt, c.max_tokens, sampling=None if c.sampling is None else EngineSampling(
            temperature=c.sampling.temperature, top_p=c.sampling.top_p, seed=c.sampling.seed),
            on_token=lambda token, c=c: feed(c, token, eos)), c) for c in joining if c.max_tokens > 0]
        for c in joining:
            if c.max_tokens <= 0:
                c.finish(FINISH_LENGTH)
        try:
            self.running_batch.add([row for row, _ in pairs])
        except Exception as e:  # the prefill failed: its requests are answered, the running rows go on
            log.exception("the prefill of %d joining requests failed", len(pairs))
            for _, c in pairs:
                c.fail(f"generation failed: {type(e).__name__}: {e}")
            return
        self._rows += pairs
        self._forget_ended()

    def _step(self) -> None:
        try:
            self.running_batch.step()
        except Exception as e:  # a failed step answers its rows (the batch is empty now); the server goes on
            log.exception("a decode step failed for a batch of %d", len(self._rows))
            self._fail_running(e)
            return
        self._forget_ended()

    def _fail_running(self, error: Exception) -> None:
        """Answer every running row with `error` and empty the batch."""
        for _, c in self._rows:
            c.fail(f"generation failed: {type(error).__name__}: {error}")
        self._rows = []
        self.running_batch.remove(self.running_batch.rows)  # empty: nothing to copy

    def _forget_ended(self) -> None:
        """Rows the batch ended (they have left it): `feed` has finished their requests."""
        for row, c in self._rows:
            if row.finish_reason is not None:
                c.finish(FINISH_LENGTH)  # a no-op: feed finished it at its eos, stop or max_tokens
        self._rows = [(row, c) for row, c in self._rows if row.finish_reason is None]

    def _drop_cancelled(self) -> None:
        """Rows whose client went away leave the batch before the next step."""
        gone = [(row, c) for row, c in self._rows if c.cancelled.is_set()]
        if not gone:
            return
        for _, c in gone:
            c.finish(FINISH_CANCELLED)
        self._rows = [(row, c) for row, c in self._rows if not c.cancelled.is_set()]
        try:
            self.running_batch.remove([row for row, _ in gone])
        except Exception as e:  # copying the rows that stay failed: they cannot go on
            log.exception("dropping %d cancelled rows failed", len(gone))
            self._fail_running(e)

    # -- the worker thread: static batches (models the running batch does not run) ----------------
    def _run_statically(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                batch = [] if self._closed else self._take_batch()
                self.current = batch
            if self._closed:
                self._refuse_waiting()
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
        live = self._live_waiting()
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
            decode = {"do_sample": False}
        else:
            decode = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=True,
                            max_new_tokens=max(c.max_tokens for c in batch), num_beams=1,
                            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id,
                            stopping_criteria=StoppingCriteriaList([RowProgress(batch, self.eos_token_id)]),
                            **decode)
