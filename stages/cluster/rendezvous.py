"""Where the ranks of one training job meet: MASTER_ADDR and MASTER_PORT.

Inside a SLURM allocation rank 0 runs on the first node of the allocation (srun's block
distribution), so that node is the rendezvous host. The port must be unique per job: two jobs on
one node with a fixed port collide (the second job's rank 0 fails with EADDRINUSE while its other
ranks join the first job). The launcher runs on the first node itself (the batch script's host) and
asks the kernel for a free port there; a rank started by a bare `srun` (no launcher) derives a port
from the job and step ids, distinct for every job running at the same time on a node. The node list
holds SLURM node names, which need not be the host name (NodeName vs NodeHostname in slurm.conf,
several slurmds on one machine in tests/slurm/local_slurm.sh): SLURMD_NODENAME, set by slurmd in
every job and step, says which node this process runs on.

The environment of a job step need not describe the job: the slurm executor clears the batch
script's SLURM_* variables before its `srun -n1` step, and that srun then sets SLURM_JOB_NODELIST
to the step's one node. A training step started from there over several nodes fails ("Only
allocated 1 nodes asked for 2"), so the launcher asks slurmctld for the job's node list
(job_nodelist) and hands it on.
"""

from __future__ import annotations

import os
import socket
import subprocess

PORT_BASE, PORT_SPAN = 20000, 20000  # derived ports fall in [20000, 40000): below the ephemeral range


def free_port(host: str = "") -> int:
    """A port the kernel says is free on this host now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def derived_port(env: dict[str, str] | None = None) -> int:
    """A port from SLURM_JOB_ID and SLURM_STEP_ID: every rank of a step computes the same one, and
    jobs whose ids differ by less than PORT_SPAN / 8 never share one."""
    env = os.environ if env is None else env
    job = int(env.get("SLURM_JOB_ID", "0"))
    step = int(env.get("SLURM_STEP_ID", "0") or 0) % 8
    return PORT_BASE + (job * 8 + step) % PORT_SPAN


def job_nodelist(env: dict[str, str] | None = None) -> str:
    """The node list of the job SLURM_JOB_ID as slurmctld holds it (node[01-04]); the environment's
    SLURM_JOB_NODELIST / SLURM_NODELIST when slurmctld does not answer; "" outside a job."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if job:
        try:
            out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True,
                                 timeout=30, check=True, env=env)
            nodelist = out.stdout.strip()
            if nodelist:
                return nodelist
        except (OSError, subprocess.SubprocessError):
            pass
    return env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""


def allocation_hosts(env: dict[str, str] | None = None, step: bool = False) -> list[str]:
    """The host names of the allocation (with `step`, of this job step: a task's own step, whose
    first node runs its rank 0), in SLURM's order (`scontrol show hostnames` expands ranges such as
    node[01-04])."""
    env = os.environ if env is None else env
    nodelist = ((step and env.get("SLURM_STEP_NODELIST")) or env.get("SLURM_JOB_NODELIST")
                or env.get("SLURM_NODELIST") or "")
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True)
        hosts = out.stdout.split()
    except (OSError, subprocess.SubprocessError):
        hosts = []
    return hosts or [nodelist.split(",")[0]]


def first_host(env: dict[str, str] | None = None, step: bool = False) -> str:
    hosts = allocation_hosts(env, step)
    return hosts[0] if hosts else "127.0.0.1"


def is_this_host(host: str, env: dict[str, str] | None = None) -> bool:
    """Whether `host` (a name from the allocation's node list) is where this process runs."""
    env = os.environ if env is None else env
    names = {socket.gethostname(), socket.gethostname().split(".")[0], "localhost", "127.0.0.1"}
    names |= {env["SLURMD_NODENAME"]} if env.get("SLURMD_NODENAME") else set()
    return host in names or host.split(".")[0] in names


def rendezvous(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for a job in the current allocation: the first host, and a free
    port probed there when this process runs on it (else the derived port)."""
    host = first_host(env)
    return host, free_port() if is_this_host(host, env) else derived_port(env)
