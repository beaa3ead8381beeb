"""SFT packing (PaddleNLP's intokens / zero padding) against padding: effective tokens/s.

A variable-length SFT set is written in prepare's layout (`<data>/sft/train.json`, `dev.json`):
records whose prompt and answer lengths are log-normal (many short, a long tail, as in real
instruction data), over a byte-level BPE trained on them (`stages.data.tokenizer`), with a
random-init model of a flavour (`stages.model`, saved by `stages.checkpoint.hf.save_pretrained`).
For each method (`--methods`: full SFT and LoRA), the fine-tune stage itself
(`stages.finetune.run`, in process, a world of one) trains it twice, with the same section but
`packing` false and true: the same max_length, the same per_device_train_batch_size in rows, the
same steps, seed, LR schedule and model.

  padded   one example per row, right-padded to the longest example (at most max_length)
  packed   several examples per row of max_length tokens (a packed row holds several examples,
           so at the same rows per step packing trains several times more examples per step)

The engine's `tokens_per_s` counts row positions, padding included; this bench counts EFFECTIVE
tokens: the non-padding tokens of the rows each step trained on, rebuilt from the same batch
source the stage used (`stages.finetune.build_source`, same examples and seed). Effective tokens/s
= the mean real tokens per measured step / the median step time (step times from train_log.csv's
elapsed_s, one row per step; the first `--warmup-steps` steps, setup, the dev evaluation and the
final write are excluded; the median drops steps other processes slowed; total real tokens / total
step time is in the JSON too). The peer (padded) is measured in the same run (`--repeats` alternate
which mode goes first); the ratio packed/padded is checked against 2x (printed, never asserted).

    .venv/bin/python bench/sft_packing.py                 # tiny, max_length 256, batch 8, 2 x 20 steps, ~3 min
    .venv/bin/python bench/sft_packing.py --quick         # smoke run, debug flavour, seconds
    .venv/bin/python bench/sft_packing.py --help

Prints a table and writes JSON (default bench/out/sft_packing.json). Timings on a shared machine
are noisy: compare ratios measured in the same run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from stages import finetune  # noqa: E402
from bench.common import csv_list, finish, load_average, machine_info  # noqa: E402
from stages.checkpoint.atomic import atomic_dir  # noqa: E402
from stages.checkpoint.hf import save_pretrained  # noqa: E402
from stages.data.sft import SftRecord, write_sft_file  # noqa: E402
from stages.data.tokenizer import load_model_tokenizer, save_tokenizer, train_tokenizer  # noqa: E402
from stages.model import build_model, config_for_flavour, counted_tokens  # noqa: E402
from stages.model.config import FLAVOURS  # noqa: E402
from stages.sections import FINETUNE, SftSettings  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "out" / "sft_packing.json"
METHODS = ("sft", "lora")
MODES = {"padded": False, "packed": True}  # mode name -> finetune.<method>.packing
TARGET_RATIO = 2.0  # packed / padded effective tokens/s on the variable-length set
# Words per prompt / answer: log-normal (median, sigma), at least one word. With the BPE trained
# on this text a word is about one token, so a median example is ~70 tokens and ~4% of them
# reach 256 (plain format adds bos and eos).
SRC_WORDS = (20.0, 0.9)
TGT_WORDS = (40.0, 1.0)


# -- machine -------------------------------------------------------------------------------------


# -- data and model ------------------------------------------------------------------------------

def make_words(count: int, rng: np.random.Generator) -> list[str]:
    """`count` distinct pronounceable pseudo-words of 1-3 syllables."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(syllables, size=rng.integers(1, 4))))
    return sorted(words)


def make_records(n: int, seed: int) -> list[SftRecord]:
    """`n` single-round records: prompt and answer word counts log-normal (SRC_WORDS, TGT_WORDS),
    words drawn Zipf-like from a 400-word vocabulary (so the loss has something to learn)."""
    rng = np.random.default_rng(seed)
    words = make_words(400, np.random.default_rng(0))  # the same vocabulary for every split
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    p /= p.sum()

    def text(median: float, sigma: float) -> str:
        k = max(1, int(round(rng.lognormal(np.log(median), sigma))))
        return " ".join(rng.choice(words, size=k, p=p))

    return [SftRecord(src=[text(*SRC_WORDS)], tgt=[text(*TGT_WORDS)]) for _ in range(n)]


