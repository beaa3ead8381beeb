"""The Megatron mapping pairs of stages/parallel/mappings.py against single-process maths (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_fixtures import run_gloo
from stages.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _forward_backward(fn, x: torch.Tensor, grad_out: torch.Tensor, group):
    x = x.clone().requires_grad_(True)
    y = fn(x, group)
    y.backward(grad_out)
    return y.detach(), x.grad


def _mapping_worker(rank: int, world: int) -> dict[str, float]:
    group = dist.group.WORLD
    singletons = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes both
    diffs = {}
    # copy: replicated input, each rank's region sends back its own gradient -> the sum
    x = _seeded(0, 4, 6)
    y, gx = _forward_backward(copy_to_tensor_parallel_region, x, _seeded(100 + rank, 4, 6), group)
    diffs["copy_fwd"] = _max_diff(y, x)
    diffs["copy_bwd"] = _max_diff(gx, sum(_seeded(100 + r, 4, 6) for r in range(world)))
    # reduce: per-rank partial sums in, replicated sum out; the replicated grad passes through
    g = _seeded(1, 4, 6)
    y, gx = _forward_backward(reduce_from_tensor_parallel_region, _seeded(10 + rank, 4, 6), g, group)
    diffs["reduce_fwd"] = _max_diff(y, sum(_seeded(10 + r, 4, 6) for r in range(world)))
    diffs["reduce_bwd"] = _max_diff(gx, g)
    # scatter: replicated input, this rank's columns out; per-rank grads gathered back
    y, gx = _forward_backward(scatter_to_tensor_parallel_region, x, _seeded(200 + rank, 4, 3), group)
    diffs["scatter_fwd"] = _max_diff(y, x[:, 3 * rank:3 * (rank + 1)])
    diffs["scatter_bwd"] = _max_diff(gx, torch.cat([_seeded(200 + r, 4, 3) for r in range(world)], dim=-1))
    # gather: per-rank columns in, replicated concatenation out; the grad's own columns back
    y, gx = _forward_backward(gather_from_tensor_parallel_region, _seeded(20 + rank, 4, 3), g, group)
    diffs["gather_fwd"] = _max_diff(y, torch.cat([_seeded(20 + r, 4, 3) for r in range(world)], dim=-1))
    diffs["gather_bwd"] = _max_diff(gx, g[:, 3 * rank:3 * (rank + 1)])
    # the sequence-parallel pairs, on dim 1 of (B, T, d) = (2, 4, 3): rank r holds tokens [2r, 2r + 2)
    h, mine = _seeded(30, 2, 4, 3), slice(2 * rank, 2 * rank + 2)
    y, gx = _forward_backward(scatter_to_sequence_parallel_region, h, _seeded(300 + rank, 2, 2, 3), group)
    diffs["seq_scatter_fwd"] = _max_diff(y, h[:, mine])
    diffs["seq_scatter_bwd"] = _max_diff(gx, torch.cat([_seeded(300 + r, 2, 2, 3) for r in range(world)], dim=1))
    # gather for a consumer every rank runs whole: the grad every rank holds whole, this rank's tokens of it
    y, gx = _forward_backward(gather_from_sequence_parallel_region, _seeded(40 + rank, 2, 2, 3), _seeded(50, 2, 4, 3),
                              group)
    diffs["seq_gather_fwd"] = _max_diff(y, torch.cat([_seeded(40 + r, 2, 2, 3) for r in range(world)], dim=1))
    diffs["seq_gather_bwd"] = _max_diff(gx, _seeded(50, 2, 4, 3)[:, mine])
    # reduce-scatter out of a row-parallel layer: partial sums in, this rank's tokens of the sum out
    y, gx = _forward_backward(reduce_scatter_to_sequence_parallel_region, _seeded(60 + rank, 2, 4, 3),
                              _seeded(600 + rank, 2, 2, 3), group)
    diffs["seq_reduce_scatter_fwd"] = _max_diff(y, sum(_seeded(60 + r, 2, 4, 3) for r in range(world))[:, mine])
    diffs["seq_reduce_scatter_bwd"] = _max_diff(gx, torch.cat([_seeded(600 + r, 2, 2, 3) for r in range(world)],
                                                              dim=1))
    # a group of one: every mapping is the identity both ways
    alone = singletons[rank]
    for name, fn in [("copy", copy_to_tensor_parallel_region), ("reduce", reduce_from_tensor_parallel_region),
                     ("scatter", scatter_to_tensor_parallel_region), ("gather", gather_from_tensor_parallel_region),
                     ("seq_scatter", scatter_to_sequence_parallel_region),
                     ("seq_gather", gather_from_sequence_parallel_region),
                     ("seq_reduce_scatter", reduce_scatter_to_sequence_parallel_region)]:
        if name.startswith("seq_"):
            y, gx = _forward_backward(fn, h, h, alone)
            diffs[f"{name}_single"] = max(_max_diff(y, h), _max_diff(gx, h))
            continue
        y, gx = _forward_backward(fn, x, g, alone)
        diffs[f"{name}_single"] = max(_max_diff(y, x), _max_diff(gx, g))
    return diffs


@pytest.fixture(scope="module")
def mapping_diffs() -> dict[str, float]:
    per_rank = run_gloo(_mapping_worker, 2)  # one spawn for the whole module: process start dominates
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}


@pytest.mark.multiproc
@pytest.mark.parametrize("mapping", ["copy", "reduce", "scatter", "gather", "seq_scatter", "seq_gather",
                                     "seq_reduce_scatter"])
def test_mapping_matches_single_process_maths(mapping_diffs, mapping):
    assert mapping_diffs[f"{mapping}_fwd"] <= 1e-6
    assert mapping_diffs[f"{mapping}_bwd"] <= 1e-6


@pytest.mark.multiproc
@pytest.mark.parametrize("mapping", ["copy", "reduce", "scatter", "gather", "seq_scatter", "seq_gather",
                                     "seq_reduce_scatter"])
def test_mapping_is_identity_for_a_group_of_one(mapping_diffs, mapping):
    assert mapping_diffs[f"{mapping}_single"] == 0.0
