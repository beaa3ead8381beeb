"""lm-evaluation-harness on our variants: any loaded variant as an lm-eval model (variant_lm.py:
`VariantLM`) and the tasks evaluate runs on it, the local ones built from the data dir and lm-eval's
own YAML on local files (tasks.py: `run_tasks`). Import the module you need: the package itself
loads nothing."""
