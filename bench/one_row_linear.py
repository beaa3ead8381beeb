"""How fast one row is multiplied by a model's weight matrices (a batch-1 decode step's Linears), by
three ways of computing F.linear, in one run: eager (MKL's gemv, what every eager step runs),
compiled without help (inductor calls the same gemv), and compiled under
`stages.inference.one_row_linear.OneRowLinear` (a fused multiply-and-sum, what the compiled decode
engine runs).

Per weight shape (out, in): enough float32 matrices for ~`--megabytes` MB (so that the weights come
from memory, not a cache, as in a model), multiplied in turn by one row, `--per-call` matrices per
call of the function (so a compiled call's fixed cost is shared as in a decode step); the GB/s of
weights read (medians of `--repeats` runs after a warm-up) and each way's ratio to eager. The
default shapes are SmolLM2-135M's (q/o, k/v, gate/up, down, the lm_head).

    .venv/bin/python bench/one_row_linear.py
Prints a table and writes JSON (default bench/out/one_row_linear.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import csv_list, finish, machine_info

DEFAULT_OUT = ROOT / "bench" / "out" / "one_row_linear.json"
DEFAULT_SHAPES = "576x576,192x576,1536x576,576x1536,49152x576"
WAYS = ("eager", "compiled", "compiled one-row")


def ways() -> dict:
    """{way: f(x, weights) -> list of F.linear(x, W)}."""
    import torch
    import torch.nn.functional as F

    from stages.inference.one_row_linear import with_one_row_linears

    def linears(x, weights):
        return [F.linear(x, w) for w in weights]

    return {"eager": linears, "compiled": torch.compile(linears, dynamic=False),
            "compiled one-row": torch.compile(with_one_row_linears(linears), dynamic=False)}


def measure_shape(out_f: int, in_f: int, megabytes: float, per_call: int, repeats: int) -> dict:
    import torch

    count = max(per_call, round(megabytes * 1e6 / (out_f * in_f * 4) / per_call) * per_call)
    weights = [torch.randn(out_f, in_f) for _ in range(count)]
    x = torch.randn(1, in_f)
    calls = [weights[i:i + per_call] for i in range(0, count, per_call)]
    gigabytes = count * out_f * in_f * 4 / 1e9
    row: dict = {"matrices": count, "gigabytes": gigabytes}
    reference = torch.cat([torch.nn.functional.linear(x, w) for w in calls[0]], dim=-1)
    for name, f in ways().items():
        got = torch.cat(f(x, calls[0]), dim=-1)  # warm-up (compiles) and a check
        row[f"{name} max_abs_diff"] = float((got - reference).abs().max())
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for ws in calls:
                f(x, ws)
            times.append(time.perf_counter() - start)
        row[f"{name} GB/s"] = gigabytes / statistics.median(times)
    for name in WAYS[1:]:
        row[f"{name} x eager"] = row[f"{name} GB/s"] / row["eager GB/s"]
    return row


def report(result: dict) -> str:
    lines = [f"{'shape':>10}  {'matrices':>8}  " + "  ".join(f"{w + ' GB/s':>21}" for w in WAYS)
             + f"  {'one-row x eager':>15}  {'max |diff|':>10}"]
    for shape, row in result["shapes"].items():
        lines.append(f"{shape:>10}  {row['matrices']:>8}  " + "  ".join(f"{row[w + ' GB/s']:>21.1f}" for w in WAYS)
                     + f"  {row['compiled one-row x eager']:>15.2f}  {row['compiled one-row max_abs_diff']:>10.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated OUTxIN weight shapes")
    parser.add_argument("--megabytes", type=float, default=500, help="float32 weights per shape (MB)")
    parser.add_argument("--per-call", type=int, default=8, help="matrices per call of the function")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per way after the warm-up")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON to write")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    shapes = {}
    for shape in csv_list(args.shapes):
        out_f, in_f = (int(n) for n in shape.split("x"))
        shapes[shape] = measure_shape(out_f, in_f, args.megabytes, args.per_call, args.repeats)
    result = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)}, "shapes": shapes}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
