"""gptqmodel and optimum's GPTQ module imported once per test process, leaving it as it was."""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings

import pytest


def import_gptq_runtimes():
    """gptqmodel (skipping the calling module without it) and, if installed, optimum's GPTQ module,
    imported leaving the process as it was. gptqmodel's import sets HF_HOME, HF_HUB_CACHE,
    TRANSFORMERS_CACHE, HF_MODULES_CACHE, TORCHINDUCTOR_CACHE_DIR, PYTORCH_ALLOC_CONF,
    CUDA_DEVICE_ORDER and KMP_DUPLICATE_LIB_OK in os.environ, adds a root logging handler at INFO
    and warning filters: the rest of a pytest session, and the subprocesses it starts, must not
    inherit those. Once imported, transformers' GPTQ path finds both in sys.modules and nothing
    runs again. Returns the gptqmodel module."""
    env, root = dict(os.environ), logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with warnings.catch_warnings():
            module = pytest.importorskip("gptqmodel")
            if importlib.util.find_spec("optimum") is not None:
                importlib.import_module("optimum.gptq")
    finally:
        os.environ.clear()
        os.environ.update(env)
        root.handlers[:] = handlers
        root.setLevel(level)
    return module
