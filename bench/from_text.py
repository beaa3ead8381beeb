"""Runtimes called from prompt text against the project's evaluation, on a finished run's dev set.

The project's evaluation feeds the model `stages.data.sft.encode_prompt` ids (`[bos] src` in the
plain format). A user of a shipped artifact types the text: transformers' `tokenizer(src)` then
`generate`; onnxruntime-genai's `Tokenizer.encode(src)` then its generator (with its default, no
special tokens, and with `update_options(add_special_tokens="true")`); transformers' GGUF loader on
a GGUF file (its tokenizer adds what `tokenizer.ggml.add_bos_token` says); llama.cpp itself on the
same file (`tokenize(text)`, which adds the bos as that key says, then greedy tokens through its KV
cache; bench/llama_cpp_runtime.py, where a binding is installed). Each also runs without special
tokens, which is what the shipped tokenizer gave before issue 50.
Per runtime: exact match against the references, answers equal to the project's, prompt ids equal
to the project's, over the first `--records` dev records, greedy, `--max-new-tokens`.

    .venv/bin/python bench/from_text.py --model results/llama/lora-merged --data results/llama/data \
        --export results/llama/export --gguf results/llama/deploy/gguf-q8_0/model-q8_0.gguf

Prints a table and writes JSON (default bench/out/from_text.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file from anywhere: `stages` is the repo's package

from bench import llama_cpp_runtime as llama_cpp  # noqa: E402
from bench.common import finish, machine_info  # noqa: E402
from stages.data.sft import encode_prompt, read_sft_file, target_text  # noqa: E402
from stages.inference.generation import generate_greedy  # noqa: E402
from stages.inference.loading import load_variant  # noqa: E402
from stages.metrics.text import exact_match  # noqa: E402


def hf_runtime(model_dir: Path, gguf_file: str | None, special: bool) -> Callable[[str, int], tuple[list[int], str]]:
    """(prompt ids, answer) of transformers on `model_dir` (or its GGUF file), from the text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()

    def answer(text: str, new_tokens: int) -> tuple[list[int], str]:
        ids = tokenizer(text, add_special_tokens=special, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return ids["input_ids"][0].tolist(), tokenizer.decode(out[0, ids["input_ids"].shape[1]:],
                                                              skip_special_tokens=True)
    return answer


def genai_runtime(export_dir: Path, special: bool) -> Callable[[str, int], tuple[list[int], str]]:
    """(prompt ids, answer) of onnxruntime-genai on an export directory, from the text."""
    import onnxruntime_genai as og

    model = og.Model(str(export_dir))
    tokenizer = og.Tokenizer(model)
    tokenizer.update_options(add_special_tokens="true" if special else "false")

    def answer(text: str, new_tokens: int) -> tuple[list[int], str]:
        prompt = [int(t) for t in tokenizer.encode(text)]
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        return prompt, tokenizer.decode(generator.get_sequence(0)[len(prompt):])
    return answer


def llama_cpp_runtime(gguf: Path, special: bool) -> Callable[[str, int], tuple[list[int], str]]:
    """(prompt ids, answer) of llama.cpp on a GGUF file, from the text; stops at the file's eos."""
    from transformers import AutoTokenizer

    llm = llama_cpp.open_gguf(gguf, n_ctx=512)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # the file's vocabulary, to decode

    def answer(text: str, new_tokens: int) -> tuple[list[int], str]:
        prompt = llm.tokenize(text, add_bos=special)
        tokens, _ = llm.greedy(prompt, new_tokens)
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[:tokens.index(tokenizer.eos_token_id)]
        return prompt, tokenizer.decode(tokens, skip_special_tokens=True)
    return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the float model the project evaluates")
    parser.add_argument("--data", type=Path, required=True, help="the run's data dir (sft/dev.json)")
    parser.add_argument("--export", type=Path, help="its ONNX export directory (onnxruntime-genai)")
    parser.add_argument("--gguf", type=Path, help="a GGUF file of it (transformers' GGUF loader)")
    parser.add_argument("--records", type=int, default=64, help="dev records (evaluate's num_dev_examples)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per answer")
    parser.add_argument("--src-length", type=int, default=64, help="the project's prompt length limit")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "from_text.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    records = [r for r in read_sft_file(args.data / "sft" / "dev.json")[:args.records] if len(r.src) == 1]
    model, tokenizer, _ = load_variant(args.model)
    prompts = [encode_prompt(tokenizer, r, args.src_length) for r in records]
    generated = generate_greedy(model, prompts, max_new_tokens=args.max_new_tokens,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, batch_size=8)
    project = [tokenizer.decode(g, skip_special_tokens=True) for g in generated]
    references = [target_text(r) for r in records]

    runtimes: dict[str, Callable[[], Callable[[str, int], tuple[list[int], str]]]] = {}
    for special, tag in ((True, ""), (False, ", no special tokens")):
        runtimes[f"transformers{tag}"] = lambda s=special: hf_runtime(args.model, None, s)
        if args.export:
            runtimes[f"onnxruntime-genai{tag}"] = lambda s=special: genai_runtime(args.export, s)
        if args.gguf:
            runtimes[f"GGUF (transformers){tag}"] = lambda s=special: hf_runtime(args.gguf.parent, args.gguf.name, s)
            if llama_cpp.installed():
                runtimes[f"GGUF (llama.cpp){tag}"] = lambda s=special: llama_cpp_runtime(args.gguf, s)
    rows: dict[str, Any] = {"project (encode_prompt)": {"exact_match": exact_match(project, references),
                                                          "same_answers": len(records),
                                                          "same_prompt_ids": len(records)}}
    for name, build in runtimes.items():
        run = build()
        results = [run(r.src[0], args.max_new_tokens) for r in records]
        answers = [a for _, a in results]
        rows[name] = {"exact_match": exact_match(answers, references),
                      "same_answers": sum(a == b for a, b in zip(answers, project)),
                      "same_prompt_ids": sum(ids == p for (ids, _), p in zip(results, prompts))}
    result = {"machine": machine_info("transformers", "onnxruntime-genai", "llama_cpp_python", "llama_cpp_cffi"),
              "llama_cpp_binding": llama_cpp.binding() if llama_cpp.installed() else None, "model": str(args.model),
              "records": len(records), "max_new_tokens": args.max_new_tokens, "runtimes": rows}

    def report(r: dict[str, Any]) -> str:
        lines = [f"{r['records']} dev records of {r['model']}, greedy, {r['max_new_tokens']} new tokens",
                 f"{'runtime, from the prompt text':48s} {'exact match':>11s} {'same answers':>12s} {'same ids':>9s}"]
        for name, row in r["runtimes"].items():
            lines.append(f"{name:48s} {row['exact_match']:11.4f} {row['same_answers']:12d} {row['same_prompt_ids']:9d}")
        return "\n".join(lines)

    return finish(args.out, result, report, started)


if __name__ == "__main__":
    sys.exit(main())
