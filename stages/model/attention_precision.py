"""Which precision a bf16 model's attention runs in on a CPU.

On a CPU without AMX (AVX512-BF16 only, e.g. AMD EPYC), PyTorch's flash attention kernel for bf16
inputs is slower than its fp32 kernel on short sequences with small heads, by a margin the casts do
not eat. bf16 time / fp32 time, forward + backward, causal, 8 heads, 4,096 tokens per call, the
casts (inputs up, output back) inside the timing, one thread (`bench/attention_precision.py`,
2-core AMD EPYC, 2026-11-27):

    head dim 32:  T 16 4.6x, T 64 2.6x, T 128 2.2x, T 256 1.30x, T 512 1.05x, T 1024 0.83x
    head dim 64:  T 16 2.7x, T 64 1.8x, T 128 1.50x, T 256 0.96x, T 512 0.89x, T 1024 0.78x
    head dim 128: T 16 2.2x, T 64 1.04x, T 128 1.10x, T 256 0.87x, T 1024 0.75x (16 heads: 0.87x at T 32)

So a bf16 model runs attention in fp32 there where head dim <= 64 and keys x head dim <= 8,192,
the shapes where fp32 won in every run (the default pretraining: head dim 32, 256 tokens; its job
171 -> 163 s), and in bf16 everywhere else: on GPUs, on CPUs with AMX (whose bf16 kernel takes
another path, not measured here), on longer sequences and bigger heads. The scores are computed in
fp32 either way (the bf16 kernel keeps its scores and softmax in fp32 too); the choice depends only
on the shapes and the machine, so a rerun on the same machine computes the same bits.
"""

from __future__ import annotations

import torch

from stages.model.attention_shapes import fp32_attention_shape

CPU_HAS_AMX = bool(torch.cpu._is_amx_tile_supported())  # read once: a constant for torch.compile too


def attention_in_fp32(q: torch.Tensor, keys: int) -> bool:
    """Whether attention of bf16 queries q (B, H, T, hd) over `keys` keys runs faster in fp32 here."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return False
    return fp32_attention_shape(q.shape[-1], keys) and not CPU_HAS_AMX
