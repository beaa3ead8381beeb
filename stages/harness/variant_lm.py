"""Any variant evaluate loads, as an lm-evaluation-harness model: `VariantLM(model, tokenizer)`.

`model` is what `stages.inference.loading.load_variant` gives: a transformers causal LM in fp32, a
peft model holding a LoRA or prefix adapter, a model with stages.quant's low-bit kernels, or an
ONNX export on onnxruntime (`OnnxCausalLM`). lm-eval's own HF backend (`lm_eval.models.huggingface.HFLM`)
loads checkpoints itself and cannot take those; this class scores with the model already loaded.

What it computes is HFLM's, so the two agree on the same checkpoint (tests/unit/test_lm_eval.py):
  * tokens: `tok_encode` as HFLM's (the tokenizer's own special tokens, or `add_bos_token` when
    given; a string that already starts with the bos text gets no second one), the empty-context
    prefix the bos (else the eos), the context length from the config's `n_positions` /
    `max_position_embeddings` / `n_ctx` (lm-eval's `resolve_max_length`);
  * loglikelihood: (context + continuation) cut to the last max_length + 1 tokens, one
    right-padded forward per batch (longest first), log-softmax in float32, the continuation's
    log-probs summed, and whether each continuation token is the argmax;
  * loglikelihood_rolling: lm-eval's disjoint rolling windows, each scored as above, summed;
  * generate_until: contexts cut from the left to max_length - max_gen_toks, then greedy (or,
    with `do_sample`, seeded sampling on the decode engine) for at most max_gen_toks tokens; the
    engine stops a row at eos or a stop string, and the text is cut at the first stop string as
    HFLM cuts it. An ONNX model generates on its own greedy loop and is cut the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)

from stages.inference.engine import DecodeEngine, Sampling, unsupported
from stages.inference.generation import generate_greedy, pad_or_eos

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's max_gen_toks when a task names none
SAMPLING_SEED = 1234  # the generator of sampled generations (lm-eval's default random_seed)


class VariantLM(TemplateLM):
    """A loaded variant as an lm-eval `TemplateLM` (see the module docstring). `batch_size`:
    sequences per forward; `add_bos_token`: HFLM's argument of that name, passed to the tokenizer
    as `add_special_tokens` (None: the tokenizer's default, which for our tokenizers puts the bos
    in front); `max_length`: the context (default: from the model's config)."""

    def __init__(self, model, tokenizer, *, batch_size: int = 8, add_bos_token: bool | None = None,
                 max_length: int | None = None):
        super().__init__()
        if tokenizer.eos_token_id is None:
            raise ValueError("lm-eval needs a tokenizer with an eos token (its end-of-text); this one has none")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.add_bos_token = add_bos_token
        # an ONNX model names its device; reading its parameters would load every initializer
        self._device = getattr(model, "device", None) or next(iter(model.parameters())).device
        self._max_length = max_length or resolve_max_length(getattr(model, "config", None), tokenizer)

    # -- what lm-eval asks of a model --------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "").replace("/", "__")

    def _special_tokens(self, add_special_tokens: bool | None, text: str) -> dict[str, bool]:
        if add_special_tokens is not None:
            return {"add_special_tokens": add_special_tokens}
        if has_bos_prefix(text, self.tokenizer.decode(self.prefix_token_id)):
            return {"add_special_tokens": False}
        return {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string, **self._special_tokens(add_special_tokens, string))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # -- scoring -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probs, every continuation token the argmax) per request
        ((context, continuation), context ids, continuation ids), in the requests' order."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            inputs, continuations = [], []
            for i in rows:
                _, context, continuation = requests[i]
                if not context or not continuation:
                    raise ValueError("lm-eval gave a request with an empty context or continuation")
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
                continuations.append(continuation)
            for i, scored in zip(rows, self._score(inputs, continuations)):
                results[i] = scored
        return results

    def _score(self, inputs: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """One right-padded forward of `inputs`; each row's last len(continuation) positions scored."""
        width = max(len(x) for x in inputs)
        ids = torch.full((len(inputs), width), pad_or_eos(self.tokenizer), dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for r, x in enumerate(inputs):
            ids[r, :len(x)], mask[r, :len(x)] = torch.tensor(x), 1
        logits = self.model(input_ids=ids.to(self._device), attention_mask=mask.to(self._device)).logits  # (B, T', V)
        offset = logits.shape[1] - width  # virtual tokens a prompt-learning adapter puts in front
        logprobs = F.log_softmax(logits.float(), dim=-1)  # (B, T', V)
        out = []
        for r, (x, cont) in enumerate(zip(inputs, continuations)):
            end = offset + len(x)
            rows = logprobs[r, end - len(cont):end]  # (C, V): position t predicts token t + 1
            target = torch.tensor(cont, device=rows.device)
            out.append((float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each whole string's log-likelihood: lm-eval's disjoint windows of max_length tokens, the
        first conditioned on the prefix token."""
        totals = []
        for (string,) in (req.args for req in requests):
            windows = [(None, *lm_utils.make_disjoint_window(w)) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            totals.append(sum(score for score, _ in self._loglikelihood_tokens(windows)))
        return totals

    # -- generation --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each request's (context, gen_kwargs) continued, requests with equal kwargs together."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str] = [""] * len(requests)
        eos_text = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        for indices in groups.values():
            settings = normalize_gen_kwargs(requests[indices[0]].args[1], DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(settings.pop("until", None), eos=eos_text)
            max_gen_toks = settings.pop("max_gen_toks")
            if self.max_length <= max_gen_toks:
                raise ValueError(f"a task asks for max_gen_toks={max_gen_toks} new tokens, but the model's context "
                                 f"is {self.max_length} tokens; lower the task's generation_kwargs.max_gen_toks")
            prompts = [self.tok_encode(requests[i].args[0], left_truncate_len=self.max_length - max_gen_toks)
                       for i in indices]
            tokens = self._generate(prompts, max_gen_toks, until, settings)
            for i, t in zip(indices, tokens):
                text = self.tokenizer.decode(t, skip_special_tokens=True)
                out[i] = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
        return out

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, until: Sequence[str],
                  settings: dict[str, Any]) -> list[list[int]]:
        eos, pad = self.eot_token_id, pad_or_eos(self.tokenizer)
        if not settings.get("do_sample"):
            return generate_greedy(self.model, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                   pad_token_id=pad, batch_size=self.batch_size, stop_strings=until,
                                   tokenizer=self.tokenizer)
        reason = unsupported(self.model)
        if reason is not None:
            raise ValueError(f"a task samples (do_sample: true), which this variant's runtime does not: {reason}; "
                             "use a greedy task or a torch variant")
        engine = DecodeEngine(self.model, eos_token_id=eos, pad_token_id=pad)
        sampling = Sampling(temperature=float(settings.get("temperature") or 1.0),
                            top_k=int(settings.get("top_k") or 0), top_p=float(settings.get("top_p") or 1.0))
        generator = torch.Generator(self._device).manual_seed(SAMPLING_SEED)
        tokens = []
        for start in range(0, len(prompts), self.batch_size):
            batch = prompts[start:start + self.batch_size]
            tokens += [d.tokens for d in engine.generate(batch, max_new_tokens, sampling=sampling, generator=generator,
                                                         stop_strings=until, tokenizer=self.tokenizer)]
        return tokens
