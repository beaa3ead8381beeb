"""Errors the user can fix, and how a stage's command line reports them.

Every check of user input (config keys, data files, model directories, weight files) raises a
subclass of `InputError` whose message names the file, line or config key and the fix. A stage run
from the command line prints that message as one line and exits with status 2, without a Python
traceback (which would bury the message under frames of our code); any other exception is a bug
and keeps its traceback. LLM_LIFECYCLE_TRACEBACK=1 shows the traceback of input errors too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

INPUT_ERROR_STATUS = 2  # as argparse uses for a bad command line
RERUN_STATUS = 75  # EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint saved; run it again


class InputError(ValueError):
    """Bad input the user can fix; the message names where it is and how to fix it."""


class ConfigError(InputError):
    """A config value the pipeline cannot use; the message names the key and the fix."""


class DiskFullError(InputError):
    """A write ran out of disk space (ENOSPC, EDQUOT); the message names the path, the space the
    write needed and what is free. What was written before is intact."""


class StopRequested(Exception):
    """A training run asked to stop (a signal, the job's deadline) saved a checkpoint and stopped
    (stages.training.preemption); the message says where and how to resume."""

    def __init__(self, reason: str, step: int, max_steps: int, checkpoint: str | None):
        self.reason, self.step, self.max_steps, self.checkpoint = reason, step, max_steps, checkpoint
        saved = (f"checkpoint {checkpoint} saved; rerun the same command to resume from step {step}"
                 if checkpoint else "no checkpoint directory was given, so a rerun starts over")
        super().__init__(f"stopped by {reason} at step {step} of {max_steps}: {saved}")


def run_cli(main: Callable[[], Any], verb: str) -> None:
    """Run a stage's `main()` as the process's entry point and exit: 0 on success (whatever main
    returns unless it is an int), 2 with `<verb>: error: <message>` on stderr for an InputError,
    RERUN_STATUS with `<verb>: <message>` for a training run stopped on request."""
    try:
        status = main()
    except StopRequested as e:
        rank = os.environ.get("RANK")
        if rank in (None, "0"):
            print(f"{verb}: {e}", file=sys.stderr, flush=True)
        sys.exit(RERUN_STATUS)
    except InputError as e:
        if os.environ.get("LLM_LIFECYCLE_TRACEBACK") == "1":
            raise
        rank = os.environ.get("RANK")
        where = f" (rank {rank})" if rank not in (None, "0") else ""
        print(f"{verb}{where}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(INPUT_ERROR_STATUS)
    sys.exit(status if isinstance(status, int) else 0)
