"""Shared fixtures: a tiny byte-level BPE tokenizer and a `debug`-flavour model saved in HF layout.

Both are built here, offline, once per test session (the tokenizer trains in well under a second).
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from checkpoint_fixtures import save_tiny_tokenizer
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import save_pretrained
from stages.model import build_model, config_for_flavour


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """Directory with a byte-level BPE PreTrainedTokenizerFast (~300 tokens): `<pad>`=0,
    `<s>`=1 (bos), `</s>`=2 (eos), as docs/artifacts.md specifies for data/tokenizer/."""
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


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
