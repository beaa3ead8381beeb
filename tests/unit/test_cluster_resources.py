"""SLURM resources of a job come from the experiment: nodes and tasks from the layout and the
cluster section, memory from the plan, partition and account from the config or the environment."""

from __future__ import annotations

import pytest

from stages.cluster.resources import RUNTIME_ALLOWANCE_BYTES, rank_layout, single_process_resources
from stages.cluster.resources import training_resources
from stages.config import ConfigError, check_config


def _experiment(**cluster):
    config = check_config({"experiments": {"x": {"model": {"flavour": "debug"}, "data": {"vocab_size": 512},
                                                 "cluster": cluster}}})
    return config["experiments"]["x"]


def test_gpu_ranks_fill_nodes_of_gpus_per_node():
    exp = _experiment(gpus_per_node=8)
    section = dict(exp["pretrain"], world_size=64)
    res = training_resources(exp, section, "experiments.x.pretrain", "pretrain", per_rank_host_bytes=0)
    assert (res["nodes"], res["tasks"], res["gres"], res["tasks_per_gpu"]) == (8, 64, "gpu:8", 1)
    assert res["runtime"] == 720  # cluster.runtime_minutes.pretrain's default
    # the executor runs the job's Snakemake in the batch step: the ranks' srun is the only step
    assert res["mpi"] == "srun"
    one = training_resources(exp, dict(exp["pretrain"], world_size=1), "k", "pretrain", per_rank_host_bytes=0)
    assert "mpi" not in one  # the executor refuses `mpi` with one task


def test_fewer_ranks_than_a_node_holds_ask_for_part_of_one_node():
    exp = _experiment(gpus_per_node=8)
    layout = rank_layout(exp, dict(exp["pretrain"], world_size=2), "k")
    assert (layout.nodes, layout.tasks_per_node, layout.gpus_per_node) == (1, 2, 2)


def test_cpu_ranks_spread_over_nodes_with_tasks_per_node():
    exp = _experiment(tasks_per_node=2, cpus_per_task=4)
    res = training_resources(exp, dict(exp["pretrain"], world_size=4), "k", "pretrain", per_rank_host_bytes=10**9)
    assert (res["nodes"], res["tasks"], res["cpus_per_task"]) == (2, 4, 4)
    assert res["slurm_extra"] == "--ntasks-per-node=2"
    # two ranks per node, each its planned bytes + the runtime allowance, with 25% headroom, whole GB
    expected_gb = -(-2 * (10**9 + RUNTIME_ALLOWANCE_BYTES) * 1.25 // 10**9)
    assert res["mem_mb"] == 1000 * expected_gb


def test_ranks_that_do_not_fill_whole_nodes_are_refused_with_the_key():
    exp = _experiment(gpus_per_node=8)
    with pytest.raises(ConfigError, match=r"experiments.x.pretrain.world_size=12 does not fill whole nodes"):
        rank_layout(exp, dict(exp["pretrain"], world_size=12), "experiments.x.pretrain")


def test_partition_and_account_come_from_the_config_or_sbatchs_own_variables(monkeypatch):
    monkeypatch.setenv("SBATCH_PARTITION", "gpu")
    monkeypatch.delenv("SBATCH_ACCOUNT", raising=False)
    res = single_process_resources(_experiment(), "quantize", 0)
    assert res["slurm_partition"] == "gpu" and "slurm_account" not in res
    res = single_process_resources(_experiment(partition="big", account="proj1"), "quantize", 0)
    assert (res["slurm_partition"], res["slurm_account"]) == ("big", "proj1")


def test_single_process_jobs_get_room_for_the_model_and_their_time_limit():
    exp = _experiment(runtime_minutes={"quantize": 240})
    small = single_process_resources(exp, "quantize", 4 * 10**6)
    assert (small["nodes"], small["tasks"], small["mem_mb"], small["runtime"]) == (1, 1, 2000, 240)
    big = single_process_resources(exp, "evaluate", 4 * 7 * 10**9)  # a 7B model in fp32
    assert big["mem_mb"] >= 3 * 28_000 and big["runtime"] == 60
    fixed = single_process_resources(_experiment(node_memory_gb=64), "export", 4 * 7 * 10**9)
    assert fixed["mem_mb"] == 64_000


def test_unknown_rule_names_in_runtime_minutes_are_refused():
    with pytest.raises(ConfigError, match="runtime_minutes"):
        _experiment(runtime_minutes={"pretrian": 10})
