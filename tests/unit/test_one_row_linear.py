"""stages/inference/one_row_linear.py: F.linear on one float32 row as a multiply-and-sum, and every
other call left to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import TorchDispatchMode

from stages.inference.one_row_linear import OneRowLinear, with_one_row_linears


class CountMatmuls(TorchDispatchMode):
    """Counts the aten matmul calls (mm, addmm, ...) made under it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.mv,
                                   torch.ops.aten.addmv, torch.ops.aten.matmul):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _linear(x, weight, bias=None):
    """(F.linear under OneRowLinear, the aten matmul calls it made)."""
    with CountMatmuls() as counter, OneRowLinear():
        y = F.linear(x, weight, bias)
    return y, counter.calls


@pytest.mark.parametrize("shape", [(1, 48), (1, 1, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_row_is_a_sum_with_the_linear_result(shape, with_bias):
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(40, 48, generator=gen), torch.randn(*shape, generator=gen)
    bias = torch.randn(40, generator=gen) if with_bias else None
    y, matmuls = _linear(x, weight, bias)
    assert matmuls == 0  # rewritten: no gemv
    assert y.shape == (*shape[:-1], 40)
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["rows", "bf16"])
def test_other_calls_are_linear_itself(case):
    """Several rows (a prefill, a batch) and other dtypes go to F.linear: the same bits."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(40, 48, generator=gen), torch.randn(3, 48, generator=gen)
    if case == "bf16":
        weight, x = weight.to(torch.bfloat16), x[:1].to(torch.bfloat16)
    y, matmuls = _linear(x, weight)
    assert matmuls == 1
    assert torch.equal(y, F.linear(x, weight))


def test_compiled_one_row_linears_follow_the_eager_module():
    """What the engine compiles: a module's forward under OneRowLinear, through torch.compile: the
    eager module's outputs, and inductor's code calls no matmul kernel (it does without the mode)."""
    torch.manual_seed(2)
    mlp = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.SiLU(), torch.nn.Linear(96, 48, bias=False)).eval()
    x = torch.randn(1, 1, 48)
    calls = {}
    for name, forward in (("plain", mlp.forward), ("one-row", with_one_row_linears(mlp.forward))):
        with torch.no_grad():
            y, code = run_and_get_code(torch.compile(forward, dynamic=False), x)
        torch.testing.assert_close(y, mlp(x), rtol=1e-5, atol=1e-5)
        calls[name] = sum(text.count("extern_kernels.mm(") + text.count("extern_kernels.addmm(") for text in code)
    assert calls == {"plain": 2, "one-row": 0}
