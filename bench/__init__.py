"""Benchmark scripts (run as files: `python bench/quant.py`); `bench.common` holds what they share."""
