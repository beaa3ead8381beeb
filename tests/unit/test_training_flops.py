"""MFU's two halves: the model's FLOPs per token and the peak the run's devices reach."""

import pytest
import torch

from stages.model import config_for_flavour
from stages.training import engine
from stages.training.flops import cpu_ranks_at_peak, flops_per_token


def test_flops_per_token_of_the_tiny_model_by_hand():
    # hidden 256, 4 layers, 8 heads of 32, 4 kv heads, MLP 704, vocab 4096, untied lm_head
    config = config_for_flavour("tiny", vocab_size=4096)
    per_layer = 256 * 8 * 32 + 2 * 256 * 4 * 32 + 8 * 32 * 256 + 3 * 256 * 704
    n_matmul = 4 * per_layer + 256 * 4096
    got = flops_per_token(config, seq_len=256)
    assert got["n_matmul_params"] == n_matmul == 3_997_696
    assert got["attention"] == 12 * 8 * 32 * 4 * 256
    assert got["total"] == 6 * n_matmul + 12 * 8 * 32 * 4 * 256 == 27_131_904


@pytest.mark.parametrize("world, local_world, cores, threads, expected", [
    (1, 1, 2, 2, 1),    # one process on all the cores: its own measurement is the node's peak
    (2, 2, 2, 1, 2),    # the default pretraining: two ranks of one thread on two cores
    (2, 2, 2, 2, 1),    # oversubscribed: two ranks of two threads on two cores run at one's rate
    (4, 4, 2, 1, 2),    # four one-thread ranks on two cores: two at a time
    (4, 2, 16, 8, 4),   # two nodes of two ranks of 8 threads on 16 cores
    (8, 4, 8, 1, 8),
])
def test_cpu_ranks_at_peak(world, local_world, cores, threads, expected):
    assert cpu_ranks_at_peak(world, local_world, cores, threads) == expected


def test_a_cpu_run_of_two_one_thread_ranks_counts_both_shares_of_the_node(monkeypatch):
    """Rank 0 measures the peak with its one thread; the node's two ranks together reach twice it
    (the default pretraining's MFU was reported against one share: 0.94 instead of ~0.47)."""
    monkeypatch.setattr(engine, "_measured_peak", lambda dtype, device: 100.0)
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    section = {"bf16": True, "fp16": False}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert engine._peak_flops(section, torch.device("cpu"), world=2) == 200.0
        torch.set_num_threads(2)
        assert engine._peak_flops(section, torch.device("cpu"), world=2) == 100.0
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert engine._peak_flops(section, torch.device("cpu"), world=1) == 100.0
    finally:
        torch.set_num_threads(threads)
