"""The one causal-LM loss: its reductions agree with each other and with transformers' loss, and no
other module of stages/ or bench/ writes its own cross-entropy or ignore index."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

from stages.model import IGNORE_INDEX, causal_lm_loss, counted_tokens

ROOT = Path(__file__).resolve().parents[2]


def _batch(seed=0, B=3, T=9, V=17):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :4] = IGNORE_INDEX  # a prompt
    labels[2, 6:] = IGNORE_INDEX  # padding
    return logits, labels


def test_mean_sum_and_normalizer_agree():
    logits, labels = _batch()
    count = int(counted_tokens(labels))
    assert count == 3 * 8 - 3 - 3  # shifted: row 0 loses positions 1-3, row 2 positions 6-8
    mean = causal_lm_loss(logits, labels)
    total = causal_lm_loss(logits, labels, reduction="sum")
    torch.testing.assert_close(total / count, mean)
    torch.testing.assert_close(causal_lm_loss(logits, labels, reduction="sum", normalizer=count), mean)
    # micro-batches: summed shares over the whole batch's count give the batch's mean
    shares = sum(causal_lm_loss(logits[i:i + 1], labels[i:i + 1], reduction="sum", normalizer=count) for i in range(3))
    torch.testing.assert_close(shares, mean)


def test_equals_transformers_causal_lm_loss():
    logits, labels = _batch(seed=1)
    expected = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])
    torch.testing.assert_close(causal_lm_loss(logits, labels), expected)


def test_per_token_variant_gives_the_same_loss():
    logits, labels = _batch(seed=2)
    per_token = lambda x, t: F.cross_entropy(x, t, ignore_index=IGNORE_INDEX, reduction="none")  # noqa: E731
    for reduction in ("mean", "sum"):
        torch.testing.assert_close(causal_lm_loss(logits, labels, reduction=reduction, per_token=per_token),
                                   causal_lm_loss(logits, labels, reduction=reduction))


@pytest.mark.parametrize("pattern", [r"\bF\.cross_entropy\(", r"IGNORE_INDEX\s*=\s*-100", r"!=\s*-100\b"])
def test_written_once(pattern):
    """One definition of the loss and of IGNORE_INDEX; the vocab-parallel cross-entropy's
    one-rank fallback is the only other call of F.cross_entropy."""
    allowed = {"stages/model/loss.py", "stages/parallel/tensor.py"} if "cross_entropy" in pattern \
        else {"stages/model/labels.py"} if "IGNORE_INDEX" in pattern else set()
    hits = sorted(str(p.relative_to(ROOT)) for folder in ("stages", "bench") for p in (ROOT / folder).rglob("*.py")
                  if re.search(pattern, p.read_text()))
    assert set(hits) <= allowed, f"{pattern} outside {sorted(allowed)}: {hits}"


def test_the_step_loss_from_the_learned_positions_only_equals_the_full_logits_loss():
    """token_sum_loss asks our model for the logits of the learned positions only: the same rows of
    the logits, the same summed loss and the same gradients as the whole (B, T, V) logits give."""
    from stages.model import LlamaForCausalLM
    from stages.model.config import config_for_flavour
    from stages.model.loss import learned_positions
    from stages.training.step import token_sum_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(config_for_flavour("debug", vocab_size=64))
    ids = torch.randint(0, 64, (3, 12))
    labels = ids.clone()
    labels[0, :7] = IGNORE_INDEX  # an SFT row's prompt
    labels[1, 9:] = IGNORE_INDEX  # padding
    where, targets = learned_positions(labels)
    assert int(where.sum()) == int(counted_tokens(labels)) == len(targets) == 5 + 8 + 11

    full = model(input_ids=ids)
    assert torch.allclose(model(input_ids=ids, logits_at=where), full[where], atol=1e-6)
    expected = causal_lm_loss(full, labels, reduction="sum")
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    got = token_sum_loss(model, ids, labels, None)
    got.backward()
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected_grads[name], rtol=1e-5, atol=1e-7), name
