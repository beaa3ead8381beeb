"""The decode engine of evaluate, predict and the server: one prefill of a left-padded batch into a
preallocated KV cache, then one decode step per token, with no `generate` call.

    engine = DecodeEngine(model, eos_token_id=2, pad_token_id=0)
    rows = engine.generate(prompts, [16, 4, 32], sampling=Sampling(temperature=0.7, top_p=0.9, seed=1),
                           stop_strings=["\\n\\n"], tokenizer=tokenizer)   # -> [Decoded(tokens, finish_reason)]

`model` is what `stages.inference.loading.load_variant` gives for a torch directory: a transformers
causal LM of any family (fp32, or with stages.quant's low-bit kernels in its linears), or a peft
model holding a LoRA or prefix-tuning adapter on one. Each forward call is the one `generate`
makes (the same input ids, position ids `cumsum(mask) - 1`, the 2-D mask or none when nothing is
padded, `logits_to_keep=1`), into `PreallocatedCache`, whose attention sees the same keys as
`DynamicCache`'s: greedy tokens equal `generate`'s token for token (tests/unit/test_decode_engine.py).
What the engine leaves out of each step: generate's per-step kwargs bookkeeping, logits processors
and stopping criteria, the re-concatenation of the ids, the mask and every layer's keys and values.

  * LoRA: the adapted layers are inside the base model; the engine calls that model directly.
  * Prefix tuning: peft's `get_prompt(B)` gives every layer's prefix keys and values; they are
    written into the cache's first `num_virtual_tokens` positions, the mask gets as many ones in
    front and the position ids start after them, as peft's `prepare_inputs_for_generation` does.
  * Rows end at eos (kept), at a stop string (the token that completed it kept), at their own
    budget, or when `on_token` says so; finished rows are fed the pad token until every row has
    ended, as in `generate` (a row's result never depends on the others).
  * Sampling: temperature, top-k, top-p as transformers' warpers apply them, then one multinomial
    draw per row from `generator` (a `torch.Generator`; `Sampling.seed` seeds a fresh one): with
    the generator seeded as `torch.manual_seed` seeds the global one, the draws are `generate`'s.

`compile=True` runs each decode step through `torch.compile` (inductor: the norms, rotary and
activations fused, one kernel launch for many aten ops) on transformers' `StaticCache`, whose
shapes stay the same from step to step (its size a multiple of COMPILED_CAPACITY_STEP; the prefill
stays eager), with every float Linear on a single row computed as a multiply-and-sum that inductor
fuses into one reduction (`one_row_linear.py`: at batch 1 the step is bound by how fast the weights
are read, and MKL's gemv reads them at 0.3-0.7x the fused sum's bandwidth on a 2-core AMD EPYC). The
first call of a batch size compiles (about 45 s for a 135M model on 2 idle cores, under 20 s when
inductor's cache already holds the graph; minutes on a loaded machine); fused float sums may differ
from eager's in the last bits, so the engines of evaluate and predict stay eager (token equality
with `generate`) and the compiled step is for long-lived callers (bench/deploy_decode.py measures
both).

`prompt_lookup=PromptLookup(...)` (`prompt_lookup.py`) decodes a lone prompt greedily with speculation:
each forward runs the last token and the tokens that followed the latest earlier occurrence of the
last few, takes the draft tokens the model would have chosen plus the model's own next token, and
crops the rest from the cache (several tokens a forward where answers copy their context; a batch
of prompts, or sampling, decodes one token a step).

`unsupported(model)` names what the engine does not run (an onnxruntime model, a prompt-learning
adapter other than prefix tuning); generation.py keeps `generate` for those and logs the reason.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, StaticCache
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stages.inference.kv_cache import PreallocatedCache, cache_fits
from stages.inference.one_row_linear import with_one_row_linears
from stages.inference.prompt_lookup import PromptLookup

log = logging.getLogger(__name__)

FINISH_EOS = "eos"  # the eos token (kept in the tokens)
FINISH_STOP = "stop"  # a stop string, or `on_token` ended the row
FINISH_LENGTH = "length"  # the row's budget of new tokens
COMPILED_CAPACITY_STEP = 256  # a compiled engine's cache holds a multiple of this: fewer shapes, fewer compiles


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; None where the engine takes one means greedy."""

    temperature: float = 1.0  # logits divided by this
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of tokens holding this probability mass (1.0: all)
    seed: int | None = None  # seeds a fresh torch.Generator when no generator is given

    def warpers(self) -> list:
        """transformers' warpers in `generate`'s order, each only where it changes something."""
        out = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p))
        return out


