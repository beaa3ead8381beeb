"""Batch prediction: one model variant answers every record of an SFT JSON-lines file.

PaddleNLP's llm/predictor.py, on transformers' `generate` with the KV cache.

`python -m stages.predict --model DIR --input FILE.jsonl --out FILE.jsonl [--batch-size 8]
 [--src-length 64] [--max-length 128] [--max-new-tokens N] [--decode-strategy greedy_search|sampling]
 [--top-k 0] [--top-p 1.0] [--temperature 1.0] [--seed 42] [--chat-template auto|true|false]
 [--backend torch|onnxruntime]`

`--model` is anything `stages.evaluate.load_variant` loads: a full HF dir (pretrain, sft,
lora-merged, base), a peft adapter dir (LoRA or prefix tuning; the base found by
`stages.evaluate.adapter_base_dir`) or a quantized dir (quant/<variant>, on its low-bit kernels);
with `--backend onnxruntime`, an export directory (model.onnx with its KV cache, or its int8/),
run by `stages.deployment.onnx_model.OnnxCausalLM` with the same batching, padding, budgets and
eos handling (greedy only).
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
`batch_size` and left-padded (attention mask; pad = the tokenizer's pad, else eos). Greedy outputs
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
from transformers import StoppingCriteria, StoppingCriteriaList

from stages.checkpoint.atomic import atomic_file, write_json
from stages.data.corpus import read_index
from stages.data.files import json_lines
from stages.data.sft import SftRecord, encode_prompt, parse_record, uses_chat_template
from stages.data.tokenizer import check_same_tokenizer
from stages.errors import InputError, run_cli
from stages.evaluate import load_variant  # one loader for every kind of model dir
from stages.serving.generation_settings import (BACKENDS, CHAT_TEMPLATE_CHOICES, DECODE_STRATEGIES, DEFAULTS,
                                               PredictSettings)
from stages.stage_logs import Progress, configure_logging, log_io

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


def prompt_format(choice: str, tokenizer, model_dir: str | Path, data_dir: Path | None) -> bool:
    """Whether prompts are rendered with the tokenizer's chat template: `choice` true or false as
    asked; auto: the sft_format prepare recorded in `data_dir`'s index.json (as evaluate and
    finetune follow it) when there is such a data dir, else whether the tokenizer has a template.
    The predictor and the server (stages.serving.served_model) both decide here."""
    has_template = uses_chat_template(tokenizer, True)
    if choice == "false":
        return False
    if choice == "true":
        if not has_template:
            raise InputError(f"--chat-template true but the tokenizer in {model_dir} has no chat template; "
                             "use --chat-template false (plain bos + text prompts)")
        return True
    if data_dir is None:
        return has_template
    index = read_index(data_dir)
    check_same_tokenizer(tokenizer, model_dir, index, data_dir)
    return index.get("sft_format") == "chat_template"


def chat_format(choice: str, tokenizer, model_dir: str | Path, input_path: str | Path) -> bool:
    """prompt_format for an input file: its data dir is the one it lies in (`<data>/sft/<file>`)."""
    input_path = Path(input_path)
    data_dir = input_path.parent.parent
    inside = input_path.parent.name == "sft" and (data_dir / "index.json").is_file()
    return prompt_format(choice, tokenizer, model_dir, data_dir if inside else None)


def left_padded(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both (B, T) with T the longest prompt: each prompt at the right end
    of its row, where generation continues; the mask hides the pads."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


# -- generation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Generation:
    tokens: list[int]  # new tokens, cut after the first eos (eos kept)
    batch: int  # index of the batch (in generation order)
    batch_seconds: float  # wall seconds of that batch's generate call


def token_budgets(prompts: Sequence[list[int]], max_length: int, max_new_tokens: int | None) -> list[int]:
    """New tokens each prompt may get: max_length - len(prompt), capped by max_new_tokens."""
    cap = max_new_tokens if max_new_tokens is not None else max_length
    return [max(0, min(cap, max_length - len(p))) for p in prompts]


class RowLimits(StoppingCriteria):
    """Ends row r once it holds `width + budgets[r]` tokens: per row, so that a short prompt's
    budget does not depend on the longest prompt of its batch."""

    def __init__(self, width: int, budgets: Sequence[int]):
        self.limits = torch.tensor([width + b for b in budgets])  # (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return input_ids.shape[1] >= self.limits.to(input_ids.device)  # (B,)


@torch.no_grad()
def generate_batched(model: torch.nn.Module, prompts: Sequence[list[int]], settings: PredictSettings, *,
                     eos_token_id: int, pad_token_id: int) -> list[Generation]:
    """Continuations of `prompts` in input order, `settings.batch_size` at a time.

    Prompts are sorted by length (longest first, fewer pad tokens) and left-padded so every row's
    last real token is at the end, where generation continues; the attention mask hides the pads.
    Sampling is seeded once, before the first batch."""
    device = next(model.parameters()).device
    budgets = token_budgets(prompts, settings.max_length, settings.max_new_tokens)
    if settings.decode_strategy == "sampling":
        decode = dict(do_sample=True, top_k=settings.top_k, top_p=settings.top_p, temperature=settings.temperature)
        torch.manual_seed(settings.seed)
    else:
        decode = dict(do_sample=False)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[Generation | None] = [None] * len(prompts)
    progress = Progress(log, "predicted records", len(prompts))
    num_batches = -(-len(prompts) // settings.batch_size)
    for batch, start in enumerate(range(0, len(order), settings.batch_size)):
        rows = order[start:start + settings.batch_size]
        ids, mask = left_padded([prompts[i] for i in rows], pad_token_id)  # (B, T) each
        width = ids.shape[1]
        row_budgets = [budgets[i] for i in rows]
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=True,
                             max_new_tokens=max(row_budgets), num_beams=1, eos_token_id=eos_token_id,
                             pad_token_id=pad_token_id, stopping_criteria=StoppingCriteriaList(
                                 [RowLimits(width, row_budgets)]), **decode)  # (B, T + new)
        seconds = time.perf_counter() - t0
        for r, i in enumerate(rows):
            new = out[r, width:width + budgets[i]].tolist()
            new = new[:new.index(eos_token_id) + 1] if eos_token_id in new else new
            results[i] = Generation(tokens=new, batch=batch, batch_seconds=seconds)
        progress.advance(len(rows), detail=f"{batch + 1} of {num_batches} batches")
    return results  # type: ignore[return-value]


# -- the stage -----------------------------------------------------------------------------------
def summary_path(out_path: str | Path) -> Path:
    """`<out>.summary.json` beside the predictions (the .jsonl suffix replaced)."""
    return Path(out_path).with_suffix(".summary.json")


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
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = []
    for row in rows:
        ids = encode_prompt(tokenizer, row.record, settings.src_length, chat)
        if not ids:
            raise InputError(f"{row.where}: the record encodes to an empty prompt (empty 'src' and the tokenizer "
                             "has no bos token); give it some text")
        prompts.append(ids)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and settings.max_length > limit:
        log.warning("max_length=%d exceeds the model's max_position_embeddings=%d", settings.max_length, limit)

    generations = generate_batched(model, prompts, settings, eos_token_id=eos, pad_token_id=pad)
    with atomic_file(out_path) as f:
        for row, prompt, g in zip(rows, prompts, generations):
            line = {**row.fields, "output": tokenizer.decode(g.tokens, skip_special_tokens=True),
                    "output_tokens": len(g.tokens), "prompt_tokens": len(prompt), "batch": g.batch,
                    "batch_seconds": g.batch_seconds}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    batch_seconds = {g.batch: g.batch_seconds for g in generations}
    generated = sum(len(g.tokens) for g in generations)
    seconds = sum(batch_seconds.values())
    summary = {
        "model_dir": str(model_dir), "kind": kind, "input": str(input_path), "output": str(out_path),
        "sft_format": "chat_template" if chat else "plain",
        "num_records": len(rows), "num_batches": len(batch_seconds),
        "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": generated,
        "generate_seconds": seconds, "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        "load_seconds": load_seconds, "total_seconds": time.perf_counter() - t_start,
        "torch_threads": torch.get_num_threads(), "settings": asdict(settings),
    }
    write_json(summary_path(out_path), summary)
    log.info("predict: %d records, %d tokens in %.2f s (%.1f tokens/s, batch_size %d) -> %s", len(rows), generated,
             seconds, summary["tokens_per_s"], settings.batch_size, out_path)
    return summary


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
