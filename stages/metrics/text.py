"""Text-overlap metrics between generated predictions and references.

BLEU-4 and ROUGE-L are the reference implementations, so the numbers compare with published ones:

  * `corpus_bleu`: sacrebleu's corpus BLEU (`sacrebleu.metrics.BLEU`), its default 13a tokenizer
    (the mteval-v13a rules: punctuation split off words, case kept) and its default exp smoothing,
    divided by 100 (the [0, 1] scale the pipeline reports). The sacrebleu signature is
    `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:<sacrebleu version>`.
  * `rouge_l`: rouge-score's rougeL F-measure (what `rouge_scorer.RougeScorer(["rougeL"],
    use_stemmer=False)` gives: its default tokenizer, lowercase, every run of characters outside
    [a-z0-9] a separator, no stemming), averaged over examples. It calls rouge-score's own
    `tokenize.tokenize` and `scoring.fmeasure` and counts the longest common subsequence itself,
    as rouge_scorer's `_score_lcs` does (equal to RougeScorer's scores in tests/unit/test_metrics.py):
    `rouge_scorer` imports nltk for its stemmer, ~1 s of every evaluate job on a 2-core machine.

Scripts beyond ASCII: rouge-score's tokenizer drops every character outside [a-z0-9], so "café"
counts as "caf" and a reference written wholly in another script (Cyrillic, Chinese, ...) has no
tokens and scores 0 against any prediction (`rouge_l` logs a warning when references hold such
letters). 13a keeps those letters but splits only at spaces and punctuation, so in scripts written
without spaces (Chinese, Japanese, Thai) a whole clause is one token and BLEU is near 0 unless it
matches exactly. Both metrics are meant for space-separated text such as the builtin English task.

The libraries are imported inside the functions: importing this module stays light (the Snakefile
parse imports stages modules). Inputs are two equal-length sequences of strings, one prediction
and one reference per example.
"""

from __future__ import annotations

import importlib.metadata
import logging
from typing import Sequence

log = logging.getLogger(__name__)

BLEU_TOKENIZE = "13a"  # sacrebleu's default; the signature and the docs name it


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


def corpus_bleu(predictions: Sequence[str], references: Sequence[str], max_order: int = 4,
                smooth: bool = True) -> float:
    """sacrebleu corpus BLEU with one reference per prediction, divided by 100: in [0, 1].

    Counts are summed over the whole corpus before any ratio is taken (this is not the mean of
    sentence BLEU), on sacrebleu's 13a tokens, case-sensitive:

        p_n  = sum_i sum_g min(count_pred_i(g), count_ref_i(g)) / sum_i #n-grams(pred_i)
        BP   = 1 if c >= r else exp(1 - r / c)     c, r: total prediction / reference tokens
        BLEU = BP * exp(sum_{n=1..N} (1/N) log p_n)

    `smooth=True` (what `stages.evaluate` and evaluation while training use): sacrebleu's default
    "exp" smoothing (mteval-v13a's; Chen & Cherry 2014 method 3): the k-th order with no match
    counts as p_n = 1 / (2^k #n-grams). `smooth=False`: any p_n = 0 gives BLEU = 0. Either way a
    corpus with no matching n-gram at all, an empty prediction corpus (c = 0), and a corpus whose
    predictions are all shorter than `max_order` tokens (no n-grams of that order) score 0;
    identical text scores 1 otherwise.
    """
    _check_pairs(predictions, references)
    from sacrebleu.metrics import BLEU

    bleu = BLEU(tokenize=BLEU_TOKENIZE, smooth_method="exp" if smooth else "none", max_ngram_order=max_order)
    score = bleu.corpus_score(list(predictions), [list(references)]).score / 100
    return min(score, 1.0)  # identical text comes out as 1 + 4e-16 (exp of a sum of logs)


def _dropped_by_rouge_tokenizer(text: str) -> bool:
    """Whether `text` holds a letter or digit that rouge-score's [a-z0-9] tokenizer discards."""
    return any(c.isalnum() and not c.isascii() for c in text)


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """rouge-score's ROUGE-L F1 (Lin, 2004) averaged over examples, in [0, 1].

    Per example, with L = LCS(pred, ref) over rouge-score's default tokens (lowercased,
    [a-z0-9]+ runs, no stemming):
        P = L / |pred|,  R = L / |ref|,  F1 = 2 P R / (P + R)   (0 when L = 0)
    An example where either side has no tokens scores 0 (two empty strings included), as in
    rouge-score. See the module docstring for text outside ASCII.
    """
    _check_pairs(predictions, references)
    from rouge_score import scoring, tokenize  # not rouge_scorer: see the module docstring

    lossy = sum(_dropped_by_rouge_tokenizer(r) for r in references)
    if lossy:
        log.warning("rouge_l: %d of %d references hold letters outside a-z/0-9, which rouge-score's tokenizer "
                    "drops; ROUGE-L undercounts on them (0 for text wholly in another script)",
                    lossy, len(references))
    total = 0.0
    for pred, ref in zip(predictions, references):
        ref_tokens, pred_tokens = tokenize.tokenize(ref, None), tokenize.tokenize(pred, None)
        if ref_tokens and pred_tokens:
            common = lcs_length(ref_tokens, pred_tokens)
            total += scoring.fmeasure(common / len(pred_tokens), common / len(ref_tokens))
    return total / len(predictions)


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of `a` and `b` (the dynamic programme of
    rouge_scorer's `_lcs_table`, one row kept)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def metric_implementations() -> dict[str, str]:
    """What computed `corpus_bleu` (with its defaults) and `rouge_l`: library, version, tokenization
    and scale, keyed by the metrics JSON's names. Reads package metadata only (imports neither)."""
    bleu_signature = f"nrefs:1|case:mixed|eff:no|tok:{BLEU_TOKENIZE}|smooth:exp|version:{_version('sacrebleu')}"
    return {
        "bleu4": f"sacrebleu corpus BLEU / 100, tokenize={BLEU_TOKENIZE}, signature {bleu_signature}",
        "rouge_l": f"rouge-score {_version('rouge-score')} rougeL F1 averaged over examples, default tokenizer "
                   "(lowercase, [a-z0-9]+ tokens), no stemming (its tokenizer and f-measure; the LCS counted "
                   "as its _score_lcs does)",
    }


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
