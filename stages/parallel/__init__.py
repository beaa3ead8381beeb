"""Tensor / pipeline / data parallelism applied to a built model (Megatron-style TP primitives,
one topology object for the process groups that also serves DeepSpeed's `mpu`)."""

from stages.parallel.plan import (
    LLAMA_TP_PLAN,
    apply_tensor_parallel,
    gather_full_state_dict,
    shard_state_dict,
)
from stages.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_causal_lm_loss,
    vocab_parallel_cross_entropy,
)
from stages.parallel.topology import ParallelDegrees, Topology, rank_coordinates, rank_groups

__all__ = [
    "LLAMA_TP_PLAN", "apply_tensor_parallel", "gather_full_state_dict", "shard_state_dict",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_causal_lm_loss", "vocab_parallel_cross_entropy",
    "ParallelDegrees", "Topology", "rank_coordinates", "rank_groups",
]
