"""What a stage's log shows: one logging format, a first line naming what the stage reads and
writes, and periodic progress lines for its long loops.

A rule's log is a file (`> {log} 2>&1`), not a terminal, so progress is a log line now and then
rather than a carriage-return bar (a tqdm bar in a file is one long line of `\\r` frames):

    2026-11-26 01:42:25,700 __main__ INFO evaluate: reads results/llama/quant/gptq-w4 (model), ...
    2026-11-26 01:42:27,310 stages.metrics.perplexity INFO perplexity windows 12/23 (52%), 1.2 s elapsed, ~1.1 s left

`Progress` logs the last item, and on the way when the count crosses a tenth of the total
(`lines` sets how many) at least `min_interval_s` after its previous line, or when `heartbeat_s`
have passed without one: a loop of a second logs one line, one of ten minutes about ten, one of
hours a line a minute. What a line says is deterministic apart from its timings; which milestones
get a line depends on the speed. The cost is a clock read per update.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
MIN_INTERVAL_S = 5.0  # milestones closer than this to the previous line are not logged
HEARTBEAT_S = 60.0  # a long loop logs at least this often (at its next update), whatever its milestones

T = TypeVar("T")
Paths = str | Path | Iterable[str | Path] | None


# Libraries that log a line per graph node or initializer at INFO: the export of SmolLM2-135M wrote
# 3,300 such lines (onnxruntime's MatMulNBits quantizer 2,351, onnx_ir's initializer deduplication
# 749, onnxscript's constant folding 195) around its 6 own; their warnings still show.
CHATTY_LOGGERS = ("onnxruntime.quantization", "onnx_ir", "onnxscript")


def configure_logging() -> None:
    """The logging setup of every stage's command line: INFO and above to stderr, LOG_FORMAT;
    CHATTY_LOGGERS from WARNING up."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _listing(items: Mapping[str, Paths]) -> str:
    named = []
    for what, paths in items.items():
        paths = [] if paths is None else [paths] if isinstance(paths, (str, Path)) else list(paths)
        if paths:
            named.append(f"{', '.join(map(str, paths))} ({what})")
    return ", ".join(named) or "nothing"


def io_line(verb: str, reads: Mapping[str, Paths], writes: Mapping[str, Paths]) -> str:
    """`<verb>: reads <path> (<what>), ...; writes <path> (<what>), ...` from {what: path(s)};
    a None (or empty) path is left out: an optional input that was not given."""
    return f"{verb}: reads {_listing(reads)}; writes {_listing(writes)}"


def log_io(verb: str, reads: Mapping[str, Paths], writes: Mapping[str, Paths],
           logger: logging.Logger | None = None) -> str:
    """Log `io_line` (on rank 0 only when torchrun started the process) and return it. Every
    stage calls this before it starts its work, so a rule's log opens with what the rule is about."""
    line = io_line(verb, reads, writes)
    if os.environ.get("RANK", "0") == "0":
        (logger or logging.getLogger(f"stages.{verb}")).info("%s", line)
    return line


def duration(seconds: float) -> str:
    """`4.2 s`, `3 min 05 s`, `1 h 02 min`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


class Progress:
    """Progress lines for a loop over `total` items:

        <what> <done>/<total> (<pct>%), <elapsed> elapsed[, ~<left> left][: <detail>]

    logged when `done` reaches `total`; before that when it crosses one of `lines` milestones
    (each 1/lines of `total`; every item when lines >= total) at least `min_interval_s` after the
    previous line, and at the first update `heartbeat_s` after it. min_interval_s=0 logs every
    milestone (a line per step of a few named steps). `eta=False` leaves out the time left, for
    steps of unequal length."""

    def __init__(self, logger: logging.Logger, what: str, total: int, *, lines: int = 10,
                 min_interval_s: float = MIN_INTERVAL_S, heartbeat_s: float = HEARTBEAT_S, eta: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        if lines < 1:
            raise ValueError(f"Progress lines={lines} must be at least 1")
        self.logger, self.what, self.total, self.lines = logger, what, total, lines
        self.min_interval_s, self.heartbeat_s, self.eta, self.clock = min_interval_s, heartbeat_s, eta, clock
        self.done = 0
        self.start = self.last_line = clock()
        self._milestone = 0  # the last milestone logged

    def _milestone_of(self, done: int) -> int:
        return done * self.lines // self.total if self.total > 0 else self.lines

    def advance(self, n: int = 1, detail: str = "") -> None:
        """Count `n` more items done and log a line if one is due (see the class). `detail` ends
        the line."""
        self.done += n
        now = self.clock()
        milestone = self._milestone_of(self.done)
        since = now - self.last_line
        if (self.done >= self.total or since >= self.heartbeat_s
                or (milestone > self._milestone and since >= self.min_interval_s)):
            self._milestone, self.last_line = milestone, now
            self.logger.info("%s", self.line(now, detail))

    def line(self, now: float, detail: str = "") -> str:
        elapsed = now - self.start
        pct = 100 * self.done // self.total if self.total > 0 else 100
        text = f"{self.what} {self.done}/{self.total} ({pct}%), {duration(elapsed)} elapsed"
        if self.eta and 0 < self.done < self.total:
            text += f", ~{duration(elapsed * (self.total - self.done) / self.done)} left"
        return f"{text}: {detail}" if detail else text


def progress_iter(items: Collection[T], logger: logging.Logger, what: str, **kwargs) -> Iterator[T]:
    """Yield `items`, counting each one done when the next is asked for (or the loop ends), with a
    `Progress` over len(items); kwargs go to Progress."""
    progress = Progress(logger, what, len(items), **kwargs)
    for item in items:
        yield item
        progress.advance()
