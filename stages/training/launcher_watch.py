"""A training rank does not outlive the torchrun that launched it.

torchrun starts each rank in a session of its own (`start_new_session=True` in torch's elastic
SubprocessHandler), so when the process group of Snakemake is killed (Snakemake crashing with the
node's OOM killer taking its group, `kill -9 -PGID`, a closed terminal) the signal reaches
Snakemake, the job's shell and torchrun but not the ranks. Left alone they would train on as
orphans: finishing the run behind the user's back, writing checkpoints and the output beside the
run that `snakemake --unlock` and the same command start, which resumes from the same checkpoint
directory. So each rank watches its parent and, once the parent is gone, SIGKILLs itself: the end
it would have met had the signal reached it, which resume already handles (a checkpoint whose save
was in flight has no `checkpoint_complete.json` and is skipped).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

LAUNCHED_BY_TORCHRUN = "TORCHELASTIC_RUN_ID"  # set by torchrun in every rank's environment


def exit_with_launcher(interval_s: float = 0.5) -> threading.Thread | None:
    """Under torchrun, start a daemon thread that SIGKILLs this process within `interval_s` of its
    parent's death (the process is then re-parented, so getppid() changes). Elsewhere (a plain
    `python -m stages.<verb>`, srun, a test) it does nothing and returns None: those processes
    share their launcher's process group or cgroup and die with it."""
    if LAUNCHED_BY_TORCHRUN not in os.environ:
        return None
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        # stderr, not logging: the process is about to die and a logging handler may hold a lock
        print(f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): the launcher (pid {parent}) is gone; "
              "stopping as if killed with it", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    thread = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    thread.start()
    return thread
