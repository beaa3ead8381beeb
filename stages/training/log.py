"""The per-step training log: `train_log.csv` (step, loss, lr, grad_norm, tokens_per_s, ...), the
same rows as TensorBoard scalars in event files beside it (`tensorboard --logdir <dir>`), plus a
progress bar. Rows are appended and flushed as they come so a crashed run still shows its curve;
the files are written under the stage's temporary output directory, so they only become part of an
artifact when the stage completes.
"""

from __future__ import annotations

import csv
import logging
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from stages.stage_logs import Progress

log = logging.getLogger(__name__)

COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s",
           "eval_loss", "eval_exact_match", "eval_bleu4", "eval_rouge_l")
EVAL_METRICS = ("eval_loss", "eval_exact_match", "eval_bleu4", "eval_rouge_l")  # eval_steps, else empty
# CSV column -> TensorBoard scalar tag; `step` is the scalars' step, `elapsed_s` sets their wall time too.
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
        "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "elapsed_s": "train/elapsed_s",
        "eval_loss": "eval/loss", "eval_exact_match": "eval/exact_match", "eval_bleu4": "eval/bleu4",
        "eval_rouge_l": "eval/rouge_l"}
EVENT_FILES = "events.out.tfevents.*"  # the names TensorBoard's writers give their files


def event_files(directory: str | Path) -> list[Path]:
    """The TensorBoard event files in `directory` (TrainLog writes one beside train_log.csv)."""
    return sorted(Path(directory).glob(EVENT_FILES))


class TrainLog:
    """Append one row per logged step to train_log.csv and, as scalars (`TAGS`) at the row's step,
    to a TensorBoard event file in the same directory; `enabled=False` (non-zero ranks) makes
    every call a no-op."""

    def __init__(self, path: str | Path, max_steps: int, enabled: bool = True, desc: str = "train",
                 flops_per_token: float | None = None, peak_flops: float | None = None,
                 previous: list[dict[str, Any]] | None = None, logits_flops_per_token: float = 0,
                 columns: tuple[str, ...] = ()):
        """With `flops_per_token` and `peak_flops` (FLOP/s of all devices together) each row gets
        mfu = the FLOPs of its tokens / seconds / peak_flops; otherwise the column stays empty. A
        token costs flops_per_token, less `logits_flops_per_token` (the vocabulary projection) where
        its next token is not learned and the step skipped it (`log(..., learned=)`).
        `previous` rows (a resumed run's log up to its checkpoint) are written first, to both files;
        elapsed_s continues from the last of them. Event files already in the directory (a run that
        stopped before this one) are removed, as train_log.csv is overwritten, so TensorBoard shows
        one curve. `columns`: more columns after `COLUMNS` (preference training's statistics), each
        a scalar tagged train/<column>, filled by `log(extra=)`."""
        self.enabled = enabled
        self.columns = (*COLUMNS, *columns)
        self.tags = {**TAGS, **{column: f"train/{column}" for column in columns}}
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.logits_flops_per_token = logits_flops_per_token
        self.rows: list[dict[str, Any]] = list(previous or [])
        if not enabled:
            return
        self._file = open(path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns, restval="")
        self._writer.writeheader()
        self._writer.writerows(self.rows)
        done = int(self.rows[-1]["step"]) if self.rows else 0
        # a bar on a terminal; in a file (a rule's log) progress lines instead of `\r` frames
        self._bar = (tqdm(total=max_steps, initial=done, desc=desc, mininterval=2.0, dynamic_ncols=True)
                     if sys.stderr.isatty() else None)
        self._progress = Progress(log, f"{desc}: steps", max_steps)
        self._progress.done = done
        self._postfix = ""
        elapsed = float(self.rows[-1]["elapsed_s"]) if self.rows else 0.0
        self._start = time.perf_counter() - elapsed
        self._last = self._start
        self._wall_start = time.time() - elapsed  # a row's wall time is this + its elapsed_s
        self._events = self._open_events(Path(path).parent)

    def _open_events(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter  # not at the top: tensorboard takes ~0.3 s to import

        for stale in event_files(directory):
            stale.unlink()
        events = SummaryWriter(log_dir=str(directory))
        for row in self.rows:
            self._add_scalars(events, row)
        events.flush()
        return events

    def _add_scalars(self, events, row: dict[str, Any]) -> None:
        """The row's filled columns as float32 scalars: float() of the CSV's text, so both files agree."""
        walltime = self._wall_start + float(row["elapsed_s"])
        for column, tag in self.tags.items():
            if row.get(column, "") != "":
                events.add_scalar(tag, float(row[column]), int(row["step"]), walltime=walltime)

    def log(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int,
            evaluation: dict[str, float] | None = None, learned: int | None = None,
            extra: dict[str, float] | None = None) -> None:
        """Record optimizer step `step` (1-based); `tokens` is the number of tokens all ranks
        consumed since the previous logged row, `learned` how many of them had a learned next token
        (None: all); `evaluation` the dev metrics measured after it; `extra` the values of the
        extra `columns`."""
        if not self.enabled:
            return
        now = time.perf_counter()
        seconds = max(now - self._last, 1e-9)
        tokens_per_s = tokens / seconds
        mfu = None
        if self.flops_per_token and self.peak_flops:
            skipped = 0 if learned is None else tokens - learned
            flops = tokens * self.flops_per_token - skipped * self.logits_flops_per_token
            mfu = flops / seconds / self.peak_flops
        row = {"step": step, "loss": f"{loss:.6f}", "lr": f"{lr:.6e}",
               "grad_norm": "" if grad_norm is None else f"{grad_norm:.6f}", "tokens": tokens,
               "tokens_per_s": f"{tokens_per_s:.1f}", "mfu": "" if mfu is None else f"{mfu:.5f}",
               "elapsed_s": f"{now - self._start:.3f}",
               **{k: "" if (evaluation or {}).get(k) is None else f"{evaluation[k]:.6f}" for k in EVAL_METRICS},
               **{k: f"{v:.6f}" for k, v in (extra or {}).items()}}
        self._last = now
        self.rows.append(row)
        self._writer.writerow(row)
        self._file.flush()
        self._add_scalars(self._events, row)
        self._events.flush()
        self._postfix = f"loss {loss:.4f}, lr {lr:.2e}"
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)

    def advance(self, n: int = 1) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
        else:
            self._progress.advance(n, self._postfix)

    def close(self) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.close()
            self._file.close()
            self._events.close()
