"""Grouped-query attention reaches SDPA with the KV heads in place (enable_gqa) where its kernel
reads them so, and with k and v repeated to every query head where a GPU would otherwise fall
back to the math kernel (stages.model.llama.gqa_in_place; an H200 measured 8 GiB more at 1b in fp32).
The GPU's choice is checked by its rule; the repeated path itself runs here on the CPU, forced."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import stages.model.llama as llama
from stages.model import build_model, config_for_flavour


def test_the_rule_keeps_the_kv_heads_on_a_cpu_and_for_a_gpus_flash_kernel_only():
    q = torch.zeros(2, 4, 8, 16)
    assert llama.gqa_in_place(q, masked=False) and llama.gqa_in_place(q, masked=True)  # a CPU: always
    assert llama.gqa_in_place(q.bfloat16(), masked=True)

    def on_gpu(dtype):
        return SimpleNamespace(device=torch.device("cuda"), dtype=dtype)

    assert llama.gqa_in_place(on_gpu(torch.bfloat16), masked=False)  # flash
    assert llama.gqa_in_place(on_gpu(torch.float16), masked=False)
    assert not llama.gqa_in_place(on_gpu(torch.bfloat16), masked=True)  # a mask: the memory-efficient kernel
    assert not llama.gqa_in_place(on_gpu(torch.float32), masked=False)  # fp32: no flash


def logits_and_grads(ids: torch.Tensor, position_ids: torch.Tensor | None):
    model = build_model(config_for_flavour("debug", vocab_size=128), seed=0)  # 4 query heads, 2 KV heads
    kwargs = {} if position_ids is None else {"position_ids": position_ids}
    logits = model(input_ids=ids, **kwargs)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True])
def test_repeated_kv_heads_compute_what_enable_gqa_computes(monkeypatch, packed):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1) if packed else None
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((k.shape[1], kwargs.get("enable_gqa")))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", spy)
    in_place = logits_and_grads(ids, position_ids)
    assert calls and all(c == (2, True) for c in calls)  # the KV heads, read in place
    calls.clear()
    monkeypatch.setattr(llama, "gqa_in_place", lambda q, masked: False)  # as a GPU's fp32 or masked attention
    repeated = logits_and_grads(ids, position_ids)
    assert calls and all(c == (4, False) for c in calls)  # every query head's k and v
    torch.testing.assert_close(repeated[0], in_place[0], rtol=1e-5, atol=1e-6)
    for name, grad in in_place[1].items():
        torch.testing.assert_close(repeated[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
