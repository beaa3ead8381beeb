"""Parallel degrees, the rank grid, and the process groups that serve DeepSpeed's `mpu`.

Rank order (fastest-varying first): tensor, context, sharding, data, pipeline, i.e. Megatron's
`tp-cp-dp-pp` with ZeRO sharding folded into the data dimension next to CP:

    rank = t + tp * (c + cp * (s + sharding * (d + dp * p)))

Why this order: tensor-parallel ranks exchange activations in every layer, so they sit on
neighbouring ranks (one node, fastest links); context-parallel ranks exchange keys and values in
every layer, so they come next; ZeRO sharding all-gathers and reduce-scatters every step;
replicated data parallelism only all-reduces gradients; pipeline stages only pass activations
point to point, so they are the slowest-varying coordinate.

DeepSpeed ZeRO partitions over the whole data-parallel group it is given, so the `mpu` data group
is `data x sharding x context`: every rank of it holds the same weights and computes gradients
of its own tokens (different samples along data x sharding, different tokens of the same samples
along context, as Megatron's "data-parallel group with context parallelism"); DeepSpeed averages
the gradients and ZeRO shards across all of them. The samples a rank reads come from its `batch`
coordinates (data x sharding, `get_batch_rank`): the context-parallel ranks of one batch rank read
the same samples. With DeepSpeed, `sharding_parallel_degree` only names how the data group splits;
the ZeRO stage itself comes from the `sharding` config key.

Expert parallelism (a mixture of experts' `expert_parallel_degree`, ep) splits the data group, not
the world: consecutive ep ranks of a data group form an expert group (each holds E/ep of every
sparse block's experts and exchanges tokens with the others in every sparse layer, all-to-all), and
the ranks at the same place of the data group's expert groups form an expert-data group (they hold
the same experts: DeepSpeed averages those experts' gradients and ZeRO shards their state over it).
This is DeepSpeed's and Megatron's placement (expert ranks next to each other, after tensor).

`rank_groups` is a pure function of the degrees (testable without processes); `Topology` creates
the torch.distributed groups from it and holds them. No process group lives in module state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stages.model.config import LlamaConfig
from stages.model.moe_layouts import expert_parallel_without_experts, moe_layout_problem

GROUP_KINDS = ("tensor", "context", "sharding", "data", "pipeline", "model", "expert", "expert_data")


@dataclass
class ParallelDegrees:
    world_size: int  # processes launched
    tensor_parallel_degree: int = 1  # ranks that split every weight matrix (Megatron TP)
    pipeline_parallel_degree: int = 1  # ranks that split the layers into stages
    sharding_parallel_degree: int = 1  # ranks that split optimizer state / grads / params (ZeRO)
    context_parallel_degree: int = 1  # ranks that split every sequence (attention over all of them)
    expert_parallel_degree: int = 1  # ranks of the data group that split a mixture's experts
    data_parallel_degree: int = field(init=False)  # derived: world / (tp * cp * pp * sharding)

    def __post_init__(self) -> None:
        for name in ("world_size", "tensor_parallel_degree", "pipeline_parallel_degree",
                     "sharding_parallel_degree", "context_parallel_degree", "expert_parallel_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        tp, pp, sh = self.tensor_parallel_degree, self.pipeline_parallel_degree, self.sharding_parallel_degree
        cp = self.context_parallel_degree
        if self.world_size % (tp * cp * pp * sh):
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tensor_parallel_degree={tp} x "
                f"context_parallel_degree={cp} x pipeline_parallel_degree={pp} x "
                f"sharding_parallel_degree={sh} = {tp * cp * pp * sh}")
        self.data_parallel_degree = self.world_size // (tp * cp * pp * sh)
        ep, data_group = self.expert_parallel_degree, self.data_parallel_degree * sh * cp
        if data_group % ep:
            raise ValueError(f"expert_parallel_degree={ep} does not divide the data-parallel group of {data_group} "
                             f"ranks (world_size={self.world_size} / (tensor x context x pipeline)): expert "
                             "parallelism splits the data group")

    def validate_for_model(self, config: LlamaConfig) -> None:
        """Raise ValueError (listing every violated rule, with the numbers) if this layout cannot
        split `config`. The vocabulary is not padded: tp must divide vocab_size."""
        tp, pp = self.tensor_parallel_degree, self.pipeline_parallel_degree
        problems = [f"tensor_parallel_degree={tp} does not divide {name}={value}"
                    for name, value in (("num_attention_heads", config.num_attention_heads),
                                        ("num_key_value_heads", config.num_key_value_heads),
                                        ("intermediate_size", config.intermediate_size),
                                        ("vocab_size", config.vocab_size))
                    if value % tp]
        if pp > config.num_hidden_layers:
            problems.append(f"pipeline_parallel_degree={pp} exceeds num_hidden_layers={config.num_hidden_layers}")
        cp, ep = self.context_parallel_degree, self.expert_parallel_degree
        problem = moe_layout_problem(config.model_type, tp, pp, cp, ep=ep, num_experts=config.num_experts) \
            if config.moe else expert_parallel_without_experts(ep, config.model_type)
        if problem:
            problems.append(problem)
        if problems:
            raise ValueError("; ".join(problems))


def _grid(degrees: ParallelDegrees) -> torch.Tensor:
    """Global ranks laid out as (pp, dp, sharding, cp, tp): tp varies fastest."""
    d = degrees
    return torch.arange(d.world_size).reshape(
        d.pipeline_parallel_degree, d.data_parallel_degree, d.sharding_parallel_degree,
        d.context_parallel_degree, d.tensor_parallel_degree)


def rank_groups(degrees: ParallelDegrees) -> dict[str, list[list[int]]]:
    """Every group of each kind, as lists of global ranks (a partition of range(world_size)).

    tensor: same (p, d, s, c); context: same (p, d, s, t); sharding: same (p, d, c, t); data: same
    (p, t), i.e. dp x sharding x cp, the group DeepSpeed averages gradients and partitions ZeRO
    state over; pipeline: same (d, s, c, t), in stage order; model: same (d, s, c), i.e. tp x pp,
    the group DeepSpeed sums gradient norms over; expert: ep consecutive ranks of a data group;
    expert_data: the ranks at the same place of a data group's expert groups.
    """
    g = _grid(degrees)
    P, D, S, C, T = g.shape
    ep = degrees.expert_parallel_degree
    data = g.permute(0, 4, 1, 2, 3).reshape(-1, D * S * C)
    layouts = {
        "tensor": g.reshape(-1, T),
        "context": g.permute(0, 1, 2, 4, 3).reshape(-1, C),
        "sharding": g.permute(0, 1, 3, 4, 2).reshape(-1, S),
        "data": data,
        "pipeline": g.permute(1, 2, 3, 4, 0).reshape(-1, P),
        "model": g.permute(1, 2, 3, 0, 4).reshape(-1, P * T),
        "expert": data.reshape(-1, ep),
        "expert_data": data.reshape(data.shape[0], -1, ep).transpose(1, 2).reshape(-1, D * S * C // ep),
    }
    return {kind: rows.tolist() for kind, rows in layouts.items()}


def rank_coordinates(rank: int, degrees: ParallelDegrees) -> dict[str, int]:
    """This rank's index along each axis of the grid."""
    if not 0 <= rank < degrees.world_size:
        raise ValueError(f"rank={rank} is outside world_size={degrees.world_size}")
    t = rank % degrees.tensor_parallel_degree
    rest = rank // degrees.tensor_parallel_degree
    c = rest % degrees.context_parallel_degree
    rest //= degrees.context_parallel_degree
    s = rest % degrees.sharding_parallel_degree
    rest //= degrees.sharding_parallel_degree
    d = rest % degrees.data_parallel_degree
    p = rest // degrees.data_parallel_degree
    return {"tensor": t, "context": c, "sharding": s, "data": d, "pipeline": p}


