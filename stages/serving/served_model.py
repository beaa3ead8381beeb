"""The model a server answers with: any directory stages.inference.loading.load_variant loads, its
tokenizer, its prompt format and its context window.

Prompts are stages.predict's, so a greedy answer here is the predictor's answer for the same
record: a chat request's messages become an SftRecord (user turns = src, assistant turns = tgt,
the system messages its system prompt) encoded by `stages.data.sft.encode_prompt`, in the format
the model was fine-tuned and evaluated with: for a model inside an experiment
(`results/<exp>/<variant>` or `results/<exp>/quant/<variant>`) the experiment's
`data/index.json` `sft_format`, as evaluate and the predict rule read it; elsewhere the tokenizer's
chat template when it has one, else the plain format (predict's `--chat-template auto` outside a
data dir). A completion's prompt is the plain format's single round ([bos] + text).
Nothing is cut: a prompt that leaves no room for one token in `max_length` is refused (400), as
is a `max_tokens` that would run past it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.data.sft import SftRecord, encode_prompt
from stages.data.sft_format import prompt_format
from stages.errors import InputError
from stages.inference.generation import pad_or_eos
from stages.inference.loading import load_variant
from stages.serving.openai_api import Request, RequestError

log = logging.getLogger(__name__)

_NO_CUT = 1 << 30  # encode_prompt's src_length when nothing may be cut


@dataclass
class ServedModel:
    model: torch.nn.Module
    tokenizer: Any
    kind: str  # load_variant's: "hf", "adapter" or "quantized"
    model_id: str  # the name /v1/models lists and requests must give
    chat: bool  # prompts through the tokenizer's chat template
    max_length: int  # prompt + answer tokens
    created: int  # when it was loaded (the model list's `created`)

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return pad_or_eos(self.tokenizer)

    def prompt_ids(self, request: Request) -> list[int]:
        """The ids the answer continues; RequestError (400) when the context cannot hold them."""
        if request.endpoint == "chat":
            system = "\n".join(text for role, text in request.messages if role == "system") or None
            turns = [text for role, text in request.messages if role != "system"]
            record = SftRecord(src=turns[0::2], tgt=turns[1::2] + [""], system=system)
            ids = encode_prompt(self.tokenizer, record, _NO_CUT, self.chat)
        else:
            ids = encode_prompt(self.tokenizer, SftRecord(src=[request.prompt], tgt=[""]), _NO_CUT, False)
        if not ids:
            raise RequestError(400, "the prompt encodes to no tokens (empty text and the tokenizer has no bos token)",
                               "messages" if request.endpoint == "chat" else "prompt")
        if len(ids) >= self.max_length:
            raise RequestError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.max_length} "
                                    "tokens (prompt + answer), so no token is left for the answer: shorten it",
                               "messages" if request.endpoint == "chat" else "prompt")
        return ids

    def answer_budget(self, request: Request, prompt_tokens: int) -> int:
        """max_tokens, or the rest of the context; RequestError (400) when max_tokens does not fit."""
        room = self.max_length - prompt_tokens
        if request.max_tokens is None:
            return room
        if request.max_tokens > room:
            raise RequestError(400, f"max_tokens={request.max_tokens} with a prompt of {prompt_tokens} tokens exceeds "
                                    f"this model's context of {self.max_length} tokens; ask for at most {room}",
                               "max_tokens")
        return request.max_tokens


def experiment_data_dir(model_dir: Path) -> Path | None:
    """The prepared data dir of the experiment `model_dir` belongs to (results/<exp>/data beside
    results/<exp>/<variant> or results/<exp>/quant/<variant>), if there is one."""
    for exp in (model_dir.parent, model_dir.parent.parent):
        if (exp / "data" / "index.json").is_file():
            return exp / "data"
    return None


def chat_format(choice: str, tokenizer, model_dir: Path) -> bool:
    """Whether chat requests use the tokenizer's chat template: predict's rule, with the data dir
    of the experiment the model lies in."""
    return prompt_format(choice, tokenizer, model_dir, experiment_data_dir(model_dir))


def load_served_model(model_dir: str | Path, *, model_id: str | None = None, chat_template: str = "auto",
                      max_length: int | None = None, base_model: torch.nn.Module | None = None) -> ServedModel:
    """Load `model_dir` (full, adapter or quantized) for serving. `chat_template`: auto (the
    experiment's sft_format, else the tokenizer's template when it has one), true or false.
    `max_length` defaults to the model's max_position_embeddings. `base_model`: an adapter's base,
    already loaded (stages.serving.shared_bases shares one copy of its weights among adapters)."""
    model_dir = Path(model_dir)
    model, tokenizer, kind = load_variant(model_dir, base_model=base_model)
    chat = chat_format(chat_template, tokenizer, model_dir)
    config = getattr(model, "config", None)
    window = getattr(config, "max_position_embeddings", None)
    if max_length is None:
        if window is None:
            raise InputError(f"{model_dir}: config.json has no max_position_embeddings; pass --max-length")
        max_length = int(window)
    elif window is not None and max_length > window:
        log.warning("--max-length %d exceeds the model's max_position_embeddings=%d", max_length, window)
    if max_length < 2:
        raise InputError(f"--max-length {max_length} must be at least 2 (one prompt token and one answer token)")
    log.info("serving %s (%s, %s prompts, context %d tokens)", model_dir, kind,
             "chat-template" if chat else "plain", max_length)
    return ServedModel(model=model, tokenizer=tokenizer, kind=kind, model_id=model_id or model_dir.resolve().name,
                       chat=chat, max_length=max_length, created=int(time.time()))
