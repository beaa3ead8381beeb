"""Start the ranks of a training stage: torchrun on this machine, srun inside a SLURM allocation.

    python -m stages.launch --nproc 4 [--nodes 2] -- stages.pretrain --data ... --out ...

One rule text serves both worlds, so the training rules call this instead of choosing a launcher:

- outside SLURM: `torchrun --standalone --nproc_per_node N -m <module> ...` (one node; torchrun
  sets RANK/LOCAL_RANK/WORLD_SIZE and picks its own rendezvous port); for one rank, `python -m
  <module> ...` itself, a world of one (stages.training.distributed.init_distributed): torchrun's
  agent would add ~1.8 s of start-up on 2 CPU cores and a process between the job and its rank;
- inside an allocation (SLURM_JOB_ID set: a batch job of the slurm profile, or `salloc`):
  `srun --overlap --kill-on-bad-exit=1 --ntasks N --nodes M --ntasks-per-node N/M python -m <module>`.
  Training jobs declare `mpi` (stages.cluster.resources), so the slurm executor runs the rule's
  shell command in the batch step and this srun is the job's only step (a signal sent to the
  job's steps, `scancel --signal=TERM`, reaches the ranks and not the executor's Snakemake). Run
  inside a step instead (`srun -n1`, which holds the job's CPUs and memory), a plain nested srun
  waits for them forever ("step creation temporarily disabled"): `--overlap` lets the training
  step share them. The executor drops the job's SLURM_* variables but SLURM_JOB_ID from the
  command's environment, so CPUs per task and the node list are asked from slurmctld.
  `--kill-on-bad-exit` ends every rank when one fails instead of leaving the others blocked in a
  collective until the time limit. The
  rendezvous host is the first node of the allocation, the port free there for this job
  (stages.cluster.rendezvous); each rank reads its rank from SLURM_PROCID
  (stages.training.distributed.init_distributed).
  The executor's step describes itself, not the job, in SLURM_JOB_NODELIST (one node): the srun gets
  the job's node list from slurmctld instead, else a multi-node step is refused ("Only allocated 1
  nodes asked for 2").

The process replaces itself with the launcher (exec), so a signal to the job reaches srun/torchrun
(or the one rank) directly. NCCL or gloo is chosen by each rank
(stages.training.distributed.init_distributed: NCCL when CUDA is there).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

from stages.cluster.rendezvous import job_nodelist, rendezvous


def inside_slurm(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return bool(env.get("SLURM_JOB_ID"))


def job_cpus_per_task(env: dict[str, str]) -> str:
    """CPUs per task of the job SLURM_JOB_ID as slurmctld holds it (`CPUs/Task=` of `scontrol show
    job`); "" when it does not answer (srun then uses its default of one)."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", env["SLURM_JOB_ID"]], capture_output=True,
                             text=True, timeout=30, check=True, env=env).stdout
    except (KeyError, OSError, subprocess.SubprocessError):
        return ""
    match = re.search(r"\bCPUs/Task=(\d+)", out)
    return match.group(1) if match else ""


def srun_command(nproc: int, nodes: int, module: str, args: list[str], env: dict[str, str]) -> list[str]:
    """The srun line of a training step inside the current allocation."""
    if nproc % nodes:
        raise SystemExit(f"stages.launch: --nproc {nproc} is not a multiple of --nodes {nodes}")
    cpus = env.get("SLURM_CPUS_PER_TASK") or job_cpus_per_task(env)
    return ["srun", "--overlap", "--kill-on-bad-exit=1", f"--ntasks={nproc}", f"--nodes={nodes}",
            f"--ntasks-per-node={nproc // nodes}", *([f"--cpus-per-task={cpus}"] if cpus else []),
            "--export=ALL", sys.executable, "-m", module, *args]


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """The torchrun line of a training run on this machine."""
    torchrun = shutil.which("torchrun")  # else this interpreter's (a venv not on PATH)
    launcher = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc_per_node={nproc}", "-m", module, *args]


# What Snakemake sets to a job's `threads` for its whole shell command (snakemake.shell).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def threads_per_rank(env: dict[str, str], nproc: int) -> dict[str, str]:
    """Each rank's share of the job's threads. Snakemake sets OMP_NUM_THREADS & co to the rule's
    `threads` for the whole command and torchrun hands that to every rank, so `nproc` ranks would
    run nproc x threads threads on `threads` cores (pretraining's two ranks on two cores: 8% slower
    per step, tiny model). Unset variables stay unset (torchrun then gives each rank 1)."""
    shares = {}
    for name in THREAD_VARIABLES:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            shares[name] = str(max(1, int(value) // nproc))
    return shares


def launch_command(nproc: int, nodes: int, module: str, args: list[str],
                   env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) that start `module` with `nproc` ranks here or in the allocation."""
    env = dict(env)
    if not inside_slurm(env):
        if nodes > 1:
            raise SystemExit(f"stages.launch: --nodes {nodes} outside a SLURM allocation: torchrun here "
                             "starts ranks on this machine only; run through the slurm profile "
                             "(--workflow-profile workflow/profiles/slurm) or inside salloc")
        env.update(threads_per_rank(env, nproc))
        if nproc == 1:
            return [sys.executable, "-m", module, *args], env
        return torchrun_command(nproc, module, args), env
    nodelist = job_nodelist(env)
    if nodelist:  # the job's nodes, not those of the executor's one-node step
        env.update(SLURM_JOB_NODELIST=nodelist, SLURM_NODELIST=nodelist)
    host, port = rendezvous(env)
    env.update(MASTER_ADDR=host, MASTER_PORT=str(port))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # the ranks take theirs from SLURM_PROCID & co
        env.pop(name, None)
    return srun_command(nproc, nodes, module, args, env), env


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: python -m stages.launch --nproc N [--nodes M] -- <module> [args...]")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m stages.launch")
    parser.add_argument("--nproc", type=int, required=True, help="ranks in all (world_size)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the ranks spread over (SLURM only)")
    opts = parser.parse_args(argv[:split])
    module, *args = argv[split + 1:]
    command, env = launch_command(opts.nproc, opts.nodes, module, args, dict(os.environ))
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} stages.launch: {' '.join(command)}"
          + (f" (MASTER_ADDR={env['MASTER_ADDR']} MASTER_PORT={env['MASTER_PORT']})" if "MASTER_PORT" in env
             and inside_slurm(env) else ""), file=sys.stderr, flush=True)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
