"""The stop request of a training run (stages.training.preemption): signals set a flag and nothing
else, the deadline keeps a margin sized from the run's own save and step times, and ranks agree
on the largest reason (the run in a real 2-rank job: tests/integration/test_graceful_stop.py)."""

from __future__ import annotations

import os
import signal
import time

from stages.training.preemption import DEADLINE, MAX_SLACK_S, StopWatch, reason_name, slurm_job_window


def test_a_stop_signal_sets_the_flag_inside_and_the_old_handler_is_back_after():
    before = signal.getsignal(signal.SIGUSR1)
    with StopWatch() as watch:
        assert watch.local_reason() == 0
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)  # the handler runs between bytecodes of the main thread
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal keeps the first reason
        time.sleep(0.01)
        assert watch.local_reason() == signal.SIGUSR1
        assert watch.agreed() == signal.SIGUSR1  # no process group: this process's own reason
    assert signal.getsignal(signal.SIGUSR1) is before


def test_the_deadline_margin_grows_with_the_measured_save_and_step_times():
    now = 1_000_000.0
    watch = StopWatch()
    watch.window = (now - 3600, now + MAX_SLACK_S + 10)  # a job of more than ten minutes: the full slack
    assert watch.local_reason(now) == 0
    watch.longest_save_s, watch.longest_step_s = 4.0, 1.5  # 2 x (4 + 1.5) = 11 s more than the slack
    assert watch.margin_s() == MAX_SLACK_S + 11
    assert watch.local_reason(now) == DEADLINE
    assert "time limit" in reason_name(DEADLINE) and reason_name(signal.SIGTERM) == "SIGTERM"


def test_a_short_job_keeps_a_tenth_of_its_time_as_slack():
    watch = StopWatch()
    watch.window = (0.0, 120.0)
    assert watch.margin_s() == 12.0
    assert watch.local_reason(100.0) == 0 and watch.local_reason(108.0) == DEADLINE


def test_no_deadline_outside_slurm():
    assert slurm_job_window({}) is None
    with StopWatch(watch_deadline=True) as watch:  # no SLURM_JOB_ID here
        assert watch.window is None and watch.local_reason() == 0
