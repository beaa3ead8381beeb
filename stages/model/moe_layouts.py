"""Which parallel layouts a mixture of experts trains in (torch-free: the config check asks at parse
time, `stages.parallel.topology` when the engine starts)."""

from __future__ import annotations


def moe_layout_problem(model_type: str, tp: int, pp: int, cp: int, sequence_parallel: bool = False) -> str | None:
    """Why a mixture of experts of `model_type` cannot train in this layout, or None. Data parallel and
    ZeRO split it as any model; tensor parallelism splits its attention (each rank runs the sparse
    blocks whole, on every token, their weights replicated as a norm's are), except OLMoE's, whose q/k
    norms span every head; sequence, context and pipeline parallelism are not built for it."""
    if pp > 1 or cp > 1:
        return (f"pipeline_parallel_degree={pp}, context_parallel_degree={cp} with the mixture of experts "
                f"model_type={model_type!r}: an MoE model trains with data parallel, ZeRO and tensor parallelism "
                "(attention) only so far; set both to 1")
    if tp > 1 and model_type == "olmoe":
        return (f"tensor_parallel_degree={tp} with model_type='olmoe': its q_norm and k_norm span every head, "
                "which a tensor-parallel rank does not hold; set tensor_parallel_degree: 1")
    if tp > 1 and sequence_parallel:
        return (f"sequence_parallel=true with the mixture of experts model_type={model_type!r}: a rank's share of "
                "the tokens would route and balance its experts apart from the others'; set sequence_parallel: false")
    return None
