"""stages/metrics/text.py: exact match, corpus BLEU-4 and ROUGE-L against hand-computed values, and
against sacrebleu and rouge-score called directly on a fixed set."""

import logging
import math

import pytest
from light_imports import loaded_by_code, loaded_by_import

from stages.metrics.text import corpus_bleu, exact_match, lcs_length, metric_implementations, rouge_l

PRED = "the cat sat on the mat"
REF = "the cat is on the mat"

# (prediction, reference): exact matches, partial overlaps, an empty prediction, punctuation and
# case that the two tokenizers treat differently, repeats, a longer sentence, accented letters.
FIXED_SET = [
    ("three big red boxes", "three big red boxes"),
    ("a tiny blue star", "a tiny blue star"),
    ("two huge green cubes", "two huge green crosses"),
    ("an enormous yellow heart", "a enormous yellow heart"),
    ("", "five small black circles"),
    ("The cat sat on the mat.", "the cat sat on the mat"),
    ("Hello, world! It's 3:15 p.m.", "Hello world, it's 3:15 pm."),
    ("the the the the", "the cat"),
    ("big big red", "four big red squares"),
    ("the quick brown fox jumps over the lazy dog", "a quick brown dog jumps over the lazy fox"),
    ("state-of-the-art (SOTA) results", "state of the art results"),
    ("café au lait", "cafe au lait"),
]


def test_exact_match_strips_whitespace_and_is_case_sensitive():
    assert exact_match([" yes ", "no"], ["yes", "No"]) == 0.5


def test_identical_is_one_and_disjoint_is_zero():
    texts = ["a b c d e", "x y z w"]
    for smooth in (False, True):
        assert corpus_bleu(texts, texts, smooth=smooth) == 1.0  # capped: sacrebleu gives 1 + 4e-16
        assert corpus_bleu(["p q r s"], ["a b c d"], smooth=smooth) == 0.0
    assert rouge_l(texts, texts) == pytest.approx(1.0)
    assert rouge_l(["p q r s"], ["a b c d"]) == 0.0
    assert exact_match(texts, texts) == 1.0


