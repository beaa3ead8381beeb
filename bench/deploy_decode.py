"""Decode speed of every runtime a model of this pipeline runs on, in one run, on the same weights:
torch eager (transformers `generate`, fp32, KV cache: what `stages.predict` ran before the engine),
our decode engine (`stages.inference.engine`: what evaluate, predict and the server run now) in
fp32 and on our low-bit kernels (wint8 and wint4, `stages.quant.load_quantized`; wint4 through
`generate` too), the exported ONNX decoder with its KV cache on onnxruntime (float and int8,
`stages.deployment.onnx_model.OnnxCausalLM`: what `stages.predict --backend onnxruntime` runs)
and, where llama-cpp-python is installed, llama.cpp on our GGUF files (f32, q8_0, q4_0; batch 1
only: llama-cpp-python decodes one sequence).

Decode tokens/s at batch B for the `generate` runtimes and the engine: B x (N - 1) tokens over the
wall time of generating N tokens less that of generating 1 (the prefill and the first token),
greedy from the same B random prompts of `--prompt-tokens` tokens with eos suppressed
(min_new_tokens = N; the engine: no eos), the median of `--repeats` runs after a warm-up,
runtimes interleaved run by run so that load from other processes hits them alike. llama.cpp: N
tokens over the wall time of its decode loop after the prompt (bench/gguf_decode.py's decoder),
the same first prompt, in the same rounds, same medians. With `--compile`, the engine with its
decode step through torch.compile too (the first call, compiling, timed apart). Ratios against
torch eager in the same run, and the issue's two targets (issue 52) at batch 1: engine fp32 /
onnx fp32 (goal >= 1) and engine wint4 / llama.cpp q4_0 (goal >= 0.5).

    .venv/bin/python bench/deploy_decode.py                       # debug flavour, ~2 min (export included)
    .venv/bin/python bench/deploy_decode.py --model results/llama/lora-merged
    .venv/bin/python bench/deploy_decode.py --model ~/.cache/llm-lifecycle/smollm2-135m-instruct   # 135M
    .venv/bin/python bench/deploy_decode.py --model ~/.cache/llm-lifecycle/smollm2-135m-instruct \
        --batch-sizes 1 --repeats 5 --compile                  # the issue's targets, compiled rows too
Prints a table and writes JSON (default bench/out/deploy_decode.json).
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
sys.path.insert(0, str(ROOT / "bench"))  # gguf_decode's llama.cpp decoder

from bench.common import csv_list, finish, machine_info
from bench.llama_cpp_runtime import installed as llama_cpp_installed

DEFAULT_OUT = ROOT / "bench" / "out" / "deploy_decode.json"
GGUF_TYPES = ("f32", "q8_0", "q4_0")


def generate_seconds(model, ids, new_tokens: int) -> float:
    import torch

    from stages.inference.engine import DecodeEngine

    if isinstance(model, DecodeEngine):  # built with eos_token_id=None: every row runs its budget
        start = time.perf_counter()
        model.generate(ids.tolist(), new_tokens)
        return time.perf_counter() - start
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, num_beams=1, eos_token_id=2, pad_token_id=0)
    return time.perf_counter() - start


def measure(models: dict, vocab_size: int, batch: int, prompt_tokens: int, new_tokens: int,
            repeats: int, decoders: dict | None = None) -> dict[str, dict]:
    """{runtime: {decode_tokens_per_s, decode_s, prefill_s}} at `batch`, runs interleaved;
    `decoders` (batch 1: llama.cpp's, {name: decode(prompt, n) -> (tokens, decode seconds)}) run
    in the same rounds, on the first prompt."""
    import torch

    ids = torch.randint(3, vocab_size, (batch, prompt_tokens), generator=torch.Generator().manual_seed(batch))
    decoders = decoders or {}
    times: dict[str, dict[str, list[float]]] = {name: {"full": [], "first": []} for name in models}
    decode_times: dict[str, list[float]] = {name: [] for name in decoders}
    for repeat in range(repeats + 1):  # the first round is the warm-up
        for name, model in models.items():
            full, first = generate_seconds(model, ids, new_tokens), generate_seconds(model, ids, 1)
            if repeat:
                times[name]["full"].append(full)
                times[name]["first"].append(first)
        for name, decode in decoders.items():
            _, took = decode(ids[0].tolist(), new_tokens)
            if repeat:
                decode_times[name].append(took)
    result = {}
    for name, t in times.items():
        decode = max(statistics.median(t["full"]) - statistics.median(t["first"]), 1e-9)
        result[name] = {"decode_tokens_per_s": batch * (new_tokens - 1) / decode, "decode_s": decode,
                        "prefill_s": statistics.median(t["first"])}
    for name, t in decode_times.items():  # llama.cpp: N tokens over its decode loop after the prompt
        result[name] = {"decode_tokens_per_s": new_tokens / statistics.median(t), "decode_s": statistics.median(t),
                        "prefill_s": None}
    return result


def llama_cpp_decoders(files: dict[str, Path], prompt_tokens: int, new_tokens: int) -> dict:
    """{`llama.cpp <type>`: decode(prompt, n)} of bench/gguf_decode.py, on torch's thread count."""
    import torch
    from gguf_decode import llama_cpp_decoder

    return {f"llama.cpp {t}": llama_cpp_decoder(path, torch.get_num_threads(), prompt_tokens + new_tokens + 8)
            for t, path in files.items()}


TARGETS = {f"{ours} / {peer}": (ours, peer, goal)
           for engine, peer, goal in (("engine fp32", "onnx fp32", 1.0), ("engine wint4", "llama.cpp q4_0", 0.5))
           for ours in (engine, f"{engine} compiled")}


def targets(runs: dict) -> dict[str, dict]:
    """The issue's targets at batch 1: {name: {ratio, goal, met}} where both runtimes ran."""
    rows = runs.get(1, {})
    out = {}
    for name, (ours, peer, goal) in TARGETS.items():
        if ours in rows and peer in rows:
            ratio = rows[ours]["decode_tokens_per_s"] / rows[peer]["decode_tokens_per_s"]
            out[name] = {"ratio": ratio, "goal": goal, "met": ratio >= goal}
    return out


def compile_seconds(engines: dict, vocab_size: int, prompt_tokens: int, new_tokens: int) -> dict[str, float]:
    """{name: seconds of the first generate call} of each compiled engine (torch.compile's time
    is in it), at batch 1, before any timed run."""
    import torch

    ids = torch.randint(3, vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(1))
    return {name: generate_seconds(engine, ids, new_tokens) for name, engine in engines.items()}


def report(result: dict) -> str:
    lines = [f"{'runtime':<22}{'batch':>6}{'decode tok/s':>14}{'x torch':>9}{'prefill ms':>12}"]
    for batch, rows in result["runs"].items():
        base = rows["torch"]["decode_tokens_per_s"]
        for name, row in rows.items():
            prefill = f"{row['prefill_s'] * 1000:>12.1f}" if row["prefill_s"] is not None else f"{'':>12}"
            lines.append(f"{name:<22}{batch:>6}{row['decode_tokens_per_s']:>14.0f}"
                         f"{row['decode_tokens_per_s'] / base:>9.2f}{prefill}")
    for name, seconds in result["compile_seconds"].items():
        lines.append(f"{name}: first call (compiling) {seconds:.0f} s")
    for name, t in result["targets"].items():
        lines.append(f"{name}: {t['ratio']:.2f} (goal >= {t['goal']}: {'met' if t['met'] else 'not met'})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="a float HF model dir to export (default: a random --flavour model)")
    parser.add_argument("--flavour", default="debug", help="stages.model flavour without --model (default: debug)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length (default: 16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per runtime after a warm-up")
    parser.add_argument("--compile", action="store_true",
                        help="add the engine rows with a torch.compile'd decode step (each compiles: 10-14 s for 135M on 2 idle cores)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON to write")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch
    from gguf_decode import make_model_dir
    from transformers import AutoModelForCausalLM

    from stages import export, quantize
    from stages.deployment.gguf_writer import write_gguf
    from stages.deployment.onnx_model import OnnxCausalLM
    from stages.inference.engine import DecodeEngine
    from stages.quant import load_quantized

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = args.model or make_model_dir(args.flavour, tmp)  # with a trained byte-level BPE
        t0 = time.perf_counter()
        metrics = export.run(model_dir, tmp / "onnx", {"int8": True})
        export_s = time.perf_counter() - t0
        for variant in ("wint4", "wint8"):
            quantize.run(model_dir, tmp / variant, variant)
        torch_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True,
                                                           use_safetensors=True).eval()
        wint4, wint8 = load_quantized(tmp / "wint4"), load_quantized(tmp / "wint8")

        def engine(model, compile=False):
            return DecodeEngine(model, eos_token_id=None, pad_token_id=0, compile=compile)

        models = {"torch": torch_model, "engine fp32": engine(torch_model),
                  "wint4 (ours)": wint4, "engine wint4": engine(wint4), "engine wint8": engine(wint8)}
        compiled = {} if not args.compile else {f"{name} compiled": engine(model, compile=True) for name, model in
                                               (("engine fp32", torch_model), ("engine wint4", wint4),
                                                ("engine wint8", wint8))}
        models.update(compiled)
        models.update({"onnx fp32": OnnxCausalLM(tmp / "onnx"), "onnx int8": OnnxCausalLM(tmp / "onnx" / "int8")})
        vocab = torch_model.config.vocab_size
        decoders = {}
        if not llama_cpp_installed():  # bench/llama_cpp_runtime.py
            print("neither llama-cpp-python nor llama-cpp-cffi is installed: no llama.cpp rows", file=sys.stderr)
        else:
            files = {t: tmp / f"model-{t}.gguf" for t in GGUF_TYPES}
            for t, path in files.items():
                write_gguf(model_dir, path, t)
            decoders = llama_cpp_decoders(files, args.prompt_tokens, args.new_tokens)
        first_calls = compile_seconds(compiled, vocab, args.prompt_tokens, args.new_tokens)
        runs = {int(b): measure(models, vocab, int(b), args.prompt_tokens, args.new_tokens, args.repeats,
                                decoders if int(b) == 1 else None) for b in csv_list(args.batch_sizes)}
    result = {
        "machine": machine_info("transformers", "onnxruntime", "llama_cpp_python", "llama_cpp_cffi"),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "export_seconds": export_s,
        "compile_seconds": first_calls,
        "export_metrics": {k: metrics[k] for k in ("rel_err", "top1_agreement", "int8_top1_agreement",
                                                   "int8_ppl_ratio", "int8_greedy_agreement", "onnx_size_bytes",
                                                   "int8_onnx_size_bytes")},
        "runs": runs,
        "ratios": {f"{name}/torch b{b}": rows[name]["decode_tokens_per_s"] / rows["torch"]["decode_tokens_per_s"]
                   for b, rows in runs.items() for name in rows if name != "torch"},
        "targets": targets(runs),
    }
    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
