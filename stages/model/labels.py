"""The label convention of every training example (torch-free: data preparation builds labels)."""

IGNORE_INDEX = -100  # label of a position no loss is taken on (prompt tokens, padding): PyTorch's and HF's value