def test_bleu_hand_computed_with_and_without_smoothing():
    # n-gram matches / totals: 1: 5/6, 2: 3/5, 3: 1/4, 4: 0/3; c = r = 6 so BP = 1.
    assert corpus_bleu([PRED], [REF], smooth=False) == 0.0  # no 4-gram match
    # exp smoothing: the first order without a match counts as 1 / (2 * 3) -> (1/48) ** (1/4)
    assert corpus_bleu([PRED], [REF], smooth=True) == pytest.approx((5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25)
    assert corpus_bleu([PRED], [REF], smooth=True) == pytest.approx(48 ** -0.25)


def test_bleu_is_corpus_level_with_brevity_penalty():
    preds, refs = ["a b c d", "a b c"], ["a b c d", "a b c d e"]
    # Summed counts: every precision is 1 (4-grams 1/1), c = 7 < r = 9 -> BP = exp(1 - 9/7).
    # A sentence-level average would be (1 + 0) / 2 since the second sentence has no 4-gram.
    assert corpus_bleu(preds, refs, smooth=False) == pytest.approx(math.exp(1 - 9 / 7))


def test_bleu_clips_repeated_ngrams():
    # "the" credited at most once (the reference holds it once): p1 = 1/4; c = 4 > r = 2 -> BP = 1.
    assert corpus_bleu(["the the the the"], ["the cat"], max_order=1) == pytest.approx(0.25)


def test_bleu_splits_punctuation_and_keeps_case():
    # 13a splits "mat." into "mat ." on both sides: identical token lists.
    assert corpus_bleu(["the cat sat on the mat."], ["the cat sat on the mat ."]) == 1.0
    # case is kept: "The" misses "the": 1-grams 5/6, 2: 4/5, 3: 3/4, 4: 2/3, BP = 1
    assert corpus_bleu(["The cat sat on the mat"], [PRED]) == pytest.approx((5 / 6 * 4 / 5 * 3 / 4 * 2 / 3) ** 0.25)


def test_bleu_empty_or_short_prediction_scores_zero():
    assert corpus_bleu([""], ["a b"]) == 0.0
    # no 3- or 4-grams in the corpus: sacrebleu scores 0 even for identical text
    assert corpus_bleu(["a b"], ["a b"]) == 0.0


def test_rouge_l_hand_computed():
    # LCS("the cat sat on the mat", "the cat is on the mat") = 5 -> P = R = F = 5/6.
    assert rouge_l([PRED], [REF]) == pytest.approx(5 / 6)
    # LCS = 3, P = 1, R = 1/2 -> F = 2/3; the mean over examples is (5/6 + 2/3) / 2.
    assert rouge_l(["a b c"], ["a x b y c z"]) == pytest.approx(2 / 3)
    assert rouge_l([PRED, "a b c"], [REF, "a x b y c z"]) == pytest.approx(0.75)
    # lowercased, punctuation is a separator: "The CAT, sat." -> the cat sat
    assert rouge_l(["The CAT, sat."], ["the cat sat"]) == pytest.approx(1.0)
    assert rouge_l([""], [""]) == 0.0  # no tokens on either side: rouge-score scores 0
    assert rouge_l([""], ["a"]) == 0.0


def test_rouge_l_warns_about_letters_its_tokenizer_drops(caplog):
    # "café" tokenizes as "caf": LCS("caf au lait", "cafe au lait") = 2 -> F = 2/3
    with caplog.at_level(logging.WARNING, logger="stages.metrics.text"):
        assert rouge_l(["cafe au lait"], ["café au lait"]) == pytest.approx(2 / 3)
        assert rouge_l(["Привет мир"], ["Привет мир"]) == 0.0  # no [a-z0-9] tokens at all
    assert len(caplog.records) == 2 and all("1 of 1 references" in r.getMessage() for r in caplog.records)


def test_agrees_with_sacrebleu_and_rouge_score_on_a_fixed_set():
    import sacrebleu
    from rouge_score import rouge_scorer

    preds, refs = [p for p, _ in FIXED_SET], [r for _, r in FIXED_SET]
    # sacrebleu's defaults: 13a, exp smoothing, case kept
    expected_bleu = sacrebleu.corpus_bleu(preds, [refs]).score / 100
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    expected_rouge = sum(scorer.score(r, p)["rougeL"].fmeasure for p, r in FIXED_SET) / len(FIXED_SET)
    assert 0.1 < expected_bleu < 0.9 and 0.1 < expected_rouge < 0.9  # a set that tells values apart
    assert corpus_bleu(preds, refs) == pytest.approx(expected_bleu, abs=1e-6)
    assert rouge_l(preds, refs) == pytest.approx(expected_rouge, abs=1e-6)
    # and per example, where rouge-score and sentence-level BLEU without smoothing differ most
    for p, r in FIXED_SET:
        assert rouge_l([p], [r]) == pytest.approx(scorer.score(r, p)["rougeL"].fmeasure, abs=1e-6)
        assert corpus_bleu([p], [r], smooth=False) == pytest.approx(
            sacrebleu.corpus_bleu([p], [[r]], smooth_method="none").score / 100, abs=1e-6)


def test_rouge_l_equals_rouge_scores_scorer_on_random_texts():
    """Our LCS over rouge-score's tokens against RougeScorer itself: 500 random pairs over a small
    vocabulary (many repeated words, so many equally long common subsequences), case and punctuation."""
    import random

    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    words = ["the", "The", "cat", "cat,", "sat", "on", "mat.", "a", "3", "big-red", ""]
    rng = random.Random(0)
    for _ in range(500):
        p, r = (" ".join(rng.choices(words, k=rng.randint(0, 12))) for _ in range(2))
        assert rouge_l([p], [r]) == scorer.score(r, p)["rougeL"].fmeasure, (p, r)
    assert lcs_length("abcbdab", "bdcaba") == 4 and lcs_length("", "abc") == 0


def test_rouge_l_does_not_import_nltk():
    """rouge_scorer imports nltk for its stemmer (~1 s): rouge_l reads rouge-score's tokenizer alone."""
    code = "from stages.metrics.text import rouge_l\nrouge_l(['a b'], ['a c'])"
    loaded = loaded_by_code(code, ("rouge_score.tokenize", "rouge_score.rouge_scorer", "nltk"))
    assert loaded == ["rouge_score.tokenize"]


def test_metric_implementations_name_the_signature_sacrebleu_gives():
    from sacrebleu.metrics import BLEU

    bleu = BLEU()
    bleu.corpus_score([PRED], [[REF]])
    implementations = metric_implementations()
    assert implementations["bleu4"].endswith(f"signature {bleu.get_signature().format()}")
    assert "tokenize=13a" in implementations["bleu4"]
    assert implementations["rouge_l"].startswith("rouge-score 0.1.2 rougeL F1")


def test_import_does_not_load_the_metric_libraries():
    assert loaded_by_import("stages.metrics.text", ("sacrebleu", "rouge_score", "nltk")) == []


@pytest.mark.parametrize("fn", [exact_match, corpus_bleu, rouge_l])
def test_mismatched_or_empty_inputs_raise(fn):
    with pytest.raises(ValueError, match="one reference per prediction"):
        fn(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no examples"):
        fn([], [])
