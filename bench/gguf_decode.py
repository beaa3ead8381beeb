"""GGUF decode speed: llama.cpp (bench/llama_cpp_runtime.py: llama-cpp-python or llama-cpp-cffi) at batch 1 on our f32 / q8_0 / q4_0 files against
torch eager on the same checkpoint, in the same run.

The checkpoint is `--model DIR` (any Hugging Face-layout Llama/Mistral/Qwen2 directory with a
byte-level tokenizer.json, e.g. the SmolLM2-135M-Instruct the tests cache under
~/.cache/llm-lifecycle/smollm2-135m-instruct), or else a random-init `--flavour` of our model with a
small trained byte-level BPE (the decode speed does not depend on the weights' values). Each
`--types` file is written by `stages.deployment.gguf_writer.write_gguf`.

Per engine: an untimed prompt of `--prompt-tokens` ids (English and code text through the model's
tokenizer), then `--decode-tokens` greedy single-token steps with the KV cache, timed from the first
step to the last (argmax included, sampling excluded).
torch is transformers' AutoModelForCausalLM in float32, eager, with its DynamicCache; llama.cpp
runs on CPU with the same number of threads as torch (`--threads`, default torch's). Every round
runs each engine once, in a rotated order, so load from other processes hits all alike; tokens/s
is the median over `--repeats` rounds after one warm-up round. `same prefix` is the number of
leading greedy tokens equal to torch's (of `--decode-tokens`; one differing token changes all that
follow, so this is where the greedy paths part, not a quality score).

    .venv/bin/python bench/gguf_decode.py                                   # tiny flavour, ~10 s
    .venv/bin/python bench/gguf_decode.py --model ~/.cache/llm-lifecycle/smollm2-135m-instruct  # ~1 min
    .venv/bin/python bench/gguf_decode.py --help

Prints a table and writes JSON (default bench/out/gguf_decode.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench.common import csv_list, finish, machine_info  # noqa: E402
from bench.llama_cpp_runtime import binding  # noqa: E402
from stages.checkpoint.atomic import atomic_dir  # noqa: E402
from stages.checkpoint.hf import save_pretrained  # noqa: E402
from stages.data.tokenizer import load_model_tokenizer  # noqa: E402
from stages.deployment.gguf_writer import FILE_TYPES, write_gguf  # noqa: E402
from stages.model import build_model, config_for_flavour  # noqa: E402

Decoder = Callable[[list[int], int], tuple[list[int], float]]  # (prompt, n) -> (tokens, decode seconds)
_TEXT = ["the colour of the apple is red", "a banana is yellow and a plum is purple",
         "def main(argv): return 0  # Python code, numbers 0123456789"]


def make_model_dir(flavour: str, out: Path, **overrides: Any) -> Path:
    """A random-init `flavour` of our model (with `overrides` of its fields) with a byte-level BPE
    trained on a few sentences."""
    from stages.data.tokenizer import save_tokenizer, train_tokenizer

    tokenizer = train_tokenizer(_TEXT * 4, vocab_size=300)
    save_tokenizer(tokenizer, out / "tokenizer")
    model = build_model(config_for_flavour(flavour, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2,
                                           pad_token_id=0, **overrides), seed=0)
    with atomic_dir(out / "model") as tmp:
        save_pretrained(model, tmp, tokenizer_dir=out / "tokenizer")
    return out / "model"


def torch_decoder(model_dir: Path) -> Decoder:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def decode(prompt: list[int], n: int) -> tuple[list[int], float]:
        out = model(torch.tensor([prompt]), use_cache=True)
        token, tokens = int(out.logits[0, -1].argmax()), []
        start = time.perf_counter()
        for _ in range(n):
            tokens.append(token)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            token = int(out.logits[0, -1].argmax())
        return tokens, time.perf_counter() - start

    return decode


def llama_cpp_decoder(gguf_path: Path, threads: int, n_ctx: int) -> Decoder:
    from bench.llama_cpp_runtime import open_gguf

    llm = open_gguf(gguf_path, n_ctx=n_ctx, threads=threads)

    def decode(prompt: list[int], n: int) -> tuple[list[int], float]:
        llm.reset()
        token, tokens = int(llm.logits(prompt).argmax()), []
        start = time.perf_counter()
        for _ in range(n):
            tokens.append(token)
            token = int(llm.logits([token]).argmax())
        return tokens, time.perf_counter() - start

    return decode


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = args.model or make_model_dir(args.flavour, work)
    files = {t: write_gguf(model_dir, work / f"model.{t}.gguf", t) for t in args.types}
    n_ctx = args.prompt_tokens + args.decode_tokens + 8
    decoders = {"torch eager f32": torch_decoder(model_dir)}
    decoders.update({f"llama.cpp {t}": llama_cpp_decoder(work / f"model.{t}.gguf", args.threads, n_ctx)
                     for t in args.types})
    prompt = load_model_tokenizer(model_dir)(" ".join(_TEXT * args.prompt_tokens))["input_ids"][:args.prompt_tokens]
    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    tokens: dict[str, list[int]] = {}
    names = list(decoders)
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            tokens[name], took = decoders[name](prompt, args.decode_tokens)
            if round_:
                seconds[name].append(took)
    reference = tokens["torch eager f32"]
    rows = {}
    for name, times in seconds.items():
        rate = args.decode_tokens / statistics.median(times)
        file_type = name.rsplit(" ", 1)[-1]
        rows[name] = {"tokens_per_s": rate, "seconds": times,
                      "same_prefix": next((i for i, (a, b) in enumerate(zip(tokens[name], reference)) if a != b),
                                          len(reference)),
                      "gguf_bytes": files[file_type]["gguf_bytes"] if name.startswith("llama.cpp") else None}
    base = rows["torch eager f32"]["tokens_per_s"]
    for row in rows.values():
        row["ratio_to_torch"] = row["tokens_per_s"] / base
    return {"machine": machine_info("transformers", "llama_cpp_python", "llama_cpp_cffi", "gguf", threads=args.threads,
                                llama_cpp_binding=binding()),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": str(model_dir), "write_metrics": files, "runs": rows}


def report(result: dict[str, Any]) -> str:
    lines = [f"decode at batch 1, {result['settings']['decode_tokens']} tokens after a "
             f"{result['settings']['prompt_tokens']}-token prompt, {result['machine']['threads']} threads "
             f"({result['model']})",
             f"{'engine':<18} {'tokens/s':>9} {'x torch':>8} {'same prefix':>12} {'file MB':>8}"]
    for name, row in result["runs"].items():
        size = f"{row['gguf_bytes'] / 1e6:8.1f}" if row["gguf_bytes"] else f"{'-':>8}"
        lines.append(f"{name:<18} {row['tokens_per_s']:9.1f} {row['ratio_to_torch']:8.2f} "
                     f"{row['same_prefix']:12d} {size}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gguf_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="Hugging Face-layout checkpoint (default: a random --flavour)")
    p.add_argument("--flavour", default="tiny", help="our flavour when --model is not given (default tiny)")
    p.add_argument("--types", type=csv_list, default=["f32", "q8_0", "q4_0"],
                   help=f"comma-separated GGUF file types, of {', '.join(FILE_TYPES)} (default f32,q8_0,q4_0)")
    p.add_argument("--prompt-tokens", type=int, default=16, help="untimed prompt length (default 16)")
    p.add_argument("--decode-tokens", type=int, default=64, help="timed greedy steps per round (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up round (default 5)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help="threads of both engines (default torch's current setting)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "gguf_decode.json", help="JSON output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # both engines on the same number of threads
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.out.parent if args.out.parent.exists() else None) as work:
        result = bench(args, Path(work))
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
