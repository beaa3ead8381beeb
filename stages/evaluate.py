"""Evaluate one model variant: validation perplexity, greedy generation on SFT dev, size and speed.

`python -m stages.evaluate --model DIR --data DIR --out FILE --variant NAME --config JSON
 [--src-length N]`

What is loaded depends on what `--model` holds (`stages.inference.loading.load_variant`):
  * `adapter_config.json`            -> peft adapter: base from `meta.json`'s `parent` (else
                                        adapter_config's `base_model_name_or_path`), then
                                        `peft.PeftModel.from_pretrained(base, dir)`
  * config.json with `quantization_config` -> `stages.quant.load_quantized(dir)` (float weights)
  * `model.onnx` (stages.export)     -> onnxruntime, CPU provider
                                        (`stages.deployment.onnx_model.OnnxCausalLM`): logits and
                                        greedy generation with the graph's KV cache; its `int8/`
                                        is a variant of its own
  * otherwise                        -> plain HF dir, `AutoModelForCausalLM` in fp32, local files
                                        only, safetensors only, never `trust_remote_code`
Every torch directory passes `stages.checkpoint.weights` first: the sha256 its meta.json records, no
pickle weights (`pytorch_model.bin`, `adapter_model.bin` are refused with the conversion), whole
safetensors files; a failure names the file and stops the stage.
The tokenizer always comes from `--model` (adapter dirs carry the tokenizer files too).

Metrics JSON (`eval/<variant>.json`, written atomically), one object:
  variant            str    the name given with --variant
  model_dir          str    the directory evaluated
  kind               str    "hf", "adapter", "quantized" or "onnx"
  sft_format         str    "chat_template" or "plain": how dev records were rendered (data/index.json)
  ppl                float  exp(token-weighted mean NLL) on validation windows (stages.metrics.perplexity)
  unigram_ppl        float  add-one unigram model of train.bin on the same target tokens (the floor to beat)
  ppl_tokens         int    validation tokens scored
  ppl_windows        int    windows of ppl_max_length tokens scored
  dev_ppl            float  perplexity of the dev answers (target tokens) given their prompts, on the
                            same num_dev_examples records (stages.metrics.perplexity.target_perplexity)
  dev_ppl_tokens     int    answer tokens scored
  exact_match        float  [0, 1] on the first num_dev_examples records of data/sft/dev.json
  bleu4              float  [0, 1] sacrebleu corpus BLEU-4 / 100: 13a tokens, exp smoothing (stages.metrics.text)
  rouge_l            float  [0, 1] rouge-score ROUGE-L F1 (default tokenizer, no stemming), mean over examples
  metric_implementations
                     dict   {"bleu4", "rouge_l"}: the library, version and tokenization that computed
                            them (bleu4 with its sacrebleu signature; stages.metrics.text.metric_implementations)
  num_dev_examples   int    dev records scored
  preference_accuracy
                     float  [0, 1] share of the preference dev pairs (data/preference/dev.json, the first
                            num_preference_pairs) whose chosen answer the model gives the higher
                            summed log-prob (stages.metrics.preference); null without that file or
                            with num_preference_pairs: 0
  preference_margin  float  mean of log p(chosen) - log p(rejected) over those pairs, nats summed over
                            the answer tokens; null without the file
  preference_pairs   int    pairs scored (null when none were asked for)
  gen_tokens         int    tokens generated (up to and including each eos)
  gen_seconds        float  wall seconds spent in generate
  gen_tokens_per_s   float  gen_tokens / gen_seconds (greedy, batched, left padding)
  size_bytes         int    bytes of weight files in the dir (*.safetensors, *.onnx, *.onnx.data);
                            for an adapter, the adapter alone
  num_parameters     int    parameters of the model as evaluated (base + adapter for peft; packed
                            low-bit tensors are buffers, not parameters; ONNX: the graph's weight
                            initializers, int8 ones included)
  model_bytes        int    bytes of the loaded model's parameters and buffers (packed weights
                            count as packed): its resident memory (stages.metrics.speed)
  rss_bytes          int    the process's resident set size after loading (VmRSS), null off Linux
  prefill_tokens_per_s_b1, prefill_tokens_per_s_b8
                     float  tokens/s of a cache-free forward over batch 1 (8) x speed_prefill_tokens
                            random ids (one key per speed_batch_sizes entry)
  decode_tokens_per_s_b1
                     float  tokens/s of greedy generation with the KV cache, batch 1, prompt not counted
  speed_tokens       dict   {"prefill", "decode_prompt", "decode_new"}: the lengths the speeds used
                            (the settings' values, cut to the model's position limit)
  torch_threads      int    threads torch used for the timings
  kernels            dict   quantized variants: {kernel: number of layers} (int8pack, int4pack,
                            int_mm, dequantized), from stages.quant.load_quantized; {} otherwise
  quantization       dict   quantized variants: the quantize stage's meta.json metrics (method,
                            spec, bits, group_size, quantize_seconds, calibration, ...); null otherwise
  lm_eval            dict   lm-evaluation-harness tasks (evaluate.lm_eval_tasks) run on this variant
                            through stages.harness.variant_lm.VariantLM: {"version", "limit",
                            "num_fewshot", "chat_template", "wall_seconds", "tasks": {task:
                            {"metrics", "higher_is_better", "samples", "num_fewshot"}}}
                            (stages.harness.tasks); null without tasks
  eval_seconds       float  wall seconds of the whole evaluation, loading included
  settings           dict   the evaluate settings used (defaults filled)
  samples            list   first 5 dev records: {"src", "reference", "prediction"}

Settings: the schema's `evaluate` keys (max_new_tokens, num_dev_examples, num_preference_pairs,
ppl_max_length, ppl_max_windows, per_device_eval_batch_size, speed_prefill_tokens, speed_batch_sizes,
speed_decode_tokens, speed_repeats, lm_eval_tasks, lm_eval_include_path, lm_eval_limit,
lm_eval_num_fewshot) plus `src_length` (default: finetune.sft's, 64; the rule passes
finetune.sft.src_length with `--src-length`, so prompts are cut as in training).

Preference pairs are encoded as the dev answers are (`encode_example`, prompts cut to `src_length`,
each side to `src_length + max_new_tokens` tokens), batched `per_device_eval_batch_size` rows a
forward; every variant kind runs them, the ONNX directories included.

Generation: prompts are `stages.data.sft.encode_prompt` ids (bos + src, left-truncated to
`src_length`), left-padded into batches of `per_device_eval_batch_size`, decoded greedily for at
most `max_new_tokens` and cut at the first eos. Left padding with peft prefix tuning works with
transformers 5.23 / peft 0.21 (peft prepends the prefix to the attention mask); the unit test
checks that batched and one-by-one generations agree for a prefix adapter.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from stages.checkpoint.atomic import write_json
from stages.data.preference import read_preference_file
from stages.data.sft import SftRecord, encode_example, encode_prompt, read_sft_file, target_text
from stages.data.sft_format import data_chat_format, format_name
from stages.errors import InputError, run_cli
from stages.harness.tasks import run_tasks
from stages.harness.variant_lm import VariantLM
# generate_greedy and adapter_base_dir are imported for those who import them from here (bench, tests)
from stages.inference.generation import generate_greedy, pad_or_eos
from stages.inference.loading import adapter_base_dir, load_variant, read_json
from stages.metrics.perplexity import model_perplexity, target_perplexity, unigram_perplexity, validation_windows
from stages.metrics.preference import preference_metrics
from stages.metrics.host_memory import rss_bytes
from stages.metrics.speed import model_bytes, speed_metrics
from stages.metrics.text import corpus_bleu, exact_match, metric_implementations, rouge_l
from stages.sections import EvaluateSettings, SftSettings
from stages.settings import add_arguments, from_arguments
from stages.stage_logs import configure_logging, log_io

log = logging.getLogger(__name__)

_WEIGHT_PATTERNS = ("*.safetensors", "*.onnx", "*.onnx.data")
_NUM_SAMPLES = 5
NO_PREFERENCE = {"preference_accuracy": None, "preference_margin": None, "preference_pairs": None}


# -- settings ------------------------------------------------------------------------------------
def eval_settings(config: Mapping[str, Any] | None, src_length: int | None = None) -> tuple[EvaluateSettings, int]:
    """The `evaluate` section completed with the schema's defaults and checked against it, and the
    prompt length `src_length`: the fine-tuned one, which the workflow passes as --src-length;
    without one, finetune.sft's default."""
    if src_length is None:
        src_length = SftSettings.of({}).src_length
    if isinstance(src_length, bool) or not isinstance(src_length, int) or src_length < 1:
        raise InputError(f"evaluate src_length={src_length!r} must be a positive integer")
    return EvaluateSettings.of(config), src_length


