"""Checkpoint save cost of the pretrain stage: synchronous against asynchronous saving.

Each mode is one real pretrain run (`torchrun --standalone --nproc_per_node 2 -m stages.pretrain`,
ZeRO stage1 over 2 data-parallel ranks; `--tp2` adds tensor_parallel_degree=2 as a second layout)
on a synthetic prepared data dir, with its own empty checkpoints directory:

- none: save_steps 0, the baseline step time;
- sync / async: save_steps N with async_save false / true (unified checkpoints);
- sync sharded / async sharded (`--sharded`): the same with unified_checkpoint false.

What is measured, per mode:

- stall: `metrics.checkpoint_save_stall_s` of meta.json, the seconds the step loop spent inside
  each save. Sync: snapshot + serialise + write + fsync + finalize. Async: the copy to CPU memory
  plus any wait for the previous save, plus the deferred finish (records gathered, index, rename,
  completion marker) at the first step where every rank's background writer is done.
- full save: the time until the checkpoint is complete on disk. Sync: the stall. Async: the stall
  plus the time from the `checkpoint-N.partial` directory appearing (the background write starts
  right after the snapshot) to `checkpoint_complete.json` appearing, both seen by a thread of
  this process polling the checkpoints directory every 5 ms. The completion is only noticed at a
  step boundary (`Checkpointer.poll`), so this includes up to one step of waiting.
- size: bytes of the newest complete `<checkpoints>/<fingerprint>/checkpoint-*` directory.
- loop s: `elapsed_s` of the last row of train_log.csv (the training loop, first step included).
- step times from train_log.csv (one row per step): `save step` is the step whose interval holds
  the save call (the step after each save's step); `other steps` all others but the first
  (warm-up); the baseline is the `none` run's median step. `overhead/save` = (sum of steps 2..N
  minus the same sum of `none`) / saves: what a save costs the loop end to end, background thread
  contention and the completion step (`poll`) included.

Read the ratios, not the absolute numbers: `async/sync stall` is what asynchronous saving buys
the step loop, `async/sync full save` what it costs in time to a durable checkpoint.

    .venv/bin/python bench/checkpoint_save.py                                   # tiny, 40 steps
    .venv/bin/python bench/checkpoint_save.py --flavour debug --steps 20 --save-steps 5
    .venv/bin/python bench/checkpoint_save.py --help
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import finish, machine_info  # noqa: E402
from stages.checkpoint.store import COMPLETE, complete_checkpoints  # noqa: E402
from stages.config import check_config  # noqa: E402
from stages.data.corpus import write_token_files  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "checkpoint_save.json"
_DIR = re.compile(r"^checkpoint-(\d+)(\.partial)?$")


def synthetic_data(out: Path, vocab_size: int, num_tokens: int) -> Path:
    """A prepared data dir of uniform random tokens (what is learned does not matter here)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, vocab_size, size=4096).tolist() for _ in range(max(1, num_tokens // 4096))]
    write_token_files(out, {"train": docs, "validation": docs[:1]}, vocab_size=vocab_size,
                      bos_id=1, eos_id=2, pad_id=0)
    return out


class SaveWatcher(threading.Thread):
    """Polls a checkpoints working directory; records when each `checkpoint-N.partial` and each
    `checkpoint-N/checkpoint_complete.json` first appear (time.perf_counter of this process)."""

    def __init__(self, root: Path, interval_s: float = 0.005):
        super().__init__(daemon=True)
        self.root, self.interval_s = root, interval_s
        self.partial: dict[int, float] = {}
        self.complete: dict[int, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            now = time.perf_counter()
            for run_dir in (p for p in _scandir(self.root) if p.is_dir()):
                for entry in _scandir(Path(run_dir.path)):
                    m = _DIR.match(entry.name)
                    if m is None:
                        continue
                    step = int(m.group(1))
                    if m.group(2):
                        self.partial.setdefault(step, now)
                    elif step not in self.complete and os.path.exists(os.path.join(entry.path, COMPLETE)):
                        self.complete[step] = now

    def stop(self) -> None:
        self._halt.set()
        self.join()


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        return list(os.scandir(path))
    except OSError:  # not created yet, or renamed under us
        return []


def pretrain(data: Path, work: Path, model: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """One 2-rank pretrain run; its stalls, per-step times, loop time, save times and checkpoint size."""
    out, ckpt = work / "out", work / "checkpoints"
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node",
           str(section["world_size"]), "-m", "stages.pretrain", "--data", str(data), "--out", str(out),
           "--checkpoints", str(ckpt), "--model-config", json.dumps(model), "--config", json.dumps(section)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ckpt.mkdir(parents=True)
    watcher = SaveWatcher(ckpt)
    watcher.start()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    finally:
        watcher.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"pretrain run failed ({' '.join(cmd[:6])} ...):\n{proc.stderr[-4000:]}")
    stalls = json.loads((out / "meta.json").read_text())["metrics"]["checkpoint_save_stall_s"]
    with open(out / "train_log.csv", newline="") as f:
        elapsed = [float(row["elapsed_s"]) for row in csv.DictReader(f)]
    every = section["save_steps"]
    saved = list(range(every, section["max_steps"], every)) if every else []  # Checkpointer.due
    if len(saved) != len(stalls) or len(elapsed) != section["max_steps"]:
        raise RuntimeError(f"expected {len(saved)} saves and {section['max_steps']} log rows, got "
                           f"{len(stalls)} stalls and {len(elapsed)} rows (logging_steps must be 1)")
    if section["async_save"]:
        full = [s + watcher.complete[n] - watcher.partial[n] if n in watcher.complete and n in watcher.partial
                else None for s, n in zip(stalls, saved)]
    else:
        full = list(stalls)
    newest = complete_checkpoints(next(ckpt.iterdir()))[-1] if saved else None
    return {"stall_s": stalls, "full_save_s": full, "saved_steps": saved,
            "step_s": [b - a for a, b in zip(elapsed, elapsed[1:])],  # step_s[i] is step i + 2
            "loop_s": elapsed[-1],
            "checkpoint_bytes": sum(p.stat().st_size for p in newest.rglob("*") if p.is_file()) if newest else 0}


def summarise(runs: list[dict[str, Any]], baseline_step_s: float | None, baseline_steps_sum: float | None
              ) -> dict[str, Any]:
    """Pool the repeats of one mode into the reported numbers (seconds, bytes)."""
    stalls = [s for r in runs for s in r["stall_s"]]
    full = [s for r in runs for s in r["full_save_s"] if s is not None]
    save_steps, other_steps = [], []
    for r in runs:
        after = {n + 1 for n in r["saved_steps"]}  # the step whose interval holds the save call
        for i, d in enumerate(r["step_s"]):
            (save_steps if i + 2 in after else other_steps).append(d)
    saves = sum(len(r["saved_steps"]) for r in runs)
    steps_sum = statistics.median(sum(r["step_s"]) for r in runs)
    return {
        "saves": saves,
        "stall_median_s": statistics.median(stalls) if stalls else None,
        "stall_total_s": sum(stalls) / len(runs),  # per run
        "full_save_median_s": statistics.median(full) if full else None,
        "checkpoint_mb": max(r["checkpoint_bytes"] for r in runs) / 1e6,
        "loop_s": statistics.median(r["loop_s"] for r in runs),
        "save_step_median_s": statistics.median(save_steps) if save_steps else None,
        "other_step_median_s": statistics.median(other_steps),
        "other_step_vs_baseline": statistics.median(other_steps) / baseline_step_s if baseline_step_s else None,
        "overhead_per_save_s": ((steps_sum - baseline_steps_sum) / (saves / len(runs))
                                if saves and baseline_steps_sum is not None else None),
        "runs": runs,
    }


MODES = {  # name -> (save, async_save, unified_checkpoint)
    "none": (False, False, True),
    "sync": (True, False, True),
    "async": (True, True, True),
    "sync sharded": (True, False, False),
    "async sharded": (True, True, False),
}


def bench_layout(args: argparse.Namespace, data: Path, work: Path, tp: int) -> dict[str, Any]:
    """Every mode of one layout, the modes interleaved within each repeat."""
    model = check_config({"experiments": {"b": {"model": {"flavour": args.flavour}}}})["experiments"]["b"]["model"]
    modes = [m for m in MODES if args.sharded or "sharded" not in m]
    raw: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            save, async_save, unified = MODES[mode]
            overrides = dict(world_size=2, sharding="stage1", tensor_parallel_degree=tp,
                             per_device_train_batch_size=args.batch_size, max_length=args.seq_len,
                             max_steps=args.steps, warmup_steps=min(args.steps // 4, 30),
                             save_steps=args.save_steps if save else 0, save_total_limit=2,
                             async_save=async_save, unified_checkpoint=unified, logging_steps=1)
            section = check_config({"experiments": {"b": {"pretrain": overrides}}})["experiments"]["b"]["pretrain"]
            print(f"tp={tp} {mode} (repeat {repeat + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
            raw[mode].append(pretrain(data, work / f"tp{tp}-{mode.replace(' ', '-')}-{repeat}", model, section))
    base = summarise(raw["none"], None, None)
    base_steps_sum = statistics.median(sum(r["step_s"]) for r in raw["none"])
    rows = {m: summarise(raw[m], base["other_step_median_s"], base_steps_sum) for m in modes}
    ratios = {}
    for suffix in ("", " sharded"):
        sync, asyn = rows.get("sync" + suffix), rows.get("async" + suffix)
        if sync and asyn:
            ratios[f"async/sync{suffix} stall (median)"] = asyn["stall_median_s"] / sync["stall_median_s"]
            ratios[f"async/sync{suffix} stall (total)"] = asyn["stall_total_s"] / sync["stall_total_s"]
            if asyn["full_save_median_s"] is not None:
                ratios[f"async/sync{suffix} full save"] = asyn["full_save_median_s"] / sync["full_save_median_s"]
    if "sync sharded" in rows:
        ratios["sharded/unified sync stall"] = rows["sync sharded"]["stall_median_s"] / rows["sync"]["stall_median_s"]
    return {"tensor_parallel_degree": tp, "data_parallel_degree": 2 // tp, "modes": rows, "ratios": ratios}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def format_report(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [f"settings: flavour={s['flavour']} steps={s['steps']} save_steps={s['save_steps']} "
             f"save_total_limit=2 batch={s['batch_size']}x{s['seq_len']} per rank, 2 ranks, ZeRO stage1, "
             f"repeats={s['repeats']}"]
    head = (f"{'mode':<15}{'saves':>6}{'stall med ms':>13}{'stall tot s':>12}{'full save ms':>13}{'ckpt MB':>9}"
            f"{'loop s':>8}{'save step ms':>13}{'other ms':>10}{'other/base':>11}{'overhead/save ms':>17}")
    for layout in result["layouts"]:
        lines += ["", f"layout: tp={layout['tensor_parallel_degree']} dp={layout['data_parallel_degree']}", head]
        for name, r in layout["modes"].items():
            rel = "-" if r["other_step_vs_baseline"] is None else f"{r['other_step_vs_baseline']:.2f}"
            lines.append(f"{name:<15}{r['saves']:>6}{_ms(r['stall_median_s']):>13}{r['stall_total_s']:>12.2f}"
                         f"{_ms(r['full_save_median_s']):>13}{r['checkpoint_mb']:>9.1f}{r['loop_s']:>8.1f}"
                         f"{_ms(r['save_step_median_s']):>13}{_ms(r['other_step_median_s']):>10}{rel:>11}"
                         f"{_ms(r['overhead_per_save_s']):>17}")
        for name, v in layout["ratios"].items():
            lines.append(f"ratio {name}: {v:.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/checkpoint_save.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", default="tiny", help="model flavour (default tiny)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    p.add_argument("--save-steps", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size (default 8)")
    p.add_argument("--seq-len", type=int, default=256, help="pretrain.max_length (default 256)")
    p.add_argument("--sharded", action="store_true", help="also run unified_checkpoint=false (sync and async)")
    p.add_argument("--tp2", action="store_true", help="also run the layout tensor_parallel_degree=2 (dp 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, interleaved (default 1)")
    p.add_argument("--data", type=Path, help="a prepared data dir (e.g. results/llama/data); default: synthetic")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the synthetic data (default 4096)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)}); checkpoints go in a temp dir beside it")
    args = p.parse_args(argv)
    if args.save_steps < 1 or args.steps <= args.save_steps or args.repeats < 1:
        p.error(f"need 1 <= --save-steps={args.save_steps} < --steps={args.steps} and --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # checkpoints go beside the output, on the disk results/ lives on, not in a RAM-backed /tmp
    with tempfile.TemporaryDirectory(prefix="checkpoint_save.", dir=args.out.parent) as tmp:
        work = Path(tmp)
        data = args.data or synthetic_data(work / "data", args.vocab_size, 64 * 4096)
        layouts = [bench_layout(args, data, work, tp) for tp in ((1, 2) if args.tp2 else (1,))]
    result = {"machine": machine_info(), "layouts": layouts,
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    return finish(args.out, result, format_report)


if __name__ == "__main__":
    sys.exit(main())
