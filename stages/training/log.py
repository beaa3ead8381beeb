"""The per-step training log: `train_log.csv` (step, loss, lr, grad_norm, tokens_per_s, ...) plus a
progress bar. Rows are appended and flushed as they come so a crashed run still shows its curve;
the file is written under the stage's temporary output directory, so it only becomes part of an
artifact when the stage completes.
"""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s",
           "eval_loss", "eval_exact_match", "eval_bleu4", "eval_rouge_l")
EVAL_METRICS = ("eval_loss", "eval_exact_match", "eval_bleu4", "eval_rouge_l")  # eval_steps, else empty


class TrainLog:
    """Append one row per logged step; `enabled=False` (non-zero ranks) makes every call a no-op."""

    def __init__(self, path: str | Path, max_steps: int, enabled: bool = True, desc: str = "train",
                 flops_per_token: float | None = None, peak_flops: float | None = None,
                 previous: list[dict[str, Any]] | None = None):
        """With `flops_per_token` and `peak_flops` (FLOP/s of all devices together) each row gets
        mfu = tokens_per_s x flops_per_token / peak_flops; otherwise the column stays empty.
        `previous` rows (a resumed run's log up to its checkpoint) are written first; elapsed_s
        continues from the last of them."""
        self.enabled = enabled
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.rows: list[dict[str, Any]] = list(previous or [])
        if not enabled:
            return
        self._file = open(path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=COLUMNS, restval="")
        self._writer.writeheader()
        self._writer.writerows(self.rows)
        done = int(self.rows[-1]["step"]) if self.rows else 0
        self._bar = tqdm(total=max_steps, initial=done, desc=desc, mininterval=2.0, dynamic_ncols=True)
        self._start = time.perf_counter() - (float(self.rows[-1]["elapsed_s"]) if self.rows else 0.0)
        self._last = self._start

    def log(self, step: int, loss: float, lr: float, grad_norm: float | None, tokens: int,
            evaluation: dict[str, float] | None = None) -> None:
        """Record optimizer step `step` (1-based); `tokens` is the number of tokens all ranks
        consumed since the previous logged row; `evaluation` the dev metrics measured after it."""
        if not self.enabled:
            return
        now = time.perf_counter()
        tokens_per_s = tokens / max(now - self._last, 1e-9)
        mfu = (tokens_per_s * self.flops_per_token / self.peak_flops
               if self.flops_per_token and self.peak_flops else None)
        row = {"step": step, "loss": f"{loss:.6f}", "lr": f"{lr:.6e}",
               "grad_norm": "" if grad_norm is None else f"{grad_norm:.6f}", "tokens": tokens,
               "tokens_per_s": f"{tokens_per_s:.1f}", "mfu": "" if mfu is None else f"{mfu:.5f}",
               "elapsed_s": f"{now - self._start:.3f}",
               **{k: "" if (evaluation or {}).get(k) is None else f"{evaluation[k]:.6f}" for k in EVAL_METRICS}}
        self._last = now
        self.rows.append(row)
        self._writer.writerow(row)
        self._file.flush()
        self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.enabled:
            self._bar.update(n)

    def close(self) -> None:
        if self.enabled:
            self._bar.close()
            self._file.close()
