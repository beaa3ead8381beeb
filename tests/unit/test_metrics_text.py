"""stages/metrics/text.py: exact match, corpus BLEU-4 and ROUGE-L against hand-computed values."""

import math

import pytest

from stages.metrics.text import corpus_bleu, exact_match, rouge_l

PRED = "the cat sat on the mat"
REF = "the cat is on the mat"


def test_exact_match_strips_whitespace_and_is_case_sensitive():
    assert exact_match([" yes ", "no"], ["yes", "No"]) == 0.5


def test_identical_is_one_and_disjoint_is_zero():
    texts = ["a b c d e", "x y z w"]
    for smooth in (False, True):
        assert corpus_bleu(texts, texts, smooth=smooth) == pytest.approx(1.0)
        assert corpus_bleu(["p q r s"], ["a b c d"], smooth=smooth) == 0.0
    assert rouge_l(texts, texts) == pytest.approx(1.0)
    assert rouge_l(["p q r s"], ["a b c d"]) == 0.0
    assert exact_match(texts, texts) == 1.0


def test_bleu_hand_computed_with_and_without_smoothing():
    # n-gram matches / totals: 1: 5/6, 2: 3/5, 3: 1/4, 4: 0/3; c = r = 6 so BP = 1.
    assert corpus_bleu([PRED], [REF], smooth=False) == 0.0  # no 4-gram match
    # add-one for n > 1: 5/6, 4/6, 2/5, 1/4 -> (1/18) ** (1/4)
    assert corpus_bleu([PRED], [REF], smooth=True) == pytest.approx((5 / 6 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25)
    assert corpus_bleu([PRED], [REF], smooth=True) == pytest.approx(18 ** -0.25)


def test_bleu_is_corpus_level_with_brevity_penalty():
    preds, refs = ["a b c d", "a b c"], ["a b c d", "a b c d e"]
    # Summed counts: every precision is 1 (4-grams 1/1), c = 7 < r = 9 -> BP = exp(1 - 9/7).
    # A sentence-level average would be (1 + 0) / 2 since the second sentence has no 4-gram.
    assert corpus_bleu(preds, refs, smooth=False) == pytest.approx(math.exp(1 - 9 / 7))


def test_bleu_clips_repeated_ngrams():
    # "the" credited at most once (the reference holds it once): p1 = 1/4; c = 4 > r = 2 -> BP = 1.
    assert corpus_bleu(["the the the the"], ["the cat"], max_order=1) == pytest.approx(0.25)


def test_bleu_empty_prediction_scores_zero():
    assert corpus_bleu([""], ["a b"]) == 0.0


def test_rouge_l_hand_computed():
    # LCS("the cat sat on the mat", "the cat is on the mat") = 5 -> P = R = F = 5/6.
    assert rouge_l([PRED], [REF]) == pytest.approx(5 / 6)
    # LCS = 3, P = 1, R = 1/2 -> F = 2/3; the mean over examples is (5/6 + 2/3) / 2.
    assert rouge_l(["a b c"], ["a x b y c z"]) == pytest.approx(2 / 3)
    assert rouge_l([PRED, "a b c"], [REF, "a x b y c z"]) == pytest.approx(0.75)
    assert rouge_l([""], [""]) == 1.0
    assert rouge_l([""], ["a"]) == 0.0


@pytest.mark.parametrize("fn", [exact_match, corpus_bleu, rouge_l])
def test_mismatched_or_empty_inputs_raise(fn):
    with pytest.raises(ValueError, match="one reference per prediction"):
        fn(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no examples"):
        fn([], [])
