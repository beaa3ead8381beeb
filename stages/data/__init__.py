"""Data: tokenizer training, corpus reading and tokenization, src/tgt SFT data."""
