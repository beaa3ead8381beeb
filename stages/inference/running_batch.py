"""A batch of generations that rows join and leave between decode steps: the server's continuous
batching, on the decode engine's pieces (`stages.inference.engine`, `stages.inference.kv_cache`).

    batch = RunningBatch(model, eos_token_id=2, pad_token_id=0)
    batch.add([Row(prompt=[5, 6, 7], max_new_tokens=16)])      # prefill: the row's first token
    while batch.rows:
        ended = batch.step()                                   # one forward, one token per row
        batch.add([Row(prompt=[9, 4], max_new_tokens=8, sampling=Sampling(temperature=0.7, seed=1))])

`DecodeEngine.generate` runs a fixed batch until its last row ends (a finished row is fed pads);
here a row leaves the step it ends, and new rows join at any step boundary, so a request arriving
while others decode starts at once instead of waiting for the whole batch.

Each row has its own budget, eos, stop strings, `on_token` (True ends the row: the server's stop
strings and cancellation) and sampling: temperature / top-k / top-p as the engine warps them and a
`torch.Generator` of its own (seeded by `Sampling.seed`), so a row's draws do not depend on which
rows share its steps. Greedy and sampling rows share a batch.

The batch's KV cache, B rows of L positions, is one `PreallocatedCache` whose rows are left-padded
to a common length: row r's keys sit at the right end, [pads][prefix][prompt pads][prompt][new],
and a 2-D attention mask (B, L) hides the pads. Each row keeps its own position ids (the next one
is `positions[r]`), so where a row sits in the cache changes nothing it computes: attention sums
over the unmasked keys, and rotary embeddings were applied before the keys were cached.
  * join: the joining rows are prefilled together in a cache of their own (left-padded among
    themselves, prefix tuning's keys written first, as the engine prefills), each gets its first
    token, and those still running are merged: both caches left-padded to the longer one's length
    (pads masked) and concatenated along the rows. Keys and values are copied at join and leave
    events only; a decode step writes one position per row in place.
  * leave: the rows that ended are selected away (`index_select`), and leading positions that
    every remaining row masks are trimmed.
  * capacity: each rebuild reserves room for CAPACITY_STEP more steps at most (fewer when every
    row's budget ends sooner); a step past it grows the cache by another CAPACITY_STEP.
With no padding anywhere (one row, or rows of equal length) the mask is dropped as the engine
drops it, so a lone row computes exactly what `DecodeEngine.generate` on its prompt computes; in a
padded batch the tokens are those of the engine's padded batches (tests/unit/test_continuous_batching.py).

`compile=True` (the server's `--compile`) runs the decode steps through `torch.compile` with dynamic
shapes, every float Linear on a single row a fused multiply-and-sum as in the engine's compiled step
(`one_row_linear.py`): one graph for a lone row and one for a batch of rows (always given the mask),
whatever their number and lengths, on the same PreallocatedCache (with a spare position, so no
length is special). `warm_up()` compiles both before the first request (80-110 s together for a
135M model on 2 idle cores; less when inductor's on-disk cache holds them). A lone row decodes 2.3-2.4x
faster on SmolLM2-135M (bench/serve.py); the fused sums and the mask change the logits' last bits, so
tokens may differ from the eager steps' where two logits are near ties. Prefills stay eager.

`unsupported(model)` names what the running batch does not run: what the engine does not
(`engine.unsupported`), a sliding window shorter than the model's context (the merged cache would
let it slide) and a model whose forward takes no position ids (they are per row here).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from stages.inference import engine as engine_module
from stages.inference.engine import DecodeEngine, Sampling, left_padded
from stages.inference.kv_cache import PreallocatedCache, cache_fits
from stages.inference.one_row_linear import with_one_row_linears

CAPACITY_STEP = 64  # decode steps a rebuilt cache has room for: fewer rebuilds vs. memory held for short answers


@dataclass(eq=False)  # compared by identity: a row is one request
class Row:
    """One generation in a running batch: what to generate, and what it generated so far."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling | None = None  # None: greedy
    on_token: Callable[[int], bool] | None = None  # sees each new token first; True ends the row (FINISH_STOP)
    stop_strings: Sequence[str] = ()  # need the batch's tokenizer
    tokens: list[int] = field(default_factory=list)  # new tokens, through the one that ended the row
    finish_reason: str | None = None  # engine.FINISH_EOS / FINISH_STOP / FINISH_LENGTH once ended
    generator: torch.Generator | None = None  # a sampling row's draws; made from sampling.seed when None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)


