"""A compiled decode step's float Linears on one row, as a multiply-and-sum that inductor fuses.

At batch 1 each decode step multiplies one row by every weight matrix, y = x W^T + b: a matrix-vector
product that reads each weight once and does two flops per weight read, so its speed is the
bandwidth at which it reads W. PyTorch's CPU path for it (F.linear -> MKL's gemv) reads at 9-13
GB/s on a 2-core AMD EPYC, whatever the thread count, where the fused reduction below reads at
15-33 GB/s (the larger the matrix, the faster). Written as

    y = (W * x).sum(-1) + b        W (out, in), x (1, in)

inside a torch.compile'd graph it becomes one inductor reduction kernel that streams W once, across
every thread, and never materialises the product. `bench/one_row_linear.py` measures both per shape;
on SmolLM2-135M the compiled fp32 decode step goes from 17 to 38 tokens/s (bench/deploy_decode.py).

    with OneRowLinear():
        logits = model(input_ids=ids[:, -1:], ...)     # under torch.compile: every F.linear on one row

Only float32 inputs and weights of a single row are rewritten; F.linear on several rows (a prefill, a
batch of rows) and other dtypes (bf16 goes to oneDNN; the low-bit kernels are not F.linear) are left
as they are. The sum runs in another order than the gemv's, so the logits differ in their last bits:
this is for the compiled step, whose fused arithmetic already does (eager steps stay bit-for-bit
`generate`'s). Outside torch.compile it is correct but slower: eager `W * x` writes the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class OneRowLinear(TorchFunctionMode):
    """F.linear(x, W, b) with x of one float32 row (any leading shape of size 1) and float32 W
    computed as (W * x).sum(-1) + b; every other call unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (x.dim() >= 2 and x.shape[:-1].numel() == 1 and x.dtype == torch.float32
                    and weight.dtype == torch.float32):
                y = (weight * x.reshape(1, -1)).sum(-1)  # (out,)
                if bias is not None:
                    y = y + bias
                return y.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


def with_one_row_linears(forward):
    """`forward` run under OneRowLinear (what the engine compiles as its decode step), as a function
    with a code object of its own: torch.compile keeps its graphs and their guards per code object,
    so the steps of two engines (two models, or a server's variants) neither share a recompile limit
    nor check each other's guards on every call."""

    def step(*args, **kwargs):
        with OneRowLinear():
            return forward(*args, **kwargs)

    step.__code__ = step.__code__.replace()  # equal to the shared one, but not the same object
    return step