# -- inputs --------------------------------------------------------------------------------------
def read_split(data_dir: str | Path, split: str) -> tuple[np.ndarray, dict[str, Any]]:
    """(memory-mapped token ids of `split`, index.json) from a prepare data dir."""
    data_dir = Path(data_dir)
    index_path = data_dir / "index.json"
    if not index_path.exists():
        raise InputError(f"{index_path} is missing; --data must be the data dir written by prepare")
    index = read_json(index_path)
    if split not in index.get("splits", {}):
        raise InputError(f"{index_path} has no split {split!r} (splits: {sorted(index.get('splits', {}))})")
    path = data_dir / index["splits"][split]["tokens"]
    if not path.exists():
        raise InputError(f"{path} is missing although {index_path} lists it; re-run prepare")
    tokens = np.memmap(path, dtype=np.dtype(index["dtype"]).newbyteorder("<"), mode="r")
    return tokens, index


def _dev_path(data_dir: Path) -> Path:
    dev_path = data_dir / "sft" / "dev.json"
    if not dev_path.exists():
        raise InputError(f"{dev_path} is missing; --data must be the data dir written by prepare")
    return dev_path


def _eos(tokenizer, model_dir: Path) -> int:
    if tokenizer.eos_token_id is None:
        raise InputError(f"the tokenizer in {model_dir} has no eos token; generation cannot stop")
    return tokenizer.eos_token_id


