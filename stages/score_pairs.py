"""Score the preference pairs with the reference model, once: the summed log-probability of each
pair's chosen and of its rejected answer, which DPO and IPO compare the policy's against.

    python -m stages.score_pairs --model results/llama/sft --data results/llama/data \
        --out results/llama/align_reference --config '{...align section...}'

Reads `<data>/preference/train.json`, encodes every pair as `stages.align` does (the align
section's src_length and max_length, the data's chat format), and runs the model in fp32 without
gradients over the pairs the alignment will draw (its seed, max_steps and global batch of pairs:
`pairs_seen`; 800 of the default's 2000). Writes atomically `<out>/reference_logps.safetensors`
(`logps` (N, 2) float64: the chosen and the rejected side of each kept pair, NaN for a pair the run
never draws; `index` (N,): the pair's line in train.json, 0-based) and meta.json, whose
`pairs_sha256` names the encoded pairs: `stages.align` refuses log-probs of other pairs, or
missing ones. Only the model, the pairs' encoding and which pairs are drawn change the scores, so a
rerun of the alignment with another beta, method or learning rate reuses them.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.meta import write_meta
from stages.data.tokenizer import load_model_tokenizer, pad_id
from stages.errors import InputError, run_cli
from stages.sections import AlignSettings
from stages.stage_logs import configure_logging, log_io
from stages.training.families import load_causal_lm
from stages.training.preference_batches import pairs_seen
from stages.training.reference_logps import (
    ENCODING_KEYS,
    REFERENCE_FILE,
    encoded_pairs,
    pairs_sha256,
    score,
)

log = logging.getLogger(__name__)

def run(model_dir: str | Path, data_dir: str | Path, out_dir: str | Path,
        config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Score `data_dir`'s training pairs with the model of `model_dir`; write `out_dir` atomically;
    return meta.json's metrics."""
    config = AlignSettings.of(config)
    model_dir, data_dir, out_dir = Path(model_dir), Path(data_dir), Path(out_dir)
    log_io("score_pairs", reads={"reference model": model_dir, "preference pairs": data_dir / "preference"},
           writes={f"{REFERENCE_FILE}, meta.json": out_dir}, logger=log)
    if not (model_dir / "config.json").exists():
        raise InputError(f"--model {model_dir}: no config.json; expected a Hugging Face model directory such "
                         "as results/<experiment>/sft")
    tokenizer = load_model_tokenizer(model_dir)
    pairs, index = encoded_pairs(model_dir, data_dir, config, tokenizer)
    model = load_causal_lm(model_dir, families="all")
    seen = pairs_seen(len(pairs), config)
    logps = torch.full((len(pairs), 2), float("nan"), dtype=torch.float64)
    scored = score(model, [pairs[i] for i in seen], pad_id(tokenizer), config.per_device_eval_batch_size)
    logps[torch.from_numpy(seen)] = scored
    metrics = {"pairs": len(pairs), "pairs_scored": len(seen), "pairs_sha256": pairs_sha256(pairs),
               "mean_logps_chosen": float(scored[:, 0].mean()), "mean_logps_rejected": float(scored[:, 1].mean()),
               "accuracy": float((scored[:, 0] > scored[:, 1]).double().mean())}
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        save_file({"logps": logps.contiguous(), "index": torch.tensor(index, dtype=torch.long)}, tmp / REFERENCE_FILE)
        write_meta(tmp, stage="score_pairs", config={k: config[k] for k in ENCODING_KEYS}, parent=model_dir,
                   seed=None, metrics=metrics)
    log.info("score_pairs: %d of %d pairs (those the alignment draws), mean log-prob chosen %.3f, rejected %.3f "
             "(the reference prefers the chosen answer in %.1f%% of them)", len(seen), len(pairs),
             metrics["mean_logps_chosen"], metrics["mean_logps_rejected"], 100 * metrics["accuracy"])
    return metrics


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m stages.score_pairs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="DIR", help="the reference model: a local Hugging Face "
                        "model directory (align.source's, e.g. results/<name>/sft)")
    parser.add_argument("--data", required=True, metavar="DIR", help="prepare's output (reads preference/train.json)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory, written atomically")
    parser.add_argument("--config", metavar="JSON", help="the align section as one JSON object (read: src_length "
                        "and max_length, the encoding; seed, max_steps and the global batch of pairs, which pairs "
                        "are scored; per_device_eval_batch_size)")
    args = parser.parse_args(argv)
    configure_logging()
    return run(args.model, args.data, args.out, json.loads(args.config) if args.config else None)


if __name__ == "__main__":
    run_cli(main, "score_pairs")
