"""Model FLOPs per token and the measured matmul peak, for MFU (model FLOPs utilisation).

MFU = tokens/s x FLOPs/token / (peak FLOP/s x devices). The peak is measured on this machine in
the same run (a loop of large matmuls in the training dtype), not read from a data sheet. On a CPU
the devices are the ranks' shares of a node's cores: a rank measures at its own thread count, and
the node's peak is that times the ranks that fit its cores side by side (`cpu_ranks_at_peak`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from stages.model.config import LlamaConfig
from stages.model.moe import SparseMoeBlock


def flops_per_token(config: LlamaConfig, seq_len: int, weights: tuple[int, int] | None = None) -> dict[str, int]:
    """Training FLOPs per token, PaLM-style: 6 * N_matmul + 12 * H * hd * sum over layers of T_l.

    N_matmul counts every weight a token is multiplied by: the attention and MLP projections of
    all layers (with head_dim, which may differ from d / H) and lm_head (the embedding is a lookup,
    norms and biases are not matmuls). The attention term is QK^T and AV (2 * 2 * T_l * H * hd
    forward per layer, x3 for forward+backward), counted over the full T x T square as is
    customary, although a causal kernel may skip half; T_l is T, or the window of a sliding-window
    layer when that is shorter (each query then sees at most `window` keys).

    `weights`, (trained, frozen) elements of the model's matmul weights (`matmul_weights`), replaces
    the config's count: a frozen weight (LoRA's base) costs its forward and the backward to its
    input, 4 FLOPs per token, not the 2 more of its own gradient; LoRA's factors count as trained.
    """
    d, L, H, K, hd = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    per_layer = d * H * hd + 2 * d * K * hd + H * hd * d + 3 * d * config.intermediate_size
    trained, frozen = weights or (L * per_layer + d * config.vocab_size, 0)
    if weights is None and config.moe:  # a sparse layer runs its router, a token's k experts, a shared expert
        sparse = d * config.num_experts + config.num_experts_per_tok * 3 * d * config.expert_width
        sparse += 3 * d * config.shared_expert_intermediate_size + d * bool(config.shared_expert_intermediate_size)
        trained += sum(config.sparse_layers()) * (sparse - 3 * d * config.intermediate_size)
    keys_seen = sum(seq_len if w is None else min(seq_len, w) for w in config.layer_windows())
    attention = 12 * H * hd * keys_seen
    dense = 6 * trained + 4 * frozen
    return {"n_matmul_params": trained + frozen, "trained_matmul_params": trained, "dense": dense,
            "attention": attention, "total": dense + attention}


def trained_and_frozen(weights: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(elements with requires_grad, elements without) of `weights`, each tensor counted once."""
    distinct = {id(w): w for w in weights}.values()
    trained = sum(w.numel() for w in distinct if w.requires_grad)
    return trained, sum(w.numel() for w in distinct) - trained


def matmul_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(trained, frozen) elements of the weights of `model`'s Linear layers (a tied lm_head, a LoRA
    layer's base, its factors): the matmul weights of our model. A mixture of experts' routed
    experts count as the share of them a token runs (top k / experts): the active weights."""
    shares = {}  # id(Linear weight) -> the share of tokens that run it
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            for m in block.experts.modules():
                if isinstance(m, torch.nn.Linear):
                    shares[id(m.weight)] = block.routing.top_k / block.num_experts
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}.values()
    trained = frozen = 0.0
    for w in weights:
        count = w.numel() * shares.get(id(w), 1.0)
        trained, frozen = (trained + count, frozen) if w.requires_grad else (trained, frozen + count)
    return round(trained), round(frozen)


def cpu_ranks_at_peak(world: int, local_world: int, cores: int, threads: int) -> int:
    """How many times one rank's measured peak the run's CPUs reach: on each of the world's nodes,
    its `local_world` ranks each run `threads` threads, and at most cores // threads of them run at
    full speed side by side (two ranks of one thread on two cores: 2; oversubscribed, two ranks of
    two threads on two cores: 1)."""
    nodes = max(1, world // max(1, local_world))
    return nodes * max(1, min(local_world, cores // max(1, threads)))


def peak_matmul_flops(dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                      n: int = 2048, iters: int = 8, repeats: int = 5) -> float:
    """Best-of-`repeats` FLOP/s of `iters` back-to-back (n, n) @ (n, n) matmuls in `dtype`."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    torch.matmul(a, b)  # the first call picks the kernel (oneDNN/AMX on CPU, cuBLAS on GPU)
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available() and torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b)
        if torch.cuda.is_available() and torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * iters / best


def cpu_matmul_width(dtype: torch.dtype, seconds: float = 0.1, widest: int = 1024) -> int:
    """The width (a multiple of 128, 256 to `widest`) of square products in `dtype` that take about
    `seconds` each on this CPU, from one 256-wide product. bf16 without AVX512-BF16 or AMX runs in
    emulation: a 1024-wide product took 2.8 s on a 2-core AMD EPYC without them (fp32: 0.03 s), and
    the peak's twelve of them 38 s of every bf16 run's start; it measures 384 wide there (0.9 s)."""
    a = torch.randn(256, 256, dtype=dtype)
    torch.matmul(a, a)  # the first call picks the kernel
    start = time.perf_counter()
    torch.matmul(a, a)
    rate = 2 * 256**3 / max(time.perf_counter() - start, 1e-9)
    return max(256, min(widest, int((rate * seconds / 2) ** (1 / 3)) // 128 * 128))
