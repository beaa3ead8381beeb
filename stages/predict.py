"""Batch prediction: one model variant answers every record of an SFT JSON-lines file.

PaddleNLP's llm/predictor.py, on transformers' `generate` with the KV cache.

`python -m stages.predict --model DIR --input FILE.jsonl --out FILE.jsonl [--batch-size 8]
 [--src-length 64] [--max-length 128] [--max-new-tokens N] [--decode-strategy greedy_search|sampling]
 [--top-k 0] [--top-p 1.0] [--temperature 1.0] [--seed 42] [--chat-template auto|true|false]
 [--compile true|false] [--prompt-lookup-num-tokens N] [--backend torch|onnxruntime]`

`--model` is anything `stages.inference.loading.load_variant` loads: a full HF dir (pretrain,
sft, lora-merged, base), a peft adapter dir (LoRA or prefix tuning; the base found by
`adapter_base_dir` there) or a quantized dir (quant/<variant>, on its low-bit kernels); with
`--backend onnxruntime`, an export directory (model.onnx with its KV cache, or its int8/), run by
`stages.deployment.onnx_model.OnnxCausalLM` with the same batching, padding, budgets and eos
handling (greedy only).
Local files only, safetensors only, never `trust_remote_code`.

Input: JSON lines `{"src": str or [str], "tgt": str or [str]}` (`stages.data.sft`); `tgt` is
optional (a record without it has a single-round `src`). Prompts are
`stages.data.sft.encode_prompt` ids, exactly as evaluate builds them: earlier rounds in full, then
the last src, cut from the left to `src_length`. The format (chat template or plain bos + src)
follows `--chat-template`: `auto` reads index.json's `sft_format` when the input lies in a prepare
data dir (`<data>/sft/<file>`, the tokenizer checked against the data's), else uses the
tokenizer's chat template when it has one (prepare's default, `data.chat_template: true`).

Lengths: a record whose prompt has P tokens generates at most `max_length - P` new tokens
(prompt + answer <= max_length, per record, whatever the batch's padding), and at most
`max_new_tokens` when that is given; `src_length < max_length` is required so every record has
room for one token. (PaddleNLP's `max_length` is the decode length alone, checked against
`total_max_length`; ours is Hugging Face's prompt + answer, and its decode length is
`max_new_tokens`.) Generation stops at the tokenizer's eos (kept in the count, dropped from the
text).

Decoding: `transformers` `generate` with the KV cache, prompts grouped by length into batches of
`batch_size` and left-padded (attention mask; pad = the tokenizer's pad, else eos). With
`--prompt-lookup-num-tokens N` (greedy, `--batch-size 1`) each forward of the decode engine checks
up to N draft tokens copied from where the last tokens occurred before
(`stages.inference.prompt_lookup`): the same greedy tokens in fewer forwards where answers copy
their prompt (the log says how many draft tokens were checked and taken). Greedy outputs
do not depend on the batch size (tested). `sampling` draws with top_k (0: off), top_p (1.0: off)
and temperature after `torch.manual_seed(seed)`: the same seed, input, batch size and machine give
the same outputs.

Output (written atomically): one JSON line per input record, in input order:
  src, tgt        as in the input (tgt only when present)
  output          str    the generated text (special tokens skipped)
  output_tokens   int    tokens generated, eos included
  prompt_tokens   int    tokens of the encoded prompt
  batch           int    index of the batch the record was generated in
  batch_seconds   float  wall seconds of that batch's generate call
and beside it `<out without .jsonl>.summary.json`:
  model_dir, kind ("hf", "adapter", "quantized", "onnx"), input, output, sft_format ("chat_template" or
  "plain"), num_records, num_batches, prompt_tokens, generated_tokens, generate_seconds (sum over
  batches), tokens_per_s (generated_tokens / generate_seconds), load_seconds, total_seconds,
  torch_threads, settings (every option above).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from stages.checkpoint.atomic import atomic_file, write_json
from stages.data.files import json_lines
from stages.data.sft import SftRecord, encode_prompt, parse_record
from stages.data.sft_format import format_name, prompt_format
from stages.errors import InputError, run_cli
# token_budgets is imported for the tests that use it from here
from stages.inference.generation import Generation, generate_batched, pad_or_eos, token_budgets
from stages.inference.loading import load_variant  # one loader for every kind of model dir
from stages.serving.generation_settings import (BACKENDS, CHAT_TEMPLATE_CHOICES, DECODE_STRATEGIES, DEFAULTS,
                                               PredictSettings)
from stages.stage_logs import configure_logging, log_io

log = logging.getLogger(__name__)

_EXAMPLE = '{"src": "...", "tgt": "..."}'


# -- input ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputRecord:
    where: str  # "path:line", for error messages
    fields: dict[str, Any]  # src and tgt as written (copied to the output line)
    record: SftRecord  # what encode_prompt reads


def read_records(path: str | Path) -> list[InputRecord]:
    """Every line of an SFT JSON-lines file; a bad line raises InputError naming `path:line`.
    Without `tgt`, `src` must be one round (a string or a one-element list): earlier rounds need
    their answers."""
    path = Path(path)
    rows = []
    for lineno, obj in json_lines(path, InputError, _EXAMPLE):
        where = f"{path}:{lineno}"
        if "src" not in obj:
            raise InputError(f"{where}: record has no 'src' (keys present: {sorted(obj)}); each line needs "
                             f"'src' (the prompt), 'tgt' is optional: {_EXAMPLE}")
        if "tgt" in obj:
            record = parse_record(obj, where)
        else:
            src = obj["src"]
            if isinstance(src, list) and len(src) == 1:
                src = src[0]
            if not isinstance(src, str):
                raise InputError(f"{where}: without 'tgt', 'src' must be one string; a multi-turn 'src' list "
                                 "needs 'tgt' with the answers of its rounds")
            record = SftRecord(src=[src], tgt=[""])  # the empty last answer is never encoded
        rows.append(InputRecord(where, {k: obj[k] for k in ("src", "tgt") if k in obj}, record))
    return rows


def chat_format(choice: str, tokenizer, model_dir: str | Path, input_path: str | Path) -> bool:
    """prompt_format for an input file: its data dir is the one it lies in (`<data>/sft/<file>`)."""
    input_path = Path(input_path)
    data_dir = input_path.parent.parent
    inside = input_path.parent.name == "sft" and (data_dir / "index.json").is_file()
    return prompt_format(choice, tokenizer, model_dir, data_dir if inside else None)


def _prompts(rows: list[InputRecord], tokenizer, src_length: int, chat: bool) -> list[list[int]]:
    """Each record's prompt ids (`encode_prompt`); InputError naming the line of an empty one."""
    prompts = []
    for row in rows:
        ids = encode_prompt(tokenizer, row.record, src_length, chat)
        if not ids:
            raise InputError(f"{row.where}: the record encodes to an empty prompt (empty 'src' and the tokenizer "
                             "has no bos token); give it some text")
        prompts.append(ids)
    return prompts


