"""Fine-tune a causal LM on src/tgt pairs: full SFT, LoRA or prefix tuning, on the training engine.

    torchrun --nproc_per_node 2 -m stages.finetune --method lora --model results/llama/pretrain \
        --data results/llama/data --out results/llama/lora --config '{...finetune.lora...}'

Reads `<data>/sft/train.json` (and `dev.json` for the dev loss), encodes it with
`stages.data.sft.encode_example` (loss on target tokens only), and trains on the shared engine
(`stages.training.engine`) in the section's layout, every method alike: world_size processes =
data x tensor x pipeline parallel, DeepSpeed ZeRO from `sharding`, one checkpointer and resume
path, one train_log.csv. LoRA and prefix tuning freeze the base and train only the adapter (our
model: our own LoRA layers and prefix keys/values, split by tensor parallelism; other families:
peft's, data parallel and ZeRO). With `packing`, several examples share a row. With `eval_steps`,
dev metrics are logged beside the loss (`load_best_model_at_end` keeps the best). Writes
atomically (docs/artifacts.md):
- sft: an HF model dir (config.json, model.safetensors, generation_config.json, tokenizer files);
- lora / prefix: a peft adapter dir (adapter_config.json, adapter_model.safetensors, tokenizer
  files) that loads with `peft.PeftModel.from_pretrained(base, dir)`, base = meta.json's parent;
plus `train_log.csv` and `meta.json` (stage "finetune-<method>").

With `--checkpoints DIR`, checkpoints every `save_steps` steps into `DIR/<fingerprint>/` and a
rerun resumes from the newest complete checkpoint there, in any layout.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from stages import settings
from stages.adapters import ADAPTER_METHODS
from stages.adapters.trainable import count_parameters
from stages.checkpoint.integrity import sha256_file
from stages.config import check_finetune_section
from stages.data.mix_sources import mix_digests, section_mix_sources
from stages.data.sft import encode_example, read_sft_file
from stages.data.sft_format import data_chat_format
from stages.data.tokenizer import load_model_tokenizer, pad_id
from stages.errors import InputError, run_cli
from stages.metrics.text import metric_implementations
from stages.model import LlamaForCausalLM
from stages.model.labels import IGNORE_INDEX
from stages.model.loss import causal_lm_loss, counted_tokens
from stages.sections import FINETUNE, PrefixSettings, SftSettings
from stages.stage_logs import configure_logging, log_io
from stages.training.batches import PackedSftBatches, SftBatches
from stages.training.checkpointing import model_identity
from stages.training.dev_eval import DevEvaluator
from stages.training.distributed import finish_distributed, init_distributed
from stages.training.engine import train as engine_train
from stages.training.families import load_causal_lm, own_families
from stages.training.mixed_batches import MixedSftBatches, mixing_metrics, reserve_for
from stages.training.parallelize import parallel_degrees
from stages.training.peak_memory import log_memory_against_plan
from stages.training.seed import set_seed

log = logging.getLogger(__name__)

METHODS = ("sft", *ADAPTER_METHODS)

Example = tuple[list[int], list[int]]  # (input_ids, labels)


# -- data ----------------------------------------------------------------------------------------
def load_examples(path: Path, tokenizer, src_length: int, max_length: int, chat: bool = False) -> list[Example]:
    """Encode every record of an SFT file (`encode_examples`)."""
    return encode_examples(read_sft_file(path), path, tokenizer, src_length, max_length, chat)


def encode_examples(records, path: Path, tokenizer, src_length: int, max_length: int,
                    chat: bool = False) -> list[Example]:
    """Encode SFT records (with `chat`, through the tokenizer's chat template). Examples longer
    than `max_length` are cut to it, with a warning counting them; those whose targets were cut
    off entirely are dropped (they carry no loss), with a warning counting them."""
    full = [encode_example(tokenizer, r, src_length, 10**9, chat) for r in records]
    cut = sum(len(ids) > max_length for ids, _ in full)
    if cut:
        log.warning("%s: %d of %d examples are longer than max_length=%d and were truncated (longest %d tokens)",
                    path, cut, len(full), max_length, max(len(ids) for ids, _ in full))
    examples = [(ids[:max_length], labels[:max_length]) for ids, labels in full]
    kept = [ex for ex in examples if any(label != IGNORE_INDEX for label in ex[1][1:])]
    if len(kept) < len(examples):
        log.warning("%s: dropped %d of %d examples with no target token left after max_length=%d",
                    path, len(examples) - len(kept), len(examples), max_length)
    if not kept:
        raise InputError(f"{path}: no example keeps a target token within max_length={max_length}; "
                         "raise max_length or lower src_length")
    return kept


def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad on the right to the longest example: pad id in input_ids, -100 in labels, 0 in
    attention_mask. Returns int64 tensors of shape (B, T)."""
    T = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), T), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), T), dtype=torch.long)
    for i, (ids, lab) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids)
        labels[i, :len(lab)] = torch.tensor(lab)
        attention_mask[i, :len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def target_token_count(labels: torch.Tensor) -> int:
    """Tokens that carry loss: labels shifted by one, as `summed_loss` scores them."""
    return int(counted_tokens(labels))


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over target tokens of -log p(token t+1 | tokens <= t), in fp32.

    A sum rather than a mean so that gradient accumulation and the dev loss weigh every target
    token equally, whatever the micro-batch it falls in.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss(logits, batch["labels"], reduction="sum")


@torch.no_grad()
def dev_loss(model: torch.nn.Module, examples: Sequence[Example], batch_size: int,
             pad_token_id: int) -> float:
    """Mean loss per target token over `examples` (eval mode, no dropout)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad_token_id)
        total += summed_loss(model, batch).item()
        count += target_token_count(batch["labels"])
    model.train(was_training)
    return total / max(count, 1)


# -- training ------------------------------------------------------------------------------------
def check_section(method: str, config: Mapping[str, Any] | None) -> SftSettings:
    """The `finetune.<method>` section `config` with the schema's defaults filled, checked as the
    workflow checks it (InputError naming the key); InputError for an unknown method."""
    if method not in METHODS:
        raise InputError(f"--method {method!r} is unknown; choose one of {METHODS}")
    config = FINETUNE[method].of(config)
    check_finetune_section(f"finetune.{method}", method, config)
    return config


# -- the stage -----------------------------------------------------------------------------------
def prefix_init_ids(config: SftSettings, examples: Sequence[Example]) -> list[int] | None:
    """With `prefix_init: tokens`, the first num_prefix_tokens tokens of the training examples
    (in file order, one after the other): real text of the task, whose KV cache starts the prefix."""
    if not isinstance(config, PrefixSettings) or config.prefix_init != "tokens":
        return None
    P = config.num_prefix_tokens
    ids = [t for example, _ in examples for t in example][:P]
    if len(ids) < P:
        raise InputError(f"finetune.prefix.prefix_init=tokens: the training examples hold {len(ids)} tokens, "
                         f"fewer than num_prefix_tokens={P}")
    return ids


def build_source(config: SftSettings, examples: Sequence[Example], pad: int,
                 mix_sources: Sequence[np.ndarray] = ()):
    """The engine's batch source: padded rows, or with `packing` several examples per row; with
    `mix_ratio` > 0, general text from `mix_sources` in the room after the examples
    (`stages.training.mixed_batches`)."""
    ratio = config.mix_ratio
    reserve = reserve_for(examples, ratio, config.max_length) if ratio else None
    if config.packing:  # examples were cut to max_length; PackedSftBatches refuses longer ones
        source = PackedSftBatches(list(examples), config.max_length, pad, config.seed, reserve)
        log.info("packing: %d examples in %d rows of %d tokens (%.0f%% real tokens)", len(examples),
                 len(source.rows), source.seq_len, 100 * source.fill)
    else:
        source = SftBatches(list(examples), config.max_length, pad, config.seed, reserve)
    if not ratio:
        return source
    return MixedSftBatches(source, mix_sources, config.mix_weights, ratio, config.seed)


def dev_evaluator(config: SftSettings, dev: Sequence[Example] | None, dev_records, tokenizer, pad: int,
                  chat: bool) -> DevEvaluator | None:
    """What the engine evaluates every `eval_steps` (and at the end: meta.json's dev_loss), or
    None without a dev set or under pipeline parallelism (the schedule only trains)."""
    if dev is None or config.pipeline_parallel_degree > 1:
        return None
    generation = None
    if config.eval_with_do_generation:
        generation = {"tokenizer": tokenizer, "records": dev_records, "src_length": config.src_length,
                      "max_new_tokens": config.max_length - config.src_length, "chat": chat}
    return DevEvaluator(dev, config.per_device_eval_batch_size, pad, generation=generation)


def _check_inputs(model_dir: Path, data_dir: Path, train_path: Path) -> None:
    """InputError unless prepare's training records and the base model's config.json exist."""
    if not train_path.exists():
        raise InputError(f"--data {data_dir}: {train_path} is missing; run the prepare stage first")
    if not (model_dir / "config.json").exists():
        raise InputError(f"--model {model_dir}: no config.json; expected a Hugging Face model "
                         "directory such as results/<experiment>/pretrain")


def _dev_set(dev_path: Path, config: SftSettings, tokenizer, chat: bool) -> tuple[list[Example] | None, list | None]:
    """(encoded dev examples, their records: the first num_eval_examples), or (None, None) with a
    warning when `dev_path` is missing."""
    if not dev_path.exists():
        log.warning("%s is missing; no evaluation, meta.json gets dev_loss=null", dev_path)
        return None, None
    dev_records = read_sft_file(dev_path)[:config.num_eval_examples or None]
    dev = encode_examples(dev_records, dev_path, tokenizer, config.src_length, config.max_length, chat)
    return dev, dev_records


def _training_model(method: str, config: SftSettings, model_dir: Path, examples: Sequence[Example]) -> torch.nn.Module:
    """The base model of `model_dir` to train: whole for sft, with the method's adapter attached
    (the base frozen) for lora and prefix. InputError when packing meets transformers' model."""
    # Each rank reads only its slice of the base, unless the prefix starts from the base's own KV
    # cache of real tokens (prefix_init: tokens), which needs the whole model before slicing.
    # Full SFT runs GPT-2 on our model too (every layout, written in GPT-2's layout); adapters of a
    # GPT-2 train on transformers' model, for peft's GPT-2 names
    model = load_causal_lm(model_dir, lazy=not (isinstance(config, PrefixSettings) and config.prefix_init == "tokens"),
                           families="all" if method == "sft" else "ours")
    if config.packing and not isinstance(model, LlamaForCausalLM):
        raise InputError(f"finetune.{method}.packing: {model_dir} trains through transformers' "
                         f"{type(model).__name__}, whose attention does not keep packed examples apart; "
                         f"packing needs a family our model implements ({', '.join(own_families())})")
    if method != "sft":  # seeded before: the adapter's initial weights repeat, the same on every rank
        from stages.adapters import attach_adapter  # peft's import, only for the adapter methods

        model = attach_adapter(model, method, config, prefix_init_ids(config, examples))
    return model


def _identity(model_dir: Path, train_path: Path, method: str, mix: Sequence[np.ndarray]) -> dict[str, Any]:
    """What makes two runs the same run (checkpoints resume only within one): the base, the
    training records, the method and the general text mixed in."""
    identity = {"base": model_identity(model_dir), "train": sha256_file(train_path), "method": method}
    if mix:  # other general text is another run: never resumed from this one's checkpoints
        identity["mix"] = mix_digests(mix)
    return identity


def _extra_metrics(config: SftSettings, source, degrees, trainable: int, total: int, train_examples: int,
                   evaluator: DevEvaluator | None) -> dict[str, Any]:
    """meta.json's metrics of the fine-tuning beside the engine's: parameter counts, examples,
    the mixing as trained, and what dev_bleu4 and dev_rouge_l are when generation is evaluated."""
    global_batch = (config.per_device_train_batch_size * config.gradient_accumulation_steps
                    * degrees.data_parallel_degree * degrees.sharding_parallel_degree)
    extra_metrics = {"trainable_params": trainable, "total_params": total, "train_examples": train_examples,
                     **mixing_metrics(config, source, global_batch)}
    if evaluator is not None and evaluator.generation is not None:  # what dev_bleu4 and dev_rouge_l are
        extra_metrics["dev_metric_implementations"] = metric_implementations()
    return extra_metrics


def run(method: str, model_dir: str | Path, data_dir: str | Path, out_dir: str | Path,
        config: Mapping[str, Any] | None = None, checkpoint_dir: str | Path | None = None) -> dict[str, Any]:
    """Fine-tune the model in `model_dir` on `data_dir/sft/train.json` with `method` and the
    validated `finetune.<method>` section `config`, on the training engine in the section's
    layout; write `out_dir` atomically; return metrics (every rank). With `checkpoint_dir`,
    checkpoints every `save_steps` steps and resumes as `resume_from_checkpoint` says. Settings
    missing from `config` take the schema's defaults of `finetune.<method>`."""
    config = check_section(method, config)
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    train_path, dev_path = data_dir / "sft" / "train.json", data_dir / "sft" / "dev.json"
    log_io(f"finetune-{method}", reads={"base model": model_dir, "SFT records": [train_path, dev_path]},
           writes={f"{'model' if method == 'sft' else 'adapter'}, train_log.csv, meta.json": out_dir,
                   "checkpoints, resumed from on a rerun": checkpoint_dir}, logger=log)
    _check_inputs(model_dir, data_dir, train_path)
    degrees = parallel_degrees(config)  # bad degrees fail before any process group exists
    init_distributed()
    set_seed(config.seed)
    tokenizer = load_model_tokenizer(model_dir)
    chat = data_chat_format(tokenizer, model_dir, data_dir)  # as prepare rendered the records
    pad = pad_id(tokenizer)
    examples = load_examples(train_path, tokenizer, config.src_length, config.max_length, chat)
    dev, dev_records = _dev_set(dev_path, config, tokenizer, chat)
    mix = section_mix_sources(config, data_dir, tokenizer, f"finetune.{method}")

    model = _training_model(method, config, model_dir, examples)
    trainable, total = count_parameters(model)
    if dist.get_rank() == 0:
        log.info("finetune-%s: %d examples, %d of %d parameters trainable, layout %s", method, len(examples),
                 trainable, total, degrees)
    identity = _identity(model_dir, train_path, method, mix)
    evaluator = dev_evaluator(config, dev, dev_records, tokenizer, pad, chat)
    writer = None
    if method != "sft":  # peft and transformers: full SFT never loads them
        from stages.adapters.peft_files import adapter_writer

        writer = adapter_writer(method, config, model, model_dir)
    source = build_source(config, examples, pad, mix)
    extra_metrics = _extra_metrics(config, source, degrees, trainable, total, len(examples), evaluator)
    metrics = engine_train(model, source, config, out_dir, stage=f"finetune-{method}",
                           tokenizer_dir=model_dir, parent=model_dir, meta_config=config,
                           checkpoint_dir=checkpoint_dir, identity=identity, evaluator=evaluator,
                           adapter_writer=writer, extra_metrics=extra_metrics)
    if dist.get_rank() == 0:
        log.info("finetune-%s: loss %.4f -> %.4f, dev loss %s", method, metrics["first_loss"], metrics["final_loss"],
                 metrics["dev_loss"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", required=True, choices=METHODS,
                        help="sft: train every weight; lora: low-rank adapters; prefix: prefix tuning")
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="base model: a local Hugging Face model directory")
    parser.add_argument("--data", required=True, metavar="DIR",
                        help="prepare's output directory (reads sft/train.json, sft/dev.json)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory, written atomically")
    parser.add_argument("--config", metavar="JSON", help="the finetune.<method> section as one JSON object")
    parser.add_argument("--checkpoints", metavar="DIR",
                        help="working directory of checkpoints (every save_steps), resumed from on a rerun")
    parser.add_argument("--plan", metavar="JSON", default=None,
                        help="results/<name>/plan.json: log its planned per-device memory beside the measured peak")
    settings.add_arguments(parser, *METHODS, group="finetune.<method> settings")
    args = parser.parse_args(argv)
    own = settings.section_schema(args.method)["properties"]
    stray = [key for key in settings.given_settings(args) if key not in own]
    if stray:
        parser.error(f"--method {args.method} has no setting {', '.join(stray)} (a setting of another method)")
    config = settings.from_arguments(args, args.method, args.config)
    configure_logging()
    metrics = run(args.method, args.model, args.data, args.out, config, args.checkpoints)
    if args.plan:
        log_memory_against_plan(args.plan, f"finetune_{args.method}")
    finish_distributed()
    return metrics


if __name__ == "__main__":
    run_cli(main, "finetune")
