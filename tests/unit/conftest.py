"""Shared fixtures: a tiny byte-level BPE tokenizer and a `debug`-flavour model saved in HF layout.

Both are built here, offline, once per test session (the tokenizer trains in well under a second).
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import save_pretrained
from stages.model import build_model, config_for_flavour

# Words the unit tests' toy data is made of, so that they become single tokens.
_CORPUS = [
    "the colour of the apple is red", "the colour of the sky is blue", "the colour of grass is green",
    "a banana is yellow and a plum is purple", "snow is white, coal is black, an orange is orange",
    "what colour is it? question answer: one two three four five six seven eight nine ten",
    "def main(argv): return 0  # Python code, numbers 0123456789",
]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """Directory with a byte-level BPE PreTrainedTokenizerFast (~300 tokens): `<pad>`=0,
    `<s>`=1 (bos), `</s>`=2 (eos), as docs/artifacts.md specifies for data/tokenizer/."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (0, 1, 2)
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def debug_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """HF-layout directory (config.json, model.safetensors, generation_config.json, tokenizer
    files) of a `debug`-flavour Llama initialised from seed 0; loads with AutoModelForCausalLM."""
    vocab_size = len(PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer_dir))
    model = build_model(config_for_flavour("debug", vocab_size=vocab_size, bos_token_id=1,
                                           eos_token_id=2, pad_token_id=0), seed=0)
    out = tmp_path_factory.mktemp("models") / "debug"
    with atomic_dir(out) as tmp:
        save_pretrained(model, tmp, tokenizer_dir=tiny_tokenizer_dir)
    return out
