"""stages.launch: one rule text starts the ranks with torchrun here and with srun inside SLURM;
the rendezvous port is unique per job. (The real srun path runs in tests/slurm.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from stages import launch
from stages.cluster import rendezvous
from stages.launch import launch_command


@pytest.fixture(autouse=True)
def _no_slurmctld(monkeypatch):
    """The job's node list as the environment says (no slurmctld to ask here)."""
    monkeypatch.setattr(launch, "job_nodelist", lambda env: env.get("SLURM_JOB_NODELIST", ""))


def test_outside_slurm_torchrun_starts_the_ranks_on_this_machine():
    argv, env = launch_command(4, 1, "stages.pretrain", ["--data", "d"], {"PATH": "/usr/bin"})
    launcher = argv[:argv.index("--standalone")]  # torchrun on PATH, else this python's torch.distributed.run
    assert launcher[0].endswith("torchrun") or launcher[1:] == ["-m", "torch.distributed.run"]
    assert argv[len(launcher):] == ["--standalone", "--nproc_per_node=4", "-m", "stages.pretrain", "--data", "d"]
    assert "MASTER_PORT" not in env  # torchrun --standalone picks its own


def test_outside_slurm_one_rank_is_the_module_itself_a_world_of_one(tmp_path):
    """One rank needs no torchrun (its agent costs ~1.8 s of start-up): the module runs under this
    python with the job's threads, and init_distributed makes it a world of one."""
    argv, env = launch_command(1, 1, "stages.finetune", ["--method", "sft"], {"OMP_NUM_THREADS": "2"})
    assert argv == [sys.executable, "-m", "stages.finetune", "--method", "sft"]
    assert env == {"OMP_NUM_THREADS": "2"}
    (tmp_path / "report_world.py").write_text(
        "import os, torch, torch.distributed as dist\n"
        "from stages.training.distributed import finish_distributed, init_distributed\n"
        "init_distributed()\n"
        "open(os.path.join(os.environ['OUT'], 'world'), 'w').write(\n"
        "    f'{dist.get_rank()} {dist.get_world_size()} {torch.get_num_threads()} {os.getppid()}')\n"
        "finish_distributed()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OUT": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "stages.launch", "--nproc", "1", "--", "report_world"], env=env)
    assert proc.wait(timeout=120) == 0
    rank, world, threads, parent = (tmp_path / "world").read_text().split()
    assert (rank, world, threads) == ("0", "1", "2")
    assert int(parent) == os.getpid()  # launch exec'd the module: no launcher process in between


def test_each_rank_gets_its_share_of_the_jobs_threads(tmp_path):
    """Snakemake sets OMP_NUM_THREADS to the rule's threads for the whole command; under torchrun
    each of the ranks gets threads / nproc (at least 1), as torch itself reports."""
    assert launch.threads_per_rank({"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}, 2) == \
        {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    assert launch.threads_per_rank({"OMP_NUM_THREADS": "1"}, 4) == {"OMP_NUM_THREADS": "1"}
    assert launch.threads_per_rank({}, 2) == {}  # unset stays unset: torchrun's own default
    (tmp_path / "report_threads.py").write_text(
        "import os, torch\n"
        "open(os.path.join(os.environ['OUT'], os.environ['RANK']), 'w').write(str(torch.get_num_threads()))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OUT": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "stages.launch", "--nproc", "2", "--", "report_threads"], env=env,
                   check=True, timeout=120)
    assert [(tmp_path / rank).read_text() for rank in ("0", "1")] == ["1", "1"]


def test_outside_slurm_several_nodes_is_refused_with_the_way_out():
    with pytest.raises(SystemExit, match="slurm profile"):
        launch_command(4, 2, "stages.pretrain", [], {})


def test_inside_an_allocation_srun_overlaps_the_executor_step_and_kills_on_a_failed_rank(monkeypatch):
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None, step=False: [socket.gethostname(), "node2"])
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
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None, step=False: ["some-other-node"])
    _, env = launch_command(2, 1, "stages.pretrain", [], {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "x"})
    assert env["MASTER_ADDR"] == "some-other-node"
    assert int(env["MASTER_PORT"]) == rendezvous.derived_port({"SLURM_JOB_ID": "77"})


