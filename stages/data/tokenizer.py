"""Byte-level BPE tokenizer training, saved as a Hugging Face fast tokenizer.

Contract (docs/artifacts.md): special tokens `<pad>`=0, `<s>`=1 (bos), `</s>`=2 (eos); the
directory holds tokenizer.json, tokenizer_config.json and special_tokens_map.json and loads with
`transformers.AutoTokenizer.from_pretrained(dir)` offline.

Choices, and why:
- Byte-level: every string encodes (no unknown token) and decoding returns the exact bytes, so
  `decode(encode(x)) == x` for any text; no normaliser, no added prefix space.
- No post-processor: encoding never inserts bos/eos by itself. Callers add them explicitly
  (`stages.data.sft` puts bos before prompts, `stages.data.corpus` puts eos after documents), so
  `tok(x)` and `tok(x, add_special_tokens=False)` give the same ids and nothing is doubled.
- `clean_up_tokenization_spaces=False`: the clean-up would rewrite " ." to "." and break the
  round trip.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from stages.checkpoint.atomic import write_json

log = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # trainer assigns ids in this order: 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens


class TokenizerError(ValueError):
    """A tokenizer that cannot be trained or loaded; the message names the cause and the fix."""


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` with at most `vocab_size` tokens (fewer when the text has
    fewer distinct merges). Deterministic: the same texts in the same order give the same
    tokenizer.json."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size={vocab_size} is below {MIN_VOCAB_SIZE} (256 byte tokens + "
                             f"{len(SPECIAL_TOKENS)} special tokens); raise data.vocab_size")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # The whole byte alphabet, even bytes the corpus lacks, so any later text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:  # guards the contract against a library change
            raise TokenizerError(f"{token!r} got id {tok.token_to_id(token)}, the contract needs {expected_id}")
    log.info("trained byte-level BPE: %d tokens (asked for %d)", tok.get_vocab_size(), vocab_size)
    return _wrap(tok)


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    specials = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    # Written by hand rather than by save_pretrained: transformers 5 no longer writes
    # special_tokens_map.json and names its own backend class, which older readers lack.
    # "PreTrainedTokenizerFast" loads in transformers 4 and 5 alike.
    write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    })
    write_json(out_dir / "special_tokens_map.json", specials)
    return out_dir


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a tokenizer directory written by `save_tokenizer` (or any HF fast tokenizer dir)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path}/tokenizer.json is missing; {path} is not a tokenizer directory "
                             "(run the prepare stage to make one)")
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.bos_token_id is None or tok.eos_token_id is None or tok.pad_token_id is None:
        raise TokenizerError(f"{path}: tokenizer lacks a bos, eos or pad token (bos={tok.bos_token_id}, "
                             f"eos={tok.eos_token_id}, pad={tok.pad_token_id}); set them in "
                             "tokenizer_config.json or rerun prepare")
    return tok