@dataclass
class Decoded:
    tokens: list[int]  # new tokens, through the one that ended the row
    finish_reason: str  # FINISH_EOS, FINISH_STOP or FINISH_LENGTH


# generation_config.json settings that make `generate` add a logits processor the engine does not
# apply, with the values that add none (None too): a checkpoint that sets one keeps `generate`
_PROCESSOR_SETTINGS = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                       "bad_words_ids": (), "suppress_tokens": (), "begin_suppress_tokens": (),
                       "forced_bos_token_id": (), "forced_eos_token_id": (), "min_length": 0, "min_new_tokens": 0,
                       "sequence_bias": (), "min_p": (), "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
                       "exponential_decay_length_penalty": (), "renormalize_logits": False, "guidance_scale": 1.0,
                       "top_h": (), "watermarking_config": ()}


def unsupported(model) -> str | None:
    """Why the engine cannot run `model`, or None when it can."""
    if not isinstance(model, torch.nn.Module):
        return f"{type(model).__name__} is not a torch model"
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and peft_config.is_prompt_learning and peft_config.peft_type != "PREFIX_TUNING":
        return f"peft {peft_config.peft_type.value} adapters put their prompt in the input embeddings"
    config = getattr(_runner(model)[0], "generation_config", None)
    for key, neutral in _PROCESSOR_SETTINGS.items():
        value = getattr(config, key, None)
        if value is not None and value != neutral:
            return f"its generation_config sets {key}={value!r}, a logits processor the engine does not apply"
    return None


