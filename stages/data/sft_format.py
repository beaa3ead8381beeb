"""The chat-template decision: whether SFT records and prompts are rendered with the tokenizer's
chat template ("chat_template") or as plain bos + src ("plain").

prepare decides it once per data dir (`stages.data.sft.uses_chat_template`: `data.chat_template`
and a tokenizer that has a template) and records it as index.json's `sft_format`. Everything that
reads that data afterwards follows the record, after checking that its model's tokenizer is the
data's (`data_chat_format`): finetune trains in it, evaluate scores in it, GPTQ calibration encodes
its SFT windows in it. A directory without index.json (not written by prepare) is read plain.

Prompts of a model outside the pipeline's data (predict's `--chat-template`, the server's
`chat_template`) take `prompt_format`: true or false as asked, else (auto) the prepared data's
record when there is such a data dir, else the tokenizer's template when it has one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stages.data.corpus import INDEX_NAME, read_index
from stages.data.sft import uses_chat_template
from stages.data.tokenizer import check_same_tokenizer
from stages.errors import InputError

log = logging.getLogger(__name__)

CHAT_TEMPLATE, PLAIN = "chat_template", "plain"  # the values of index.json's `sft_format`


def format_name(chat: bool) -> str:
    """The `sft_format` value that records `chat` (index.json, evaluate's and predict's JSON)."""
    return CHAT_TEMPLATE if chat else PLAIN


def recorded_chat_format(index: Mapping[str, Any]) -> bool:
    """Whether prepare rendered this data with the chat template (index.json's `sft_format`)."""
    return index.get("sft_format") == CHAT_TEMPLATE


def data_chat_format(tokenizer, model_dir: str | os.PathLike, data_dir: str | os.PathLike | None) -> bool:
    """Whether SFT records of `data_dir` are rendered with the chat template, as prepare decided
    (index.json's `sft_format`); first checks that `tokenizer` (the model's, from `model_dir`) is the
    data's. Plain without a data dir, or for one without index.json (not written by prepare)."""
    if data_dir is None:
        return False
    if not (Path(data_dir) / INDEX_NAME).is_file():
        log.warning("%s has no index.json (not written by prepare): plain SFT format, tokenizer not checked", data_dir)
        return False
    index = read_index(data_dir)
    check_same_tokenizer(tokenizer, model_dir, index, data_dir)
    chat = recorded_chat_format(index)
    log.info("SFT format: %s", "the tokenizer's chat template" if chat else "plain (bos src tgt eos)")
    return chat


def prompt_format(choice: str, tokenizer, model_dir: str | os.PathLike, data_dir: Path | None) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template: `choice` true or false as
    asked; auto: the sft_format prepare recorded in `data_dir` (`data_chat_format`, as evaluate and
    finetune follow it) when there is such a data dir, else whether the tokenizer has a template.
    The predictor and the server (stages.serving.served_model) both decide here."""
    has_template = uses_chat_template(tokenizer, True)
    if choice == "false":
        return False
    if choice == "true":
        if not has_template:
            raise InputError(f"--chat-template true but the tokenizer in {model_dir} has no chat template; "
                             "use --chat-template false (plain bos + text prompts)")
        return True
    if data_dir is None:
        return has_template
    return data_chat_format(tokenizer, model_dir, data_dir)