def write_data(data_dir: Path, num_train: int, num_dev: int) -> None:
    """prepare's SFT layout: data_dir/sft/train.json and dev.json (JSON lines, src/tgt)."""
    write_sft_file(data_dir / "sft" / "train.json", make_records(num_train, seed=1))
    write_sft_file(data_dir / "sft" / "dev.json", make_records(num_dev, seed=2))


def write_model(model_dir: Path, flavour: str, data_dir: Path, vocab_size: int) -> dict[str, Any]:
    """A random-init `flavour` model dir with a byte-level BPE (`<pad>`=0, `<s>`=1, `</s>`=2)
    trained on the SFT text, as the prepare stage trains one on its corpus."""
    texts = [line for name in ("train.json", "dev.json") for line in (data_dir / "sft" / name).read_text().splitlines()]
    tok_dir = save_tokenizer(train_tokenizer(texts, vocab_size), model_dir.parent / "tokenizer")
    vocab = len(load_model_tokenizer(tok_dir))
    config = config_for_flavour(flavour, vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = build_model(config, seed=0)
    with atomic_dir(model_dir) as tmp:
        save_pretrained(model, tmp, tokenizer_dir=tok_dir)
    return {"flavour": flavour, "vocab_size": vocab, "num_parameters": config.num_parameters(),
            **{k: FLAVOURS[flavour][k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")}}


def section(method: str, packing: bool, args: argparse.Namespace) -> SftSettings:
    """The validated `finetune.<method>` section (schema defaults) with the bench's settings."""
    return FINETUNE[method].of(dict(
        max_steps=args.steps, warmup_steps=min(args.warmup_steps, args.steps), seed=0,
        per_device_train_batch_size=args.batch_size, max_length=args.max_length,
        src_length=args.max_length // 2, logging_steps=1, eval_steps=0, save_steps=0,
        num_eval_examples=args.num_dev, packing=packing))


# -- what each step trained on -------------------------------------------------------------------

def step_contents(config: SftSettings, model_dir: Path, data_dir: Path) -> dict[str, Any]:
    """The stage's batch source rebuilt (same examples, tokenizer, seed) and what each of the
    section's steps trains on: real (non-padding) tokens, learned tokens, examples."""
    tokenizer = load_model_tokenizer(model_dir)
    pad = finetune.pad_id(tokenizer)
    examples = finetune.load_examples(data_dir / "sft" / "train.json", tokenizer, config["src_length"],
                                      config["max_length"])
    source = finetune.build_source(config, examples, pad)
    lengths = np.array([len(ids) for ids, _ in examples])
    rows = len(source.ids)
    real_in_source = int((source.ids != pad).sum())
    if real_in_source != int(np.minimum(lengths, source.seq_len).sum()):  # pad id inside real text
        raise ValueError(f"pad id {pad} occurs inside the examples; real tokens cannot be told from padding")
    B = config["per_device_train_batch_size"]
    global_batch = B * config["gradient_accumulation_steps"]
    per_step: dict[str, list[int]] = {"real_tokens": [], "learned_tokens": [], "examples": [], "dynamic_positions": []}
    for step in range(config["max_steps"]):
        real = learned = count = dynamic = 0
        for ids, labels, *packed in source.micro_batches(step, global_batch, 0, 1, B):
            is_real = ids != pad
            real += int(is_real.sum())
            learned += int(counted_tokens(labels))
            # packed: an example starts where its position id is 0 (the padding tail also restarts at 0)
            count += int(((packed[0] == 0) & is_real).sum()) if packed else len(ids)
            dynamic += len(ids) * int(is_real.sum(1).max())  # padded to this micro-batch's longest row
        for key, value in zip(per_step, (real, learned, count, dynamic)):
            per_step[key].append(value)
    return {"rows_per_epoch": rows, "num_examples": len(examples), "seq_len": source.seq_len,
            "fill": real_in_source / (rows * source.seq_len), "examples_per_row": len(examples) / rows,
            "example_tokens": {"mean": float(lengths.mean()), "p10": int(np.percentile(lengths, 10)),
                               "p50": int(np.percentile(lengths, 50)), "p90": int(np.percentile(lengths, 90)),
                               "max": int(lengths.max()),
                               "at_max_length": int((lengths >= config["max_length"]).sum())},
            "epoch_real_tokens": real_in_source, "per_step": per_step}


def step_times(out_dir: Path) -> tuple[list[float], list[float]]:
    """(seconds of each step, loss of each step) from train_log.csv (logging_steps 1)."""
    with open(out_dir / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    elapsed = [float(r["elapsed_s"]) for r in rows]
    return [b - a for a, b in zip([0.0, *elapsed[:-1]], elapsed)], [float(r["loss"]) for r in rows]


# -- one training run ----------------------------------------------------------------------------

def train_once(method: str, mode: str, args: argparse.Namespace, model_dir: Path, data_dir: Path,
               work: Path, tag: str) -> dict[str, Any]:
    config = section(method, MODES[mode], args)
    out = work / f"{method}-{mode}-{tag}"
    start = time.perf_counter()
    metrics = finetune.run(method, model_dir, data_dir, out, config)
    wall = time.perf_counter() - start
    times, losses = step_times(out)
    if len(times) != args.steps:
        raise RuntimeError(f"{out}/train_log.csv has {len(times)} rows, expected one per step ({args.steps})")
    return {"config": config, "times": times, "losses": losses, "metrics": metrics, "stage_wall_s": wall}


def warm_up_process(method: str, args: argparse.Namespace, model_dir: Path, data_dir: Path, work: Path) -> float:
    """One short untimed stage run first, so what a process pays once (the engine's peak-FLOPs
    measurement, DeepSpeed and gloo set-up, the allocator's first growth) lands on neither mode:
    without it the first measured run had 100+ s of set-up and steps up to 2x slower here."""
    config = {**section(method, False, args), "max_steps": 2, "warmup_steps": 0}
    start = time.perf_counter()
    finetune.run(method, model_dir, data_dir, work / "warm-up", config)
    return time.perf_counter() - start


def summarize(runs: list[dict[str, Any]], contents: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Pool the measured steps (after `warmup`) of every repeat of one method x mode."""
    per_step = contents["per_step"]
    times = [t for r in runs for t in r["times"][warmup:]]
    pick = lambda key: [v for _ in runs for v in per_step[key][warmup:]]  # noqa: E731
    real, learned = pick("real_tokens"), pick("learned_tokens")
    examples, dynamic = pick("examples"), pick("dynamic_positions")
    n, seconds, median = len(times), sum(times), statistics.median(times)
    config, metrics = runs[-1]["config"], runs[-1]["metrics"]
    positions = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"] * contents["seq_len"]
    # Rates are per-step means over the median step time: a step's cost does not depend on how
    # many of its positions are real (padded rows are as wide as ever), and the median drops the
    # steps other processes on a shared machine slowed down. The plain total / time is kept too.
    effective = sum(real) / n / median
    return {
        "rows_per_epoch": contents["rows_per_epoch"], "examples_per_row": contents["examples_per_row"],
        "seq_len": contents["seq_len"], "fill": contents["fill"],
        "fill_trained": sum(real) / (positions * len(times)),
        "fill_if_padded_per_batch": sum(real) / sum(dynamic),  # reference: dynamic padding of these batches
        "measured_steps": n, "measured_seconds": seconds,
        "median_step_s": median, "min_step_s": min(times), "step_times_s": [r["times"] for r in runs],
        "real_tokens_per_step": sum(real) / n, "learned_tokens_per_step": sum(learned) / n,
        "examples_per_step": sum(examples) / n,
        "effective_tokens_per_s": effective, "effective_tokens_per_s_total": sum(real) / seconds,
        "learned_tokens_per_s": sum(learned) / n / median, "examples_per_s": sum(examples) / n / median,
        "row_positions_per_s": positions / median,  # what the engine's tokens_per_s counts
        "engine_tokens_per_s": metrics["tokens_per_s"],
        "epoch_s_estimate": contents["epoch_real_tokens"] / effective,
        "first_loss": metrics["first_loss"], "final_loss": metrics["final_loss"],
        "final_loss_mean_last10": metrics["final_loss_mean_last10"], "dev_loss": metrics["dev_loss"],
        "losses": [r["losses"] for r in runs], "stage_wall_s": [r["stage_wall_s"] for r in runs],
        "trainable_params": metrics.get("trainable_params"),
    }


def bench_method(method: str, args: argparse.Namespace, model_dir: Path, data_dir: Path, work: Path) -> dict[str, Any]:
    """Both modes of `method`, `--repeats` times, alternating which goes first."""
    contents = {mode: step_contents(section(method, packing, args), model_dir, data_dir)
                for mode, packing in MODES.items()}
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            t0 = time.perf_counter()
            runs[mode].append(train_once(method, mode, args, model_dir, data_dir, work, str(r)))
            print(f"[{method}] {mode} run {r + 1}/{args.repeats}: {time.perf_counter() - t0:.0f} s", file=sys.stderr,
                  flush=True)
    modes = {mode: summarize(runs[mode], contents[mode], args.warmup_steps) for mode in MODES}
    padded, packed = modes["padded"], modes["packed"]
    ratio = packed["effective_tokens_per_s"] / padded["effective_tokens_per_s"]
    return {"modes": modes, "example_tokens": contents["padded"]["example_tokens"],
            "num_examples": contents["padded"]["num_examples"],
            # effective_tokens_per_s = real_tokens_per_step / median_step_s: the first factor is
            # timing-free (what packing puts in a step), the second what a packed step costs more
            "ratio": {"effective_tokens_per_s": ratio,
                      "effective_tokens_per_s_min_step": (packed["real_tokens_per_step"] / packed["min_step_s"])
                      / (padded["real_tokens_per_step"] / padded["min_step_s"]),
                      "real_tokens_per_step": packed["real_tokens_per_step"] / padded["real_tokens_per_step"],
                      "examples_per_s": packed["examples_per_s"] / padded["examples_per_s"],
                      "median_step_s": packed["median_step_s"] / padded["median_step_s"],
                      "min_step_s": packed["min_step_s"] / padded["min_step_s"],
                      "epoch_s_estimate": packed["epoch_s_estimate"] / padded["epoch_s_estimate"],
                      "fill": packed["fill"] / padded["fill"]},
            "target": {"effective_tokens_per_s_ratio_min": TARGET_RATIO, "pass": ratio >= TARGET_RATIO}}


# -- report --------------------------------------------------------------------------------------

def format_report(result: dict[str, Any]) -> str:
    m, s, model = result["machine"], result["settings"], result["model"]
    first = next(iter(result["methods"].values()))
    ex = first["example_tokens"]
    lines = [f"machine: {m['cpu']} | {m['cores']} cores, {m['torch_threads']} torch threads | torch {m['torch']} | "
             f"load average at start {m['loadavg_at_start']}",
             f"model: {model['flavour']} ({model['num_parameters'] / 1e6:.1f}M parameters, vocab "
             f"{model['vocab_size']}), random init; fp32 (the stage's default bf16={s['bf16']})",
             f"data: {first['num_examples']} training examples, tokens per example mean {ex['mean']:.0f}, "
             f"p10 {ex['p10']}, p50 {ex['p50']}, p90 {ex['p90']}, max {ex['max']} ({ex['at_max_length']} cut to "
             "max_length)",
             f"both modes: max_length {s['max_length']}, {s['batch_size']} rows per step, {s['steps']} steps "
             f"({s['warmup_steps']} warm-up steps not timed), {s['repeats']} repeat(s); a packed row holds several "
             "examples, so at the same rows per step packing trains more examples per step",
             "eff tok/s = mean non-padding tokens per measured step / median step time; row pos/s counts padding "
             "too (the engine's tokens_per_s)", ""]
    header = ["method", "mode", "rows/epoch", "ex/row", "width", "fill", "real tok/step", "ex/step", "step s (med)",
              "eff tok/s", "row pos/s", "ex/s", "epoch s (est)", "final loss", "dev loss",
              f"packed/padded >= {TARGET_RATIO:g}x"]
    table = [header]
    for method, r in result["methods"].items():
        for mode, d in r["modes"].items():
            verdict = "-"
            if mode == "packed":
                verdict = f"{'PASS' if r['target']['pass'] else 'FAIL'} ({r['ratio']['effective_tokens_per_s']:.2f}x)"
            table.append([method, mode, str(d["rows_per_epoch"]), f"{d['examples_per_row']:.2f}", str(d["seq_len"]),
                          f"{d['fill']:.3f}", f"{d['real_tokens_per_step']:.0f}", f"{d['examples_per_step']:.1f}",
                          f"{d['median_step_s']:.3f}", f"{d['effective_tokens_per_s']:.0f}",
                          f"{d['row_positions_per_s']:.0f}", f"{d['examples_per_s']:.1f}",
                          f"{d['epoch_s_estimate']:.1f}",
                          f"{d['final_loss']:.4f}", "-" if d["dev_loss"] is None else f"{d['dev_loss']:.4f}", verdict])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"  # noqa: E731
    lines += [fmt(table[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *[fmt(row) for row in table[1:]], ""]
    for method, r in result["methods"].items():
        q, padded = r["ratio"], r["modes"]["padded"]
        lines.append(f"{method}: packed/padded eff tok/s {q['effective_tokens_per_s']:.2f}x (= real tokens per step "
                     f"{q['real_tokens_per_step']:.2f}x / median step time {q['median_step_s']:.2f}x; with the fastest "
                     f"step instead: {q['effective_tokens_per_s_min_step']:.2f}x, step time {q['min_step_s']:.2f}x), "
                     f"examples/s {q['examples_per_s']:.2f}x, epoch time {q['epoch_s_estimate']:.2f}x; "
                     f"padded fill of the trained rows {padded['fill_trained']:.3f} (padded to each batch's own "
                     f"longest row, as dynamic padding would: {padded['fill_if_padded_per_batch']:.3f})")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    result: dict[str, Any] = {"machine": machine_info("transformers"), "settings": {
        "flavour": args.flavour, "methods": args.methods, "steps": args.steps, "warmup_steps": args.warmup_steps,
        "repeats": args.repeats, "batch_size": args.batch_size, "max_length": args.max_length,
        "src_length": args.max_length // 2, "num_train": args.num_train, "num_dev": args.num_dev,
        "vocab_size": args.vocab_size, "bf16": section(args.methods[0], False, args)["bf16"],
        "src_words_lognormal": SRC_WORDS, "tgt_words_lognormal": TGT_WORDS, "quick": args.quick,
        "threads": args.threads,
        "timing": "effective tokens/s = mean real (non-padding) tokens per step over steps warmup_steps+1..steps "
                  "/ the median of their step times (train_log.csv elapsed_s differences; setup, dev evaluation and "
                  "the final write excluded); effective_tokens_per_s_total = their sum / the sum of step times"},
        "methods": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sft-packing-bench-", dir=args.out.parent) as tmp:
        work = Path(tmp)
        data_dir, model_dir = work / "data", work / "model"
        write_data(data_dir, args.num_train, args.num_dev)
        result["model"] = write_model(model_dir, args.flavour, data_dir, args.vocab_size)
        result["warm_up_run_s"] = warm_up_process(args.methods[0], args, model_dir, data_dir, work)
        print(f"untimed warm-up run: {result['warm_up_run_s']:.0f} s", file=sys.stderr, flush=True)
        for method in args.methods:
            result["methods"][method] = bench_method(method, args, model_dir, data_dir, work)
    result["machine"]["loadavg_at_end"] = load_average()
    return result


QUICK = dict(flavour="debug", steps=4, warmup_steps=1, repeats=1, batch_size=4, max_length=128, num_train=200,
             num_dev=8, vocab_size=400)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/sft_packing.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", "--sizes", dest="flavour", choices=sorted(FLAVOURS), default="tiny",
                   help="model flavour (stages.model.config.FLAVOURS; default tiny)")
    p.add_argument("--methods", type=csv_list, default=list(METHODS), help="comma-separated: sft, lora (default sft,lora)")
    p.add_argument("--steps", type=int, default=20,
                   help="optimizer steps per run, the same for both modes (default 20)")
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="first steps not timed; also the LR warm-up (default 3)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per mode, alternating which mode goes first (default 2)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="per_device_train_batch_size in rows, both modes (default 8)")
    p.add_argument("--max-length", type=int, default=256, help="finetune max_length, both modes (default 256)")
    p.add_argument("--num-train", type=int, default=2000, help="training records (default 2000)")
    p.add_argument("--num-dev", type=int, default=32, help="dev records: dev loss after training (default 32)")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary to train (default 1024)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine with more runnable threads than cores, "
                        "two OpenMP threads wait for each other's descheduled partner; steps were 10x slower "
                        f"and swung 2x run to run; {torch.get_num_threads()} is this machine's default)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: " + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"JSON output (default {DEFAULT_OUT.relative_to(ROOT)})")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        p.error(f"--methods {unknown or args.methods}: choose from {', '.join(METHODS)}")
    if args.warmup_steps < 0 or args.steps <= args.warmup_steps:
        p.error(f"--steps={args.steps} must exceed --warmup-steps={args.warmup_steps} (>= 0): some steps must be timed")
    if min(args.repeats, args.batch_size, args.threads, args.num_train, args.num_dev) < 1 or args.max_length < 8:
        p.error("--repeats, --batch-size, --threads, --num-train and --num-dev must be >= 1, --max-length >= 8")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    start = time.perf_counter()
    result = run(args)
    return finish(args.out, result, format_report, start)


if __name__ == "__main__":
    sys.exit(main())
