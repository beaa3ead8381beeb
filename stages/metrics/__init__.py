"""Evaluation metrics: text overlap (exact match, BLEU-4, ROUGE-L) and perplexity."""

from stages.metrics.perplexity import (
    model_perplexity, unigram_perplexity, validation_windows, window_starts,
)
from stages.metrics.text import corpus_bleu, exact_match, rouge_l

__all__ = ["corpus_bleu", "exact_match", "model_perplexity", "rouge_l", "unigram_perplexity",
           "validation_windows", "window_starts"]
