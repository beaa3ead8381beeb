"""Byte-level BPE tokenizer training, saved as a Hugging Face fast tokenizer.

Contract (docs/artifacts.md): special tokens `<pad>`=0, `<s>`=1 (bos), `</s>`=2 (eos); the
directory holds tokenizer.json, tokenizer_config.json and special_tokens_map.json and loads with
`transformers.AutoTokenizer.from_pretrained(dir)` offline.

Choices, and why:
- Byte-level: every string encodes (no unknown token) and decoding returns the exact bytes, so
  `decode(encode(x)) == x` for any text; no normaliser, no added prefix space.
- Encoding with special tokens puts bos in front, as the plain training format does
  (`[bos] src tgt [eos]`, `stages.data.sft`): `tok(src)` gives the ids the model was trained to
  answer, for anyone who loads the shipped files (transformers; llama.cpp through GGUF's
  `add_bos_token`; onnxruntime-genai, whose `encode` adds special tokens only when asked). A
  post-processor in tokenizer.json does it (transformers 5 reads `add_bos_token` in
  tokenizer_config.json for its Llama classes only; it is written too, for readers that go by
  it). The stages encode with `add_special_tokens=False` and place bos/eos themselves
  (`stages.data.corpus` puts eos after documents), so nothing is doubled.
- `clean_up_tokenization_spaces=False`: the clean-up would rewrite " ." to "." and break the
  round trip.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from stages.checkpoint.atomic import write_json
from stages.errors import InputError
from stages.stage_logs import progress_iter

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built or loaded: ~0.9 s that a
    from transformers import PreTrainedTokenizerFast  # training rank which never loads one does not pay

log = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # trainer assigns ids in this order: 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens


class TokenizerError(InputError):
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
    if isinstance(texts, Collection):  # what the trainer has read; counting its merges has no hook
        texts = progress_iter(texts, log, "tokenizer training texts read")
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer)
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:  # guards the contract against a library change
            raise TokenizerError(f"{token!r} got id {tok.token_to_id(token)}, the contract needs {expected_id}")
    log.info("trained byte-level BPE: %d tokens (asked for %d) in %.1f s", tok.get_vocab_size(), vocab_size,
             time.perf_counter() - start)
    tok.post_processor = bos_post_processor()
    return _wrap(tok)


def bos_post_processor() -> processors.TemplateProcessing:
    """[bos] before the text (and before the first of a pair): the plain format's prompt."""
    bos_id = SPECIAL_TOKENS.index(BOS_TOKEN)
    return processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B:1",
                                         special_tokens=[(BOS_TOKEN, bos_id)])


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str | os.PathLike) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`
    (a tokenizer of `train_tokenizer`: encoding with special tokens adds bos)."""
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
        "add_bos_token": True,  # what the post-processor in tokenizer.json does
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.bos_token_id is None or tok.eos_token_id is None or tok.pad_token_id is None:
        raise TokenizerError(f"{path}: tokenizer lacks a bos, eos or pad token (bos={tok.bos_token_id}, "
                             f"eos={tok.eos_token_id}, pad={tok.pad_token_id}); set them in "
                             "tokenizer_config.json or rerun prepare")
    return tok


# -- a checkpoint's own tokenizer ----------------------------------------------------------------
# (its files are carried from artifact to artifact by stages.checkpoint.hf.copy_tokenizer)

def load_model_tokenizer(model_dir: str | os.PathLike):
    """The tokenizer a checkpoint ships (local files only, never remote code); TokenizerError naming
    the directory when it has none or it lacks an eos token (generation could not stop)."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise TokenizerError(f"{model_dir} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); "
                             "save the checkpoint's tokenizer beside it with tokenizer.save_pretrained(dir)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False,
                                        **_files_decide(model_dir))
    if tok.eos_token_id is None:
        raise TokenizerError(f"{model_dir}: the tokenizer has no eos token; set eos_token in tokenizer_config.json")
    return tok


def _files_decide(model_dir: Path) -> dict:
    """Keyword arguments that make a generic tokenizer load the same from any directory: transformers
    5 picks the tokenizer class from config.json when one lies beside it (a Qwen2 model dir gives
    Qwen2Tokenizer, which adds `<|endoftext|>`), but not from an adapter dir without config.json,
    so one tokenizer's files would load as two vocabularies. A tokenizer_config.json that names the
    generic class therefore loads with an empty model config."""
    import json

    from transformers import PretrainedConfig

    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    declared = json.loads(path.read_text(encoding="utf-8")).get("tokenizer_class")
    return {"config": PretrainedConfig()} if declared in ("PreTrainedTokenizerFast", "TokenizersBackend") else {}


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map (special and added tokens included): two tokenizers with the
    same fingerprint give every text the same ids, whatever files they were saved as."""
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()


def check_same_tokenizer(tokenizer, model_dir: str | os.PathLike, index: dict, data_dir: str | os.PathLike) -> None:
    """Raise TokenizerError when `tokenizer` (loaded from `model_dir`) is not the one `data_dir` was
    tokenized with (index.json's `tokenizer_fingerprint`): the ids would mean other tokens. Data
    written before fingerprints were recorded is compared by vocabulary size only."""
    want = index.get("tokenizer_fingerprint")
    got = tokenizer_fingerprint(tokenizer)
    if want is None:
        if len(tokenizer) != index.get("vocab_size", len(tokenizer)):
            raise TokenizerError(f"tokenizer mismatch: {model_dir} has {len(tokenizer)} tokens but {data_dir} was "
                                 f"tokenized with {index['vocab_size']}; rerun prepare for this model")
        return
    if got != want:
        raise TokenizerError(
            f"tokenizer mismatch: {model_dir} carries tokenizer {got[:12]} ({len(tokenizer)} tokens) but {data_dir} "
            f"was tokenized with tokenizer {want[:12]} ({index.get('vocab_size')} tokens, from "
            f"{index.get('tokenizer_source', 'prepare')}); evaluate and fine-tune a model on data prepared with "
            "its own tokenizer (rerun prepare, or point model.model_name_or_path at this model)")


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else eos: padded positions are masked out, so any id serves."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return value
    raise InputError("the tokenizer has neither a pad nor an eos token; set pad_token in tokenizer_config.json")
