"""A checkpoint's tokenizer as GGUF metadata: llama.cpp's `tokenizer.ggml.*` keys for byte-level BPE.

Contract: `gguf_tokenizer(model_dir, vocab_size)` reads `model_dir/tokenizer.json` (and the
tokenizer_config.json beside it, through transformers) and returns a `GGUFTokenizer` whose
`write(writer)` adds tokenizer.ggml.model "gpt2", tokenizer.ggml.pre, tokens, token_type, merges,
the bos/eos/pad ids, add_bos/add_eos and the chat template. Anything GGUF cannot describe raises
`GGUFTokenizerError` naming tokenizer.json and the reason; nothing is approximated.

Why the pre-tokenizer is matched, not copied: GGUF stores no regex. llama.cpp picks its split from
the name in `tokenizer.ggml.pre` (llama-vocab.cpp), so the writer must find the name whose regexes
equal the tokenizer's. `PRE_TOKENIZERS` lists the names we recognise, each with the split as a
tokenizer.json spells it (Hugging Face's spelling, not llama.cpp's rewritten one). llama.cpp's own
converter identifies tokenizers by hashing the ids of a test string, which only knows published
vocabularies; ours are trained here, so the pre-tokenizer's structure is compared instead:

- `gpt-2`: `ByteLevel(use_regex=True)` alone, which is our trained tokenizer (stages.data.tokenizer)
  and GPT-2's. (The name is "gpt-2"; llama.cpp's "default" is a different, four-regex split.)
- `smollm`: each numeral isolated (`Digits(individual_digits=True)`, or `Split(\\p{N})` as
  stages.checkpoint.gguf writes it), then GPT-2's split: SmolLM / SmolLM2.
- `qwen2`, `llama-bpe`: Qwen2's and Llama 3's single `Split` regex.

Scope: byte-level BPE only (tokenizer.ggml.model "gpt2"). SentencePiece-style vocabularies (BPE
with byte_fallback or a Metaspace pre-tokenizer: Llama 2, Mistral 7B; GGUF model "llama") and
Unigram / WordPiece / WordLevel models are refused by name, as are normalizers other than NFC
(llama.cpp normalizes nothing; NFC is Qwen2's, which llama.cpp's own converter keeps too).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.errors import InputError

log = logging.getLogger(__name__)

# GPT-2's split as tokenizers' ByteLevel(use_regex=True) applies it, and the same without the last
# alternative (stages.checkpoint.gguf writes it so): a whitespace character left unmatched becomes a
# piece of its own under "isolated" splitting either way, so both spellings split alike.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_GPT2_SPLITS = (GPT2_SPLIT, GPT2_SPLIT.removesuffix(r"|\s+"))
DIGIT_SPLIT = r"\p{N}"
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's `tokenizer.ggml.pre` name -> the regexes it splits with, in order (HF spelling).
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt-2": (GPT2_SPLIT,),
    "smollm": (DIGIT_SPLIT, GPT2_SPLIT),
    "qwen2": (QWEN2_SPLIT,),
    "llama-bpe": (LLAMA3_SPLIT,),
}
ALLOWED_NORMALIZERS = (None, "NFC")

# llama.cpp's token types (gguf.TokenType): written as plain ints so this module needs no gguf import.
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


class GGUFTokenizerError(InputError):
    """A tokenizer GGUF cannot describe; the message names tokenizer.json and the reason."""


@dataclass
class GGUFTokenizer:
    """What the writer puts under tokenizer.ggml.* (lists indexed by token id)."""

    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", best first
    special_ids: dict[str, int] = field(default_factory=dict)  # "bos"/"eos"/"pad"/"unk" -> id
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    def write(self, writer: Any) -> None:
        """Add the tokenizer keys to a `gguf.GGUFWriter`."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        writer.add_token_merges(self.merges)
        adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
                  "pad": writer.add_pad_token_id, "unk": writer.add_unk_token_id}
        for name, token_id in self.special_ids.items():
            adders[name](token_id)
        writer.add_add_bos_token(self.add_bos)
        writer.add_add_eos_token(self.add_eos)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def _flatten(pre: dict[str, Any] | None) -> list[dict[str, Any]]:
    if pre is None:
        return []
    if pre.get("type") == "Sequence":
        return [step for p in pre["pretokenizers"] for step in _flatten(p)]
    return [pre]


def _split_regexes(pre: dict[str, Any] | None) -> tuple[str, ...] | str:
    """The regexes a byte-level pre-tokenizer splits with, in order, or why it is not one llama.cpp
    can apply (a string)."""
    steps = _flatten(pre)
    if not steps or steps[-1].get("type") != "ByteLevel":
        return "byte-level BPE needs a ByteLevel pre-tokenizer last; found " + json.dumps(pre)
    *splits, byte_level = steps
    if byte_level.get("add_prefix_space"):
        return "ByteLevel(add_prefix_space=true) adds a space llama.cpp does not add"
    regexes: list[str] = []
    for step in splits:
        kind = step.get("type")
        if kind == "Digits" and step.get("individual_digits"):
            regexes.append(DIGIT_SPLIT)
        elif (kind == "Split" and "Regex" in step.get("pattern", {}) and step.get("behavior") == "Isolated"
              and not step.get("invert")):
            regexes.append(step["pattern"]["Regex"])
        else:
            return f"pre-tokenizer step {json.dumps(step)} has no llama.cpp equivalent"
    if byte_level.get("use_regex", True):
        regexes.append(GPT2_SPLIT)
    return tuple(GPT2_SPLIT if r in _GPT2_SPLITS else r for r in regexes)


