"""Align a fine-tuned causal LM on preference pairs: DPO, IPO, SimPO or ORPO, full or LoRA, on the
training engine.

    python -m stages.score_pairs --model results/llama/sft --data results/llama/data \
        --out results/llama/align_reference --config '{...align...}'          # dpo and ipo only
    torchrun --nproc_per_node 2 -m stages.align --model results/llama/sft --data results/llama/data \
        --reference results/llama/align_reference --out results/llama/align --config '{...align...}'

Reads `<data>/preference/train.json` (pairs: a prompt, a chosen and a rejected answer), encodes
both sides of every pair as fine-tuning encodes a conversation (loss positions: the answer), and
trains the model of `--model` with the align section's `method` (`stages.model.preference_loss`)
on the shared engine in the section's layout: world_size processes = data x tensor x pipeline
parallel (pipeline for tuning full), ZeRO from `sharding`. A step's loss is the mean pair loss over its
global batch of pairs, so every layout follows the one-process run. dpo and ipo compare the
policy's log-probs with the reference model's, read from `--reference` (the score_pairs artifact,
computed once from the same model: a change of beta or method reruns only this stage). Writes
atomically:
- tuning full: an HF model dir (config.json, model.safetensors, tokenizer files);
- tuning lora: a peft adapter dir on `--model` (meta.json's parent);
plus `train_log.csv` (loss and, per logged row, the mean rewards of the chosen and rejected
answers, reward accuracy and margin, the policy's log-probs; TensorBoard scalars beside it) and
`meta.json` (stage "align"). With `mix_ratio` > 0, general text from `mix_datasets` follows the
answers in their rows and is learned as fine-tuning's mixing learns it, its mean NLL added to the
loss (`stages.training.preference_batches`); meta.json records `mix_token_share`. With
`--checkpoints DIR`, checkpoints every `save_steps` steps and a rerun resumes from the newest
complete one (any layout); SIGTERM saves one and stops, as every training stage does.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stages import settings
from stages.adapters.trainable import count_parameters
from stages.checkpoint.integrity import sha256_file
from stages.config import check_align_section
from stages.data.mix_sources import mix_digests, section_mix_sources
from stages.data.tokenizer import load_model_tokenizer, pad_id
from stages.errors import InputError, run_cli
from stages.model.preference_loss import PreferenceObjective
from stages.sections import AlignSettings, LoraSettings
from stages.stage_logs import configure_logging, log_io
from stages.training.checkpointing import model_identity
from stages.training.distributed import finish_distributed, init_distributed
from stages.training.engine import train as engine_train
from stages.training.families import load_causal_lm
from stages.training.mixed_batches import GeneralText, mixing_metrics
from stages.training.parallelize import parallel_degrees
from stages.training.peak_memory import log_memory_against_plan
from stages.training.preference_batches import PreferenceBatches, global_batch_of
from stages.training.reference_logps import (
    REFERENCE_FILE,
    encoded_pairs,
    read_reference,
)
from stages.training.seed import set_seed

log = logging.getLogger(__name__)

LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "target_parameters")


def check_section(config: Mapping[str, Any] | None) -> tuple[AlignSettings, PreferenceObjective]:
    """The align section with the schema's defaults filled and checked, and its objective;
    InputError naming the key for what the schema cannot say."""
    config = AlignSettings.of(config)
    check_align_section("align", config.as_dict())  # as the workflow checks it: lengths, warmup, smoothing, pp
    objective = PreferenceObjective(config.method, config.beta, config.label_smoothing, config.simpo_gamma)
    return config, objective


def lora_section(config: AlignSettings) -> LoraSettings:
    """The finetune.lora section of the align section's LoRA keys (what the adapter code reads)."""
    return LoraSettings.of({key: config[key] for key in LORA_KEYS} | {"seed": config.seed})


def _training_model(config: AlignSettings, model_dir: Path) -> torch.nn.Module:
    """The model to train: whole (tuning full; each rank reads only its slice), or frozen with a
    fresh LoRA adapter (tuning lora; seeded before, so the adapter repeats on every rank)."""
    model = load_causal_lm(model_dir, lazy=True, families="all" if config.tuning == "full" else "ours")
    if config.tuning == "lora":
        from stages.adapters import attach_adapter  # peft's import, only for LoRA

        model = attach_adapter(model, "lora", lora_section(config))
    return model


