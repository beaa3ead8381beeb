"""Parallel degrees, the rank grid (pure functions) and the process groups of Topology (4 gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel_fixtures import run_gloo
from stages.model import config_for_flavour
from stages.parallel.topology import ParallelDegrees, Topology, rank_coordinates, rank_groups


def test_degrees_derive_data_parallel():
    d = ParallelDegrees(world_size=16, tensor_parallel_degree=2, pipeline_parallel_degree=2,
                        sharding_parallel_degree=2)
    assert d.data_parallel_degree == 2
    assert ParallelDegrees(world_size=3).data_parallel_degree == 3


def test_degrees_that_do_not_divide_name_the_numbers():
    with pytest.raises(ValueError, match=r"world_size=6 .* tensor_parallel_degree=4 .* = 4"):
        ParallelDegrees(world_size=6, tensor_parallel_degree=4)
    with pytest.raises(ValueError, match=r"world_size=4 .*pipeline_parallel_degree=3.* = 6"):
        ParallelDegrees(world_size=4, tensor_parallel_degree=2, pipeline_parallel_degree=3)
    with pytest.raises(ValueError, match="tensor_parallel_degree=0"):
        ParallelDegrees(world_size=4, tensor_parallel_degree=0)


def test_validate_for_model_lists_every_violation():
    config = config_for_flavour("debug", vocab_size=321)  # 4 heads, 2 KV heads, 192 inner, 2 layers
    ParallelDegrees(world_size=2, tensor_parallel_degree=1, pipeline_parallel_degree=2).validate_for_model(config)
    with pytest.raises(ValueError) as err:
        ParallelDegrees(world_size=12, tensor_parallel_degree=4, pipeline_parallel_degree=3).validate_for_model(config)
    message = str(err.value)
    assert "tensor_parallel_degree=4 does not divide num_key_value_heads=2" in message
    assert "tensor_parallel_degree=4 does not divide vocab_size=321" in message
    assert "pipeline_parallel_degree=3 exceeds num_hidden_layers=2" in message
    assert "num_attention_heads" not in message and "intermediate_size" not in message


def test_groups_tp2_dp2():
    groups = rank_groups(ParallelDegrees(world_size=4, tensor_parallel_degree=2))
    assert groups["tensor"] == [[0, 1], [2, 3]]  # tp varies fastest: neighbours share a node
    assert groups["data"] == [[0, 2], [1, 3]]
    assert groups["pipeline"] == [[0], [1], [2], [3]]
    assert groups["model"] == [[0, 1], [2, 3]]
    assert rank_coordinates(3, ParallelDegrees(world_size=4, tensor_parallel_degree=2)) == \
        {"tensor": 1, "context": 0, "sharding": 0, "data": 1, "pipeline": 0}


def test_groups_tp2_pp2():
    d = ParallelDegrees(world_size=4, tensor_parallel_degree=2, pipeline_parallel_degree=2)
    groups = rank_groups(d)
    assert groups["tensor"] == [[0, 1], [2, 3]]
    assert groups["pipeline"] == [[0, 2], [1, 3]]  # stage order
    assert groups["data"] == [[0], [1], [2], [3]]
    assert groups["model"] == [[0, 1, 2, 3]]  # tp x pp: gradient norms sum over it
    assert [rank_coordinates(r, d)["pipeline"] for r in range(4)] == [0, 0, 1, 1]


def test_groups_partition_the_world_and_sharding_folds_into_data():
    d = ParallelDegrees(world_size=16, tensor_parallel_degree=2, sharding_parallel_degree=2,
                        pipeline_parallel_degree=2)
    groups = rank_groups(d)
    for kind, rows in groups.items():
        assert sorted(r for row in rows for r in row) == list(range(16)), kind
    assert groups["sharding"][0] == [0, 2]
    assert groups["data"][0] == [0, 2, 4, 6]  # dp x sharding: what DeepSpeed's ZeRO partitions over
    for rank in range(16):  # rank = t + tp * (s + sharding * (d + dp * p))
        c = rank_coordinates(rank, d)
        assert rank == c["tensor"] + 2 * (c["sharding"] + 2 * (c["data"] + 2 * c["pipeline"]))


def test_context_ranks_sit_next_to_tensor_ranks_and_share_the_gradient_group():
    d = ParallelDegrees(world_size=16, tensor_parallel_degree=2, context_parallel_degree=2,
                        sharding_parallel_degree=2, pipeline_parallel_degree=2)
    assert d.data_parallel_degree == 1
    groups = rank_groups(d)
    for kind, rows in groups.items():
        assert sorted(r for row in rows for r in row) == list(range(16)), kind
    assert groups["tensor"][0] == [0, 1]
    assert groups["context"][:2] == [[0, 2], [1, 3]]  # cp next to tp: keys and values move every layer
    assert groups["sharding"][0] == [0, 4]
    # DeepSpeed averages gradients and ZeRO shards over dp x sharding x cp: every rank of it holds
    # the same weights and its own tokens
    assert groups["data"][0] == [0, 2, 4, 6]
    assert groups["pipeline"][0] == [0, 8]
    assert groups["model"][0] == [0, 1, 8, 9]  # tp x pp, as without cp
    for rank in range(16):  # rank = t + tp * (c + cp * (s + sharding * (d + dp * p)))
        c = rank_coordinates(rank, d)
        assert rank == c["tensor"] + 2 * (c["context"] + 2 * (c["sharding"] + 2 * (c["data"] + c["pipeline"])))
    with pytest.raises(ValueError, match="context_parallel_degree=3"):
        ParallelDegrees(world_size=4, context_parallel_degree=3)


def _topology_worker(rank: int, world: int) -> dict:
    topo = Topology(ParallelDegrees(world_size=world, tensor_parallel_degree=2))
    mine = torch.tensor([float(rank)])
    sums = {}
    for name, group in [("tensor", topo.get_tensor_model_parallel_group()),
                        ("data", topo.get_data_parallel_group()), ("model", topo.get_model_parallel_group()),
                        ("pipeline", topo.get_pipeline_model_parallel_group())]:
        t = mine.clone()
        dist.all_reduce(t, group=group)
        sums[name] = t.item()
    return {
        "sums": sums,
        "tp": (topo.get_tensor_model_parallel_rank(), topo.get_tensor_model_parallel_world_size()),
        "dp": (topo.get_data_parallel_rank(), topo.get_data_parallel_world_size()),
        "pp": (topo.get_pipeline_model_parallel_rank(), topo.get_pipeline_model_parallel_world_size()),
        "mp": (topo.get_model_parallel_rank(), topo.get_model_parallel_world_size()),
        "src": topo.get_tensor_model_parallel_src_rank(),
        "dp_ranks": topo.get_data_parallel_group_ranks(),
    }


@pytest.mark.multiproc
def test_topology_groups_and_mpu_interface_on_four_ranks():
    out = run_gloo(_topology_worker, 4)  # tp2 x dp2
    for rank, r in enumerate(out):
        t, d = rank % 2, rank // 2
        assert r["tp"] == (t, 2) and r["dp"] == (d, 2) and r["pp"] == (0, 1) and r["mp"] == (t, 2)
        assert r["src"] == 2 * d and r["dp_ranks"] == [t, t + 2]
        # all-reduce of the global ranks within each group: who is in it
        assert r["sums"] == {"tensor": 4 * d + 1, "data": 2 * t + 2, "model": 4 * d + 1, "pipeline": rank}


def _deepspeed_worker(rank: int, world: int, tp: int, zero_stage: int) -> list[tuple[float, float]]:
    """(loss, global grad norm) of 4 clipped AdamW steps through a DeepSpeed engine; with tp > 1
    the model is tensor-parallel and the Topology is DeepSpeed's mpu."""
    import os

    import deepspeed

    from stages.model import build_model, config_for_flavour
    from stages.parallel.plan import apply_tensor_parallel

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    config = config_for_flavour("debug", vocab_size=256)
    model = build_model(config, seed=3)
    topology = None
    if tp > 1:
        degrees = ParallelDegrees(world_size=world, tensor_parallel_degree=tp)
        degrees.validate_for_model(config)
        topology = Topology(degrees)
        apply_tensor_parallel(model, topology)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    ds_config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                 "train_batch_size": 4 * world // tp,  # micro x accum x data-parallel degree
                 "gradient_clipping": 0.5, "zero_optimization": {"stage": zero_stage},
                 "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=topology)
    out = []
    for step in range(4):
        batch = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(100 + step))
        _, loss = engine(batch, labels=batch)
        engine.backward(loss)
        engine.step()
        out.append((loss.item(), float(engine.get_global_grad_norm())))
    return out


@pytest.mark.multiproc
@pytest.mark.slow
def test_deepspeed_zero1_with_topology_as_mpu_matches_one_process():
    """Loss and clipped-gradient norm of tp2 + ZeRO-1 equal the single-process run: DeepSpeed counts
    the replicated norm weights once (model-parallel rank 0) and sums the shards' squares over tp."""
    single = run_gloo(_deepspeed_worker, 1, 1, 1)[0]
    tp2 = run_gloo(_deepspeed_worker, 2, 2, 1)
    ref = torch.tensor(single)  # (step, [loss, grad norm])
    for rank_out in tp2:
        got = torch.tensor(rank_out)
        torch.testing.assert_close(got[:, 0], ref[:, 0], rtol=1e-5, atol=0)
        torch.testing.assert_close(got[0, 1], ref[0, 1], rtol=1e-6, atol=0)  # same weights: same norm
        # later norms are of weights that differ by fp32 rounding which Adam's g/sqrt(v) amplifies
        torch.testing.assert_close(got[1:, 1], ref[1:, 1], rtol=1e-4, atol=0)
    assert single[0][1] > 0.5  # clipping was active, so the norm mattered
