"""The reference model's log-probabilities of preference pairs, the artifact of rule score_pairs
that DPO and IPO read (`stages.score_pairs` writes it, `stages.align` reads it): which pairs, how
they are scored, and the checks that they belong to the run reading them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from stages.data.preference import read_preference_file
from stages.data.sft_format import data_chat_format
from stages.errors import InputError
from stages.sections import AlignSettings
from stages.training.preference_batches import Pair, encode_pairs, pad_rows, pairs_seen
from stages.training.preference_step import row_logps

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
        total = row_logps(model, ids, labels).logps.total.double()
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
