"""Attention's shape rules, torch-free: the shapes where a bf16 model's attention runs in fp32 on a
CPU without AMX (the model asks it on every attention call, `stages.model.attention_precision`,
which holds the why and the measurements; the memory planner counts the fp32 copies SDPA then
saves), the head counts Ulysses context parallelism can split (the config check, the planner
and `stages.parallel.context`), and the query rows ring attention scores at once. The config check
and the planner (`stages.planning.memory`) must load without torch when Snakemake parses the
workflow."""

from __future__ import annotations

MAX_HEAD_DIM = 64
MAX_KEYS_TIMES_HEAD_DIM = 8192
# Query rows whose scores ring attention (`stages.parallel.ring_attention`) computes at once: a block's
# (B, H, Tl, Tl) fp32 scores would grow with the square of a rank's tokens (2048 tokens, 8 heads:
# 134 MB per tensor, three in backward); tiles of rows keep them at (B, H, RING_QUERY_TILE, Tl).
RING_QUERY_TILE = 256


def fp32_attention_shape(head_dim: int, keys: int) -> bool:
    """Whether attention with heads of `head_dim` over `keys` keys (prefix included) is of the
    shapes whose fp32 kernel beat the bf16 one in every measured run."""
    return head_dim <= MAX_HEAD_DIM and keys * head_dim <= MAX_KEYS_TIMES_HEAD_DIM


def ulysses_head_conflict(cp: int, tp: int, heads: int | None, kv_heads: int | None) -> str | None:
    """Why Ulysses context parallelism over `cp` ranks cannot split the heads of a tensor-parallel
    rank (its query and key-value heads, counts / `tp`, each divided by cp), or None; a count that
    is not known (None) is not checked."""
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value is not None and (value // tp) % cp:
            return (f"context_parallel_mode=ulysses with context_parallel_degree={cp}: {name}={value} / "
                    f"tensor_parallel_degree={tp} is not divisible by {cp} (Ulysses splits each rank's heads); use "
                    "context_parallel_mode: all_gather")
    return None
