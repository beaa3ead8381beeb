"""The shapes where a bf16 model's attention runs in fp32 on a CPU without AMX, torch-free: the
model asks it on every attention call (`stages.model.attention_precision`, which holds the why and
the measurements) and the memory planner to count the fp32 copies SDPA then saves
(`stages.planning.memory`), which must load without torch when Snakemake parses the workflow."""

from __future__ import annotations

MAX_HEAD_DIM = 64
MAX_KEYS_TIMES_HEAD_DIM = 8192


def fp32_attention_shape(head_dim: int, keys: int) -> bool:
    """Whether attention with heads of `head_dim` over `keys` keys (prefix included) is of the
    shapes whose fp32 kernel beat the bf16 one in every measured run."""
    return head_dim <= MAX_HEAD_DIM and keys * head_dim <= MAX_KEYS_TIMES_HEAD_DIM
