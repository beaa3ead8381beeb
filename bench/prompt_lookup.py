"""Prompt-lookup speculative decoding (`stages.inference.prompt_lookup`) against plain greedy
decoding and transformers' own prompt lookup, in one run, on answers that copy their prompt.

Four runtimes decode the same prompts greedily at batch 1, in interleaved rounds (so that load
from other processes hits them alike), each to eos or `--new-tokens`:

- generate: transformers' `generate` (what predict ran before the decode engine);
- generate + lookup: `generate(prompt_lookup_num_tokens=N)`, transformers' prompt lookup (the peer);
- engine: our decode engine, one forward per token;
- engine + lookup: the engine checking up to N prompt-lookup draft tokens a forward.

Prompts ask the model to repeat, correct or continue passages of Python's own documentation (the
`builtin:pydoc` corpus, local), through the model's chat template when it has one: answers that
quote their prompt, where prompt lookup pays. Tokens/s = tokens generated over the wall time of
the whole generation (prefill included), the median of `--repeats` rounds after a warm-up. The
table gives each runtime's tokens/s, its ratio to `generate`, forwards per token, the share of
draft tokens taken, and whether its tokens equal `generate`'s.

    .venv/bin/python bench/prompt_lookup.py                                       # SmolLM2-135M-Instruct
    .venv/bin/python bench/prompt_lookup.py --model results/llama/sft --new-tokens 32
Prints a table and writes JSON (default bench/out/prompt_lookup.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import finish, machine_info

DEFAULT_OUT = ROOT / "bench" / "out" / "prompt_lookup.json"
DEFAULT_MODEL = Path.home() / ".cache" / "llm-lifecycle" / "smollm2-135m-instruct"
TASKS = ("Repeat the following text exactly, word for word:\n\n{}",
         "Rewrite the following text, correcting any mistakes:\n\n{}",
         "Copy this passage and then continue it:\n\n{}")


def passages(count: int, words: int) -> list[str]:
    """`count` passages of about `words` words from the builtin pydoc corpus (deterministic)."""
    from stages.data.corpus import iter_documents

    out = []
    for document in iter_documents(["builtin:pydoc"]):
        text = " ".join(document.split()[:words])
        if len(text.split()) >= words // 2:
            out.append(text)
        if len(out) == count:
            break
    return out


def encode(tokenizer, text: str) -> list[int]:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    return tokenizer(text)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="a float HF model dir (default: SmolLM2-135M-Instruct, from `python -m "
                             "stages.checkpoint.gguf --smollm2`)")
    parser.add_argument("--prompts", type=int, default=3, help="passages, each with every task (default: 3)")
    parser.add_argument("--words", type=int, default=60, help="words per passage (default: 60)")
    parser.add_argument("--new-tokens", type=int, default=96, help="greedy tokens at most (default: 96)")
    parser.add_argument("--num-draft-tokens", type=int, default=10, help="prompt lookup's N (default: 10)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after a warm-up (default: 3)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON to write")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    import torch
    from transformers import AutoModelForCausalLM

    from stages.data.tokenizer import load_model_tokenizer
    from stages.inference.engine import DecodeEngine
    from stages.inference.prompt_lookup import PromptLookup

    if not (args.model / "config.json").is_file():
        print(f"{args.model} has no config.json: pass --model DIR (SmolLM2: python -m stages.checkpoint.gguf "
              f"--smollm2 --out {DEFAULT_MODEL})", file=sys.stderr)
        return 2
    tokenizer = load_model_tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, local_files_only=True,
                                                 use_safetensors=True).eval()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = [encode(tokenizer, task.format(p)) for p in passages(args.prompts, args.words) for task in TASKS]
    plain = DecodeEngine(model, eos_token_id=eos, pad_token_id=pad)
    lookup = DecodeEngine(model, eos_token_id=eos, pad_token_id=pad,
                          prompt_lookup=PromptLookup(num_draft_tokens=args.num_draft_tokens))

    @torch.no_grad()
    def generate(prompt: list[int], **extra) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                             do_sample=False, num_beams=1, eos_token_id=eos, pad_token_id=pad, **extra)
        tokens = out[0, ids.shape[1]:].tolist()
        return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens

    runtimes = {
        "generate": lambda p: generate(p),
        "generate + lookup": lambda p: generate(p, prompt_lookup_num_tokens=args.num_draft_tokens),
        "engine": lambda p: plain.generate([p], args.new_tokens)[0].tokens,
        "engine + lookup": lambda p: lookup.generate([p], args.new_tokens)[0].tokens,
    }
    seconds = {name: [] for name in runtimes}
    tokens: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats + 1):  # the first round is the warm-up
        for name, run in runtimes.items():
            if name.startswith("engine"):
                engine = lookup if "lookup" in name else plain
                engine.forward_calls = engine.drafted_tokens = engine.accepted_tokens = 0
            start = time.perf_counter()
            tokens[name] = [run(p) for p in prompts]
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    generated = sum(len(t) for t in tokens["generate"])
    rows = {}
    for name in runtimes:
        took = statistics.median(seconds[name])
        rows[name] = {"tokens": sum(len(t) for t in tokens[name]), "seconds": took,
                      "tokens_per_s": sum(len(t) for t in tokens[name]) / took,
                      "equal_to_generate": tokens[name] == tokens["generate"]}
    for name, engine in (("engine", plain), ("engine + lookup", lookup)):  # the last round's counts
        rows[name]["forwards_per_token"] = engine.forward_calls / max(1, rows[name]["tokens"])
        rows[name]["draft_tokens"], rows[name]["accepted_tokens"] = engine.drafted_tokens, engine.accepted_tokens
    base = rows["generate"]["tokens_per_s"]
    for row in rows.values():
        row["x_generate"] = row["tokens_per_s"] / base
    result = {"machine": machine_info("transformers"), "model": str(args.model),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "num_prompts": len(prompts), "generated_tokens": generated, "runs": rows,
              "engine_lookup_over_generate_lookup": rows["engine + lookup"]["tokens_per_s"]
              / rows["generate + lookup"]["tokens_per_s"],
              "engine_lookup_over_engine": rows["engine + lookup"]["tokens_per_s"] / rows["engine"]["tokens_per_s"]}
    return finish(args.out, result, report, started)


def report(result: dict) -> str:
    lines = [f"{result['num_prompts']} prompts, {result['generated_tokens']} greedy tokens ({result['model']})",
             f"{'runtime':<20}{'tokens/s':>10}{'x generate':>12}{'fwd/token':>11}{'drafts taken':>14}"
             f"{'= generate':>12}"]
    for name, row in result["runs"].items():
        forwards = f"{row['forwards_per_token']:>11.2f}" if "forwards_per_token" in row else f"{'':>11}"
        taken = (f"{row['accepted_tokens']:>6}/{row['draft_tokens']:<7}" if row.get("draft_tokens") else f"{'':>14}")
        lines.append(f"{name:<20}{row['tokens_per_s']:>10.1f}{row['x_generate']:>12.2f}{forwards}{taken}"
                     f"{str(row['equal_to_generate']):>12}")
    lines.append(f"engine + lookup / generate + lookup: {result['engine_lookup_over_generate_lookup']:.2f}; "
                 f"/ engine: {result['engine_lookup_over_engine']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
