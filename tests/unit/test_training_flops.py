"""MFU's two halves: the model's FLOPs per token and the peak the run's devices reach."""

import pytest
import torch
from sft_fixtures import finetune_section

from stages.adapters import attach_adapter
from stages.model import build_model, config_for_flavour
from stages.training import engine, flops
from stages.training.families import estimated_flops_per_token
from stages.training.flops import cpu_ranks_at_peak, flops_per_token, matmul_weights


def test_flops_per_token_of_the_tiny_model_by_hand():
    # hidden 256, 4 layers, 8 heads of 32, 4 kv heads, MLP 704, vocab 4096, untied lm_head
    config = config_for_flavour("tiny", vocab_size=4096)
    per_layer = 256 * 8 * 32 + 2 * 256 * 4 * 32 + 8 * 32 * 256 + 3 * 256 * 704
    n_matmul = 4 * per_layer + 256 * 4096
    got = flops_per_token(config, seq_len=256)
    assert got["n_matmul_params"] == n_matmul == 3_997_696
    assert got["attention"] == 12 * 8 * 32 * 4 * 256
    assert got["total"] == 6 * n_matmul + 12 * 8 * 32 * 4 * 256 == 27_131_904


@pytest.mark.parametrize("tied", [False, True])
def test_a_fully_trained_model_counts_what_its_config_counts(tied):
    """The pretraining's and SFT's count is unchanged: our model's Linear weights (a tied lm_head
    once) are the config's N, all trained."""
    config = config_for_flavour("tiny", vocab_size=4096, tie_word_embeddings=tied)
    model = build_model(config, seed=0)
    by_config = flops_per_token(config, seq_len=256)
    assert matmul_weights(model) == (by_config["n_matmul_params"], 0)
    assert engine.model_flops_per_token(model, 256) == by_config["total"]


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_frozen_weights_cost_four_flops_per_token_and_lora_factors_six(method):
    """LoRA's and prefix tuning's base model is frozen: forward and the backward to its input (4 N),
    no weight gradient; LoRA's A and B train (6 each). The default LoRA run logged MFU 1.003
    against one thread's fp32 peak while it counted 6 per frozen weight."""
    config = config_for_flavour("tiny", vocab_size=4096)
    model = build_model(config, seed=0)
    base = flops_per_token(config, seq_len=128)
    attach_adapter(model, method, finetune_section(method))
    trained, frozen = matmul_weights(model)
    assert frozen == base["n_matmul_params"]
    if method == "lora":  # rank 4 on q_proj, v_proj, down_proj (sft_fixtures): r x (in + out) each, 4 layers
        r, d, kv, ff = 4, 256, 4 * 32, 704
        per_layer = r * ((d + d) + (d + kv) + (ff + d))
        assert trained == 4 * per_layer == sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        assert trained == 0  # the prefix's keys and values are no Linear's weights
    assert engine.model_flops_per_token(model, 128) == 6 * trained + 4 * frozen + base["attention"]


def test_a_peft_model_counts_its_frozen_base_at_four():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    full = estimated_flops_per_token(model, 32)
    assert full["dense"] == 6 * full["n_matmul_params"] == 6 * full["trained_matmul_params"]
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapter = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    got = estimated_flops_per_token(wrapped, 32)
    assert got["trained_matmul_params"] == adapter
    assert got["dense"] == 6 * adapter + 4 * full["n_matmul_params"]
    assert got["attention"] == full["attention"]


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


def test_the_logits_share_is_our_lm_head_at_six_or_four_and_nothing_for_transformers():
    """What a position whose next token is not learned does not cost (the step skips its lm_head)."""
    from transformers import LlamaConfig as HfLlamaConfig
    from transformers import LlamaForCausalLM as HfLlamaForCausalLM

    from stages.model import LlamaForCausalLM
    from stages.model.config import config_for_flavour
    from stages.training.engine import logits_flops_per_token

    ours = LlamaForCausalLM(config_for_flavour("debug", vocab_size=512))
    assert logits_flops_per_token(ours) == 6 * 512 * ours.config.hidden_size
    ours.lm_head.weight.requires_grad_(False)  # LoRA's and prefix tuning's frozen base
    assert logits_flops_per_token(ours) == 4 * 512 * ours.config.hidden_size
    hf = HfLlamaForCausalLM(HfLlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4))
    assert logits_flops_per_token(hf) == 0


@pytest.mark.parametrize("rate, width", [(60e9, 1024), (5e9, 512), (2e9, 384), (0.5e9, 256)])
def test_the_cpu_peak_is_measured_on_products_of_about_a_tenth_of_a_second(monkeypatch, rate, width):
    """Fast kernels 1024 wide; an emulated dtype (bf16 without AVX512-BF16 or AMX: ~1 GFLOP/s, 2.8 s
    per 1024-wide product) on products that still take about 0.1 s, never below 256."""
    clock = iter([0.0, 2 * 256**3 / rate])
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(clock))
    assert flops.cpu_matmul_width(torch.float32) == width