def run(model_dir: str | Path, data_dir: str | Path, out_dir: str | Path, config: Mapping[str, Any] | None = None,
        reference_dir: str | Path | None = None, checkpoint_dir: str | Path | None = None) -> dict[str, Any]:
    """Align the model in `model_dir` on `data_dir/preference/train.json` with the align section
    `config` (schema defaults for what it leaves out), in the section's layout; write `out_dir`
    atomically; return the metrics (every rank). dpo and ipo need `reference_dir` (score_pairs'
    output for the same model and pairs)."""
    config, objective = check_section(config)
    model_dir, data_dir = Path(model_dir), Path(data_dir)
    log_io("align", reads={"model": model_dir, "preference pairs": data_dir / "preference",
                           "reference log-probs": reference_dir},
           writes={f"{'model' if config.tuning == 'full' else 'adapter'}, train_log.csv, meta.json": out_dir,
                   "checkpoints, resumed from on a rerun": checkpoint_dir}, logger=log)
    if objective.needs_reference and reference_dir is None:
        raise InputError(f"align.method={config.method} compares with the reference model: pass --reference, the "
                         "output of python -m stages.score_pairs on the same model and data")
    if not (model_dir / "config.json").exists():
        raise InputError(f"--model {model_dir}: no config.json; expected a Hugging Face model directory such as "
                         "results/<experiment>/sft")
    degrees = parallel_degrees(config)  # bad degrees fail before any process group exists
    init_distributed()
    set_seed(config.seed)
    tokenizer = load_model_tokenizer(model_dir)
    pairs, _ = encoded_pairs(model_dir, data_dir, config, tokenizer)
    reference = read_reference(reference_dir, pairs, config) if objective.needs_reference else None
    mix = section_mix_sources(config, data_dir, tokenizer, "align")
    general = GeneralText(mix, config.mix_weights, config.mix_ratio, config.seed) if mix else None
    source = PreferenceBatches(pairs, pad_id(tokenizer), config.seed, reference, general, config.max_length)

    model = _training_model(config, model_dir)
    trainable, total = count_parameters(model)
    if dist.get_rank() == 0:
        log.info("align (%s, tuning %s): %d pairs, %d of %d parameters trainable, layout %s", config.method,
                 config.tuning, len(pairs), trainable, total, degrees)
    identity = {"base": model_identity(model_dir), "train": sha256_file(data_dir / "preference" / "train.json")}
    if reference is not None:  # other reference log-probs are another run
        identity["reference"] = sha256_file(Path(reference_dir) / REFERENCE_FILE)
    if mix:  # other general text is another run
        identity["mix"] = mix_digests(mix)
    writer = None
    if config.tuning == "lora":  # peft and transformers: only LoRA alignments load them
        from stages.adapters.peft_files import adapter_writer

        writer = adapter_writer("lora", lora_section(config), model, model_dir)
    metrics = engine_train(model, source, config, out_dir, stage="align", tokenizer_dir=model_dir, parent=model_dir,
                           meta_config=config, checkpoint_dir=checkpoint_dir, identity=identity,
                           adapter_writer=writer, objective=objective,
                           extra_metrics={"trainable_params": trainable, "total_params": total, "pairs": len(pairs),
                                          **mixing_metrics(config, source, global_batch_of(config))})
    if dist.get_rank() == 0:
        log.info("align: loss %.4f -> %.4f, reward accuracy %.3f, margin %.3f (last logged row)",
                 metrics["first_loss"], metrics["final_loss"], metrics["final_rewards_accuracy"],
                 metrics["final_rewards_margin"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.align", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="the model to align (and the reference of dpo/ipo): a local Hugging Face model directory")
    parser.add_argument("--data", required=True, metavar="DIR",
                        help="prepare's output directory (reads preference/train.json)")
    parser.add_argument("--reference", metavar="DIR",
                        help="score_pairs' output: the reference log-probs (dpo and ipo; simpo and orpo need none)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory, written atomically")
    parser.add_argument("--config", metavar="JSON", help="the align section as one JSON object")
    parser.add_argument("--checkpoints", metavar="DIR",
                        help="working directory of checkpoints (every save_steps), resumed from on a rerun")
    parser.add_argument("--plan", metavar="JSON", default=None,
                        help="results/<name>/plan/align.json: log its planned per-device memory beside the measured peak")
    settings.add_arguments(parser, "align", group="align settings")
    args = parser.parse_args(argv)
    config = settings.from_arguments(args, "align", args.config)
    configure_logging()
    metrics = run(args.model, args.data, args.out, config, args.reference, args.checkpoints)
    if args.plan:
        log_memory_against_plan(args.plan, "align")
    finish_distributed()
    return metrics


if __name__ == "__main__":
    run_cli(main, "align")
