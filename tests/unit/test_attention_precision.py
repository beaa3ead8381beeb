"""A bf16 model's attention runs in fp32 on a CPU without AMX for short sequences with small heads
(faster there: stages.model.attention_precision, bench/attention_precision.py), in bf16 elsewhere."""

import pytest
import torch
import torch.nn.functional as F

import stages.model.attention_precision as precision
import stages.model.llama as llama
from stages.model import build_model, config_for_flavour


def bf16_queries(head_dim: int, tokens: int, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(2, 4, tokens, head_dim, dtype=torch.bfloat16, device=device)


@pytest.fixture
def no_amx(monkeypatch):
    monkeypatch.setattr(precision, "CPU_HAS_AMX", False)


def test_the_rule_picks_fp32_for_short_sequences_of_small_bf16_heads_on_a_cpu_without_amx(no_amx):
    assert precision.attention_in_fp32(bf16_queries(32, 256), keys=256)  # the default pretraining's
    assert precision.attention_in_fp32(bf16_queries(64, 16), keys=128)
    assert not precision.attention_in_fp32(bf16_queries(32, 257), keys=257)  # 257 x 32 > 8,192
    assert not precision.attention_in_fp32(bf16_queries(64, 1), keys=129)  # the keys count, prefix included
    assert not precision.attention_in_fp32(bf16_queries(128, 16), keys=16)  # head dim 128: bf16 is faster
    assert not precision.attention_in_fp32(bf16_queries(32, 64).float(), keys=64)  # fp32 model: nothing to do
    assert not precision.attention_in_fp32(bf16_queries(32, 64, device="meta"), keys=64)  # not a CPU


def test_a_cpu_with_amx_keeps_bf16(monkeypatch):
    monkeypatch.setattr(precision, "CPU_HAS_AMX", True)
    assert not precision.attention_in_fp32(bf16_queries(32, 64), keys=64)


def model_logits(ids: torch.Tensor) -> torch.Tensor:
    model = build_model(config_for_flavour("debug", vocab_size=128), seed=0).to(torch.bfloat16)
    logits = model(input_ids=ids)
    logits.float().square().mean().backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    return logits.detach()


def test_the_model_computes_attention_in_fp32_where_the_rule_says_so(monkeypatch, no_amx):
    """The bf16 model's logits equal those of the same model whose attention is SDPA on q, k, v cast
    to fp32 (output cast back), bit for bit, and differ from bf16 SDPA's."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = model_logits(ids)

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(llama, "attention_in_fp32", lambda q, keys: False)
    in_bf16 = model_logits(ids)
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: sdpa(q.float(), k.float(), v.float(), **kw).to(q.dtype))
    in_fp32 = model_logits(ids)

    assert torch.equal(ours, in_fp32)
    assert not torch.equal(ours, in_bf16)  # the kernels differ, so the test tells them apart
