"""Which parallel layouts a mixture of experts trains in (torch-free: the config check asks at parse
time, `stages.parallel.topology` when the engine starts)."""

from __future__ import annotations


def moe_layout_problem(model_type: str, tp: int, pp: int, cp: int, sequence_parallel: bool = False, *,
                       ep: int = 1, num_experts: int | None = None, sharding: str = "none",
                       capacity_factor: float | None = None) -> str | None:
    """Why a mixture of experts of `model_type` cannot train in this layout, or None. Data parallel and
    ZeRO split it as any model; tensor parallelism splits its attention (each rank runs the sparse
    blocks whole, on every token, their weights replicated as a norm's are; OLMoE's q/k norms, which
    span every head, split with the heads); expert parallelism (`ep`) splits the experts over ranks of
    the data group, with ZeRO 1/2 (DeepSpeed shards expert state over the ranks holding the same
    experts; its ZeRO-3 takes no experts of ours); context parallelism splits each sequence's tokens, the routers'
    losses summed over the context group (dropless routing only: a capacity counts a forward's
    tokens); sequence parallelism splits the residual stream, the sparse blocks gathering the whole
    sequence on every tensor-parallel rank; pipeline parallelism is not built for it."""
    if ep > 1 and num_experts is not None and num_experts % ep:
        return (f"expert_parallel_degree={ep} does not divide num_experts={num_experts} of the mixture of experts "
                f"model_type={model_type!r}: every expert rank holds the same number of experts")
    if ep > 1 and sharding == "stage3":
        return (f"expert_parallel_degree={ep} with sharding=stage3: DeepSpeed's ZeRO-3 partitions no experts "
                "it did not build itself; use sharding: stage1 or stage2 (expert state is then sharded over "
                "the ranks holding the same experts), or expert_parallel_degree: 1")
    if pp > 1:
        return (f"pipeline_parallel_degree={pp} with the mixture of experts model_type={model_type!r}: the "
                "load-balancing loss couples every layer's routing, which the pipeline splits over stages; an MoE "
                "model trains with data, tensor (attention), context and expert parallelism and ZeRO; set it to 1")
    if cp > 1 and capacity_factor is not None:
        return (f"context_parallel_degree={cp} with moe_capacity_factor={capacity_factor}: an expert's capacity "
                "counts the tokens of one forward, which context parallelism splits over ranks; use dropless "
                "routing (moe_capacity_factor: null) or context_parallel_degree: 1")
    return None


def expert_parallel_without_experts(ep: int, model_type: str) -> str | None:
    """Why `expert_parallel_degree` cannot apply to a dense `model_type`, or None."""
    if ep > 1:
        return (f"expert_parallel_degree={ep} with the dense model_type={model_type!r}: expert parallelism splits "
                "a mixture of experts' experts (mixtral, qwen2_moe, qwen3_moe, olmoe); set expert_parallel_degree: 1")
    return None
