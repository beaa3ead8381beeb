"""Measurements: text overlap (exact match, BLEU-4, ROUGE-L: text.py), perplexity (perplexity.py),
logit agreement between two runtimes (logit_agreement.py), inference speed and memory (speed.py),
and what of a run is a measurement of the machine (measured.py). Import the module you need: the
package itself loads nothing, so its torch-free modules stay torch-free."""
