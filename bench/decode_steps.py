"""What each step of the decode engine buys (issue 52), on one model, in one run: transformers'
`generate` (fp32, DynamicCache), then `stages.inference.engine.DecodeEngine` with transformers'
DynamicCache (its own prefill and decode loop, no `generate`), with its PreallocatedCache (no
re-concatenation of the cache: what evaluate, predict and the server run), and with its decode step
through torch.compile (StaticCache). `--device cuda` runs all four on one GPU (the model moved there
in `--dtype`, each run's time read after the device has finished), `--flavour 135m` is SmolLM2-135M's
layer stack (bench/train_throughput.py's SHAPES) with the small test tokenizer's vocabulary.

Per runtime: decode tokens/s at batch B (B x (N - 1) tokens over the wall time of N tokens less
that of 1, greedy from the same random prompts, eos never ends a row; medians of `--repeats` runs
after a warm-up, runtimes interleaved run by run), and the operator calls per decode step (torch
profiler events whose name starts with `aten::` in a run of N tokens less those of a run of 1, over
N - 1; the B rows of a step share each call) with the wall time per call. The first call's seconds
include torch.compile's for the compiled engine.

    .venv/bin/python bench/decode_steps.py                       # debug flavour
    .venv/bin/python bench/decode_steps.py --model ~/.cache/llm-lifecycle/smollm2-135m-instruct
    python3 bench/decode_steps.py --flavour 135m --device cuda --dtype bfloat16   # one GPU
Prints a table and writes JSON (default bench/out/decode_steps.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # gguf_decode's model maker

from bench.common import csv_list, finish, machine_info

DEFAULT_OUT = ROOT / "bench" / "out" / "decode_steps.json"


def runners(model, compile_engine: bool = True) -> dict:
    """{name: run(prompts, n)} of the four ways to decode (see the module docstring), on the model's
    device; each returns when the device has finished."""
    import torch
    from transformers import DynamicCache

    from stages.inference.engine import DecodeEngine

    device = next(model.parameters()).device

    def generate(ids, n):
        ids = ids.to(device)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dynamic = DecodeEngine(model, eos_token_id=None, pad_token_id=0)
    dynamic._new_cache = lambda batch, capacity: DynamicCache(config=model.config)  # the engine's loop, HF's cache
    engines = {"engine + DynamicCache": dynamic,
               "engine (preallocated)": DecodeEngine(model, eos_token_id=None, pad_token_id=0)}
    if compile_engine:
        engines["engine compiled"] = DecodeEngine(model, eos_token_id=None, pad_token_id=0, compile=True)
    out = {"generate": generate}
    for name, engine in engines.items():
        out[name] = lambda ids, n, engine=engine: engine.generate(ids.tolist(), n)
    return out


def aten_calls(run, ids, n: int) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the operators called, on any device
        run(ids, n)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def measure(runs: dict, vocab: int, batch: int, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    import torch

    ids = torch.randint(3, vocab, (batch, prompt_tokens), generator=torch.Generator().manual_seed(batch))
    compile_s = {}
    for name, run in runs.items():  # warm-up; the compiled engine compiles here
        t0 = time.perf_counter()
        run(ids, new_tokens)
        compile_s[name] = time.perf_counter() - t0
    times = {name: {"full": [], "first": []} for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            for key, n in (("full", new_tokens), ("first", 1)):
                t0 = time.perf_counter()
                run(ids, n)
                times[name][key].append(time.perf_counter() - t0)
    tokens = batch * (new_tokens - 1)
    out = {}
    for name, run in runs.items():
        decode = max(statistics.median(times[name]["full"]) - statistics.median(times[name]["first"]), 1e-9)
        calls = (aten_calls(run, ids, new_tokens) - aten_calls(run, ids, 1)) / (new_tokens - 1)
        out[name] = {"decode_tokens_per_s": tokens / decode, "aten_calls_per_step": calls,
                     "us_per_call": decode / (new_tokens - 1) / max(calls, 1) * 1e6, "first_call_s": compile_s[name]}
    return out


def report(result: dict) -> str:
    lines = [f"{'runtime':<24}{'batch':>6}{'decode tok/s':>14}{'x generate':>12}{'aten calls/step':>17}"
             + f"{'first call s':>14}"]
    for batch, rows in result["runs"].items():
        base = rows["generate"]["decode_tokens_per_s"]
        for name, row in rows.items():
            lines.append(f"{name:<24}{batch:>6}{row['decode_tokens_per_s']:>14.1f}"
                         f"{row['decode_tokens_per_s'] / base:>12.2f}{row['aten_calls_per_step']:>17.0f}"
                         f"{row['first_call_s']:>14.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a float HF model dir (default: a random --flavour model)")
    parser.add_argument("--flavour", default="debug",
                        help="stages.model flavour without --model, or 135m (SmolLM2-135M's layers; default: debug)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to decode (default: cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's weights (default: float32)")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes (default: 1)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default: 16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated (default: 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per runtime after a warm-up")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also the engine with its compiled step (its first call compiles)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON to write")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch
    from gguf_decode import make_model_dir
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None and args.flavour == "135m":
            from bench.train_throughput import SHAPES

            shape = dict(SHAPES["135m"])
            shape.pop("vocab_size")  # the test tokenizer's
            model_dir = make_model_dir(shape.pop("base"), Path(tmp), **shape)
        else:
            model_dir = args.model or make_model_dir(args.flavour, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype),
                                                     local_files_only=True, use_safetensors=True)
        model = model.to(args.device).eval()
        runs = {int(b): measure(runners(model, args.compile), model.config.vocab_size, int(b), args.prompt_tokens,
                                args.new_tokens, args.repeats) for b in csv_list(args.batch_sizes)}
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = {"machine": machine_info("transformers", gpu=gpu),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "runs": runs}
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
