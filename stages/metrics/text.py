"""Text-overlap metrics between generated predictions and references.

All metrics tokenize by whitespace (`str.split()`), so they are language- and
tokenizer-independent but treat punctuation attached to a word as part of it. Inputs are two
equal-length sequences of strings, one prediction and one reference per example.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence


def _check_pairs(predictions: Sequence[str], references: Sequence[str]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"got {len(predictions)} predictions but {len(references)} references; "
                         "pass exactly one reference per prediction")
    if not predictions:
        raise ValueError("no examples to score; pass at least one (prediction, reference) pair")


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of examples whose prediction equals the reference after `str.strip()`."""
    _check_pairs(predictions, references)
    hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references))
    return hits / len(predictions)


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def corpus_bleu(predictions: Sequence[str], references: Sequence[str], max_order: int = 4,
                smooth: bool = True) -> float:
    """Corpus-level BLEU (Papineni et al., 2002) with one reference per prediction, in [0, 1].

    Counts are summed over the whole corpus before any ratio is taken (this is not the mean of
    sentence BLEU):

        p_n  = sum_i sum_g min(count_pred_i(g), count_ref_i(g)) / sum_i #n-grams(pred_i)
        BP   = 1 if c > r else exp(1 - r / c)      c, r: total prediction / reference tokens
        BLEU = BP * exp(sum_{n=1..N} (1/N) log p_n)

    Smoothing (`smooth=True`, the default used by `stages.evaluate`): add one to the numerator
    and the denominator of p_n for n > 1 only (Lin & Och 2004; "smoothing 2" in Chen & Cherry
    2014, NLTK's `method2`). It keeps a short corpus with no matching 4-gram from scoring exactly
    0 while a wholly disjoint corpus still scores 0 (p_1 stays unsmoothed) and identical text
    still scores 1. With `smooth=False` any p_n = 0 gives BLEU = 0, as in the original paper.
    An empty prediction corpus (c = 0) scores 0.
    """
    _check_pairs(predictions, references)
    matches = [0] * max_order
    totals = [0] * max_order
    pred_len = ref_len = 0
    for pred, ref in zip(predictions, references):
        p_tok, r_tok = pred.split(), ref.split()
        pred_len += len(p_tok)
        ref_len += len(r_tok)
        for n in range(1, max_order + 1):
            p_ngrams, r_ngrams = _ngrams(p_tok, n), _ngrams(r_tok, n)
            # Clipping: an n-gram is credited at most as often as the reference holds it.
            matches[n - 1] += sum(min(c, r_ngrams[g]) for g, c in p_ngrams.items())
            totals[n - 1] += max(len(p_tok) - n + 1, 0)
    if pred_len == 0:
        return 0.0
    log_precision = 0.0
    for n in range(1, max_order + 1):
        num, den = matches[n - 1], totals[n - 1]
        if smooth and n > 1:
            num, den = num + 1, den + 1
        if num == 0 or den == 0:
            return 0.0
        log_precision += math.log(num / den) / max_order
    brevity = 1.0 if pred_len > ref_len else math.exp(1.0 - ref_len / pred_len)
    return brevity * math.exp(log_precision)


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, start=1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """ROUGE-L F1 (Lin, 2004) averaged over examples, in [0, 1].

    Per example, with L = LCS(pred, ref) over whitespace tokens:
        P = L / |pred|,  R = L / |ref|,  F1 = 2 P R / (P + R)   (0 when L = 0)
    Two empty strings count as a perfect match (1.0); one empty string scores 0.
    """
    _check_pairs(predictions, references)
    total = 0.0
    for pred, ref in zip(predictions, references):
        p_tok, r_tok = pred.split(), ref.split()
        if not p_tok and not r_tok:
            total += 1.0
            continue
        lcs = _lcs_length(p_tok, r_tok)
        if lcs:
            precision, recall = lcs / len(p_tok), lcs / len(r_tok)
            total += 2 * precision * recall / (precision + recall)
    return total / len(predictions)
