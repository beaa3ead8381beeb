"""The process-group lifecycle of a training run: one process per rank (torchrun locally, srun
under SLURM, or a plain `python -m stages.<verb>` as a world of one), gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import torch

from stages.cluster.rendezvous import derived_port, first_host
from stages.training.launcher_watch import exit_with_launcher

log = logging.getLogger(__name__)

# What a rank reads to join its world: set by torchrun, by `init_distributed` for a srun task or a
# world of one. A process that started an in-process world hides them from what it starts next.
WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def without_world(env: Mapping[str, str], **updates: str) -> dict[str, str]:
    """`env` less WORLD_VARIABLES, with `updates`: the environment of a process started by one
    that may have joined a world of its own (a test session, a bench)."""
    return {**{name: value for name, value in env.items() if name not in WORLD_VARIABLES}, **updates}


def init_distributed() -> None:
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    exit_with_launcher()  # torchrun's ranks have a session of their own: die with torchrun, not after it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:  # one task of `srun`

        # stages.launch sets MASTER_ADDR/PORT (a port free for this job); a bare srun derives them
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          MASTER_ADDR=os.environ.get("MASTER_ADDR") or first_host(step=True),
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(derived_port()))
        if "SLURM_NTASKS_PER_NODE" in os.environ or "SLURM_STEP_TASKS_PER_NODE" in os.environ:
            per_node = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ["SLURM_STEP_TASKS_PER_NODE"]
            os.environ.setdefault("LOCAL_WORLD_SIZE", per_node.split("(")[0].split(",")[0])
    if "RANK" not in os.environ:  # a plain `python -m stages.<verb>`: a world of one
        # port 0: the store binds a port the kernel picks (nobody else connects to a world of one);
        # choosing a free port first and binding it later raced with other processes (EADDRINUSE)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or "0")
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    log.info("rank %s of %s on node %s (local rank %s, rendezvous %s:%s, %s)", os.environ["RANK"],
             os.environ["WORLD_SIZE"], os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
             os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], backend)


def finish_distributed() -> None:
    """End a successful run: every rank waits for the others, then the process groups are destroyed
    while the interpreter is whole. Left to interpreter exit, gloo's worker threads can be torn down
    mid-destruction and abort the process ("terminate called without an active exception", SIGABRT),
    failing a job whose outputs were already written. Engines left in reference cycles (ZeRO-3
    keeps communication handles) are collected first, while their process groups still exist."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
