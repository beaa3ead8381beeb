"""Fine-tune a causal LM on src/tgt pairs: full SFT, LoRA or prefix tuning.

    python -m stages.finetune --method lora --model results/llama/pretrain \
        --data results/llama/data --out results/llama/lora --config '{...finetune.lora...}'

Reads `<data>/sft/train.json` (and `dev.json` for the dev loss), encodes it with
`stages.data.sft.encode_example` (loss on target tokens only), trains single-process with AdamW
and the shared LR schedule, and writes atomically (docs/artifacts.md):
- sft: an HF model dir (config.json, model.safetensors, generation_config.json, tokenizer files);
- lora / prefix: a peft adapter dir (adapter_config.json, adapter_model.safetensors, tokenizer
  files) that loads with `peft.PeftModel.from_pretrained(base, dir)`, base = meta.json's parent;
plus `train_log.csv` and `meta.json` (stage "finetune-<method>").

With `--checkpoints DIR`, every method checkpoints every `save_steps` steps into
`DIR/<fingerprint>/` and a rerun resumes from the newest complete checkpoint there: full SFT through
the training engine, LoRA and prefix tuning through `stages.training.local_checkpoint` (same format).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
import transformers

from stages.adapters import ADAPTER_METHODS, attach_adapter, count_parameters
from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.hf import copy_tokenizer
from stages.checkpoint.meta import write_meta
from stages.checkpoint.store import StateReader
from stages.checkpoint.weights import check_model_dir
from stages.data.corpus import read_index
from stages.data.sft import IGNORE_INDEX, encode_example, read_sft_file
from stages.data.tokenizer import check_same_tokenizer, load_model_tokenizer
from stages.errors import InputError, run_cli
from stages.training.batches import SftBatches
from stages.checkpoint.integrity import sha256_file
from stages.training.checkpointing import model_identity, run_fingerprint
from stages.training.engine import finish_distributed, init_distributed, parallel_degrees
from stages.training.engine import train as engine_train
from stages.training.launcher_watch import exit_with_launcher
from stages.training.local_checkpoint import LocalCheckpointer, restore
from stages.training.log import TrainLog
from stages.training.schedule import build_scheduler
from stages.training.seed import set_seed

log = logging.getLogger(__name__)

METHODS = ("sft", *ADAPTER_METHODS)
# Keys of a finetune section this stage reads; stages.config.check_config fills them all.
REQUIRED_KEYS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "min_learning_rate",
    "warmup_steps", "max_steps", "lr_scheduler_type", "weight_decay", "adam_beta1", "adam_beta2",
    "max_grad_norm", "seed", "logging_steps", "bf16", "src_length", "max_length",
)
METHOD_KEYS = {"sft": ("world_size", "sharding", "tensor_parallel_degree", "pipeline_parallel_degree"), "lora": ("lora_rank", "lora_alpha", "lora_dropout", "target_modules"),
               "prefix": ("num_prefix_tokens",)}

Example = tuple[list[int], list[int]]  # (input_ids, labels)


# -- data ----------------------------------------------------------------------------------------
def load_examples(path: Path, tokenizer, src_length: int, max_length: int, chat: bool = False) -> list[Example]:
    """Encode every record of an SFT file (with `chat`, through the tokenizer's chat template);
    examples whose targets were cut off entirely by `max_length` are dropped (they carry no
    loss), with a warning counting them."""
    examples = [encode_example(tokenizer, r, src_length, max_length, chat) for r in read_sft_file(path)]
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


def train_batches(examples: Sequence[Example], batch_size: int, pad_token_id: int,
                  seed: int, skip: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches: each epoch is a fresh permutation drawn from (seed, epoch), so the
    order depends only on the seed and not on any other use of the global RNG. The first `skip`
    micro-batches are passed over without being built (a resumed run's data position)."""
    epoch = 0
    while True:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, len(order), batch_size):
            if skip > 0:
                skip -= 1
                continue
            yield collate([examples[i] for i in order[start:start + batch_size]], pad_token_id)
        epoch += 1


