"""Checks that an exported cache graph generates what the torch model generates.

`generation_agreement`: onnxruntime runs the prompts as one left-padded batch with the KV cache
(`onnx_generate.greedy_generate`: prefill, then one token per step); torch runs each prompt alone,
unpadded, recomputing the whole sequence at every step without any cache. Equal tokens therefore
show that the cache, the padding mask and the position ids all do what a plain forward does.
fp32 arithmetic reordered by onnxruntime may decide a near-tie the other way, after which the
two continuations legitimately differ: a divergence is accepted as a near-tie when torch's own
logits of the two tokens differ by at most `rtol` of the logit scale (the export stage's
rel_err bound), and that row is compared no further. Any other divergence fails the check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from stages.deployment.onnx_generate import OnnxDecoder, greedy_generate


@dataclass
class GenerationAgreement:
    rows: int  # prompts generated from
    new_tokens: int  # greedy tokens per row
    tokens_compared: int  # up to each row's end or first near-tie
    near_ties: int  # rows that diverged at a near-tie (accepted)
    mismatches: list[str]  # rows that diverged otherwise: what torch and onnxruntime chose

    @property
    def agreement(self) -> float:
        """Share of the compared tokens that are equal (1.0 unless mismatches)."""
        return 1.0 - len(self.mismatches) / max(self.tokens_compared, 1)


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) (B, T): each prompt at the right end of its row; the numpy twin of
    stages.inference.generation.left_padded (inference reads ONNX through this package)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_token_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], mask[r, width - len(p):] = p, 1
    return ids, mask


@torch.no_grad()
def generation_agreement(torch_logits: Callable[[torch.Tensor], torch.Tensor], decoder: OnnxDecoder,
                         prompts: Sequence[Sequence[int]], new_tokens: int, rtol: float,
                         pad_token_id: int = 0) -> GenerationAgreement:
    """Compare onnxruntime's batched, cached greedy generation with torch's (see module docstring).
    `torch_logits(ids (1, T)) -> (1, T, V)` is the torch model without a cache."""
    ids, mask = left_pad(prompts, pad_token_id)
    width = ids.shape[1]
    got = greedy_generate(decoder, ids, mask, new_tokens, None, pad_token_id)[:, width:]  # (B, new)
    compared, near_ties, mismatches = 0, 0, []
    for r, prompt in enumerate(prompts):
        seq = torch.tensor([list(prompt)])
        for step in range(new_tokens):
            logits = torch_logits(seq)[0, -1].float()  # (V,)
            want, have = int(logits.argmax()), int(got[r, step])
            compared += 1
            if want != have:
                if float(logits[want] - logits[have]) <= rtol * float(logits.abs().max()):
                    near_ties += 1
                else:
                    mismatches.append(f"row {r} step {step}: torch {want} (logit {float(logits[want]):.4g}), "
                                      f"onnxruntime {have} (logit {float(logits[have]):.4g})")
                break
            seq = torch.cat([seq, torch.tensor([[want]])], dim=1)
    return GenerationAgreement(len(prompts), new_tokens, compared, near_ties, mismatches)
