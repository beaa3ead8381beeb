"""stages.launch: one rule text starts the ranks with torchrun here and with srun inside SLURM;
the rendezvous port is unique per job. (The real srun path runs in tests/slurm.)"""

from __future__ import annotations

import socket
import sys

import pytest

from stages.cluster import rendezvous
from stages.launch import launch_command


def test_outside_slurm_torchrun_starts_the_ranks_on_this_machine():
    argv, env = launch_command(4, 1, "stages.pretrain", ["--data", "d"], {"PATH": "/usr/bin"})
    assert argv[0].endswith("torchrun")
    assert argv[1:] == ["--standalone", "--nproc_per_node=4", "-m", "stages.pretrain", "--data", "d"]
    assert "MASTER_PORT" not in env  # torchrun --standalone picks its own


def test_outside_slurm_several_nodes_is_refused_with_the_way_out():
    with pytest.raises(SystemExit, match="slurm profile"):
        launch_command(4, 2, "stages.pretrain", [], {})


def test_inside_an_allocation_srun_overlaps_the_executor_step_and_kills_on_a_failed_rank(monkeypatch):
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None: [socket.gethostname(), "node2"])
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "x", "SLURM_CPUS_PER_TASK": "3", "RANK": "0"}
    argv, out_env = launch_command(8, 2, "stages.finetune", ["--method", "lora"], env)
    assert argv[:7] == ["srun", "--overlap", "--kill-on-bad-exit=1", "--ntasks=8", "--nodes=2",
                        "--ntasks-per-node=4", "--cpus-per-task=3"]
    assert argv[-5:] == [sys.executable, "-m", "stages.finetune", "--method", "lora"]
    assert out_env["MASTER_ADDR"] == socket.gethostname()  # rank 0 runs on the allocation's first node
    assert 1024 < int(out_env["MASTER_PORT"]) < 65536
    assert "RANK" not in out_env  # every task takes its own from SLURM_PROCID


def test_uneven_ranks_per_node_are_refused():
    with pytest.raises(SystemExit, match="multiple of --nodes"):
        launch_command(6, 4, "stages.pretrain", [], {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1"})


def test_the_launcher_away_from_the_first_node_derives_the_port_from_the_job(monkeypatch):
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None: ["some-other-node"])
    _, env = launch_command(2, 1, "stages.pretrain", [], {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "x"})
    assert env["MASTER_ADDR"] == "some-other-node"
    assert int(env["MASTER_PORT"]) == rendezvous.derived_port({"SLURM_JOB_ID": "77"})


def test_derived_ports_differ_for_jobs_running_at_the_same_time():
    ports = {rendezvous.derived_port({"SLURM_JOB_ID": str(job)}) for job in range(1000, 3500)}
    assert len(ports) == 2500
    assert all(rendezvous.PORT_BASE <= p < rendezvous.PORT_BASE + rendezvous.PORT_SPAN for p in ports)
    assert rendezvous.derived_port({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "1"}) != \
        rendezvous.derived_port({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"})


def test_free_ports_are_free_now():
    port = rendezvous.free_port()
    with socket.socket() as sock:
        sock.bind(("", port))  # would raise EADDRINUSE if the probe lied
