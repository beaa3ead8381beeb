"""Expert parallelism (stages/parallel/experts.py): the rank groups against DeepSpeed's own placement,
and a sparse block whose experts are split over 2 gloo ranks against the whole block in one process
(outputs, input and expert gradients), dropless and with a capacity factor; the layout checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_fixtures import run_gloo
from stages.config import check_config
from stages.errors import ConfigError
from stages.model.moe import MoeRouting, SparseMoeBlock
from stages.model.moe_layouts import moe_layout_problem
from stages.parallel.experts import ShardedExperts, apply_expert_parallel, local_experts
from stages.parallel.topology import ParallelDegrees, rank_groups

D, WIDTH, EXPERTS, TOKENS = 16, 24, 4, 12


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2), (2, 4), (1, 4)])
def test_expert_groups_are_deepspeeds_placement(tp, ep):
    """Consecutive ranks of a data group form an expert group, as DeepSpeed places them itself
    (its `_get_expert_parallel_ranks`, which our registry entries replace)."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    degrees = ParallelDegrees(world_size=8, tensor_parallel_degree=tp, expert_parallel_degree=ep)
    groups = rank_groups(degrees)
    theirs_ep, theirs_edp = _get_expert_parallel_ranks(8, tp, ep)
    assert sorted(groups["expert"]) == sorted(theirs_ep)
    assert sorted(groups["expert_data"]) == sorted(theirs_edp)
    for kind in ("expert", "expert_data"):  # each a partition of the world
        assert sorted(r for g in groups[kind] for r in g) == list(range(8))


def test_expert_parallel_must_divide_the_data_group_and_the_experts():
    with pytest.raises(ValueError, match="expert_parallel_degree=4 does not divide the data-parallel group of 2"):
        ParallelDegrees(world_size=4, tensor_parallel_degree=2, expert_parallel_degree=4)
    assert "does not divide num_experts=6" in moe_layout_problem("mixtral", 1, 1, 1, ep=4, num_experts=6)
    assert "sharding=stage3" in moe_layout_problem("mixtral", 1, 1, 1, ep=2, num_experts=4, sharding="stage3")
    assert local_experts(8, 1, 4) == range(2, 4)


@pytest.mark.parametrize("pretrain, match", [
    (dict(world_size=2, expert_parallel_degree=2), "expert_parallel_degree=2 with the dense model_type='llama'"),
    (dict(world_size=4, tensor_parallel_degree=4, expert_parallel_degree=2),
     "expert_parallel_degree=2 does not divide the data-parallel degree"),
])
def test_the_config_check_names_the_key(pretrain, match):
    with pytest.raises(ConfigError, match=match):
        check_config({"experiments": {"t": {"pretrain": pretrain}}})
    with pytest.raises(ConfigError, match="sharding=stage3"):
        check_config({"experiments": {"t": {"model": {"flavour": "moe-debug"}, "pretrain": dict(
            world_size=2, expert_parallel_degree=2, sharding="stage3")}}})


def _block(case: str) -> SparseMoeBlock:
    """`dropless`: top 2 of 4; `capacity`: at most one even share per expert; `idle`: top 1 of 4 with
    experts 2 and 3 never chosen, so the second rank's experts get no token at all."""
    torch.manual_seed(0)
    routing = MoeRouting(top_k=1 if case == "idle" else 2, renormalize=True,
                         capacity_factor=1.0 if case == "capacity" else None)
    block = SparseMoeBlock(D, WIDTH, EXPERTS, routing, ("w1", "w3", "w2"))
    if case == "idle":
        with torch.no_grad():  # logits +-100 x.v for experts 0 and 1, 0 for 2 and 3
            block.gate.weight.zero_()
            block.gate.weight[0] = 100.0 * torch.randn(D, generator=torch.Generator().manual_seed(3))
            block.gate.weight[1] = -block.gate.weight[0]
    return block


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(1, TOKENS, D, generator=torch.Generator().manual_seed(10 + rank))


def _split_block(rank: int, world: int, case: str) -> dict:
    """This rank's outputs and gradients with the experts split, and the whole block's on every
    rank's tokens (each rank computes the reference itself)."""
    reference = _block(case)
    xs = [_tokens(r).requires_grad_() for r in range(world)]
    ref_out = [reference(x) for x in xs]  # each rank's tokens routed alone, as the split block does
    sum((o * (r + 1)).sum() for r, o in enumerate(ref_out)).backward()

    block = _block(case)
    apply_expert_parallel(block, dist.group.WORLD, rank, world)
    assert isinstance(block.experts, ShardedExperts) and sorted(block.experts) == \
        [str(e) for e in local_experts(EXPERTS, rank, world)]
    x = _tokens(rank).requires_grad_()
    out = block(x)
    (out * (rank + 1)).sum().backward()
    grads = {f"experts.{name}": p.grad for name, p in block.experts.named_parameters()}
    for p in block.gate.parameters():  # replicated: each rank has its own tokens' share
        dist.all_reduce(p.grad)
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if n.startswith("experts.")}
    return {"out": out.detach(), "ref_out": ref_out[rank].detach(), "x_grad": x.grad, "ref_x_grad": xs[rank].grad,
            "grads": grads, "ref_grads": ref_grads,
            "gate": block.gate.weight.grad, "ref_gate": reference.gate.weight.grad}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["dropless", "capacity", "idle"])
def test_split_experts_equal_the_whole_block(case):
    for rank, got in enumerate(run_gloo(_split_block, 2, case)):
        torch.testing.assert_close(got["out"], got["ref_out"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["x_grad"], got["ref_x_grad"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["gate"], got["ref_gate"], rtol=1e-5, atol=1e-6)
        assert len(got["grads"]) == 2 * 3  # two experts of three projections each
        for name, grad in got["grads"].items():  # every rank's tokens reached this rank's experts
            torch.testing.assert_close(grad, got["ref_grads"][name], rtol=1e-5, atol=1e-6, msg=name)
        busy = [float(g.abs().max()) > 0 for g in got["grads"].values()]
        assert not any(busy) if case == "idle" and rank == 1 else all(busy)
