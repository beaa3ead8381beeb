"""Where the ranks of one training job meet: MASTER_ADDR and MASTER_PORT.

Inside a SLURM allocation rank 0 runs on the first node of the allocation (srun's block
distribution), so that node is the rendezvous host. The port must be unique per job: two jobs on
one node with a fixed port collide (the second job's rank 0 fails with EADDRINUSE while its other
ranks join the first job). The launcher runs on the first node itself (the batch script's host) and
asks the kernel for a free port there; a rank started by a bare `srun` (no launcher) derives a port
from the job and step ids, distinct for every job running at the same time on a node.
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


def allocation_hosts(env: dict[str, str] | None = None) -> list[str]:
    """The host names of the allocation, in SLURM's order (`scontrol show hostnames` expands
    ranges such as node[01-04])."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True)
        hosts = out.stdout.split()
    except (OSError, subprocess.SubprocessError):
        hosts = []
    return hosts or [nodelist.split(",")[0]]


def first_host(env: dict[str, str] | None = None) -> str:
    hosts = allocation_hosts(env)
    return hosts[0] if hosts else "127.0.0.1"


def is_this_host(host: str) -> bool:
    names = {socket.gethostname(), socket.gethostname().split(".")[0], "localhost", "127.0.0.1"}
    return host in names or host.split(".")[0] in names


def rendezvous(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for a job in the current allocation: the first host, and a free
    port probed there when this process runs on it (else the derived port)."""
    host = first_host(env)
    return host, free_port() if is_this_host(host) else derived_port(env)
