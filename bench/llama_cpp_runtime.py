"""llama.cpp itself, as the tests and benchmarks drive it: open a GGUF file, tokenize text as
llama.cpp's users do, feed tokens through its KV cache and read the logits after the last one.

Two Python bindings carry a llama.cpp build, and whichever is installed is used:
- llama-cpp-python (`import llama_cpp`), the one users know; PyPI has only its source, a C++ build
  of 12 minutes of CPU on 2 cores (bench/README.md);
- llama-cpp-cffi 0.3.1 (`import llama.llama_cpp`), a prebuilt wheel of llama.cpp's C library
  (CPU build, AVX2, late 2024), which `make test` installs for the tests; its newer wheels link
  GCC 14's libstdc++ and do not load on Debian 12. Through it we call llama.cpp's C API:
  llama_tokenize, llama_decode on llama_batch_get_one, llama_get_logits_ith.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

GGML_TYPE_F32 = 0  # ggml_type: an f32 KV cache, so that f32 files compare with torch at 1e-4


class LlamaCppUnavailable(ImportError):
    """Neither binding is installed."""


def binding() -> str:
    """The binding that `open_gguf` will use: "llama-cpp-python" or "llama-cpp-cffi"."""
    try:
        import llama_cpp  # noqa: F401

        return "llama-cpp-python"
    except ImportError:
        pass
    try:
        os.environ.setdefault("LLAMA_CPP_BACKEND", "cpu")
        from llama.llama_cpp import lib  # noqa: F401

        return "llama-cpp-cffi"
    except ImportError as err:
        raise LlamaCppUnavailable("neither llama-cpp-python nor llama-cpp-cffi is installed") from err


class LlamaCpp:
    """One model and one context. `tokenize(text)` adds the bos when the file says so (as
    `llama-cli` and llama-cpp-python's `Llama.tokenize` do); `logits(tokens)` appends tokens to the
    cache and returns the logits after the last one; `reset()` empties the cache."""

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        raise NotImplementedError

    def logits(self, tokens: list[int]) -> np.ndarray:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """(n greedy tokens after `prompt`, the logits after the prompt), from an empty cache."""
        self.reset()
        first = self.logits(prompt)
        tokens = [int(first.argmax())]
        while len(tokens) < n:
            tokens.append(int(self.logits(tokens[-1:]).argmax()))
        return tokens, first


class _Python(LlamaCpp):
    def __init__(self, path: Path, n_ctx: int, threads: int, f32_cache: bool, vocab_only: bool):
        import llama_cpp

        cache = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_cache else {}
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   logits_all=True, verbose=False, vocab_only=vocab_only, **cache)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=add_bos, special=special)

    def logits(self, tokens: list[int]) -> np.ndarray:
        self.llm.eval(tokens)
        return np.array(self.llm.scores[self.llm.n_tokens - 1])

    def reset(self) -> None:
        self.llm.reset()


class _Cffi(LlamaCpp):
    def __init__(self, path: Path, n_ctx: int, threads: int, f32_cache: bool, vocab_only: bool):
        from llama.llama_cpp import ffi, lib

        self.ffi, self.lib = ffi, lib
        lib.llama_backend_init()
        lib.llama_log_set(_quiet_log(ffi), ffi.NULL)
        params = lib.llama_model_default_params()
        params.vocab_only = vocab_only
        self.model = lib.llama_load_model_from_file(str(path).encode(), params)
        if self.model == ffi.NULL:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lib.llama_n_vocab(self.model)
        self.ctx = ffi.NULL
        if not vocab_only:
            cparams = lib.llama_context_default_params()
            cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = n_ctx
            cparams.n_threads = cparams.n_threads_batch = threads
            if f32_cache:
                cparams.type_k = cparams.type_v = GGML_TYPE_F32
            self.ctx = lib.llama_new_context_with_model(self.model, cparams)
            if self.ctx == ffi.NULL:
                raise RuntimeError(f"llama.cpp could not make a context for {path}")

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        data = text.encode()
        size = len(data) + 8
        buf = self.ffi.new("int32_t[]", size)
        n = self.lib.llama_tokenize(self.model, data, len(data), buf, size, add_bos, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens for {text!r}")
        return [buf[i] for i in range(n)]

    def logits(self, tokens: list[int]) -> np.ndarray:
        buf = self.ffi.new("int32_t[]", tokens)
        if self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(buf, len(tokens))) != 0:
            raise RuntimeError(f"llama_decode failed on {len(tokens)} tokens")
        row = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.frombuffer(self.ffi.buffer(row, self.n_vocab * 4), dtype=np.float32).copy()

    def reset(self) -> None:
        self.lib.llama_kv_cache_clear(self.ctx)

    def __del__(self):
        if getattr(self, "ctx", self.ffi.NULL) != self.ffi.NULL:
            self.lib.llama_free(self.ctx)
        if getattr(self, "model", self.ffi.NULL) != self.ffi.NULL:
            self.lib.llama_free_model(self.model)


_LOG_CALLBACK = None


def _quiet_log(ffi):
    """llama.cpp's log callback that drops its messages (it prints every tensor it loads)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = ffi.callback("void(enum ggml_log_level, char *, void *)", lambda level, text, data: None)
    return _LOG_CALLBACK


def installed() -> bool:
    """Whether a binding is installed."""
    try:
        binding()
    except LlamaCppUnavailable:
        return False
    return True


def open_gguf(path: Path, n_ctx: int = 128, threads: int = 2, f32_cache: bool = False,
              vocab_only: bool = False) -> LlamaCpp:
    """`path` in llama.cpp through the installed binding (LlamaCppUnavailable without one)."""
    kind = {"llama-cpp-python": _Python, "llama-cpp-cffi": _Cffi}[binding()]
    return kind(Path(path), n_ctx, threads, f32_cache, vocab_only)