def test_the_first_node_is_known_by_its_slurm_node_name_as_well_as_its_host_name(monkeypatch):
    # NodeName differs from the host name (several slurmds on one machine, or NodeHostname): the
    # launcher on that node still probes a free port there instead of deriving one
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None, step=False: ["llmnode1", "llmnode2"])
    monkeypatch.setattr(rendezvous, "free_port", lambda host="": 54321)
    job = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "llmnode[1-2]"}
    _, env = launch_command(2, 2, "stages.pretrain", [], {**job, "SLURMD_NODENAME": "llmnode1"})
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("llmnode1", "54321")
    _, env = launch_command(2, 2, "stages.pretrain", [], {**job, "SLURMD_NODENAME": "llmnode2"})
    assert (env["MASTER_ADDR"], int(env["MASTER_PORT"])) == ("llmnode1", rendezvous.derived_port(job))


def test_the_srun_gets_the_jobs_node_list_not_the_one_node_of_the_executors_step(monkeypatch):
    # the executor's `srun -n1` step says SLURM_JOB_NODELIST=llmnode1 in a 2-node job: srun would
    # refuse a 2-node step ("Only allocated 1 nodes asked for 2")
    monkeypatch.setattr(launch, "job_nodelist", lambda env: "llmnode[1-2]")
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None, step=False: ["llmnode1", "llmnode2"])
    step = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "llmnode1", "SLURM_NODELIST": "llmnode1"}
    argv, env = launch_command(2, 2, "stages.pretrain", [], step)
    assert env["SLURM_JOB_NODELIST"] == env["SLURM_NODELIST"] == "llmnode[1-2]"
    assert "--nodes=2" in argv and env["MASTER_ADDR"] == "llmnode1"


def test_the_jobs_node_list_comes_from_slurmctld_else_from_the_environment(monkeypatch):
    calls = []

    def squeue(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="llmnode[1-2]\n", stderr="")

    monkeypatch.setattr(rendezvous.subprocess, "run", squeue)
    assert rendezvous.job_nodelist({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "llmnode1"}) == "llmnode[1-2]"
    assert calls == [["squeue", "-h", "-j", "9", "-o", "%N"]]

    def unreachable(argv, **kwargs):
        raise subprocess.CalledProcessError(1, argv)

    monkeypatch.setattr(rendezvous.subprocess, "run", unreachable)
    assert rendezvous.job_nodelist({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "llmnode1"}) == "llmnode1"
    assert rendezvous.job_nodelist({}) == ""


def test_a_bare_srun_task_meets_at_the_first_node_of_its_own_step():
    # rank 0 of a step runs on the step's first node, which need not be the job's
    env = {"SLURM_JOB_NODELIST": "jobfirst", "SLURM_STEP_NODELIST": "stepfirst"}
    assert rendezvous.first_host(env, step=True) == "stepfirst"
    assert rendezvous.first_host(env) == "jobfirst"
    assert rendezvous.first_host({"SLURM_JOB_NODELIST": "jobfirst"}, step=True) == "jobfirst"


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


def test_cpus_per_task_come_from_slurmctld_when_the_executor_dropped_the_jobs_variables(tmp_path, monkeypatch):
    # the executor keeps SLURM_JOB_ID only in the batch step's command: srun asks scontrol for the job
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho \"JobId=$4 JobName=x NumNodes=1 NumCPUs=6 NumTasks=2 CPUs/Task=3 "
                        "ReqB:S:C:T=0:0:*:*\"\n")
    scontrol.chmod(0o755)
    monkeypatch.setattr(rendezvous, "allocation_hosts", lambda env=None, step=False: [socket.gethostname()])
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    assert launch.job_cpus_per_task(env) == "3"
    argv, _ = launch_command(2, 1, "stages.pretrain", [], env)
    assert "--cpus-per-task=3" in argv
    assert launch.job_cpus_per_task({"SLURM_JOB_ID": "1", "PATH": str(tmp_path / "none")}) == ""


def test_a_training_rank_imports_transformers_and_peft_only_when_it_uses_them():
    """Every rank of every training job pays its imports: on 2 CPU cores transformers costs ~0.9 s
    and peft ~1.9 s more. Pretraining never needs them and full fine-tuning needs only the tokenizer
    (transformers, imported when it loads one); LoRA and prefix import peft when they attach it."""
    code = ("import sys, stages.pretrain, stages.finetune, stages.training.engine; "
            "sys.exit(' '.join(sorted({'transformers', 'peft'} & set(sys.modules))) or None)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"imported at start-up: {done.stderr.strip()}"