class Topology:
    """The process groups of this rank for a `ParallelDegrees` grid; also DeepSpeed's `mpu`.

    Must be constructed on every rank, in the same order relative to other group creation, after
    `torch.distributed` is initialised with `degrees.world_size` processes. Pass it to
    `deepspeed.initialize(..., mpu=topology)`.
    """

    def __init__(self, degrees: ParallelDegrees):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("Topology needs torch.distributed to be initialised first")
        if dist.get_world_size() != degrees.world_size:
            raise ValueError(f"ParallelDegrees.world_size={degrees.world_size} but torch.distributed has "
                             f"{dist.get_world_size()} processes")
        self.degrees = degrees
        self.rank = dist.get_rank()
        self.coordinates = rank_coordinates(self.rank, degrees)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._ranks: dict[str, list[int]] = {}
        for kind, all_ranks in rank_groups(degrees).items():
            if kind.startswith("expert") and degrees.expert_parallel_degree == 1:
                continue  # no expert parallelism: single ranks and the data group again
            for ranks in all_ranks:  # new_group is collective: every rank creates every group
                group = dist.new_group(ranks=ranks)
                if self.rank in ranks:
                    self._groups[kind], self._ranks[kind] = group, ranks

    def group(self, kind: str):
        """The group of `kind` (one of GROUP_KINDS) this rank belongs to."""
        if kind not in self._groups:
            raise ValueError(f"group kind {kind!r} is unknown; choose one of {GROUP_KINDS}")
        return self._groups[kind]

    def ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of `kind`."""
        self.group(kind)
        return list(self._ranks[kind])

    def _rank_in(self, kind: str) -> int:
        return self._ranks[kind].index(self.rank)

    # -- tensor parallel -----------------------------------------------------------------------
    @property
    def tp_group(self):
        return self._groups["tensor"]

    def get_tensor_model_parallel_group(self):
        return self._groups["tensor"]

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank_in("tensor")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.degrees.tensor_parallel_degree

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of tensor-parallel rank 0 in this rank's group (broadcast source)."""
        return self._ranks["tensor"][0]

    # -- pipeline parallel ---------------------------------------------------------------------
    def get_pipeline_model_parallel_group(self):
        return self._groups["pipeline"]

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._rank_in("pipeline")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.degrees.pipeline_parallel_degree

    # -- context parallel ----------------------------------------------------------------------
    def get_context_parallel_group(self):
        return self._groups["context"]

    def get_context_parallel_rank(self) -> int:
        return self._rank_in("context")

    def get_context_parallel_world_size(self) -> int:
        return self.degrees.context_parallel_degree

    # -- data parallel (dp x sharding x cp: what DeepSpeed averages over and ZeRO partitions over) ---
    def get_data_parallel_group(self):
        return self._groups["data"]

    def get_data_parallel_rank(self) -> int:
        return self._rank_in("data")

    def get_data_parallel_world_size(self) -> int:
        d = self.degrees
        return d.data_parallel_degree * d.sharding_parallel_degree * d.context_parallel_degree

    # -- the samples a rank reads (dp x sharding; the context-parallel ranks of one read the same) ---
    def get_batch_rank(self) -> int:
        return self.coordinates["data"] * self.degrees.sharding_parallel_degree + self.coordinates["sharding"]

    def get_batch_world_size(self) -> int:
        return self.degrees.data_parallel_degree * self.degrees.sharding_parallel_degree

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.ranks("data")

    def get_sharding_parallel_group(self):
        return self._groups["sharding"]

    def get_sharding_parallel_rank(self) -> int:
        return self._rank_in("sharding")

    def get_sharding_parallel_world_size(self) -> int:
        return self.degrees.sharding_parallel_degree

    # -- expert parallel (a mixture's experts split over ranks of the data group) ---------------
    def get_expert_parallel_group(self):
        return self._groups["expert"]

    def get_expert_parallel_rank(self) -> int:
        return self._rank_in("expert")

    def get_expert_parallel_world_size(self) -> int:
        return self.degrees.expert_parallel_degree

    def get_expert_data_parallel_group(self):
        """The ranks holding this rank's experts: their gradients are averaged and ZeRO-sharded over it."""
        return self._groups["expert_data"]

    def get_expert_data_parallel_rank(self) -> int:
        return self._rank_in("expert_data")

    def get_expert_data_parallel_world_size(self) -> int:
        return self.get_data_parallel_world_size() // self.degrees.expert_parallel_degree

    # -- model parallel (Megatron's legacy names, as DeepSpeed reads them) ---------------------
    def get_model_parallel_group(self):
        """tp x pp: DeepSpeed sums squared gradient norms (and overflow flags) over it."""
        return self._groups["model"]

    def get_model_parallel_rank(self) -> int:
        """The tensor-parallel rank, as in Megatron's legacy alias. DeepSpeed counts a replicated
        (non-`tensor_model_parallel`) parameter's gradient norm only where this is 0, so it must
        be 0 on one rank per TP group, including on every pipeline stage."""
        return self.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        """The tensor-parallel degree (Megatron's legacy alias; DeepSpeed names checkpoints by it)."""
        return self.get_tensor_model_parallel_world_size()
