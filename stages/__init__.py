"""The LLM lifecycle pipeline: one verb module per Snakemake rule, shared nouns in sub-packages."""
