"""The training step's logits of the learned positions only, against the logits of every position.

`stages.training.step.token_sum_loss` asks our model for the vocabulary projection (lm_head) and
the cross-entropy of the positions whose next token is learned; in fine-tuning rows most positions
are the prompt's or padding. This script times the forward and backward of one micro-batch both
ways on the same model, weights and tokens, interleaved over rounds, for the default run's shapes:
full SFT (16 rows x 51 tokens, 65.3% of the positions learned, measured on the default data with
`finetune.build_source`), LoRA's rows (16 x 27, 37.0%) and a pretraining window (8 x 256, all but
the last position). Every weight is trained in all three (the LoRA row's shape and share, not its
frozen base). It checks that both ways give the same loss, prints a table and writes JSON.

    .venv/bin/python bench/learned_logits.py                      # tiny, fp32, 1 thread, 5 rounds
    .venv/bin/python bench/learned_logits.py --flavour 135m --threads 2 --steps 5
    .venv/bin/python bench/learned_logits.py --quick              # debug flavour, a smoke run
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

# name -> (rows, tokens per row, share of the positions learned)
CASES = {"sft": (16, 51, 0.653), "lora-shape": (16, 27, 0.370), "pretrain": (8, 256, 1.0)}
DEFAULT_OUT = ROOT / "bench" / "out" / "learned_logits.json"


def batch(rows: int, length: int, share: float, vocab: int, seed: int):
    """Token ids and labels whose first positions of every row are not learned (a prompt), so that
    `share` of the positions (at most all but the last of a row) score a learned next token."""
    import torch

    from stages.model import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    learned = min(round(share * length), length - 1)  # label t is scored at position t - 1; label 0 never
    labels[:, :length - learned] = IGNORE_INDEX
    return ids, labels


def step_seconds(model, ids, labels, learned_only: bool, steps: int) -> tuple[list[float], float]:
    """Seconds of each of `steps` forward + backward passes, and the last summed loss."""
    from stages.model import causal_lm_loss
    from stages.training.step import token_sum_loss

    times, loss = [], None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if learned_only:
            loss = token_sum_loss(model, ids, labels, None)
        else:
            loss = causal_lm_loss(model(input_ids=ids), labels, reduction="sum")
        loss.backward()
        times.append(time.perf_counter() - start)
    return times, float(loss)


def run_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    from stages.model import build_model, counted_tokens
    from stages.model.config import config_for_flavour

    rows, length, share = CASES[name]
    config = config_for_flavour(args.flavour, vocab_size=args.vocab_size)
    length = min(length, config.max_position_embeddings)
    model = build_model(config, seed=0).train()
    ids, labels = batch(rows, length, share, config.vocab_size, seed=1)
    step_seconds(model, ids, labels, True, args.warmup)
    step_seconds(model, ids, labels, False, args.warmup)
    times: dict[str, list[float]] = {"all": [], "learned": []}
    losses = {}
    for _ in range(args.rounds):  # interleaved: a slow stretch of the machine hits both ways
        for way in ("all", "learned"):
            seconds, losses[way] = step_seconds(model, ids, labels, way == "learned", args.steps)
            times[way] += seconds
    median = {way: statistics.median(t) for way, t in times.items()}
    return {"rows": rows, "tokens_per_row": length, "learned_positions": int(counted_tokens(labels)),
            "learned_share": int(counted_tokens(labels)) / labels.numel(),
            "ms_all_logits": 1e3 * median["all"], "ms_learned_logits": 1e3 * median["learned"],
            "speedup": median["all"] / median["learned"], "steps_each": len(times["all"]),
            "loss_all": losses["all"], "loss_learned": losses["learned"],
            "loss_rel_diff": abs(losses["all"] - losses["learned"]) / abs(losses["all"])}


def report(result: dict[str, Any]) -> str:
    lines = [f"flavour {result['flavour']}, fp32, {result['threads']} thread(s); median ms per forward + backward",
             "", "| case | rows x tokens | learned | all logits ms | learned logits ms | speedup | loss rel. diff |",
             "|---|---|---|---|---|---|---|"]
    for name, c in result["cases"].items():
        lines.append(f"| {name} | {c['rows']} x {c['tokens_per_row']} | {c['learned_share']:.1%} | "
                     f"{c['ms_all_logits']:.1f} | {c['ms_learned_logits']:.1f} | {c['speedup']:.2f}x | "
                     f"{c['loss_rel_diff']:.1e} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/learned_logits.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", default="tiny", help="model flavour (default tiny, the default run's)")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary (default 4096, the default run's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a fine-tuning job)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per way and round (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per way first (default 3)")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--quick", action="store_true", help="debug flavour, vocab 512, 1 round of 2 steps")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output (default bench/out/learned_logits.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.flavour, args.vocab_size, args.rounds, args.steps, args.warmup = "debug", 512, 1, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    result = {"machine": machine_info(), "commit": git_commit(), "flavour": args.flavour, "threads": args.threads,
              "vocab_size": args.vocab_size, "rounds": args.rounds,
              "cases": {name: run_case(name, args) for name in args.cases}}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
