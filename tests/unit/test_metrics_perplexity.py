"""stages/metrics/perplexity.py: window selection, model perplexity and the unigram baseline."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stages.metrics.perplexity import (
    model_perplexity, unigram_perplexity, validation_windows, window_starts,
)


class UniformLM(torch.nn.Module):
    """Outputs equal logits for every token: perplexity must equal the vocabulary size."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.dummy = torch.nn.Parameter(torch.zeros(()))  # gives the model a device

    def forward(self, input_ids):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab_size))


def test_window_starts_are_evenly_spread_and_deterministic():
    assert window_starts(100, 10, 4) == [0, 30, 60, 90]
    assert window_starts(100, 10, 64) == list(range(0, 100, 10))  # fewer windows than the cap
    assert window_starts(105, 10, 3) == [0, 40, 90]  # the 5-token tail is never a window
    assert window_starts(5, 10, 3) == []


def test_validation_windows_shapes():
    tokens = np.arange(35, dtype=np.uint16)
    w = validation_windows(tokens, 10, 2)
    assert w.shape == (2, 10) and w.dtype == np.int64
    np.testing.assert_array_equal(w[1], np.arange(20, 30))
    assert validation_windows(tokens[:7], 10, 2).shape == (1, 7)  # short split: one window
    with pytest.raises(ValueError, match="at least 2"):
        validation_windows(tokens[:1], 10, 2)


def test_uniform_logits_have_perplexity_equal_to_vocab_size():
    vocab = 37
    windows = validation_windows(np.random.default_rng(0).integers(0, vocab, 200), 16, 5)
    ppl, n = model_perplexity(UniformLM(vocab), windows, batch_size=2)
    assert ppl == pytest.approx(vocab, rel=1e-5)
    assert n == 5 * 15  # token 0 of each window is not predicted


def test_model_perplexity_matches_transformers_loss():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    window = np.random.default_rng(1).integers(0, 50, (1, 12))
    ppl, _ = model_perplexity(model, window)
    ids = torch.as_tensor(window)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss  # mean NLL over the 11 shifted targets
    assert ppl == pytest.approx(math.exp(float(loss)), rel=1e-5)


def test_out_of_vocabulary_token_is_an_error():
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        model_perplexity(UniformLM(5), np.array([[1, 2, 9]]))


def test_unigram_baseline_hand_computed():
    # counts [2, 1, 0], add-one over N + V = 3 + 3 -> p = [3/6, 2/6, 1/6]
    # targets [0, 2]: mean NLL = -(log 1/2 + log 1/6) / 2 -> ppl = sqrt(2 * 6)
    ppl = unigram_perplexity(np.array([0, 0, 1], dtype=np.uint16), np.array([[0, 2]]), vocab_size=3)
    assert ppl == pytest.approx(math.sqrt(12))


def test_unigram_baseline_rejects_ids_outside_vocab():
    with pytest.raises(ValueError, match="vocab_size=3"):
        unigram_perplexity(np.array([0, 5]), np.array([0]), vocab_size=3)
    with pytest.raises(ValueError, match="vocab_size=3"):
        unigram_perplexity(np.array([0, 1]), np.array([4]), vocab_size=3)


def test_target_perplexity_scores_only_answer_tokens():
    from stages.metrics.perplexity import target_perplexity

    class Uniform(torch.nn.Module):
        def __init__(self, vocab):
            super().__init__()
            self.vocab = vocab
            self.p = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask=None):
            class Out:
                pass
            out = Out()
            out.logits = torch.zeros(*input_ids.shape, self.vocab) + self.p
            return out

    examples = [([1, 5, 6, 7, 2], [-100, -100, 6, 7, 2]), ([1, 5, 2], [-100, -100, 2])]
    ppl, tokens = target_perplexity(Uniform(11), examples, pad_token_id=0, batch_size=2)
    assert tokens == 4 and abs(ppl - 11) < 1e-5  # uniform over 11 tokens, prompts and padding skipped
