"""What the stop check costs a training step: `StopWatch.agreed()` (stages.training.preemption),
the one all-reduce of one integer every rank makes after each optimizer step so that a signal to
any rank stops all of them at the same step, against a data-parallel training step of the same
processes, measured in the same run.

Two gloo processes (one thread each, as two ranks on a 2-core machine) build the `--flavour`
model (default tiny, the default experiment's) and time `--steps` data-parallel steps at the
default pretraining shape (8 sequences of 256 tokens per rank: forward, backward, gradient
all-reduce, AdamW), then `--checks` calls of `agreed()` inside a StopWatch (handlers installed,
no signal). Prints a table and writes JSON (default bench/out/stop_check.json).

    .venv/bin/python bench/stop_check.py                  # ~1 min on 2 cores
    .venv/bin/python bench/stop_check.py --flavour debug --steps 20
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import finish, machine_info  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "stop_check.json"


def _rank(rank: int, world: int, port: int, out_dir: str, flavour: str, steps: int, checks: int,
          batch: int, seq: int) -> None:
    import torch.distributed as dist

    from stages.model import build_model, config_for_flavour
    from stages.training.preemption import StopWatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build_model(config_for_flavour(flavour, vocab_size=4096), seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(rank))
    step_s = []
    for _ in range(steps + 1):  # the first step warms up and is dropped
        start = time.perf_counter()
        _, loss = model(ids, labels=ids)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
    check_s = []
    with StopWatch() as watch:
        dist.barrier()
        for _ in range(checks):
            start = time.perf_counter()
            reason = watch.agreed()
            check_s.append(time.perf_counter() - start)
            assert reason == 0
    torch.save({"step_s": step_s[1:], "check_s": check_s}, Path(out_dir) / f"{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def measure(flavour: str, steps: int, checks: int, batch: int, seq: int) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(2, port, out_dir, flavour, steps, checks, batch, seq), nprocs=2, join=True)
        ranks = [torch.load(Path(out_dir) / f"{r}.pt", weights_only=True) for r in range(2)]
    step = statistics.median(max(a, b) for a, b in zip(ranks[0]["step_s"], ranks[1]["step_s"]))
    check = statistics.median(max(a, b) for a, b in zip(ranks[0]["check_s"], ranks[1]["check_s"]))
    return {"flavour": flavour, "world_size": 2, "per_rank_batch": batch, "seq_len": seq, "steps": steps,
            "checks": checks, "step_median_s": step, "check_median_s": check, "check_over_step": check / step}


def report(result: dict) -> str:
    r = result["result"]
    return "\n".join([
        f"stop check against a data-parallel step ({r['flavour']}, 2 gloo ranks, "
        f"{r['per_rank_batch']}x{r['seq_len']} tokens per rank)",
        "",
        "| what | median | per step |",
        "|---|---|---|",
        f"| training step (fwd, bwd, grad all-reduce, AdamW) | {r['step_median_s'] * 1e3:.1f} ms | 1 |",
        f"| stop check (all-reduce of one integer) | {r['check_median_s'] * 1e6:.1f} us | {r['check_over_step']:.2e} |",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checks", type=int, default=500)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = {"machine": machine_info("torch"),
              "result": measure(args.flavour, args.steps, args.checks, args.batch, args.seq)}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