def pre_tokenizer_name(pre: dict[str, Any] | None) -> tuple[str | None, str]:
    """(llama.cpp's `tokenizer.ggml.pre` name, "") for a tokenizer.json pre_tokenizer, or (None, why)."""
    regexes = _split_regexes(pre)
    if isinstance(regexes, str):
        return None, regexes
    for name, known in PRE_TOKENIZERS.items():
        if regexes == known:
            return name, ""
    return None, (f"its split regexes {list(regexes)} match none of llama.cpp's pre-tokenizers this writer "
                  f"knows ({', '.join(PRE_TOKENIZERS)}); llama.cpp would split text differently")


def _check_model(spec: dict[str, Any], path: Path) -> None:
    model = spec.get("model") or {}
    kind = model.get("type")
    if kind != "BPE":
        raise GGUFTokenizerError(f"{path}: a {kind} tokenizer model; this writer writes byte-level BPE "
                                 "(GGUF tokenizer model 'gpt2') only")
    pre_steps = [s.get("type") for s in _flatten(spec.get("pre_tokenizer"))]
    if model.get("byte_fallback") or "Metaspace" in pre_steps:
        raise GGUFTokenizerError(f"{path}: a SentencePiece-style BPE (byte_fallback / Metaspace, as Llama 2 and "
                                 "Mistral 7B ship); GGUF describes it as tokenizer model 'llama' with scores, "
                                 "which this writer does not write (byte-level BPE only)")
    normalizer = (spec.get("normalizer") or {}).get("type")
    if normalizer not in ALLOWED_NORMALIZERS:
        raise GGUFTokenizerError(f"{path}: normalizer {normalizer!r}; llama.cpp applies no normalizer, so "
                                 f"token ids would differ (accepted: none, or NFC)")
    if normalizer == "NFC":
        log.warning("%s: NFC normalizer dropped; llama.cpp does not normalize (NFC text tokenizes alike)", path)
    decoder = [s.get("type") for s in _flatten(spec.get("decoder"))] if spec.get("decoder") else []
    if decoder and decoder != ["ByteLevel"]:
        log.warning("%s: decoder %s replaced by llama.cpp's byte-level decoding", path, decoder)


def _merges(spec: dict[str, Any], path: Path) -> list[str]:
    merges = []
    for merge in spec["model"].get("merges", []):
        pair = merge.split(" ") if isinstance(merge, str) else list(merge)
        if len(pair) != 2 or any(" " in part for part in pair):
            raise GGUFTokenizerError(f"{path}: merge {merge!r} contains a space; GGUF stores merges as "
                                     "'left right' strings and cannot describe it")
        merges.append(" ".join(pair))
    return merges


def _vocabulary(spec: dict[str, Any], vocab_size: int, path: Path) -> tuple[list[str], list[int]]:
    """Tokens and llama.cpp token types by id, padded to the model's `vocab_size` rows with unused
    `[PAD{id}]` tokens (as llama.cpp's converter does: the embedding must have one row per token)."""
    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    if max(by_id) >= vocab_size:
        raise GGUFTokenizerError(f"{path}: token id {max(by_id)} is beyond the model's vocab_size={vocab_size} "
                                 "embedding rows; the tokenizer does not belong to this model")
    entries = [by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(vocab_size)]
    tokens = [t for t, _ in entries]
    if len(set(tokens)) != len(tokens):
        raise GGUFTokenizerError(f"{path}: a token string appears under two ids; GGUF maps strings to one id")
    return tokens, [k for _, k in entries]


def _special_flags(tokenizer: Any, path: Path) -> tuple[bool, bool]:
    """(add_bos, add_eos): whether encoding with special tokens wraps the text in bos / eos. Any
    other template (e.g. a prefix that is not bos) has no GGUF key and is refused."""
    text = "a b"
    bare = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer(text, add_special_tokens=True)["input_ids"]
    add_bos = tokenizer.bos_token_id is not None and full[:1] == [tokenizer.bos_token_id] != bare[:1]
    add_eos = tokenizer.eos_token_id is not None and full[-1:] == [tokenizer.eos_token_id] != bare[-1:]
    if full[int(add_bos):len(full) - int(add_eos)] != bare:
        raise GGUFTokenizerError(f"{path}: the post-processor adds tokens other than bos/eos ({full} against "
                                 f"{bare} for {text!r}); GGUF can only say add_bos_token / add_eos_token")
    return add_bos, add_eos


def gguf_tokenizer(model_dir: str | Path, vocab_size: int) -> GGUFTokenizer:
    """The tokenizer of `model_dir` in GGUF's terms, for a model with `vocab_size` embedding rows."""
    from stages.data.tokenizer import load_model_tokenizer  # tokenizers: this module is read without it

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        other = [n for n in ("tokenizer.model", "vocab.json") if (path.parent / n).is_file()]
        raise GGUFTokenizerError(f"{path} is missing" + (f" (the directory has {other[0]}, a slow tokenizer)"
                                 if other else "") + "; the GGUF writer reads byte-level BPE from tokenizer.json")
    spec = json.loads(path.read_text(encoding="utf-8"))
    _check_model(spec, path)
    pre, why = pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        raise GGUFTokenizerError(f"{path}: llama.cpp cannot reproduce this pre-tokenizer: {why}")
    tokens, token_types = _vocabulary(spec, vocab_size, path)
    tokenizer = load_model_tokenizer(model_dir)
    add_bos, add_eos = _special_flags(tokenizer, path)
    special_ids = {name: getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: llama.cpp reads the default one
        template = template.get("default")
    return GGUFTokenizer(pre=pre, tokens=tokens, token_types=token_types, merges=_merges(spec, path),
                         special_ids={k: v for k, v in special_ids.items() if v is not None},
                         add_bos=add_bos, add_eos=add_eos, chat_template=template)