def unsupported(model) -> str | None:
    """Why a RunningBatch cannot run `model`, or None when it can."""
    reason = engine_module.unsupported(model)
    if reason is not None:
        return reason
    runner, _ = engine_module._runner(model)
    if "position_ids" not in inspect.signature(runner.forward).parameters:
        return f"{type(runner).__name__}.forward takes no position_ids (each row of a running batch has its own)"
    context = getattr(runner.config.get_text_config(decoder=True), "max_position_embeddings", None)
    return cache_fits(runner.config, context) if context else None


def _compiled_step(forward: Callable) -> Callable:
    """`forward` through torch.compile with dynamic shapes, one-row Linears fused, traced without
    duck shaping: a warm-up batch of 2 rows on a model with 2 KV heads would otherwise give both
    sizes one symbol, and the graph would hold only for batches of as many rows as KV heads."""
    from torch.fx.experimental import _config as shapes_config  # use_duck_shape: read when a trace starts

    compiled = torch.compile(with_one_row_linears(forward), dynamic=True)

    def step(*args, **kwargs):
        with shapes_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return step


class RunningBatch:
    """The rows generating together and their KV cache (see the module docstring). Not
    thread-safe: one thread adds, steps and removes."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int | None, pad_token_id: int, tokenizer=None,
                 compile: bool = False):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"a running batch cannot run this model: {reason}")
        self.engine = DecodeEngine(model, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        # compile: the decode steps through torch.compile with dynamic shapes (module docstring)
        self._step = _compiled_step(self.engine.runner.forward) if compile else None
        self.tokenizer = tokenizer
        self.device = self.engine.device
        self._config = self.engine.runner.config
        self._clear()

    def _clear(self) -> None:
        self._rows: list[Row] = []
        self._cache: PreallocatedCache | None = None
        self._mask: torch.Tensor | None = None  # (B, capacity): ones beyond the written positions
        self._padded = False  # whether the mask hides anything (else the forward takes none)
        self._next: torch.Tensor | None = None  # (B, 1) each row's last token, the next step's input
        self._positions: torch.Tensor | None = None  # (B, 1) its position id
        self.length = 0  # L: positions written in every row

    @property
    def rows(self) -> list[Row]:
        """The running rows, in the cache's row order."""
        return list(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def compiled(self) -> bool:
        """Whether the decode steps run compiled (`compile=True`)."""
        return self._step is not None

    @property
    def forward_calls(self) -> int:
        """Prefills and decode steps so far."""
        return self.engine.forward_calls

    # -- joining -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, rows: Sequence[Row]) -> list[Row]:
        """Prefill `rows` together (one forward), give each its first token, and merge the rows
        still running into the batch. Returns the rows that ended at their first token (they never
        join). The batch is unchanged when this raises."""
        rows = list(rows)
        if not rows:
            return []
        for row in rows:
            self._check(row)
        engine, prefix, batch = self.engine, self.engine.num_prefix_tokens, len(rows)
        ids, prompt_mask = left_padded([r.prompt for r in rows], engine.pad_token_id)  # (k, T) each
        ids, prompt_mask = ids.to(self.device), prompt_mask.to(self.device)
        cache = PreallocatedCache(engine._num_layers, prefix + ids.shape[1])
        if prefix:
            engine._write_prefix(cache, batch)
        mask = torch.cat([prompt_mask.new_ones((batch, prefix)), prompt_mask], dim=1)  # (k, prefix + T)
        positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0) + prefix  # (k, T), pads at prefix
        # no padding: no mask, the causal one alone (as the engine and generate prefill)
        logits = engine._forward(ids, None if bool(prompt_mask.all()) else mask, positions, cache)  # (k, V)
        tokens = self._advance(rows, self._choose(logits, rows))
        stay = [i for i, r in enumerate(rows) if r.finish_reason is None]
        if stay:
            self._merge([rows[i] for i in stay], cache, mask, tokens, positions[:, -1:] + 1, stay)
        return [r for r in rows if r.finish_reason is not None]

    def _check(self, row: Row) -> None:
        if not row.prompt:
            raise ValueError("a row needs a prompt of at least one token")
        if row.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={row.max_new_tokens}: a row generates at least one token")
        if row.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need the tokenizer that decodes the tokens (RunningBatch(tokenizer=))")
        if row.sampling is not None and row.generator is None:
            row.generator = torch.Generator(self.device)
            if row.sampling.seed is not None:
                row.generator.manual_seed(row.sampling.seed)  # the draws torch.manual_seed(seed) gives
            else:
                row.generator.seed()

    def _merge(self, joining: list[Row], cache: PreallocatedCache, mask: torch.Tensor, tokens: torch.Tensor,
               positions: torch.Tensor, stay: list[int]) -> None:
        """The batch's rows, then `joining` (rows `stay` of the prefill's cache and of its mask
        (k, Lj), tokens (k,) and next positions (k, 1)), left-padded to a common length."""
        old, new, width = self.length, mask.shape[1], max(self.length, mask.shape[1])
        rows, keep, here = self._rows + joining, torch.tensor(stay, device=self.device), len(self._rows)

        def aligned(ours: torch.Tensor | None, joined: torch.Tensor) -> torch.Tensor:
            """(B + k', H, L', D): our rows (B, H, L, D) over the joining ones (k', H, Lj, D), both right-aligned."""
            out = joined.new_zeros((len(rows), joined.shape[1], width, joined.shape[-1]))  # zeros: no NaN under the mask
            if ours is not None:
                out[:here, :, width - old:] = ours
            out[here:, :, width - new:] = joined
            return out

        layers = []
        for i, layer in enumerate(cache.layers):
            ours = self._cache.layers[i] if here else None
            layers.append((aligned(None if ours is None else ours.keys, layer.keys.index_select(0, keep)),
                           aligned(None if ours is None else ours.values, layer.values.index_select(0, keep))))
        full = mask.new_zeros((len(rows), width))  # (B', L')
        if self._rows:
            full[:len(self._rows), width - old:] = self._mask[:, :old]
        full[len(self._rows):, width - new:] = mask.index_select(0, keep)
        nexts = tokens.index_select(0, keep)[:, None]  # (k', 1)
        self._install(rows, layers, full,
                      nexts if not self._rows else torch.cat([self._next, nexts]),
                      positions.index_select(0, keep) if not self._rows else
                      torch.cat([self._positions, positions.index_select(0, keep)]))

    # -- decoding ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One decode step: every running row's next token (one forward for the batch). Returns the
        rows that ended; they have left the batch. A failed step leaves the batch empty."""
        if not self._rows:
            return []
        try:
            if self.length + 1 > self._cache.capacity:
                self._rebuild(self._rows, list(range(len(self._rows))), grow=True)
            length = self.length + 1
            mask = None  # no padding: the causal mask alone
            if self._padded or (self._step is not None and len(self._rows) > 1):  # a compiled batch: a mask always
                mask = self._mask[:, :length]  # (B, L + 1), the new position's column ones
                if self._step is not None:
                    mask = mask.contiguous()  # one layout for the compiled graph
            logits = self.engine._forward(self._next, mask, self._positions, self._cache, step=True,
                                          forward=self._step)  # (B, V)
            self.length = length
            tokens = self._advance(self._rows, self._choose(logits, self._rows))
        except BaseException:
            self._clear()  # the cache may hold half a step: these rows cannot go on
            raise
        self._next, self._positions = tokens[:, None], self._positions + 1
        ended = [r for r in self._rows if r.finish_reason is not None]
        if ended:
            self._keep([i for i, r in enumerate(self._rows) if r.finish_reason is None])
        return ended

    def warm_up(self) -> float:
        """Compile the decode step's graphs (`compile=True`) on dummy rows: a lone row, then two
        rows of different lengths; returns the seconds it took (0 without compile). The batch must
        be empty and is empty again after."""
        if self._step is None:
            return 0.0
        if self._rows:
            raise RuntimeError("warm_up needs an empty running batch")
        start, eos = time.perf_counter(), self.engine.eos_token_id
        self.engine.eos_token_id = None  # the dummy rows run their budget, whatever they generate
        try:
            for prompts in ([[1, 2, 3]], [[1, 2, 3], [1, 2]]):
                self.add([Row(prompt=p, max_new_tokens=3) for p in prompts])
                while self._rows:
                    self.step()
        finally:
            self.engine.eos_token_id = eos
            self._clear()
        return time.perf_counter() - start

    @torch.inference_mode()
    def remove(self, rows: Sequence[Row]) -> None:
        """Drop `rows` (e.g. their client went away) before the next step; their finish_reason
        stays as it is."""
        gone = {id(r) for r in rows}
        self._keep([i for i, r in enumerate(self._rows) if id(r) not in gone])

    def _choose(self, logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
        """(B,) each row's token from its logits (B, V): argmax, or a draw from its own generator
        after its warpers (the engine's draw for a batch of one)."""
        tokens = logits.argmax(dim=-1)  # (B,)
        for r, row in enumerate(rows):
            if row.sampling is not None:
                scores = logits[r:r + 1]  # (1, V)
                for warp in row.sampling.warpers():
                    scores = warp(None, scores)
                tokens[r] = torch.multinomial(scores.softmax(dim=-1), num_samples=1, generator=row.generator)[0, 0]
        return tokens

    def _advance(self, rows: Sequence[Row], tokens: torch.Tensor) -> torch.Tensor:
        """Give each row its token (the engine's rule: on_token, eos, stop strings, budget); returns `tokens`."""
        for row, token in zip(rows, tokens.tolist()):
            on_token = None if row.on_token is None else (lambda _, t, row=row: row.on_token(t))
            self.engine._advance(0, token, row, row.max_new_tokens, on_token, row.stop_strings, self.tokenizer)
        return tokens

    # -- the cache ---------------------------------------------------------------------------------
    def _keep(self, keep: list[int]) -> None:
        """Only rows `keep` (indices, in order) go on."""
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._clear()
            return
        self._rebuild([self._rows[i] for i in keep], keep)

    def _rebuild(self, rows: list[Row], keep: list[int], grow: bool = False) -> None:
        index = torch.tensor(keep, device=self.device)
        layers = [(layer.keys.index_select(0, index), layer.values.index_select(0, index))
                  for layer in self._cache.layers]  # (B', H, L, D) each
        self._install(rows, layers, self._mask[:, :self.length].index_select(0, index),
                      self._next.index_select(0, index), self._positions.index_select(0, index), grow)

    def _install(self, rows: list[Row], layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
                 nexts: torch.Tensor, positions: torch.Tensor, grow: bool = False) -> None:
        """Make `rows` the batch: their keys and values (B, H, L, D) per layer and mask (B, L),
        less the leading positions every row masks, in a new cache with room for the next steps."""
        start = int((mask.sum(0) > 0).nonzero()[0])  # the first position some row attends to
        mask = mask[:, start:]  # (B, L - start)
        length = mask.shape[1]
        steps = max(r.remaining for r in rows)
        capacity = length + (CAPACITY_STEP if grow else min(steps, CAPACITY_STEP))
        reason = cache_fits(self._config, capacity)
        if reason is not None:
            raise ValueError(f"the running batch's KV cache cannot hold {capacity} positions: {reason}")
        cache = PreallocatedCache(self.engine._num_layers, capacity, spare=0 if self._step is None else 1)
        for i, (keys, values) in enumerate(layers):
            cache.update(keys[:, :, start:], values[:, :, start:], i)
        full = mask.new_ones((len(rows), capacity))  # (B, capacity): every step writes a real position per row
        full[:, :length] = mask
        self._rows, self._cache, self._mask, self.length = rows, cache, full, length
        self._padded = not bool(mask.all())
        self._next, self._positions = nexts, positions
