"""bf16 attention on this CPU: PyTorch's bf16 kernel against its fp32 kernel on the same inputs.

`stages.model.attention_precision` runs a bf16 model's attention in fp32 on a CPU without AMX where
head dim <= 64 and keys x head dim <= 8,192. This script measures what that rule rests on: for head
dims 32 / 64 / 128 and sequence lengths 16 ... 1024 (always 4,096 tokens per call, causal, 8 heads)
it times SDPA's forward + backward on bf16 q, k, v, and the same with q, k, v cast to fp32 and the
output cast back (the casts inside the timing), interleaved over rounds, and prints which one the
rule picks and whether that is the faster one here. Rerun it on another CPU (one with AMX, say) to
see whether the rule holds there.

    .venv/bin/python bench/attention_precision.py              # 1 thread, as one rank of the default run
    .venv/bin/python bench/attention_precision.py --threads 2
    .venv/bin/python bench/attention_precision.py --quick      # two shapes, a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import finish, git_commit, machine_info  # noqa: E402

TOKENS_PER_CALL = 4096
HEADS = 8
DEFAULT_OUT = ROOT / "bench" / "out" / "attention_precision.json"


def call_seconds(q, k, v, grad, fp32: bool, calls: int) -> list[float]:
    """Seconds of each of `calls` causal attention forward + backward passes of bf16 q, k, v."""
    import torch.nn.functional as F

    times = []
    for _ in range(calls):
        q.grad = k.grad = v.grad = None
        start = time.perf_counter()
        if fp32:
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(grad)
        times.append(time.perf_counter() - start)
    return times


def run_shape(head_dim: int, length: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from stages.model.attention_precision import attention_in_fp32

    rows = max(1, TOKENS_PER_CALL // length)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, HEADS, length, head_dim, generator=g).bfloat16().requires_grad_()
               for _ in range(3))
    grad = torch.randn(rows, HEADS, length, head_dim, generator=g).bfloat16()
    times: dict[str, list[float]] = {"bf16": [], "fp32": []}
    for way in times:
        call_seconds(q, k, v, grad, way == "fp32", args.warmup)
    for _ in range(args.rounds):  # interleaved: a slow stretch of the machine hits both ways
        for way in times:
            times[way] += call_seconds(q, k, v, grad, way == "fp32", args.calls)
    median = {way: statistics.median(t) for way, t in times.items()}
    picks_fp32 = attention_in_fp32(q, length)
    faster = "fp32" if median["fp32"] < median["bf16"] else "bf16"
    return {"head_dim": head_dim, "tokens": length, "rows": rows, "heads": HEADS,
            "ms_bf16": 1e3 * median["bf16"], "ms_fp32": 1e3 * median["fp32"],
            "bf16_over_fp32": median["bf16"] / median["fp32"], "calls_each": len(times["bf16"]),
            "rule_picks": "fp32" if picks_fp32 else "bf16", "faster": faster,
            "rule_cost": median["fp32" if picks_fp32 else "bf16"] / min(median.values())}


def report(result: dict[str, Any]) -> str:
    lines = [f"{result['threads']} thread(s), causal, {HEADS} heads, {TOKENS_PER_CALL} tokens per call; "
             "median ms per forward + backward", "",
             "| head dim | tokens | bf16 ms | fp32 ms | bf16/fp32 | rule picks | faster | rule's time / best |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["shapes"]:
        lines.append(f"| {r['head_dim']} | {r['tokens']} | {r['ms_bf16']:.2f} | {r['ms_fp32']:.2f} | "
                     f"{r['bf16_over_fp32']:.2f}x | {r['rule_picks']} | {r['faster']} | {r['rule_cost']:.2f} |")
    lines.append(f"\nthe rule's time over the best way's, summed over the shapes: {result['rule_cost_total']:.3f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/attention_precision.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as one rank of the default run)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024],
                   help="sequence lengths (each call holds 4,096 tokens: 4,096 / length rows)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--calls", type=int, default=5, help="timed calls per way and round (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per way first (default 2)")
    p.add_argument("--quick", action="store_true", help="head dim 32 at 64 and 1024 tokens, 1 round of 2 calls")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="JSON output (default bench/out/attention_precision.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.head_dims, args.tokens, args.rounds, args.calls, args.warmup = [32], [64, 1024], 1, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    shapes = [run_shape(d, t, args) for d in args.head_dims for t in args.tokens]
    rule = sum(r[f"ms_{r['rule_picks']}"] for r in shapes)  # the time of the way the rule picks
    best = sum(min(r["ms_bf16"], r["ms_fp32"]) for r in shapes)
    result = {"machine": machine_info(), "commit": git_commit(), "threads": args.threads,
              "cpu_has_amx": bool(torch.cpu._is_amx_tile_supported()), "shapes": shapes,
              "rule_cost_total": rule / best}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
