"""The tokenizer files a checkpoint directory carries (torch-free: data preparation uses it too)."""

from __future__ import annotations

import shutil
from pathlib import Path

# Files a Hugging Face tokenizer directory may hold; all that exist are carried from artifact to
# artifact byte for byte (the chat template lives in tokenizer_config.json or chat_template.jinja).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def copy_tokenizer(src: str | Path, dst: str | Path) -> list[str]:
    """Copy every tokenizer file of `src` that exists into `dst` (created); returns the names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    return copied