# -- what the variant is -------------------------------------------------------------------------
def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of the weight files directly in `model_dir` (an adapter dir holds only the adapter)."""
    files = {f for pattern in _WEIGHT_PATTERNS for f in Path(model_dir).glob(pattern) if f.is_file()}
    return sum(f.stat().st_size for f in files)


def _kernel_counts(model: torch.nn.Module) -> dict[str, int]:
    """{kernel: layers} of a model from stages.quant.load_quantized (its `quant_kernels`), else {}."""
    counts: dict[str, int] = {}
    for kernel in (getattr(model, "quant_kernels", None) or {}).values():
        counts[kernel] = counts.get(kernel, 0) + 1
    return counts


def _quantization_meta(model_dir: Path) -> dict[str, Any] | None:
    """The quantize stage's metrics from the variant's meta.json (None without one)."""
    path = model_dir / "meta.json"
    return read_json(path).get("metrics") if path.exists() else None


# -- the measurements ----------------------------------------------------------------------------
def _validation_perplexity(model, valid: np.ndarray, train: np.ndarray, vocab_size: int,
                           settings: EvaluateSettings) -> dict[str, Any]:
    """ppl, unigram_ppl, ppl_tokens, ppl_windows on windows of the validation split."""
    windows = validation_windows(valid, settings.ppl_max_length, settings.ppl_max_windows)
    ppl, ppl_tokens = model_perplexity(model, windows, batch_size=settings.per_device_eval_batch_size)
    unigram = unigram_perplexity(train, windows[:, 1:], vocab_size)
    return {"ppl": ppl, "unigram_ppl": unigram, "ppl_tokens": ppl_tokens, "ppl_windows": len(windows)}


def _dev_metrics(model, tokenizer, records: list[SftRecord], chat: bool, src_length: int, eos: int,
                 settings: EvaluateSettings) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """(dev_ppl ... gen_tokens_per_s, samples): the dev answers' perplexity, then greedy generation
    on the dev prompts scored against the references."""
    pad = pad_or_eos(tokenizer)
    batch_size = settings.per_device_eval_batch_size
    answers = [encode_example(tokenizer, r, src_length, src_length + settings.max_new_tokens,
                              chat) for r in records]
    dev_ppl, dev_ppl_tokens = target_perplexity(model, answers, pad, batch_size)
    prompts = [encode_prompt(tokenizer, r, src_length, chat) for r in records]
    t_gen = time.perf_counter()
    generated = generate_greedy(model, prompts, max_new_tokens=settings.max_new_tokens, eos_token_id=eos,
                                pad_token_id=pad, batch_size=batch_size)
    gen_seconds = time.perf_counter() - t_gen
    predictions = [tokenizer.decode(g, skip_special_tokens=True) for g in generated]
    references = [target_text(r) for r in records]
    gen_tokens = sum(len(g) for g in generated)
    metrics = {
        "dev_ppl": dev_ppl,
        "dev_ppl_tokens": dev_ppl_tokens,
        "exact_match": exact_match(predictions, references),
        "bleu4": corpus_bleu(predictions, references, smooth=True),
        "rouge_l": rouge_l(predictions, references),
        "metric_implementations": metric_implementations(),
        "num_dev_examples": len(records),
        "gen_tokens": gen_tokens,
        "gen_seconds": gen_seconds,
        "gen_tokens_per_s": gen_tokens / gen_seconds if gen_seconds > 0 else 0.0,
    }
    samples = [{"src": r.src[-1], "reference": ref, "prediction": pred}
               for r, ref, pred in zip(records[:_NUM_SAMPLES], references, predictions)]
    return metrics, samples


def _preference(model, tokenizer, data_dir: Path, chat: bool, src_length: int,
                settings: EvaluateSettings) -> dict[str, Any]:
    """preference_accuracy, preference_margin, preference_pairs on the first num_preference_pairs
    pairs of data/preference/dev.json; all null when prepare wrote no pairs or none are asked for."""
    path = data_dir / "preference" / "dev.json"
    if not settings.num_preference_pairs:
        log.info("evaluate.num_preference_pairs: 0: preference metrics skipped")
        return dict(NO_PREFERENCE)
    if not path.exists():
        log.info("no %s: preference metrics skipped", path)
        return dict(NO_PREFERENCE)
    records = read_preference_file(path)[:settings.num_preference_pairs]
    return preference_metrics(model, tokenizer, records, src_length, src_length + settings.max_new_tokens, chat,
                              pad_or_eos(tokenizer), settings.per_device_eval_batch_size)


def _lm_eval(model, tokenizer, data_dir: Path, chat: bool, settings: EvaluateSettings) -> dict[str, Any] | None:
    """evaluate.lm_eval_tasks on this variant (stages.harness.tasks); None without tasks."""
    if not settings.lm_eval_tasks:
        return None
    lm = VariantLM(model, tokenizer, batch_size=settings.per_device_eval_batch_size)
    return run_tasks(lm, settings.lm_eval_tasks, data_dir=data_dir, include_path=settings.lm_eval_include_path,
                     limit=settings.lm_eval_limit, num_fewshot=settings.lm_eval_num_fewshot,
                     max_gen_toks=settings.max_new_tokens, chat=chat)


# -- the stage -----------------------------------------------------------------------------------
def run(model_dir: str | Path, data_dir: str | Path, out_path: str | Path, variant: str,
        config: Mapping[str, Any] | None = None, src_length: int | None = None,
        base_dir: str | Path | None = None) -> dict[str, Any]:
    """Evaluate `model_dir` on `data_dir`, write the metrics JSON to `out_path` and return it.
    `config`: the `evaluate` section (what it lacks takes the schema's default); `src_length`: the
    prompt tokens kept, the model's finetune.sft.src_length (default: that key's default);
    `base_dir`: an adapter's base model (default: found from the adapter, `adapter_base_dir`)."""
    t_start = time.perf_counter()
    settings, src_length = eval_settings(config, src_length)
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    log_io("evaluate", reads={"model": model_dir,
                              "validation and train tokens, sft/dev.json, preference/dev.json": data_dir},
           writes={"metrics": out_path}, logger=log)
    dev_path = _dev_path(data_dir)
    model, tokenizer, kind = load_variant(model_dir, base_dir=base_dir)
    memory = {"model_bytes": model_bytes(model), "rss_bytes": rss_bytes()}

    valid, index = read_split(data_dir, "validation")
    chat = data_chat_format(tokenizer, model_dir, data_dir)  # checks the tokenizer against the data's
    train, _ = read_split(data_dir, "train")
    perplexity = _validation_perplexity(model, valid, train, index["vocab_size"], settings)
    records = read_sft_file(dev_path)[:settings.num_dev_examples]
    dev, samples = _dev_metrics(model, tokenizer, records, chat, src_length, _eos(tokenizer, model_dir), settings)
    preference = _preference(model, tokenizer, data_dir, chat, src_length, settings)
    lm_eval = _lm_eval(model, tokenizer, data_dir, chat, settings)
    speed = speed_metrics(model, index["vocab_size"], settings)

    metrics = {
        "variant": variant, "model_dir": str(model_dir), "kind": kind, "sft_format": format_name(chat),
        **perplexity,
        **dev,
        **preference,
        "size_bytes": weight_bytes(model_dir),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        **memory,
        **speed,
        "kernels": _kernel_counts(model),
        "quantization": _quantization_meta(model_dir) if kind == "quantized" else None,
        "lm_eval": lm_eval,
        "eval_seconds": time.perf_counter() - t_start,
        "settings": {"src_length": src_length, **settings},
        "samples": samples,
    }
    write_json(out_path, metrics)
    log.info("%s: ppl %.2f (unigram %.2f), exact_match %.3f, bleu4 %.3f, rouge_l %.3f -> %s", variant,
             metrics["ppl"], metrics["unigram_ppl"], metrics["exact_match"], metrics["bleu4"], metrics["rouge_l"],
             out_path)
    return metrics


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="model dir: HF layout, peft adapter or quantized HF dir")
    parser.add_argument("--data", required=True, help="data dir written by prepare (index.json, *.bin, sft/dev.json)")
    parser.add_argument("--out", required=True, help="metrics JSON to write (eval/<variant>.json)")
    parser.add_argument("--variant", required=True, help="variant name recorded in the JSON (e.g. sft, lora, wint4)")
    parser.add_argument("--config", metavar="JSON", help="the experiment's `evaluate` section as one JSON object")
    parser.add_argument("--src-length", type=int, default=None,
                        help="prompt tokens kept (left truncation): the model's finetune.sft.src_length "
                             "(default: that key's default)")
    parser.add_argument("--base", default=None, metavar="DIR",
                        help="an adapter's base model dir (default: from the adapter's meta.json / adapter_config.json)")
    add_arguments(parser, "evaluate")
    args = parser.parse_args(argv)
    configure_logging()
    config = from_arguments(args, "evaluate", args.config)
    # the prompt length the model was fine-tuned with
    return run(args.model, args.data, args.out, args.variant, config, args.src_length, args.base)


if __name__ == "__main__":
    run_cli(main, "evaluate")
