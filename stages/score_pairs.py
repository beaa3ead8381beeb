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
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint.atomic import atomic_dir
from stages.checkpoint.meta import write_meta
from stages.data.preference import read_preference_file
from stages.data.sft_format import data_chat_format
from stages.data.tokenizer import load_model_tokenizer, pad_id
from stages.errors import InputError, run_cli
from stages.sections import AlignSettings
from stages.stage_logs import configure_logging, log_io
from stages.training.preference_batches import Pair, encode_pairs, pad_rows, pairs_seen
from stages.training.preference_step import row_logps

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logps.safetensors"
# the align keys that change the scores: the model, the pairs' encoding, which pairs are drawn
ENCODING_KEYS = ("source", "src_length", "max_length", "seed", "max_steps")


def pairs_sha256(pairs: Sequence[Pair]) -> str:
    """A digest of the encoded pairs (token ids and labels of both sides)."""
    digest = hashlib.sha256()
    for pair in pairs:
        digest.update(json.dumps(pair, separators=(",", ":")).encode())
    return digest.hexdigest()


@torch.no_grad()
def score(model: torch.nn.Module, pairs: Sequence[Pair], pad_token_id: int, batch_size: int) -> torch.Tensor:
    """(N, 2) float64: the summed log-prob of each pair's chosen and rejected answer under `model` (eval mode)."""
    model.eval()
    out = []
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start:start + batch_size]
        width = max(len(ids) for pair in chunk for ids, _ in pair)
        ids, labels = pad_rows([c for c, _ in chunk] + [r for _, r in chunk], width, pad_token_id)
        total = row_logps(model, ids, labels).total.double()
        out.append(torch.stack([total[:len(chunk)], total[len(chunk):]], dim=1))
    return torch.cat(out)


def encoded_pairs(model_dir: Path, data_dir: Path, config: AlignSettings, tokenizer) -> tuple[list[Pair], list[int]]:
    """The training pairs of `data_dir` encoded for the align section `config` (as both stages do)."""
    path = data_dir / "preference" / "train.json"
    if not path.exists():
        raise InputError(f"--data {data_dir}: {path} is missing; run the prepare stage first (it writes the "
                         "preference pairs of data.preference)")
    chat = data_chat_format(tokenizer, model_dir, data_dir)
    return encode_pairs(read_preference_file(path), tokenizer, config.src_length, config.max_length, chat, str(path))


def read_reference(reference_dir: str | Path, pairs: Sequence[Pair], config: AlignSettings) -> torch.Tensor:
    """The (N, 2) reference log-probs of `pairs` from a score_pairs output; InputError when they
    were computed for other pairs (other data, lengths or tokenizer) or lack one the run of
    `config` draws (another seed, more steps or a larger global batch)."""
    from safetensors.torch import load_file

    reference_dir = Path(reference_dir)
    path, meta_path = reference_dir / REFERENCE_FILE, reference_dir / "meta.json"
    if not path.exists() or not meta_path.exists():
        raise InputError(f"--reference {reference_dir}: no {REFERENCE_FILE} and meta.json; run "
                         "python -m stages.score_pairs first")
    digest = json.loads(meta_path.read_text())["metrics"]["pairs_sha256"]
    if digest != pairs_sha256(pairs):
        raise InputError(f"--reference {reference_dir}: its log-probs belong to other pairs than these (the "
                         "preference data, the tokenizer or align.src_length / max_length changed since); rerun "
                         "python -m stages.score_pairs")
    logps = load_file(path)["logps"]
    missing = torch.isnan(logps[torch.from_numpy(pairs_seen(len(pairs), config))]).any(dim=1)
    if missing.any():
        raise InputError(f"--reference {reference_dir}: {int(missing.sum())} of the pairs this run draws were not "
                         "scored (they were for another seed, fewer steps or a smaller global batch of pairs); "
                         "rerun python -m stages.score_pairs with this align section")
    return logps


def run(model_dir: str | Path, data_dir: str | Path, out_dir: str | Path,
        config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Score `data_dir`'s training pairs with the model of `model_dir`; write `out_dir` atomically;
    return meta.json's metrics."""
    from stages.training.families import load_causal_lm

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
