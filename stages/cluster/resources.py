"""SLURM resources of each rule, derived from the experiment rather than written in the profile.

A training rule (pretrain, finetune) runs `world_size` ranks: with GPUs one rank per GPU and
`min(world_size, gpus_per_node)` ranks per node; on CPU `cluster.tasks_per_node` ranks per node
(default: all on one node). Its memory per node is what its ranks need on the host: on CPU the
planned training memory of each rank (stages/planning/memory.py), with GPUs the host side of a rank
(loading the checkpoint and offloaded optimizer state); plus a per-process allowance for the Python
runtime, torch and DeepSpeed. Every other rule is one process with `cpus_per_task` cores and memory
for a few fp32 copies of the model. `cluster.node_memory_gb` overrides the derived memory.

The names are the slurm executor plugin's: nodes, tasks, cpus_per_task, mem_mb, runtime,
slurm_partition, slurm_account, gres + tasks_per_gpu (GPU jobs), slurm_extra.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from stages.errors import ConfigError

RUNTIME_ALLOWANCE_BYTES = 1_500_000_000  # one rank's Python + torch + DeepSpeed + gloo buffers (measured ~1.1 GB)
HOST_HEADROOM = 1.25  # allocator fragmentation, checkpoint copies written in the background


@dataclass(frozen=True)
class RankLayout:
    """Where a training rule's ranks run."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


def rank_layout(exp: dict[str, Any], section: dict[str, Any], key: str) -> RankLayout:
    """Nodes and ranks per node of a training section (`key` names it in errors)."""
    cluster = exp["cluster"]
    world, gpus = section["world_size"], cluster["gpus_per_node"]
    per_node = min(world, gpus) if gpus else (cluster["tasks_per_node"] or world)
    per_node = min(per_node, world)
    if world % per_node:
        what = f"gpus_per_node={gpus}" if gpus else f"tasks_per_node={cluster['tasks_per_node']}"
        raise ConfigError(f"{key}.world_size={world} does not fill whole nodes of cluster.{what}: use a "
                          f"world_size that is a multiple of {per_node} (or fewer ranks than one node holds)")
    return RankLayout(nodes=world // per_node, tasks_per_node=per_node, gpus_per_node=min(gpus, per_node))


# A rule without a limit of its own in cluster.runtime_minutes takes its kin's before `default`:
# align trains as fine-tuning does (the schema gives finetune a default, not align: a default for it
# would change every experiment's cluster section, and so its plan's params).
RUNTIME_KIN = {"align": "finetune", "merge_align": "merge_lora"}


def runtime_minutes(exp: dict[str, Any], rule: str) -> int:
    limits = exp["cluster"]["runtime_minutes"]
    for name in (rule, RUNTIME_KIN.get(rule)):
        if name in limits:
            return int(limits[name])
    return int(limits["default"])


def site_settings(exp: dict[str, Any]) -> dict[str, str]:
    """Partition and account: the config's, else SBATCH_PARTITION / SBATCH_ACCOUNT from the
    environment (SLURM's own variables), else nothing (the cluster's default partition; the
    executor guesses an account where accounting exists)."""
    cluster = exp["cluster"]
    settings = {}
    partition = cluster["partition"] or os.environ.get("SBATCH_PARTITION")
    account = cluster["account"] or os.environ.get("SBATCH_ACCOUNT")
    if partition:
        settings["slurm_partition"] = partition
    if account:
        settings["slurm_account"] = account
    return settings


def node_memory_mb(exp: dict[str, Any], per_rank_host_bytes: int, tasks_per_node: int) -> int:
    """sbatch --mem of a job whose `tasks_per_node` ranks each need `per_rank_host_bytes`."""
    if exp["cluster"]["node_memory_gb"]:
        return int(exp["cluster"]["node_memory_gb"] * 1000)
    need = tasks_per_node * (per_rank_host_bytes + RUNTIME_ALLOWANCE_BYTES) * HOST_HEADROOM
    return 1000 * math.ceil(need / 1e9)  # whole GB


def training_resources(exp: dict[str, Any], section: dict[str, Any], key: str, rule: str,
                       per_rank_host_bytes: int) -> dict[str, Any]:
    """The resources of a training job: one task per rank over `nodes` nodes."""
    layout = rank_layout(exp, section, key)
    resources: dict[str, Any] = {
        "nodes": layout.nodes,
        "tasks": layout.tasks,
        "cpus_per_task": exp["cluster"]["cpus_per_task"],
        "mem_mb": node_memory_mb(exp, per_rank_host_bytes, layout.tasks_per_node),
        "runtime": runtime_minutes(exp, rule),
        **site_settings(exp),
    }
    if layout.tasks > 1:  # the executor refuses `mpi` for one task
        # the executor runs the job's Snakemake in the batch step instead of a `srun -n1` step, so
        # the training step (stages.launch's srun) is the job's only step: `scancel --signal=TERM`
        # (steps only) reaches the ranks, which save, and not the Snakemake that waits for them
        resources["mpi"] = "srun"
    if layout.gpus_per_node:
        resources.update(gres=f"gpu:{layout.gpus_per_node}", tasks_per_gpu=1)
    elif layout.nodes > 1:
        resources["slurm_extra"] = f"--ntasks-per-node={layout.tasks_per_node}"
    return resources


def single_process_resources(exp: dict[str, Any], rule: str, model_bytes_fp32: int) -> dict[str, Any]:
    """The resources of a one-process job (prepare, merges, quantize, export, evaluate, ...): room
    for three fp32 copies of the model (the weights, a converted or quantized copy, the file being
    written), at least 2 GB."""
    if exp["cluster"]["node_memory_gb"]:
        mem_mb = int(exp["cluster"]["node_memory_gb"] * 1000)
    else:
        mem_mb = max(2000, 1000 * math.ceil((3 * model_bytes_fp32 + RUNTIME_ALLOWANCE_BYTES) / 1e9))
    return {"nodes": 1, "tasks": 1, "cpus_per_task": exp["cluster"]["cpus_per_task"], "mem_mb": mem_mb,
            "runtime": runtime_minutes(exp, rule), **site_settings(exp)}