def _warn_past_position_limit(model, max_length: int) -> None:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        log.warning("max_length=%d exceeds the model's max_position_embeddings=%d", max_length, limit)


# -- output --------------------------------------------------------------------------------------
def summary_path(out_path: str | Path) -> Path:
    """`<out>.summary.json` beside the predictions (the .jsonl suffix replaced)."""
    return Path(out_path).with_suffix(".summary.json")


def _write_predictions(out_path: str | Path, rows: list[InputRecord], prompts: list[list[int]],
                       generations: list[Generation], tokenizer) -> None:
    """One JSON line per record, in input order (the module docstring's Output)."""
    with atomic_file(out_path) as f:
        for row, prompt, g in zip(rows, prompts, generations):
            line = {**row.fields, "output": tokenizer.decode(g.tokens, skip_special_tokens=True),
                    "output_tokens": len(g.tokens), "prompt_tokens": len(prompt), "batch": g.batch,
                    "batch_seconds": g.batch_seconds}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def _generation_summary(prompts: list[list[int]], generations: list[Generation]) -> dict[str, Any]:
    """num_batches, prompt_tokens, generated_tokens, generate_seconds, tokens_per_s."""
    batch_seconds = {g.batch: g.batch_seconds for g in generations}
    generated = sum(len(g.tokens) for g in generations)
    seconds = sum(batch_seconds.values())
    return {"num_batches": len(batch_seconds), "prompt_tokens": sum(len(p) for p in prompts),
            "generated_tokens": generated, "generate_seconds": seconds,
            "tokens_per_s": generated / seconds if seconds > 0 else 0.0}