def target_token_count(labels: torch.Tensor) -> int:
    """Tokens that carry loss: labels shifted by one, as `summed_loss` scores them."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def summed_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over target tokens of -log p(token t+1 | tokens <= t), in fp32.

    A sum rather than a mean so that gradient accumulation and the dev loss weigh every target
    token equally, whatever the micro-batch it falls in.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    V = logits.shape[-1]
    shift_logits = logits[:, :-1, :].reshape(-1, V).float()  # (B*(T-1), V)
    shift_labels = batch["labels"][:, 1:].reshape(-1)  # (B*(T-1),)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


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
def check_section(method: str, config: dict[str, Any]) -> None:
    """Raise ValueError for an unknown method or a config section missing keys this stage reads."""
    if method not in METHODS:
        raise InputError(f"--method {method!r} is unknown; choose one of {METHODS}")
    missing = [k for k in (*REQUIRED_KEYS, *METHOD_KEYS[method]) if k not in config]
    if missing:
        raise InputError(f"finetune.{method} config lacks {missing}; pass the section as filled by "
                         "stages.config.check_config (it adds every default)")
    if config["src_length"] >= config["max_length"]:
        raise InputError(f"finetune.{method}: src_length={config['src_length']} must be smaller than "
                         f"max_length={config['max_length']} (room is needed for the target)")


def build_optimizer(model: torch.nn.Module, config: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay only on matrices, since decaying norm
    gains and biases towards zero only hurts (the usual GPT/Llama recipe)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config["learning_rate"],
                             betas=(config["adam_beta1"], config["adam_beta2"]))


def train(model: torch.nn.Module, examples: Sequence[Example], config: dict[str, Any],
          pad_token_id: int, train_log: TrainLog, checkpointer: LocalCheckpointer | None = None,
          resume: StateReader | None = None) -> dict[str, Any]:
    """Run `max_steps` optimizer steps of `gradient_accumulation_steps` micro-batches each.

    With `checkpointer`, saves every `save_steps` steps; with `resume` (a checkpoint that
    `checkpointer` wrote), continues after its step: trainable weights, Adam, LR schedule, RNG,
    loss history and data position as they were, so the result is that of an uninterrupted run
    (`train_log` must already hold the checkpoint's rows).

    Returns first_loss, final_loss (per target token, of the first / last optimizer step),
    train_tokens_per_s (non-pad input tokens per second of this process's steps) and
    resumed_from_step (None when not resumed).
    """
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    params = [p for p in model.parameters() if p.requires_grad]
    accum = config["gradient_accumulation_steps"]
    start_step, losses, tokens_since_log = 0, [], 0
    if resume is not None:
        state = restore(resume, model, optimizer, scheduler)
        start_step, losses, tokens_since_log = state["global_step"], state["losses"], state["tokens_since_log"]
        log.info("resumed from %s at step %d of %d", resume.path, start_step, config["max_steps"])
        resume.close()
    batches = train_batches(examples, config["per_device_train_batch_size"], pad_token_id, config["seed"],
                            skip=start_step * accum)
    # bf16 autocast keeps fp32 master weights; the loss is computed in fp32 either way.
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if config["bf16"] else nullcontext
    # max_grad_norm=0 disables clipping; an infinite threshold still measures the norm for the log.
    clip = config["max_grad_norm"] or math.inf
    model.train()
    total_tokens, start = 0, time.perf_counter()
    for step in range(start_step + 1, config["max_steps"] + 1):
        micro = [next(batches) for _ in range(accum)]
        # Normalise by the step's target tokens so a step's gradient is that of its mean token loss.
        n_targets = max(sum(target_token_count(b["labels"]) for b in micro), 1)
        step_loss = 0.0
        for batch in micro:
            with autocast():
                loss = summed_loss(model, batch) / n_targets
            loss.backward()
            step_loss += loss.item()
            tokens_since_log += int(batch["attention_mask"].sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if step % config["logging_steps"] == 0 or step == config["max_steps"]:
            train_log.log(step, step_loss, lr, grad_norm, tokens_since_log)
            total_tokens += tokens_since_log
            tokens_since_log = 0
        train_log.advance()
        if checkpointer is not None and checkpointer.due(step, config["max_steps"]):
            checkpointer.save(step, model, optimizer, scheduler, {
                "max_steps": config["max_steps"], "losses": list(losses), "train_log": list(train_log.rows),
                "tokens_since_log": tokens_since_log})
    elapsed = time.perf_counter() - start
    nan = float("nan")
    return {"first_loss": losses[0] if losses else nan, "final_loss": losses[-1] if losses else nan,
            "train_tokens_per_s": total_tokens / max(elapsed, 1e-9), "resumed_from_step": start_step or None}


# -- the stage -----------------------------------------------------------------------------------
def load_base(model_dir: str | Path) -> tuple[transformers.PreTrainedModel, Any]:
    """The fp32 model and tokenizer of a local HF directory (no hub, no remote code, no pickle)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise InputError(f"--model {model_dir}: no config.json; expected a Hugging Face model "
                         "directory such as results/<experiment>/pretrain")
    check_model_dir(model_dir)  # sha256 against meta.json, no pickle, whole safetensors files
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True, trust_remote_code=False, use_safetensors=True)
    return model, load_model_tokenizer(model_dir)


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else eos: padded positions are masked out, so any id serves."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return value
    raise InputError("the tokenizer has neither a pad nor an eos token; set pad_token in tokenizer_config.json")


def save_tokenizer(tokenizer, model_dir: Path, out: Path) -> None:
    """Copy the parent's tokenizer files byte for byte when it has tokenizer.json, so every
    artifact carries the same files as `prepare` wrote; else let transformers write them."""
    if (model_dir / "tokenizer.json").exists():
        copy_tokenizer(model_dir, out)
    else:
        tokenizer.save_pretrained(out)


@torch.no_grad()
def _dev_loss_of(model: torch.nn.Module, examples: Sequence[Example], batch_size: int, pad_token_id: int) -> float:
    """Mean dev-target loss of the project's own model (forward(input_ids) -> logits; right
    padding never reaches earlier positions under causal attention)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start:start + batch_size], pad_token_id)
        logits = model(batch["input_ids"])
        labels = batch["labels"][:, 1:]
        total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum"))
        count += target_token_count(batch["labels"])
    return total / max(count, 1)


def run_full_sft(model_dir: Path, out_dir: str | Path, config: dict[str, Any], tokenizer,
                 examples: Sequence[Example], dev: Sequence[Example] | None, train_path: Path | None = None,
                 checkpoint_dir: str | Path | None = None) -> dict[str, Any]:
    """Full SFT on the shared training engine (stages.training.engine), in the section's layout:
    world_size processes = data x tensor x pipeline parallel, DeepSpeed ZeRO from `sharding`.
    The families our model implements train through it in every layout; any other causal LM
    transformers supports trains through transformers' model with data parallel and ZeRO only
    (`stages.training.families`). Every layout follows the single-process curve; the ranks write
    an HF model dir. With `checkpoint_dir`, checkpoints every `save_steps` and resumes from the
    newest complete one."""
    import torch.distributed as dist

    from stages.training.families import load_causal_lm

    parallel_degrees(config)  # bad degrees fail before any process group exists
    init_distributed()
    model = load_causal_lm(model_dir)
    pad = pad_id(tokenizer)
    source = SftBatches(list(examples), config["max_length"], pad, config["seed"])
    identity = {"base": model_identity(model_dir)}
    if train_path is not None:
        identity["train"] = sha256_file(train_path)
    metrics = engine_train(model, source, config, out_dir, stage="finetune-sft", tokenizer_dir=model_dir,
                           parent=model_dir, meta_config=config, checkpoint_dir=checkpoint_dir, identity=identity)
    metrics.update(trainable_params=metrics["num_parameters"], total_params=metrics["num_parameters"],
                   train_examples=len(examples), dev_loss=None)
    if dev is not None and dist.get_rank() == 0:
        final = load_causal_lm(out_dir)  # transformers' models take the attention mask, ours does not need it
        score = dev_loss if isinstance(final, transformers.PreTrainedModel) else _dev_loss_of
        metrics["dev_loss"] = score(final, dev, config["per_device_train_batch_size"], pad)
    return metrics


def sft_format(tokenizer, model_dir: Path, data_dir: Path) -> bool:
    """Whether SFT records are rendered with the chat template, as prepare decided for this data
    (index.json's `sft_format`); first checks that the model's tokenizer is the data's. A data dir
    with SFT files but no index.json (not written by prepare) is read in the plain format."""
    if not (data_dir / "index.json").exists():
        log.warning("%s has no index.json (not written by prepare): plain SFT format, tokenizer not checked", data_dir)
        return False
    index = read_index(data_dir)
    check_same_tokenizer(tokenizer, model_dir, index, data_dir)
    chat = index.get("sft_format") == "chat_template"
    log.info("SFT format: %s", "the tokenizer's chat template" if chat else "plain (bos src tgt eos)")
    return chat


def adapter_checkpointer(checkpoint_dir: str | Path, method: str, config: dict[str, Any], model_dir: Path,
                         train_path: Path) -> LocalCheckpointer:
    """LoRA / prefix checkpoints in `checkpoint_dir/<fingerprint>`: the fingerprint hashes the
    recipe, the base model's content, the training data and the method, so any change starts afresh."""
    identity = {"base": model_identity(model_dir), "train": sha256_file(train_path), "method": method}
    global_batch = config["per_device_train_batch_size"] * config["gradient_accumulation_steps"]
    return LocalCheckpointer(Path(checkpoint_dir) / run_fingerprint(config, global_batch, identity), config)


def run(method: str, model_dir: str | Path, data_dir: str | Path, out_dir: str | Path,
        config: dict[str, Any], checkpoint_dir: str | Path | None = None) -> dict[str, Any]:
    """Fine-tune the model in `model_dir` on `data_dir/sft/train.json` with `method` and the
    validated `finetune.<method>` section `config`; write `out_dir` atomically; return metrics.
    Full SFT runs on the distributed training engine (any layout); LoRA and prefix tuning train
    the peft adapter in one process. With `checkpoint_dir`, every method checkpoints every
    `save_steps` steps and resumes as `resume_from_checkpoint` says."""
    check_section(method, config)
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    set_seed(config["seed"])
    train_path, dev_path = data_dir / "sft" / "train.json", data_dir / "sft" / "dev.json"
    if not train_path.exists():
        raise InputError(f"--data {data_dir}: {train_path} is missing; run the prepare stage first")
    if method == "sft":
        tokenizer = load_model_tokenizer(model_dir)
        chat = sft_format(tokenizer, model_dir, data_dir)
        examples = load_examples(train_path, tokenizer, config["src_length"], config["max_length"], chat)
        dev = (load_examples(dev_path, tokenizer, config["src_length"], config["max_length"], chat)
               if dev_path.exists() else None)
        metrics = run_full_sft(model_dir, out_dir, config, tokenizer, examples, dev, train_path, checkpoint_dir)
        log.info("finetune-sft: loss %.4f -> %.4f, dev loss %s", metrics["first_loss"], metrics["final_loss"],
                 metrics["dev_loss"])
        return metrics
    model, tokenizer = load_base(model_dir)
    chat = sft_format(tokenizer, model_dir, data_dir)
    pad = pad_id(tokenizer)
    examples = load_examples(train_path, tokenizer, config["src_length"], config["max_length"], chat)
    # Seeded above, so the adapter's initial weights (LoRA's A) repeat from run to run.
    model = attach_adapter(model, method, config)
    trainable, total = count_parameters(model)
    log.info("finetune-%s: %d examples, %d of %d parameters trainable", method, len(examples), trainable, total)
    checkpointer = resume = None
    if checkpoint_dir is not None:
        checkpointer = adapter_checkpointer(checkpoint_dir, method, config, model_dir, train_path)
        resume = checkpointer.find()
    with atomic_dir(out_dir) as tmp:
        train_log = TrainLog(tmp / "train_log.csv", config["max_steps"], desc=f"finetune-{method}",
                             previous=resume.trainer_state["train_log"] if resume is not None else None)
        try:
            metrics: dict[str, Any] = train(model, examples, config, pad, train_log, checkpointer, resume)
        finally:
            train_log.close()
        metrics.update(trainable_params=trainable, total_params=total, train_examples=len(examples),
                       dev_loss=None)
        if dev_path.exists():
            dev = load_examples(dev_path, tokenizer, config["src_length"], config["max_length"], chat)
            metrics["dev_loss"] = dev_loss(model, dev, config["per_device_train_batch_size"], pad)
        else:
            log.warning("%s is missing; meta.json gets dev_loss=null", dev_path)
        # peft models save only the adapter (adapter_config.json, adapter_model.safetensors).
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, model_dir, tmp)
        write_meta(tmp, stage=f"finetune-{method}", config=config, parent=model_dir,
                   seed=config["seed"], metrics=metrics)
    log.info("finetune-%s: loss %.4f -> %.4f, dev loss %s", method, metrics["first_loss"],
             metrics["final_loss"], metrics["dev_loss"])
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
    parser.add_argument("--config", required=True, metavar="JSON",
                        help="the finetune.<method> config section as a JSON object, defaults filled")
    parser.add_argument("--checkpoints", metavar="DIR",
                        help="working directory of checkpoints (every save_steps), resumed from on a rerun")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as e:
        parser.error(f"--config is not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(config, dict):
        parser.error(f"--config must be a JSON object (the finetune.{args.method} section), "
                     f"got {type(config).__name__}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    exit_with_launcher()  # LoRA / prefix ranks never reach init_distributed's watch
    metrics = run(args.method, args.model, args.data, args.out, config, args.checkpoints)
    finish_distributed()  # no-op for the single-process LoRA / prefix loop
    return metrics


if __name__ == "__main__":
    run_cli(main, "finetune")
