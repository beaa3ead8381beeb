"""Stop soon, cleanly: a training run asked to stop saves a checkpoint and exits to be rerun.

A cluster ends jobs that are not finished: at their time limit, on preemption, on `scancel`.
Without a handler the work since the last periodic checkpoint is lost. Here:

- SIGTERM and SIGUSR1 set a flag; the handler does nothing else, so a signal that lands
  mid-collective or mid-save changes nothing there (torchrun forwards both to every rank and gives
  them 30 s before SIGKILL; a `kill` of one rank is enough, see below);
- under SLURM, rank 0 reads the job's end time (`squeue -o %e`, again every DEADLINE_REFRESH_S
  in a background thread, so `scontrol update TimeLimit=` is seen) and the run stops on its own
  once the time left is below a margin: slack (min(60 s, a tenth of the job's time limit)) plus
  twice the longest save and twice the longest step this run has measured. Nothing has to be
  signalled: under the Snakemake SLURM executor a signal to the job also reaches the executor's
  own Snakemake process and the srun of the step, which end the step before the ranks could save;
- after every optimizer step all ranks agree (one all-reduce of one integer, MAX) whether any of
  them was asked to stop, so they stop at the same step even when only one got the signal;
- the step loop then saves a complete checkpoint there (the normal atomic path), waits for it,
  and raises `stages.errors.StopRequested`; the stage exits with RERUN_STATUS (75, EX_TEMPFAIL
  of sysexits.h: "try again later"). Inside a SLURM job rank 0 first asks `scontrol requeue`
  for it (at most MAX_REQUEUES times, SLURM_RESTART_COUNT), so SLURM queues it again, the
  Snakemake executor, which sees it pending, waits for it, and the rerun resumes from that
  checkpoint exactly as after any other stop.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from datetime import datetime

import torch

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEADLINE = 1000  # the reason code of a stop by the allocation's deadline (beyond every signal number)
MAX_SLACK_S = 60.0  # time kept before the job's end beyond the measured save and step times
DEADLINE_REFRESH_S = 15.0  # how often rank 0 asks SLURM for the job's end time again
MAX_REQUEUES = int(os.environ.get("LLM_LIFECYCLE_MAX_REQUEUES", "20"))  # then the job ends, to be rerun by hand


def reason_name(code: int) -> str:
    if code == DEADLINE:
        return "the SLURM job's time limit (deadline)"
    try:
        return signal.Signals(code).name
    except ValueError:
        return f"signal {code}"


def slurm_job_window(env: dict[str, str] | None = None) -> tuple[float, float] | None:
    """(start, end) of this SLURM job in epoch seconds (the end is its time limit), or None outside
    SLURM, for a job without a limit, or when squeue cannot tell (no squeue on PATH, slurmctld not
    answering)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%S|%e"], capture_output=True, text=True,
                             timeout=30, check=True).stdout.strip()
        start, end = out.split("|")
        return datetime.fromisoformat(start).timestamp(), datetime.fromisoformat(end).timestamp()  # local time
    except (subprocess.SubprocessError, OSError, ValueError):  # "N/A", "Unknown", an unreachable controller
        return None


def requeue_slurm_job(env: dict[str, str] | None = None) -> bool:
    """Ask SLURM to queue this job again (it is killed and restarted from its batch script). False,
    with a warning, when it cannot (not a requeueable job, already being requeued)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID")
    if not job or shutil.which("scontrol") is None:
        return False
    restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    if restarts >= MAX_REQUEUES:
        log.warning("SLURM job %s was requeued %d times (LLM_LIFECYCLE_MAX_REQUEUES=%d): not again; it ends, "
                    "and rerunning the workflow resumes from the checkpoint", job, restarts, MAX_REQUEUES)
        return False
    try:
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        failure = None if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()
    except (subprocess.SubprocessError, OSError) as exc:  # a controller that does not answer
        failure = str(exc)
    if failure is not None:
        log.warning("scontrol requeue %s failed (%s); the job ends and is rerun by the profile's retries",
                    job, failure)
        return False
    log.info("SLURM job %s requeued: it resumes from the checkpoint when it starts again", job)
    return True


class StopWatch:
    """What asks the run to stop: SIGTERM/SIGUSR1 received by this process, or (`watch_deadline`,
    rank 0 inside a SLURM job) the job's time limit. Use as a context manager around the step
    loop: the handlers are installed in the main thread only (elsewhere, e.g. a run in a test's
    thread, signals keep their previous handling) and the deadline thread stops on exit."""

    def __init__(self, watch_deadline: bool = False):
        self.received = 0
        self.window: tuple[float, float] | None = None  # the SLURM job's (start, end), epoch seconds
        self.longest_save_s = 0.0
        self.longest_step_s = 0.0
        self._previous: dict[int, object] = {}
        self._watch_deadline = watch_deadline
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StopWatch:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        if self._watch_deadline and os.environ.get("SLURM_JOB_ID"):
            self.window = slurm_job_window()
            self._thread = threading.Thread(target=self._refresh, name="slurm-deadline", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._closed.set()

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum

    def _refresh(self) -> None:
        while not self._closed.wait(DEADLINE_REFRESH_S):
            window = slurm_job_window()
            if window is not None:
                self.window = window

    def margin_s(self) -> float:
        """Time to keep before the deadline: slack, two of the longest save and of the longest step."""
        slack = MAX_SLACK_S if self.window is None else min(MAX_SLACK_S, 0.1 * (self.window[1] - self.window[0]))
        return slack + 2 * self.longest_save_s + 2 * self.longest_step_s

    def local_reason(self, now: float | None = None) -> int:
        if self.received:
            return self.received
        if self.window is not None and (now or time.time()) + self.margin_s() >= self.window[1]:
            return DEADLINE
        return 0

    def agreed(self, device: torch.device | str = "cpu") -> int:
        """The reason to stop after this step, the same on every rank: 0 (go on), a signal number or
        DEADLINE. Collective over the default group (one all-reduce of one integer)."""
        import torch.distributed as dist

        reason = torch.tensor([self.local_reason()], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(reason, op=dist.ReduceOp.MAX)
        return int(reason.item())