# -- the stage -----------------------------------------------------------------------------------
def run(model_dir: str | Path, input_path: str | Path, out_path: str | Path,
        settings: PredictSettings | None = None, base_dir: str | Path | None = None) -> dict[str, Any]:
    """Predict every record of `input_path` with `model_dir` (an adapter on `base_dir`, default: the
    base the adapter names); write the JSON lines to `out_path` and the summary beside it; return
    the summary."""
    t_start = time.perf_counter()
    settings = settings or PredictSettings()
    model_dir, input_path = Path(model_dir), Path(input_path)
    log_io("predict", reads={"model": model_dir, "records": input_path},
           writes={"predictions": out_path, "summary": summary_path(out_path)}, logger=log)
    rows = read_records(input_path)  # bad input fails before the model loads
    model, tokenizer, kind = load_variant(model_dir, settings.backend, base_dir)
    load_seconds = time.perf_counter() - t_start
    chat = chat_format(settings.chat_template, tokenizer, model_dir, input_path)
    prompts = _prompts(rows, tokenizer, settings.src_length, chat)
    _warn_past_position_limit(model, settings.max_length)

    generations = generate_batched(model, prompts, settings, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=pad_or_eos(tokenizer))
    _write_predictions(out_path, rows, prompts, generations, tokenizer)
    generated = _generation_summary(prompts, generations)
    summary = {
        "model_dir": str(model_dir), "kind": kind, "input": str(input_path), "output": str(out_path),
        "sft_format": format_name(chat), "num_records": len(rows), **generated,
        "load_seconds": load_seconds, "total_seconds": time.perf_counter() - t_start,
        "torch_threads": torch.get_num_threads(), "settings": asdict(settings),
    }
    write_json(summary_path(out_path), summary)
    log.info("predict: %d records, %d tokens in %.2f s (%.1f tokens/s, batch_size %d) -> %s", len(rows),
             generated["generated_tokens"], generated["generate_seconds"], generated["tokens_per_s"],
             settings.batch_size, out_path)
    return summary


def _true_or_false(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")
    return text.lower() == "true"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m stages.predict", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model dir: HF layout, peft adapter or quantized HF dir")
    parser.add_argument("--input", required=True,
                        help='SFT JSON lines to predict: {"src": ..., "tgt": ...} (tgt optional)')
    parser.add_argument("--out", required=True, help="predictions to write (JSON lines; the summary goes beside it)")
    parser.add_argument("--base", default=None, metavar="DIR",
                        help="an adapter's base model dir (default: from the adapter's meta.json / adapter_config.json)")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                        help="records per generate call (default %(default)s)")
    parser.add_argument("--src-length", type=int, default=DEFAULTS["src_length"],
                        help="prompt tokens kept, cut from the left (default %(default)s)")
    parser.add_argument("--max-length", type=int, default=DEFAULTS["max_length"],
                        help="prompt + generated tokens per record (default %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"],
                        help="a further cap on generated tokens (default: none, max-length decides)")
    parser.add_argument("--decode-strategy", choices=DECODE_STRATEGIES, default=DEFAULTS["decode_strategy"],
                        help="greedy_search or sampling (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=DEFAULTS["top_k"], help="sampling: top-k filter, 0 = off")
    parser.add_argument("--top-p", type=float, default=DEFAULTS["top_p"], help="sampling: nucleus mass, 1.0 = off")
    parser.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                        help="sampling: logits temperature (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="sampling seed (default %(default)s)")
    parser.add_argument("--compile", type=_true_or_false, default=DEFAULTS["compile"], metavar="{true,false}",
                        help="decode steps through torch.compile on a static KV cache (default %(default)s; "
                             "a one-off compile per batch size, then faster steps; tokens can differ from eager "
                             "decoding's on exact ties)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=DEFAULTS["prompt_lookup_num_tokens"],
                        metavar="N", help="greedy_search at --batch-size 1: prompt-lookup speculative decoding, up "
                                          "to N draft tokens a forward (default %(default)s: off)")
    parser.add_argument("--backend", choices=BACKENDS, default=DEFAULTS["backend"],
                        help="runtime: torch (default) or onnxruntime (an export directory with model.onnx "
                             "and its KV cache; greedy_search only)")
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATE_CHOICES, default=DEFAULTS["chat_template"],
                        help="prompt format: auto = the data dir's index.json sft_format when the input is "
                             "<data>/sft/*.json, else the tokenizer's chat template when it has one")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    configure_logging()
    settings = PredictSettings(**{key: getattr(args, key) for key in DEFAULTS})
    return run(args.model, args.input, args.out, settings, args.base)


if __name__ == "__main__":
    run_cli(main, "predict")