def _runner(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """(the transformers model each step calls, prefix positions): a peft model's base model
    (LoRA's layers live inside it) and its prefix length; any other model itself and 0."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is None:
        return model, 0
    prefix = peft_config.num_virtual_tokens if peft_config.is_prompt_learning else 0
    return model.get_base_model(), prefix


def left_padded(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, T) with T the longest prompt: each prompt at the right end
    of its row, where generation continues; the mask hides the pads."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


def _stop_string_hit(tokenizer, tokens: list[int], stop_strings: Sequence[str]) -> bool:
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    return any(s in text for s in stop_strings)


class DecodeEngine:
    """Prefill and decode steps of one model (see the module docstring). Keeps its KV cache
    between `generate` calls of the same batch size and no larger length."""

    def __init__(self, model: torch.nn.Module, *, eos_token_id: int | None, pad_token_id: int,
                 compile: bool = False, prompt_lookup: PromptLookup | None = None):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"the decode engine cannot run this model: {reason}")
        if compile and prompt_lookup is not None:
            raise ValueError("prompt lookup checks its drafts in several-token forwards, which the compiled "
                             "one-token step does not run; choose one of compile and prompt_lookup")
        self.model = model
        self.prompt_lookup = prompt_lookup  # speculative greedy decoding of a lone prompt (prompt_lookup.py)
        self.runner, self.num_prefix_tokens = _runner(model)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        params = inspect.signature(self.runner.forward).parameters
        self._position_ids = "position_ids" in params  # generate passes them where forward takes them
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._num_layers = self.runner.config.get_text_config(decoder=True).num_hidden_layers
        self._cache: PreallocatedCache | StaticCache | None = None
        # compile: the decode step through torch.compile (inductor), on a StaticCache whose shapes do
        # not change from step to step (one graph per batch size and cache size; the prefill stays eager)
        # the compiled step's float Linears on one row are a fused multiply-and-sum (one_row_linear.py:
        # MKL's gemv reads weights at 0.3-0.7x its bandwidth on a 2-core EPYC, and batch 1 is bound by it)
        self._step = torch.compile(with_one_row_linears(self.runner.forward), dynamic=False) if compile else None
        self.forward_calls = 0  # prefills and decode steps so far (the bench's and the tests' count)
        self.drafted_tokens = self.accepted_tokens = 0  # prompt lookup's draft tokens checked and taken so far

    # -- the cache ---------------------------------------------------------------------------------
    def _new_cache(self, batch: int, capacity: int):
        """A reset PreallocatedCache of >= `capacity` positions (the last one when it fits), or
        transformers' DynamicCache where the model's layers need another (a sliding window); a
        compiled engine's StaticCache of a multiple of COMPILED_CAPACITY_STEP positions."""
        if self._step is not None:
            size = -(-capacity // COMPILED_CAPACITY_STEP) * COMPILED_CAPACITY_STEP
            if self._cache is None or self._cache_shape != (batch, size):
                self._cache, self._cache_shape = StaticCache(config=self.runner.config, max_cache_len=size), (batch, size)
            self._cache.reset()
            return self._cache
        reason = cache_fits(self.runner.config, capacity)
        if reason is not None:
            log.info("decode engine: DynamicCache instead of a preallocated one: %s", reason)
            return DynamicCache(config=self.runner.config)
        if self._cache is None or not self._cache.fits(batch, capacity):
            self._cache = PreallocatedCache(self._num_layers, capacity)
        self._cache.reset()
        return self._cache

    def _write_prefix(self, cache, batch: int) -> None:
        """Prefix tuning: peft's prefix keys and values (B, H, num_virtual_tokens, D) per layer,
        into the cache's first positions."""
        prefix = self.model.get_prompt(batch_size=batch)
        layers = prefix.layers if hasattr(prefix, "layers") else None
        if layers is None:
            raise ValueError(f"peft's get_prompt gave a {type(prefix).__name__}, not a transformers Cache")
        for i, layer in enumerate(layers):
            cache.update(layer.keys, layer.values, i)

    # -- one forward -------------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache,
                 step: bool = False, forward: Callable | None = None) -> torch.Tensor:
        """(B, vocab) float32 logits of the last position of `ids` (B, n); `step`: a decode step
        (compiled, where the engine compiles); `forward`: what runs the model instead of the runner
        (the running batch's compiled step)."""
        return self._logits(ids, mask, positions, cache, step, forward=forward)[:, -1]

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache,
                step: bool = False, keep: int = 1, forward: Callable | None = None) -> torch.Tensor:
        """(B, keep, vocab) float32 logits of the last `keep` positions of `ids` (B, n), as `_forward`."""
        kwargs = {"logits_to_keep": keep} if self._extra else {}
        if self._position_ids:
            kwargs["position_ids"] = positions
        self.forward_calls += 1
        if forward is None:
            forward = self._step if step and self._step is not None else self.runner
        out = forward(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                          return_dict=True, **kwargs)
        return out.logits[:, -keep:].float()  # (B, keep, V)

    # -- generation --------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int | Sequence[int], *,
                 sampling: Sampling | None = None, generator: torch.Generator | None = None,
                 stop_strings: Sequence[str] = (), tokenizer=None,
                 on_token: Callable[[int, int], bool] | None = None) -> list[Decoded]:
        """Continuations of `prompts` (lists of ids) as one left-padded batch, in their order.
        `max_new_tokens`: one budget for all rows or one per row. `sampling` None: greedy.
        `stop_strings` need `tokenizer`. `on_token(row, token)` sees each new token of a running
        row first and returns True to end that row (FINISH_STOP)."""
        batch = len(prompts)
        budgets = [max_new_tokens] * batch if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(budgets) != batch:
            raise ValueError(f"{len(budgets)} budgets for {batch} prompts")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer that decodes the tokens")
        rows = [Decoded([], FINISH_LENGTH) for _ in prompts]
        running = [b > 0 for b in budgets]
        if not any(running):
            return rows
        warpers = sampling.warpers() if sampling is not None else []
        if sampling is not None and generator is None:
            generator = torch.Generator(self.device)
            if sampling.seed is not None:
                generator.manual_seed(sampling.seed)
            else:
                generator.seed()

        ids, prompt_mask = left_padded(prompts, self.pad_token_id)  # (B, T) each
        ids, prompt_mask = ids.to(self.device), prompt_mask.to(self.device)
        width, prefix, steps = ids.shape[1], self.num_prefix_tokens, max(budgets)
        cache = self._new_cache(batch, prefix + width + steps)
        if prefix:
            self._write_prefix(cache, batch)
        # generate drops an all-ones mask (no padding: the causal mask alone); with padding it
        # grows the mask by one 1 per step, and peft puts the prefix's ones in front. A compiled
        # step always takes the mask of the whole static cache (one shape; the causal mask hides
        # the positions not written yet).
        mask, full = None, self._step is not None
        if full or not bool(prompt_mask.all()):
            length = self._cache_shape[1] if full else prefix + width + steps
            mask = torch.ones((batch, length), dtype=prompt_mask.dtype, device=self.device)
            mask[:, prefix:prefix + width] = prompt_mask  # (B, prefix + T + steps), or the cache's length
        positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0) + prefix  # (B, T), pads at prefix
        logits = self._forward(ids, mask if full or mask is None else mask[:, :prefix + width], positions, cache)
        if self.prompt_lookup is not None and batch == 1 and sampling is None:
            self._speculate(list(prompts[0]), logits, int(positions[0, -1]), cache, rows[0], budgets[0], on_token,
                            stop_strings, tokenizer)
            return rows
        pad = torch.tensor(self.pad_token_id, device=self.device)
        for step in range(steps):
            if sampling is not None:
                for warp in warpers:
                    logits = warp(None, logits)
                new = torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(1)  # (B,)
            else:
                new = logits.argmax(dim=-1)  # (B,)
            for r, token in enumerate(new.tolist()):
                if running[r]:
                    running[r] = self._advance(r, token, rows[r], budgets[r], on_token, stop_strings, tokenizer)
            if not any(running) or step == steps - 1:
                break
            alive = torch.tensor(running, device=self.device)
            new = torch.where(alive, new, pad)[:, None]  # (B, 1): finished rows are fed pad, as generate does
            positions = positions[:, -1:] + 1  # (B, 1)
            length = prefix + width + step + 1
            logits = self._forward(new, mask if full or mask is None else mask[:, :length], positions, cache,
                                   step=True)
        return rows

    def _speculate(self, context: list[int], logits: torch.Tensor, position: int, cache, row: Decoded, budget: int,
                   on_token, stop_strings, tokenizer) -> None:
        """Greedy decoding of one unpadded row after its prefill (`logits` of its last position, at
        `position`), each forward checking a prompt-lookup draft: the last token and the draft go
        through the model at once; the draft's tokens that equal the model's greedy choice before
        them are taken with the model's own token after them, and the cache forgets the rest. The
        tokens are the greedy ones up to float rounding: a several-token forward sums in another
        order than one-token steps, which can flip a tie to the last bits."""
        token = int(logits[0].argmax())
        while self._advance(0, token, row, budget, on_token, stop_strings, tokenizer):
            context.append(token)
            draft = self.prompt_lookup.draft(context, limit=budget - len(row.tokens) - 1)
            ids = torch.tensor([[token, *draft]], device=self.device)  # (1, 1 + d)
            places = torch.arange(position + 1, position + 2 + len(draft), device=self.device)[None]  # (1, 1 + d)
            choices = self._logits(ids, None, places, cache, keep=ids.shape[1])[0].argmax(-1).tolist()  # after each
            taken = 0
            while taken < len(draft) and draft[taken] == choices[taken]:
                taken += 1
            self.drafted_tokens += len(draft)
            self.accepted_tokens += taken
            cache.crop(taken - len(draft))  # forget the rejected tokens' keys and values
            for accepted in draft[:taken]:
                if not self._advance(0, accepted, row, budget, on_token, stop_strings, tokenizer):
                    return
                context.append(accepted)
            position += 1 + taken
            token = choices[taken]

    def _advance(self, r: int, token: int, row: Decoded, budget: int, on_token, stop_strings, tokenizer) -> bool:
        """Add `token` to row `r`; False once the row has ended (its finish_reason set)."""
        row.tokens.append(token)
        if on_token is not None and on_token(r, token):
            row.finish_reason = FINISH_STOP
        elif token == self.eos_token_id:
            row.finish_reason = FINISH_EOS
        elif stop_strings and _stop_string_hit(tokenizer, row.tokens, stop_strings):
            row.finish_reason = FINISH_STOP
        elif len(row.tokens) >= budget:
            row.finish_reason = FINISH_LENGTH
        else:
            return True
        return False
